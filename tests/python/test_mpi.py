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


def mpirun(np, *case, timeout=240):
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    cmd = [MPIRUN, "-np", str(np), sys.executable, os.path.join(HERE, "mpi_cases.py"), *case]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


CASES = ["strategies", "bfloat16", "side_by_side", "errors", "disagree", "bad_comms", "many_shapes"]


@pytest.fixture(scope="module")
def all_cases():
    """Every case in one job of 4 processes (a start costs seconds: each process imports torch); a failing case
    aborts the job, so the cases after it report nothing."""
    return mpirun(4, *CASES, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_four_ranks(all_cases, case):
    code, output, _ = all_cases
    for rank in range(4):
        assert f"{case} ok rank {rank}" in output, output
    if case == CASES[-1]:
        assert code == 0, output


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


def test_mpi_not_initialised_is_a_config_error():
    # mpi4py told not to initialise MPI: a ConfigError naming comm, not Open MPI's abort from MPI_Comm_c2f.
    code = (
        "import mpi4py; mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI\n"
        "import cpattn, cpattn.torch as ct\n"
        "try:\n"
        "    ct.ContextParallelAttention(MPI.COMM_WORLD)\n"
        "except cpattn.ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused: comm: MPI is not initialised" in out.stdout, out.stdout + out.stderr
