"""Cases run by every process under mpirun (test_mpi.py launches them): python3 mpi_cases.py CASE [CASE ...],
one after another.
The cases of any group (cases.py) on MPI.COMM_WORLD, and MPI's own. Each process asserts on its own results and
prints "CASE ok rank R" at the end; any failure raises (mpi4py then aborts the job, so a failed case cannot leave
the others waiting)."""

import sys

import torch
from mpi4py import MPI

import cases
import cpattn
import cpattn.torch as ct
from cases import check_strategy, expect_error, problem

WORLD = MPI.COMM_WORLD
cases.make = lambda **options: ct.ContextParallelAttention(WORLD, **options)
cases.RANK = WORLD.rank
cases.all_gather = lambda out, t: [o.copy_(x) for o, x in zip(out, WORLD.allgather(t))]


def case_errors():
    cases.case_errors()
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention("world"), "comm")


def case_subgroups():
    # 8 processes: two groups of 4 running different problems at the same time.
    color = WORLD.rank // 4
    sub = WORLD.Split(color, WORLD.rank)
    if color == 0:
        check_strategy(lambda **o: ct.ContextParallelAttention(sub, **o), "ulysses", 10, bitwise=True, Hq=8, Hkv=2)
    else:
        check_strategy(lambda **o: ct.ContextParallelAttention(sub, **o), "all_gather", 11, bitwise=True, Hq=12, Hkv=3, S=384, load_balance=True)
    sub.Free()


def case_bad_comms():
    # Communicators that cannot run attention: refused on every rank naming comm, never a crash.
    null = MPI.COMM_NULL
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(null), "comm: MPI.COMM_NULL")
    freed = WORLD.Dup()
    freed.Free()
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(freed), "comm: MPI.COMM_NULL")
    half = WORLD.Split(WORLD.rank % 2, WORLD.rank)
    inter = half.Create_intercomm(0, WORLD, 1 - WORLD.rank % 2, tag=7)
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(inter), "intercommunicator")
    inter.Free()
    half.Free()
    attn = ct.ContextParallelAttention(WORLD, strategy="ulysses", threads=1)
    q, k, v, _, _ = problem(1, 64, 4, 2, 16, 32)
    o = attn(*(attn.shard(t) for t in (q, k, v)))
    assert torch.equal(o, attn.shard(ct.attention(q, k, v, threads=1)))


def case_dies():
    # Rank 1 dies before the collective: mpirun ends the job (the others must not wait forever).
    if WORLD.rank == 1:
        import os
        os._exit(3)
    q, k, v, _, _ = problem(1, 256, 8, 2, 32, 40)
    attn = ct.ContextParallelAttention(WORLD, strategy="ulysses", threads=1, timeout=60)
    attn(attn.shard(q), attn.shard(k), attn.shard(v))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        (globals().get("case_" + name) or getattr(cases, "case_" + name))()
        print(f"{name} ok rank {WORLD.rank}", flush=True)
