"""The cases every process of a group runs, on any group: a driver (mpi_cases.py under mpirun, gloo_cases.py under
python3 -m cpattn.launch) sets `make` (a ContextParallelAttention over its group from options), RANK and SIZE
(4 for the cases below), runs `case_NAME()` and prints "NAME ok rank R". Each process asserts on its own results;
any failure raises."""

import torch

import cpattn
import cpattn.torch as ct
import naive

make = None  # make(**options) -> ContextParallelAttention over the driver's group
all_gather = None  # all_gather(tensors, tensor): every rank's tensor into the list, over the driver's group
RANK = 0


def problem(B, S, Hq, Hkv, D, seed, packed=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    do = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    seg = None
    if packed:
        seg = torch.zeros(B, S, dtype=torch.int32)
        seg[:, S // 3:] = 1
        seg[:, 3 * S // 4:] = 2
    return q, k, v, do, seg


def single_process(q, k, v, do, causal, seg, window=None, softcap=None, sinks=None):
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    ss = None if sinks is None else sinks.clone().requires_grad_()
    o = ct.attention(qs, ks, vs, causal=causal, segment_ids=seg, threads=1, window=window, softcap=softcap, sinks=ss)
    o.backward(do)
    return o.detach(), qs.grad, ks.grad, vs.grad, None if ss is None else ss.grad


def check_strategy(make_attn, strategy, seed, bitwise, Hq=8, Hkv=2, S=256, causal=True, packed=False, window=None,
                   softcap=None, sinks=None, **options):
    """This rank's O equals the single-process result on its shard (bit for bit where `bitwise`), gradients
    within 1e-6 of the largest magnitude."""
    B, D = 2, 32
    q, k, v, do, seg = problem(B, S, Hq, Hkv, D, seed, packed)
    attn = make_attn(strategy=strategy, causal=causal, threads=1, window=window, softcap=softcap, **options)
    ql, kl, vl = (attn.shard(t).clone().requires_grad_() for t in (q, k, v))
    sl = None if sinks is None else sinks.clone().requires_grad_()
    o = attn(ql, kl, vl, segment_ids=None if seg is None else attn.shard(seg), sinks=sl)
    o.backward(attn.shard(do))
    want = single_process(q, k, v, do, causal, seg, window, softcap, sinks)
    o_want = attn.shard(want[0])
    if bitwise:
        assert torch.equal(o, o_want), (strategy, (o - o_want).abs().max().item())
    else:
        assert naive.relative_error(o, o_want) < 1e-6, (strategy, naive.relative_error(o, o_want))
    for name, got, ref in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), want[1:4]):
        err = naive.relative_error(got, attn.shard(ref))
        assert err < 1e-6, (strategy, name, err)
    if sinks is not None:  # the ranks' shares add up to the gradient
        shares = [torch.zeros_like(sl.grad) for _ in range(attn.cp)]
        all_gather(shares, sl.grad)
        err = naive.relative_error(sum(shares), want[4])
        assert err < 1e-5, (strategy, "dsinks", err)
    return attn


def case_strategies():
    # KV replication: Hq 8 on Hkv 2 at cp 4 puts each kv head on two ranks.
    ulysses = check_strategy(make, "ulysses", 1, bitwise=True)
    assert ulysses.comm_wait_seconds == 0.0  # no ring: nothing waited on
    check_strategy(make, "ulysses", 2, bitwise=True, packed=True)
    check_strategy(make, "all_gather", 3, bitwise=True, load_balance=True)
    check_strategy(make, "all_gather", 4, bitwise=True, load_balance=True, packed=True, causal=False)
    # The ring and the hybrid merge partial softmaxes: close, not bitwise.
    ring = check_strategy(make, "ring", 5, bitwise=False, load_balance=True)
    assert 0.0 < ring.comm_wait_seconds < 600.0, ring.comm_wait_seconds  # its shifts' waits, forward and backward
    check_strategy(make, "hybrid", 6, bitwise=False, ulysses_degree=2, load_balance=True)
    # Sliding windows: one rank's chunk is 64 tokens, the windows reach one or two chunks back.
    check_strategy(make, "ulysses", 8, bitwise=True, causal=False, window=(16, 8))
    check_strategy(make, "ring", 9, bitwise=False, load_balance=True, packed=True, window=40, softcap=1.5,
                   sinks=torch.tensor([0.5, 4.0, -3.0, 1.0, 0.0, 2.5, -1.0, 6.0]))
    check_strategy(make, "ulysses", 10, bitwise=True, sinks=torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, -1.0, 2.0, 5.0]))
    # The layouts cut by the packed row's documents (problem()'s: 85, 107 and 64 tokens at S = 256).
    check_strategy(make, "all_gather", 11, bitwise=True, packed=True, layout="solver", documents=[85, 107, 64])
    check_strategy(make, "ring", 12, bitwise=False, packed=True, layout="per_document", documents=(85, 107, 64))


def case_bfloat16():
    B, S, Hq, Hkv, D = 1, 256, 8, 2, 32
    q, k, v, do, _ = problem(B, S, Hq, Hkv, D, 7, dtype=torch.bfloat16)
    attn = make(strategy="ulysses", threads=1)
    ql, kl, vl = (attn.shard(t).clone().requires_grad_() for t in (q, k, v))
    o = attn(ql, kl, vl)
    o.backward(attn.shard(do))
    assert o.dtype == torch.bfloat16 and ql.grad.dtype == torch.bfloat16 and kl.grad.dtype == torch.bfloat16
    o_want = attn.shard(ct.attention(q, k, v, threads=1))
    assert torch.equal(o, o_want)


def case_side_by_side():
    # Two objects with different head counts and strategies, interleaved, each with two forwards in flight
    # before their backwards (no state leaks between them, none is overwritten).
    a = make(strategy="ulysses", threads=1)
    b = make(strategy="all_gather", load_balance=True, threads=1)
    pa = problem(1, 128, 8, 2, 16, 20)
    pb = problem(1, 256, 4, 1, 32, 21)
    pa2 = problem(1, 128, 8, 2, 16, 22)
    runs = []
    for attn, (q, k, v, do, _) in ((a, pa), (b, pb), (a, pa2)):
        ql, kl, vl = (attn.shard(t).clone().requires_grad_() for t in (q, k, v))
        runs.append((attn, ql, kl, vl, attn(ql, kl, vl), (q, k, v, do)))
    for attn, ql, kl, vl, o, (q, k, v, do) in reversed(runs):
        o.backward(attn.shard(do))
        want = single_process(q, k, v, do, True, None)
        assert torch.equal(o, attn.shard(want[0]))
        for got, ref in zip((ql.grad, kl.grad, vl.grad), want[1:]):
            assert naive.relative_error(got, attn.shard(ref)) < 1e-6


def expect_error(kind, fn, *needles):
    try:
        fn()
    except kind as e:
        for needle in needles:
            assert needle in str(e), (needle, str(e))
        return str(e)
    raise AssertionError(f"no {kind.__name__} raised")


def case_errors():
    rank = RANK
    q, k, v, _, _ = problem(1, 256, 8, 2, 32, 30)
    attn = make(strategy="ulysses", threads=1)
    ql, kl, vl = (attn.shard(t) for t in (q, k, v))
    # A shape that disagrees on one rank only: every rank raises, the bad one naming its tensor.
    bad = ql[:, :, :, :16] if rank == 2 else ql
    msg = expect_error(cpattn.ConfigError, lambda: attn(bad, kl, vl))
    assert "k: head_dim 32 differs from q's 16" in msg if rank == 2 else "rank 2 passed arguments" in msg, msg
    # A wrong dtype on one rank (caught in Python before C++) also raises everywhere.
    bad = ql.double() if rank == 1 else ql
    msg = expect_error(cpattn.ConfigError, lambda: attn(bad, kl, vl))
    assert "float64" in msg if rank == 1 else "rank 1" in msg, msg
    # A local seq that differs between ranks: each rank names the field and the range.
    expect_error(cpattn.ConfigError, lambda: attn(ql[:, : 64 - rank], kl[:, : 64 - rank], vl[:, : 64 - rank]), "seq")
    # The wrong size of communicator for the problem: ulysses needs cp <= Hq.
    expect_error(cpattn.ConfigError, lambda: attn(ql[:, :, :2], kl[:, :, :1], vl[:, :, :1]), "num_q_heads")
    # An unknown strategy, a bad option.
    expect_error(cpattn.ConfigError, lambda: make(strategy="zigzag"), "strategy")
    expect_error(cpattn.ConfigError, lambda: make(threads=0), "threads")
    # A bad option on one rank only (its communicator is made first, a collective): every rank raises, the bad
    # one naming its option, the others naming that rank.
    bad = {0: dict(strategy="zigzag"), 1: dict(threads="two"), 2: dict(timeout=-1), 3: dict(layout=3)}[rank]
    for bad_rank in range(4):
        options = bad if rank == bad_rank else {}
        field = next(iter(bad)) if rank == bad_rank else f"rank {bad_rank} passed options"
        expect_error(cpattn.ConfigError, lambda: make(**{"threads": 1, **options}), field)
    # A tensor numpy cannot view on one rank (a lazy negation): every rank raises.
    bad = ql.neg()._neg_view() if rank == 3 else ql
    msg = expect_error(cpattn.ConfigError, lambda: attn(bad, kl, vl))
    assert "q: cannot be read" in msg if rank == 3 else "rank 3 passed arguments" in msg, msg
    # After all of that the communicator and the object still work.
    o = attn(ql, kl, vl)
    assert torch.equal(o, attn.shard(ct.attention(q, k, v, threads=1)))


def case_disagree():
    # An option one rank holds otherwise: every rank raises ConfigError naming the option, each value and the
    # ranks holding it, before any data moves (the ranks would otherwise compute other numbers, or wait).
    rank = RANK
    other = {
        "causal": (True, False),
        "strategy": ("ring", "all_gather"),
        "scale": (None, 0.2),
        "load_balance": (False, True),
        "remat": (False, True),
        "threads": (1, 2),
        "timeout": (60, 30),
    }
    for field, (usual, odd) in other.items():
        options = {"strategy": "ring", "threads": 1, field: odd if rank == 1 else usual}
        msg = expect_error(cpattn.ConfigError, lambda: make(**options),
                           f"the ranks disagree on {field}", "on rank 1")
        assert "ranks 0, 2..3" in msg, msg
    # causal=None is not a value (the default is causal): refused, not taken for False.
    expect_error(cpattn.ConfigError, lambda: make(causal=None), "causal")
    attn = make(strategy="ring", threads=1)
    q, k, v, _, seg = problem(1, 256, 8, 2, 32, 31, packed=True)
    ql, kl, vl = (attn.shard(t) for t in (q, k, v))
    # segment_ids on one rank only.
    segs = attn.shard(seg) if rank != 2 else None
    expect_error(cpattn.ConfigError, lambda: attn(ql, kl, vl, segment_ids=segs), "segment_ids")
    # A graph on one rank only (no_grad elsewhere): one keeps state for a backward, the others do not.
    grad = ql.clone().requires_grad_() if rank == 0 else ql
    expect_error(cpattn.ConfigError, lambda: attn(grad, kl, vl), "forward_only")
    # After all of that the communicator and the object still work.
    o = attn(ql, kl, vl)
    assert naive.relative_error(o, attn.shard(ct.attention(q, k, v, threads=1))) < 1e-6


def case_many_shapes():
    # More shapes than the object keeps: a forward of the first shape still in flight while ten others run
    # (its object leaves the cache and is kept alive by that forward); its backward is still right.
    attn = make(strategy="all_gather", threads=1)
    q, k, v, do, _ = problem(1, 64, 4, 2, 16, 50)
    ql, kl, vl = (attn.shard(t).clone().requires_grad_() for t in (q, k, v))
    o = attn(ql, kl, vl)
    for i in range(10):
        p = problem(1, 32 * (i + 3), 4, 2, 16, 51 + i)
        op = attn(*(attn.shard(t) for t in p[:3]))
        assert torch.equal(op, attn.shard(ct.attention(*p[:3], threads=1)))
    o.backward(attn.shard(do))
    want = single_process(q, k, v, do, True, None)
    assert torch.equal(o, attn.shard(want[0]))
    for got, ref in zip((ql.grad, kl.grad, vl.grad), want[1:]):
        assert naive.relative_error(got, attn.shard(ref)) < 1e-6
