#!/usr/bin/env python3
"""cpattn.torch.ContextParallelAttention over a torch.distributed gloo group against the same over an mpi4py
communicator: one layer's forward + backward per strategy, the same inputs and threads, measured in one run.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_group.py [--cp 4] [--seq 16384] [--heads 8]
        [--kv-heads 8] [--head-dim 64] [--repeats 3] [--strategies ulysses,all_gather,ring]

It starts the gloo run (python3 -m cpattn.launch --nproc CP) and the MPI run (mpirun -np CP), one after the
other; each process takes its shard, runs --repeats layers and reports its best forward and forward + backward
(the slowest rank's, between barriers). The table gives both and their ratio; the difference is what the
transport costs: gloo's isend/irecv through Python against Open MPI's shared memory from C++. For the ring it
also gives the time the ranks waited on their transfers after their compute (the slowest rank's): what the
transport's asynchronous sends did not overlap.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def worker(a):
    import torch

    torch.set_num_threads(1)
    import cpattn.torch as ct

    if a.backend == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, barrier = dist.get_rank(), dist.barrier
        make = lambda **o: ct.ContextParallelAttention(**o)  # noqa: E731

        def largest(x):
            t = torch.tensor([x], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t)
    else:
        from mpi4py import MPI

        rank, barrier = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.Barrier
        make = lambda **o: ct.ContextParallelAttention(MPI.COMM_WORLD, **o)  # noqa: E731

        def largest(x):
            return MPI.COMM_WORLD.allreduce(x, op=MPI.MAX)
    g = torch.Generator().manual_seed(1)
    S, D = a.seq, a.head_dim
    q = torch.randn(1, S, a.heads, D, generator=g)
    k, v = (torch.randn(1, S, a.kv_heads, D, generator=g) for _ in range(2))
    do = torch.randn(1, S, a.heads, D, generator=g)
    out = {}
    for strategy in a.strategies.split(","):
        attn = make(strategy=strategy, threads=1, load_balance=strategy != "ulysses")
        ql, kl, vl = (attn.shard(t).clone().requires_grad_() for t in (q, k, v))
        dol = attn.shard(do)
        best_f = best_fb = float("inf")
        wait = 0.0  # the ring's waiting on its transfers in the best forward + backward
        for _ in range(a.repeats):
            barrier()
            t0 = time.perf_counter()
            o = attn(ql, kl, vl)
            barrier()
            t1 = time.perf_counter()
            o.backward(dol)
            barrier()
            t2 = time.perf_counter()
            if t2 - t0 < best_fb:
                wait = attn.comm_wait_seconds
            best_f, best_fb = min(best_f, t1 - t0), min(best_fb, t2 - t0)
            ql.grad = kl.grad = vl.grad = None
        out[strategy] = {"forward": best_f, "forward_backward": best_fb, "wait": largest(wait)}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def run(cmd, env):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"python_group: {' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default="ulysses,all_gather,ring")
    ap.add_argument("--backend", choices=["gloo", "mpi"], help=argparse.SUPPRESS)  # a worker's
    a = ap.parse_args()
    if a.backend:
        worker(a)
        return
    flags = [f"--seq={a.seq}", f"--heads={a.heads}", f"--kv-heads={a.kv_heads}", f"--head-dim={a.head_dim}",
             f"--repeats={a.repeats}", f"--strategies={a.strategies}"]
    me = os.path.abspath(__file__)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    gloo = run([sys.executable, "-m", "cpattn.launch", "--nproc", str(a.cp), me, "--backend", "gloo"] + flags, env)
    mpirun = shutil.which("mpirun")
    mpi = None
    if mpirun:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        mpi = run([mpirun, "-np", str(a.cp), sys.executable, me, "--backend", "mpi"] + flags, env)
    print(f"cp {a.cp}, S {a.seq}, {a.heads}/{a.kv_heads} heads, D {a.head_dim}, fp32, causal, one thread per "
          f"process; the best of {a.repeats} (ms)\n")
    print("| strategy | gloo forward | MPI forward | gloo fwd+bwd | MPI fwd+bwd | gloo / MPI (fwd+bwd) | ring's wait, "
          "gloo / MPI |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s, g in gloo.items():
        m = mpi[s] if mpi else None
        wait = f"{g['wait'] * 1e3:.1f} / {m['wait'] * 1e3:.1f}" if m else f"{g['wait'] * 1e3:.1f} / -"
        cells = [f"{g['forward'] * 1e3:.1f}", f"{m['forward'] * 1e3:.1f}" if m else "-",
                 f"{g['forward_backward'] * 1e3:.1f}", f"{m['forward_backward'] * 1e3:.1f}" if m else "-",
                 f"{g['forward_backward'] / m['forward_backward']:.3f}" if m else "-",
                 wait if s in ("ring", "hybrid") else "-"]
        print(f"| {s} | " + " | ".join(cells) + " |")
    print("\nring's wait (ms): the slowest rank's time in its K/V and dK/dV transfers' wait() after its compute, in "
          "the best forward + backward (ContextParallelAttention.comm_wait_seconds): what the transfers did not "
          "hide behind the kernels.")


if __name__ == "__main__":
    main()
