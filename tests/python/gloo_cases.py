"""Cases run by every process of a torch.distributed gloo group started by python3 -m cpattn.launch (test_gloo.py
launches them): python3 gloo_cases.py CASE [CASE ...]. The cases of any group (cases.py) on the default group, and the
process groups' own: data parallelism around context parallelism, bad groups, a rank that dies or stops. Each
process asserts on its own results and prints "CASE ok rank R" at the end."""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import cases
import cpattn
import cpattn.torch as ct
import naive
from cases import check_strategy, expect_error, problem

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
RANK = dist.get_rank()
cases.make = lambda **options: ct.ContextParallelAttention(**options)  # the default group
cases.RANK = RANK
cases.all_gather = dist.all_gather


def case_dp_cp():
    # dp 2 x cp 2: each pair of ranks is a context-parallel group (dist.new_group, which every rank calls for
    # every group), running its own problem and strategy at the same time as the other pair; the gradients'
    # data-parallel all-reduce is the user's (here over the other pair's ranks).
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[RANK // 2]
    made = lambda **o: ct.ContextParallelAttention(group=mine, **o)  # noqa: E731
    if RANK // 2 == 0:
        attn = check_strategy(made, "hybrid", 10, bitwise=False, ulysses_degree=2, load_balance=True)
    else:
        attn = check_strategy(made, "ring", 11, bitwise=False, Hq=12, Hkv=3, S=384, load_balance=True)
    assert attn.cp == 2 and attn.rank == RANK % 2
    x = torch.full((3,), float(RANK))
    dist.all_reduce(x, group=dp_groups[RANK % 2])
    assert torch.equal(x, torch.full((3,), float(RANK % 2 + RANK % 2 + 2)))


def case_sdpa():
    # The drop-in: scaled_dot_product_attention's [B, H, S, D] layout and arguments, GQA 8 on 2, on shards; O
    # and the gradients equal the single process's on the same shard.
    B, S, Hq, Hkv, D = 2, 256, 8, 2, 32
    q, k, v, do, _ = problem(B, S, Hq, Hkv, D, 60)
    want = cases.single_process(q, k, v, do, True, None)
    for strategy, options in (("ulysses", {}), ("ring", {"load_balance": True})):
        probe = ct.ContextParallelAttention(strategy=strategy, threads=1, **options)
        ql, kl, vl = (probe.shard(t).transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
        o = ct.context_parallel_sdpa(ql, kl, vl, is_causal=True, strategy=strategy, threads=1, **options)
        assert o.shape == (B, Hq, S // 4, D), o.shape
        o.backward(probe.shard(do).transpose(1, 2))
        assert naive.relative_error(o.transpose(1, 2), probe.shard(want[0])) < 1e-6, strategy
        for got, ref in zip((ql.grad, kl.grad, vl.grad), want[1:]):
            assert naive.relative_error(got.transpose(1, 2), probe.shard(ref)) < 1e-6, strategy
    q0 = torch.zeros(1, 4, 64, 16)
    expect_error(cpattn.ConfigError, lambda: ct.context_parallel_sdpa(q0, q0, q0, attn_mask=q0), "attn_mask")
    expect_error(cpattn.ConfigError, lambda: ct.context_parallel_sdpa(q0, q0, q0, dropout_p=0.1), "dropout_p")
    expect_error(cpattn.ConfigError, lambda: ct.context_parallel_sdpa(q0[0], q0, q0), "query")


def case_bad_groups():
    other = dist.new_group([0, 1])  # ranks 2 and 3 are not members
    if RANK >= 2:
        expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(group=other), "not a member")
    else:
        attn = ct.ContextParallelAttention(group=other, threads=1)
        assert attn.cp == 2
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(group="world"), "ProcessGroup")
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(dist.group.WORLD), "goes in group=")
    expect_error(cpattn.ConfigError, lambda: ct.ContextParallelAttention(group=dist.group.WORLD, comm=object()),
                 "not both")


def case_transport_sizes():
    # A message shorter than its receiver expects is an error naming both sizes, not a silent short read (the
    # strategies agree on shapes before data moves; this is the transport's own check, under every collective).
    transport = ct._GroupTransport(dist.group.WORLD)
    if RANK == 0:
        transport.start([(1, memoryview(bytearray(b"abcd")))], [], 4242).wait(30)
    elif RANK == 1:
        pending = transport.start([], [(0, memoryview(bytearray(8)))], 4242)
        msg = expect_error(RuntimeError, lambda: pending.wait(30), "4 bytes where 8 were expected", "rank 0")
        print(f"transport_sizes rank 1: {msg}", flush=True)
    # and one of the expected size arrives whole
    if RANK == 0:
        transport.start([(1, memoryview(bytearray(b"abcdefgh")))], [], 4243).wait(30)
    elif RANK == 1:
        got = bytearray(8)
        transport.start([], [(0, memoryview(got))], 4243).wait(30)
        assert got == bytearray(b"abcdefgh"), got
    dist.barrier()


def _problem_and_object(timeout):
    q, k, v, _, _ = problem(1, 256, 8, 2, 32, 40)
    attn = ct.ContextParallelAttention(strategy="ring", threads=1, timeout=timeout)
    return attn, [attn.shard(t) for t in (q, k, v)]


def case_dies():
    # Rank 1 ends mid-job (after the object exists): every other rank raises CommunicationError, not a hang.
    attn, (q, k, v) = _problem_and_object(60)
    if RANK == 1:
        os._exit(3)
    start = time.monotonic()
    msg = expect_error(cpattn.CommunicationError, lambda: attn(q, k, v), "torch.distributed (gloo)")
    print(f"dies raised rank {RANK} after {time.monotonic() - start:.1f} s: {msg.splitlines()[0][:200]}",
          flush=True)


def case_stopped():
    # Rank 1 stops (SIGSTOP) and never answers: every other rank raises CommunicationError at its timeout.
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    attn, (q, k, v) = _problem_and_object(5)
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    msg = expect_error(cpattn.CommunicationError, lambda: attn(q, k, v))
    seconds = time.monotonic() - start
    print(f"stopped raised rank {RANK} after {seconds:.1f} s: {msg.splitlines()[0][:200]}", flush=True)
    assert seconds < 30, seconds
    if RANK == 0:
        os.kill(pids[1], signal.SIGKILL)


if __name__ == "__main__":
    for name in sys.argv[1:]:  # several cases in one start (each process imports torch once)
        (globals().get("case_" + name) or getattr(cases, "case_" + name))()
        print(f"{name} ok rank {RANK}", flush=True)
        if name in ("dies", "stopped"):
            os._exit(0)  # the process group cannot be torn down with a peer gone
    dist.destroy_process_group()
