"""cpattn.torch.ContextParallelAttention on torch.distributed gloo process groups (env:// rendezvous), four
processes started by python3 -m cpattn.launch (gloo_cases.py)."""

import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed (scripts/setup installs it)")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(*names, nproc=4, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "cpattn.launch", "--nproc", str(nproc), "--grace", "20",
           os.path.join(HERE, "gloo_cases.py"), *names]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


CASES = ["strategies", "bfloat16", "side_by_side", "errors", "disagree", "many_shapes", "dp_cp", "bad_groups", "sdpa",
         "transport_sizes"]


@pytest.fixture(scope="module")
def all_cases():
    """Every case in one start of 4 processes (a start costs seconds: each process imports torch)."""
    return launch(*CASES, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_four_processes(all_cases, case):
    code, output, _ = all_cases
    for rank in range(4):
        assert f"{case} ok rank {rank}" in output, output
    if case == CASES[-1]:
        assert code == 0, output


def test_a_process_that_dies_raises_on_every_other():
    code, output, seconds = launch("dies", timeout=120)
    assert code == 3, output  # the launcher's status: the dead process's
    for rank in (0, 2, 3):
        assert f"dies ok rank {rank}" in output, output
        assert f"dies raised rank {rank} " in output, output
    assert "dies ok rank 1" not in output, output
    assert output.count("from rank 1 (global rank 1)") == 3, output  # each names the process that died
    assert seconds < 90, seconds


def test_a_stopped_process_raises_on_every_other_at_the_timeout():
    code, output, seconds = launch("stopped", timeout=120)
    for rank in (0, 2, 3):
        assert f"stopped ok rank {rank}" in output, output
    assert output.count("from rank 1 (global rank 1)") == 3, output
    assert code != 0, output  # the stopped process was killed
    assert seconds < 90, seconds


def test_the_launcher_refuses_a_bad_count_and_a_missing_script():
    for args, needle in ((["--nproc", "0", "x.py"], "--nproc 0"), (["--nproc", "2", "/no/such.py"], "does not exist")):
        out = subprocess.run([sys.executable, "-m", "cpattn.launch"] + args, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_without_an_initialised_process_group_the_error_says_what_to_do():
    code = ("import cpattn, cpattn.torch as ct\n"
            "try:\n    ct.ContextParallelAttention()\nexcept cpattn.ConfigError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "refused: group: torch.distributed is not initialised" in out.stdout, out.stdout + out.stderr
