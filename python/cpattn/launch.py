"""Starts N processes of a script with the env:// rendezvous torch.distributed reads (as torchrun sets it):
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

    python3 -m cpattn.launch --nproc 4 script.py [args...]

For a torch whose own launcher does not start (Debian's python3-torch 1.13 on Python 3.11: its torchrun fails in
its error handler). The script calls torch.distributed.init_process_group("gloo") (env:// by default). When a
process ends with an error, or is killed, the others are stopped after --grace seconds (they normally end on
their own first: their next wait on it fails); the exit status is the first failing process's (128 + signal
for a signal), 0 when all succeed. SIGINT and SIGTERM to the launcher go to every process (killed 10 s later
if still running); the processes die with the launcher (Linux's parent-death signal).
"""

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time


def _die_with_parent():
    """In the child before exec: SIGKILL when the launcher dies (prctl PR_SET_PDEATHSIG), so that no process
    outlives a launcher that was killed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Terminated(Exception):
    """SIGTERM to the launcher, raised by its handler and acted on outside it (a handler that waited on the
    processes could run inside Popen's own wait and block on its lock)."""


def _terminated(signum, _frame):
    raise _Terminated(signum)


def _stop(procs, sig, wait_seconds):
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + wait_seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m cpattn.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", "--nproc_per_node", "--nproc-per-node", type=int, required=True,
                    help="processes to start (1 to 256)")
    ap.add_argument("--master-port", type=int, default=0, help="the rendezvous port (default: a free one)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds the others may take to end after one failed (default 30)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if not 1 <= a.nproc <= 256:
        ap.error(f"--nproc {a.nproc}: valid: 1 to 256")
    if not os.path.exists(a.script):
        ap.error(f"script '{a.script}' does not exist")
    port = a.master_port or _free_port()
    procs = []
    for rank in range(a.nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, a.script] + a.args, env=env, preexec_fn=_die_with_parent))

    signal.signal(signal.SIGTERM, _terminated)
    status = 0
    failed_at = None
    try:
        while True:
            running = 0
            for p in procs:
                rc = p.poll()
                if rc is None:
                    running += 1
                elif rc != 0 and status == 0:
                    status = rc if rc > 0 else 128 - rc
                    failed_at = time.monotonic()
                    print(f"cpattn.launch: process {procs.index(p)} exited with {rc}", file=sys.stderr)
            if running == 0:
                break
            if failed_at is not None and time.monotonic() - failed_at > a.grace:
                for p in procs:
                    if p.poll() is None:
                        print(f"cpattn.launch: stopping process {procs.index(p)} ({a.grace:g} s after a failure)",
                              file=sys.stderr)
                _stop(procs, signal.SIGTERM, 2)
                failed_at = float("inf")
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, signal.SIGINT, 10)
        return 130
    except _Terminated:
        _stop(procs, signal.SIGTERM, 10)
        return 128 + signal.SIGTERM
    return status


if __name__ == "__main__":
    sys.exit(main())
