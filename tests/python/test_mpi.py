"""cpattn.torch.ContextParallelAttention on mpi4py communicators under real mpirun (mpi_cases.py)."""

import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="python3-torch is not installed (scripts/setup installs it)")
pytest.importorskip("mpi4py", reason="python3-mpi4py is not installed (scripts/setup installs it)")

HERE = os.path.dirname(os.path.abspath(__file__))
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (Debian: openmpi-bin)")


def mpirun(np, case, timeout=240):
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    cmd = [MPIRUN, "-np", str(np), sys.executable, os.path.join(HERE, "mpi_cases.py"), case]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.mark.parametrize("case", ["strategies", "bfloat16", "side_by_side", "errors", "many_shapes"])
def test_four_ranks(case):
    code, output, _ = mpirun(4, case)
    assert code == 0, output
    for rank in range(4):
        assert f"{case} ok rank {rank}" in output, output


def test_two_groups_of_four_on_sub_communicators():
    code, output, _ = mpirun(8, "subgroups")
    assert code == 0, output
    for rank in range(8):
        assert f"subgroups ok rank {rank}" in output, output


def test_a_dead_process_ends_the_job():
    code, output, seconds = mpirun(4, "dies", timeout=120)
    assert code != 0, output
    assert "dies ok" not in output, output
    assert seconds < 60, seconds
