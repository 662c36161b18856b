"""cpattn.torch.attention and the numpy level against PyTorch's naive attention in float64; bad inputs."""

import json
import os
import subprocess
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed (scripts/setup installs it)")

import cpattn  # noqa: E402
import cpattn.torch as ct  # noqa: E402
import naive  # noqa: E402

CASES = [
    # (name, B, S, Hq, Hkv, D, causal, packed)
    ("causal_gqa", 2, 192, 8, 2, 32, True, False),
    ("noncausal_gqa", 1, 160, 8, 2, 64, False, False),
    ("causal_mqa", 1, 130, 8, 1, 32, True, False),
    ("noncausal_mha", 1, 96, 4, 4, 16, False, False),
    ("packed_causal_gqa", 2, 200, 8, 2, 32, True, True),
    ("packed_noncausal_mqa", 1, 150, 8, 1, 48, False, True),
]


def make(B, S, Hq, Hkv, D, packed, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    do = torch.randn(B, S, Hq, D, generator=g)
    seg = None
    if packed:  # three documents in row 0, two in the others
        seg = torch.zeros(B, S, dtype=torch.int64)
        seg[0, S // 3:] = 1
        seg[0, 2 * S // 3:] = 2
        seg[1:, S // 2:] = 5
    return q, k, v, do, seg


def float64_reference(q, k, v, do, causal, seg):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o = naive.attention(q64, k64, v64, causal, seg)
    o.backward(do.double())
    return o.detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_float32_matches_float64_within_1e_5(case):
    _, B, S, Hq, Hkv, D, causal, packed = case
    q, k, v, do, seg = make(B, S, Hq, Hkv, D, packed)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = ct.attention(qg, kg, vg, causal=causal, segment_ids=seg)
    assert o.dtype == torch.float32 and o.shape == q.shape
    o.backward(do)
    want = float64_reference(q, k, v, do, causal, seg)
    for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, qg.grad, kg.grad, vg.grad), want):
        assert got.dtype == torch.float32
        assert naive.relative_error(got, ref) < 1e-5, name


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bfloat16_keeps_its_dtype_within_3e_2(case):
    _, B, S, Hq, Hkv, D, causal, packed = case
    q, k, v, do, seg = make(B, S, Hq, Hkv, D, packed)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    o = ct.attention(qb, kb, vb, causal=causal, segment_ids=None if seg is None else seg.int())
    o.backward(do.bfloat16())
    want = float64_reference(q, k, v, do, causal, seg)
    for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, qb.grad, kb.grad, vb.grad), want):
        assert got.dtype == torch.bfloat16, name
        assert naive.relative_error(got, ref) < 3e-2, name


WINDOWS = [
    # (causal, window, packed)
    (True, 0, False),
    (True, 7, True),
    (True, 64, False),
    (False, (20, 5), True),
    (False, (3, None), False),
]


@pytest.mark.parametrize("causal,window,packed", WINDOWS)
def test_sliding_windows_match_float64_with_autograd(causal, window, packed):
    q, k, v, do, seg = make(2, 150, 8, 2, 32, packed)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = ct.attention(qg, kg, vg, causal=causal, segment_ids=seg, window=window)
    o.backward(do)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = naive.attention(q64, k64, v64, causal, seg, window=window)
    ref.backward(do.double())
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, qg.grad, kg.grad, vg.grad),
                               (ref, q64.grad, k64.grad, v64.grad)):
        if want.abs().max() > 0:
            assert naive.relative_error(got, want) < 1e-5, name
        else:  # window 0: each query sees itself only, P = 1, dq exactly 0 in exact arithmetic
            assert got.abs().max() < 1e-5, name
    # the numpy level takes the same window; one off is far off (the comparison can fail)
    o_np, _ = cpattn.attention(q.numpy(), k.numpy(), v.numpy(), causal=causal,
                               segment_ids=None if seg is None else seg.numpy(), window=window)
    assert naive.relative_error(torch.from_numpy(o_np), ref.detach()) < 1e-5
    left = window if isinstance(window, int) else window[0]
    wider = left + 1 if isinstance(window, int) else (left + 1, window[1])
    assert naive.relative_error(o, naive.attention(q.double(), k.double(), v.double(), causal, seg, window=wider)) > 1e-3


@pytest.mark.parametrize("causal,window,softcap", [(True, None, 2.0), (False, None, 30.0), (True, 24, 1.5)])
def test_soft_caps_match_float64_with_autograd(causal, window, softcap):
    q, k, v, do, seg = make(1, 130, 8, 2, 32, True)
    q = q * 2  # logits of spread 2: the cap bends them
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = ct.attention(qg, kg, vg, causal=causal, segment_ids=seg, window=window, softcap=softcap)
    o.backward(do)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = naive.attention(q64, k64, v64, causal, seg, window=window, softcap=softcap)
    ref.backward(do.double())
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, qg.grad, kg.grad, vg.grad),
                               (ref, q64.grad, k64.grad, v64.grad)):
        assert naive.relative_error(got, want) < 1e-5, name
    # the comparison can fail: without the cap the reference is far off
    assert naive.relative_error(o, naive.attention(q.double(), k.double(), v.double(), causal, seg, window=window)) > 1e-3


@pytest.mark.parametrize("causal,window,softcap,dtype", [(True, None, None, torch.float32),
                                                         (False, 20, 3.0, torch.float32),
                                                         (True, None, None, torch.bfloat16)])
def test_sinks_match_float64_and_receive_their_gradient(causal, window, softcap, dtype):
    q, k, v, do, seg = make(2, 120, 8, 2, 32, True)
    sinks = torch.tensor([0.5, 4.0, -3.0, 1.0, 0.0, 2.5, -1.0, 6.0])
    qg, kg, vg = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    sg = sinks.clone().requires_grad_()
    o = ct.attention(qg, kg, vg, causal=causal, segment_ids=seg, window=window, softcap=softcap, sinks=sg)
    o.backward(do.to(dtype))
    assert sg.grad is not None and sg.grad.shape == sinks.shape and sg.grad.dtype == torch.float32
    q64, k64, v64 = (t.to(dtype).detach().double().requires_grad_() for t in (q, k, v))
    s64 = sinks.double().requires_grad_()
    ref = naive.attention(q64, k64, v64, causal, seg, window=window, softcap=softcap, sinks=s64)
    ref.backward(do.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, got, want in zip(("o", "dq", "dk", "dv", "dsinks"), (o, qg.grad, kg.grad, vg.grad, sg.grad),
                               (ref, q64.grad, k64.grad, v64.grad, s64.grad)):
        assert naive.relative_error(got, want) < tol, name
    # the comparison can fail: the same output against attention without sinks is far off
    plain = naive.attention(q.double(), k.double(), v.double(), causal, seg, window=window, softcap=softcap)
    assert naive.relative_error(o, plain) > 1e-2


@pytest.mark.parametrize("sinks", [np.zeros(7, np.float32), np.zeros(8, np.float64), np.zeros((1, 8), np.float32),
                                   "x", np.full(8, np.nan, np.float32), np.full(8, np.inf, np.float32)])
def test_bad_sinks_name_their_field(sinks):
    q, k, v, _, _ = make(1, 16, 8, 2, 8, False)
    with pytest.raises(cpattn.ConfigError) as e:
        cpattn.attention(q.numpy(), k.numpy(), v.numpy(), sinks=sinks)
    assert "sinks" in str(e.value)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan"), "50", True])
def test_bad_soft_caps_name_their_field(softcap):
    q, k, v, _, _ = make(1, 16, 2, 1, 8, False)
    with pytest.raises(cpattn.ConfigError) as e:
        cpattn.attention(q.numpy(), k.numpy(), v.numpy(), softcap=softcap)
    assert "softcap" in str(e.value)


@pytest.mark.parametrize("window,field", [(-1, "window"), ((4, -2), "window_right"), ((1, 2, 3), "window"),
                                          ("8", "window"), (True, "window"), ((5, 5), "window_right")])
def test_bad_windows_name_their_field(window, field):
    q, k, v, _, _ = make(1, 16, 2, 1, 8, False)
    with pytest.raises(cpattn.ConfigError) as e:
        cpattn.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, window=window)
    assert field in str(e.value)


def test_negative_control_a_wrong_mask_is_caught():
    # The comparison can fail: causal output against a non-causal reference is far off.
    q, k, v, do, _ = make(1, 128, 4, 2, 32, False)
    o = ct.attention(q, k, v, causal=True)
    wrong = naive.attention(q.double(), k.double(), v.double(), causal=False)
    assert naive.relative_error(o, wrong) > 1e-2


def test_scale_is_passed_through():
    q, k, v, _, _ = make(1, 64, 4, 2, 32, False)
    o = ct.attention(q, k, v, causal=False, scale=0.05)
    assert naive.relative_error(o, naive.attention(q.double(), k.double(), v.double(), False, None, 0.05)) < 1e-5


def test_numpy_level_strided_views_equal_contiguous_copies():
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((1, 128, 12, 32), dtype=np.float32)  # q heads 0..7, k 8..9, v 10..11
    q, k, v = qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]
    assert not q.flags.c_contiguous
    o1, lse1 = cpattn.attention(q, k, v)
    o2, lse2 = cpattn.attention(*(np.ascontiguousarray(x) for x in (q, k, v)))
    assert np.array_equal(o1, o2) and np.array_equal(lse1, lse2)
    assert o1.dtype == np.float32 and lse1.shape == (1, 8, 128)
    do = rng.standard_normal(o1.shape, dtype=np.float32)
    g1 = cpattn.attention_backward(q, k, v, o1, lse1, do)
    g2 = cpattn.attention_backward(*(np.ascontiguousarray(x) for x in (q, k, v)), o2, lse2, do)
    for a, b in zip(g1, g2):
        assert np.array_equal(a, b)
    # a last axis that is not contiguous is copied, not misread
    qt = np.ascontiguousarray(np.swapaxes(q, 2, 3)).swapaxes(2, 3)
    assert qt.strides[3] != 4
    o3, _ = cpattn.attention(qt, k, v)
    assert np.array_equal(o1, o3)


def test_non_contiguous_torch_tensors_and_expanded_gradients():
    q, k, v, _, _ = make(1, 96, 8, 2, 32, False)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    qg = qt.clone().requires_grad_()
    o = ct.attention(qg, k, v)
    o.sum().backward()  # dO is an expanded tensor (stride 0)
    q2 = q.clone().requires_grad_()
    o2 = ct.attention(q2, k, v)
    o2.backward(torch.ones_like(o2))
    assert torch.equal(o, o2) and torch.equal(qg.grad, q2.grad)


def test_backward_gives_none_for_every_non_tensor_argument():
    q, k, v, do, seg = make(1, 64, 4, 2, 16, True)
    o = ct.attention(q.clone().requires_grad_(), k, v, segment_ids=seg)
    # The Function's own backward, as autograd calls it: one entry per argument of forward (q, k, v,
    # segment_ids, causal, scale, threads, window, softcap, sinks), None for each that is not a differentiable
    # tensor (yunchang #149).
    out = o.grad_fn.apply(do)
    assert len(out) == 10
    assert all(isinstance(g, torch.Tensor) for g in out[:3])
    assert all(g is None for g in out[3:])


@pytest.mark.parametrize(
    "args, field",
    [
        (lambda q, k, v: (q[0], k, v), "q"),  # wrong rank of tensor
        (lambda q, k, v: (q, k[..., :16], v[..., :16]), "k"),  # head dims disagree
        (lambda q, k, v: (q, k, v.double()), "v"),  # a dtype the kernels do not take
        (lambda q, k, v: (q, k[:, :32], v[:, :32]), "k"),  # seq disagrees
        (lambda q, k, v: (q[:, :, :5], k, v), "num_q_heads"),  # 5 % 2 != 0
        (lambda q, k, v: (q, k, v[:, :, :1]), "v"),  # k and v differ
        (lambda q, k, v: (q.numpy(), k, v), "q"),  # not a tensor
    ],
)
def test_bad_inputs_raise_config_error_naming_the_field(args, field):
    q, k, v, _, _ = make(1, 64, 8, 2, 32, False)
    with pytest.raises(cpattn.ConfigError) as e:
        ct.attention(*args(q, k, v))
    assert isinstance(e.value, ValueError)
    assert any(item["field"] == field for item in e.value.errors), e.value.errors


def test_all_broken_rules_are_listed_at_once():
    q = np.zeros((1, 8, 3, 600), np.float32)
    k = np.zeros((1, 8, 2, 600), np.float64)
    with pytest.raises(cpattn.ConfigError) as e:
        cpattn.attention(q, k, k)
    fields = [item["field"] for item in e.value.errors]
    assert fields.count("k") >= 1 and "v" in fields


def test_bad_segment_ids():
    q, k, v, _, _ = make(2, 64, 4, 2, 16, False)
    for seg in (torch.zeros(2, 63, dtype=torch.int32), torch.zeros(2, 64), torch.full((2, 64), 2**40)):
        with pytest.raises(cpattn.ConfigError, match="segment_ids"):
            ct.attention(q, k, v, segment_ids=seg)


def test_gil_is_released_during_compute():
    q, k, v, _, _ = make(1, 2048, 8, 2, 64, False)
    ticks = [0]
    done = threading.Event()

    def run():
        ct.attention(q, k, v, threads=1)
        done.set()

    t = threading.Thread(target=run)
    start = time.perf_counter()
    t.start()
    while not done.is_set():
        ticks[0] += 1
        time.sleep(0.001)
    t.join()
    elapsed = time.perf_counter() - start
    # The main thread ran on while the kernel computed (the GIL held would leave it at a tick or two).
    assert elapsed > 0.02 and ticks[0] >= 10, (elapsed, ticks[0])


def cli(*args):
    program = os.environ.get("CPATTN_PROGRAM", "cpattn")
    out = subprocess.run([program, *args, "--json"], capture_output=True, text=True)
    return out.returncode, json.loads(out.stdout)


@pytest.mark.parametrize(
    "config",
    [
        dict(strategy="ulysses", cp=4, q_heads=32, kv_heads=2, head_dim=256, seq=65536, dtype="bf16"),
        dict(strategy="hybrid", cp=8, ulysses_degree=4, q_heads=28, kv_heads=4, head_dim=128, seq=65536),
        dict(strategy="all_gather", cp=4, q_heads=30, kv_heads=4, head_dim=600, seq=100, load_balance=True),
    ],
)
def test_validate_is_the_programs_document(config):
    flags = []
    for name, value in config.items():
        flags += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
    code, doc = cli("validate", *flags)
    assert cpattn.validate(**config) == doc
    assert (code == 0) == doc["valid"]


def test_plan_is_the_programs_document():
    code, doc = cli("plan", "--preset", "llama3-8b", "--seq", "65536", "--cp", "16", "--ranks-per-host", "8",
                    "--segments", "61440,4096")
    assert code == 0
    assert cpattn.plan(preset="llama3-8b", seq=65536, cp=16, ranks_per_host=8, segments=[61440, 4096]) == doc
    assert doc["recommended"]["strategy"] == "hybrid"


def test_validate_refuses_unknown_keywords_and_bad_values():
    with pytest.raises(cpattn.ConfigError, match="q_heads"):
        cpattn.validate(qheads=32)
    with pytest.raises(cpattn.ConfigError, match="cp"):
        cpattn.validate(cp="four", q_heads=8, kv_heads=2, head_dim=64, seq=64)
    assert cpattn.validate(cp=3, q_heads=8, kv_heads=2, head_dim=64, seq=64, strategy="ulysses")["valid"] is False


def test_import_does_not_initialise_mpi():
    code = "import cpattn, cpattn.torch, sys; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([os.environ.get("PYTHON", "/usr/bin/python3"), "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- Options read as the program reads its flags: the same types, ranges and limits; None refused where it
# means nothing; every refusal a ConfigError naming the field, raised before anything is computed. ----

BAD_OPTIONS = [
    ("causal", None),
    ("causal", 1),
    ("causal", "yes"),
    ("causal", 0.0),
    ("causal", [True]),
    ("scale", "0.5"),
    ("scale", 1e300),
    ("scale", -1.0),
    ("scale", 0.0),
    ("scale", float("nan")),
    ("scale", float("inf")),
    ("scale", 1e-31),
    ("scale", 1e31),
    ("scale", True),
    ("scale", [0.5]),
    ("scale", b"0.5"),
    ("threads", 2**40),
    ("threads", 2**31 - 1),
    ("threads", 10**6),
    ("threads", 1025),
    ("threads", 0),
    ("threads", -1),
    ("threads", True),
    ("threads", 4.0),
    ("threads", "2"),
    ("threads", 10**30),
]


@pytest.mark.parametrize("function", ["attention", "attention_backward"])
@pytest.mark.parametrize("field, value", BAD_OPTIONS, ids=[f"{f}={v!r}" for f, v in BAD_OPTIONS])
def test_a_bad_option_is_a_config_error_naming_it(function, field, value):
    q = np.random.default_rng(0).standard_normal((1, 64, 4, 16)).astype(np.float32)
    k = q[:, :, :2].copy()
    start = time.monotonic()
    with pytest.raises(cpattn.ConfigError) as e:
        if function == "attention":
            cpattn.attention(q, k, k, **{field: value})
        else:
            o, lse = cpattn.attention(q, k, k)
            cpattn.attention_backward(q, k, k, o, lse, q, **{field: value})
    assert time.monotonic() - start < 10
    assert any(item["field"] == field for item in e.value.errors), e.value.errors
    assert field in str(e.value)


GOOD_OPTIONS = [
    ("causal", np.bool_(False)),
    ("scale", np.float32(0.25)),
    ("scale", 1),
    ("scale", np.float64(1e-30)),
    ("threads", np.int64(2)),
    ("threads", 1024),
]


@pytest.mark.parametrize("field, value", GOOD_OPTIONS, ids=[f"{f}={v!r}" for f, v in GOOD_OPTIONS])
def test_numpy_scalars_and_the_range_ends_are_taken(field, value):
    q = np.random.default_rng(1).standard_normal((1, 64, 4, 16)).astype(np.float32)
    k = q[:, :, :2].copy()
    o, _ = cpattn.attention(q, k, k, **{field: value})
    want = dict(causal=True, scale=None, threads=None)
    want[field] = {"causal": bool, "scale": float, "threads": int}[field](value)
    assert np.array_equal(o, cpattn.attention(q, k, k, **want)[0])


BAD_POSITIONS = [
    ((2**31, 1, 0), "seq_len"),
    ((2**62, 2, 0), "seq_len"),
    ((2**30, 1, 0), "seq_len"),
    ((0, 1, 0), "seq_len"),
    ((64, 0, 0), "cp"),
    ((64, 70000, 0), "cp"),
    ((64, 2, 2), "rank"),
    ((64, 2, -1), "rank"),
    ((64, "2", 0), "cp"),
    ((64.0, 2, 0), "seq_len"),
    ((None, 2, 0), "seq_len"),
    ((64, 2, 0, "zigzag"), "layout"),
    ((64, 2, 0, 5), "layout"),
    ((63, 2, 0), "seq_len"),
    ((66, 2, 0, "dual_chunk_swap"), "seq_len"),
    ((64, 2, 0, "solver", [10, 10]), "documents"),
    ((64, 2, 0, "per_document", "64"), "documents"),
    ((64, 2, 0, "per_document", [64, 0]), "documents[1]"),
    ((64, 2, 0, "per_document", [32, None]), "documents[1]"),
]


@pytest.mark.parametrize("layout", ["per_document", "solver"])
def test_local_positions_of_the_document_layouts_cover_the_row_once(layout):
    docs = [1, 100, 3, 152]
    ranks = [cpattn.local_positions(256, 4, r, layout, documents=docs) for r in range(4)]
    assert all(len(x) == 64 for x in ranks)
    assert sorted(np.concatenate(ranks).tolist()) == list(range(256))
    # per_document: each rank holds a quarter of the last document (152 tokens)
    if layout == "per_document":
        for r in ranks:
            assert sum(1 for p in r if 104 <= p) == 38
    # a window changes the solver's costs, not its rules
    w = [cpattn.local_positions(256, 4, r, layout, documents=docs, window=16) for r in range(4)]
    assert sorted(np.concatenate(w).tolist()) == list(range(256))


@pytest.mark.parametrize("args, field", BAD_POSITIONS, ids=[repr(a) for a, _ in BAD_POSITIONS])
def test_local_positions_refuses_at_once(args, field):
    start = time.monotonic()
    with pytest.raises(cpattn.ConfigError) as e:
        cpattn.local_positions(*args)
    assert time.monotonic() - start < 10  # a refusal, not minutes of work (the bound is the hang, not the speed)
    assert any(item["field"] == field for item in e.value.errors), e.value.errors


@pytest.mark.parametrize("field, value", [("causal", None), ("scale", "0.5"), ("threads", 2**40), ("threads", 0)])
def test_the_torch_level_refuses_as_the_numpy_level(field, value):
    q, k, v, _, _ = make(1, 64, 4, 2, 16, False)
    with pytest.raises(cpattn.ConfigError) as e:
        ct.attention(q, k, v, **{field: value})
    assert any(item["field"] == field for item in e.value.errors), e.value.errors


def test_a_copy_that_cannot_be_allocated_is_a_memory_error():
    # A broadcast view (zero strides along seq) cannot be read in place: its C-order copy is 16 GiB, more than a
    # 2 GiB address-space limit allows. MemoryError naming q, in a child process under that limit.
    code = (
        "import resource, numpy as np, cpattn\n"
        "a = np.broadcast_to(np.float32(1), (1, 1 << 23, 8, 64))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "try:\n"
        "    cpattn.attention(a, a[:, :, :2], a[:, :, :2])\n"
        "except MemoryError as e:\n"
        "    print('MemoryError:', e)\n"
    )
    env = dict(os.environ)
    out = subprocess.run([os.environ.get("PYTHON", "/usr/bin/python3"), "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MemoryError: out of memory while allocating" in out.stdout, out.stdout + out.stderr
    assert "for q (a C-order copy" in out.stdout, out.stdout + out.stderr


def test_ctrl_c_stops_a_long_call_between_kernel_tasks():
    # SIGINT a second into a call that would take tens of seconds: the kernels stop at their next task (the
    # KeyboardInterrupt is theirs, not Python's after the call) and the next call works.
    code = (
        "import os, signal, threading, numpy as np, cpattn\n"
        "q = np.random.default_rng(0).standard_normal((1, 32768, 8, 128)).astype(np.float32)\n"
        "threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "try:\n"
        "    cpattn.attention(q, q, q, threads=1)\n"
        "    print('finished')\n"
        "except KeyboardInterrupt as e:\n"
        "    print('KeyboardInterrupt:', e)\n"
        "o, _ = cpattn.attention(q[:, :64], q[:, :64], q[:, :64])\n"
        "print('next call', o.shape)\n"
    )
    out = subprocess.run([os.environ.get("PYTHON", "/usr/bin/python3"), "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "KeyboardInterrupt: interrupted (Ctrl-C) between kernel tasks" in out.stdout, out.stdout
    assert "next call (1, 64, 8, 128)" in out.stdout, out.stdout


def test_plan_takes_forward_only_and_refuses_it_with_remat():
    doc = cpattn.plan(preset="llama3-70b", seq=4096, cp=4, forward_only=True)
    assert doc["valid"] is True and doc["problem"]["forward_only"] is True
    for s in doc["strategies"]:
        for c in s.get("collectives", []):
            assert c["phase"] == "forward", c
    doc = cpattn.plan(preset="llama3-70b", seq=4096, cp=4, forward_only=True, remat=True)
    assert doc["valid"] is False
    assert any("forward-only" in e["message"] for e in doc["errors"]), doc["errors"]


def test_plan_takes_a_profile_file(tmp_path):
    profile = tmp_path / "mine.yaml"
    profile.write_text("name: mine\nflops: 1e15\nbandwidth: 4e11\nsource: a test\n")
    doc = cpattn.plan(preset="llama3-70b", seq=4096, cp=4, profile=str(profile))
    assert doc["valid"] is True and doc["hardware"]["name"] == "mine", doc.get("errors")
    assert doc["hardware"]["flops"] == 1e15
    profile.write_text("name: mine\nflop: 1e15\nbandwidth: 4e11\nsource: a test\n")
    doc = cpattn.plan(preset="llama3-70b", seq=4096, cp=4, profile=str(profile))
    assert doc["valid"] is False and any("did you mean 'flops'" in e["message"] for e in doc["errors"]), doc
    # A file and a named profile (even the default's name) are one too many.
    profile.write_text("name: mine\nflops: 1e15\nbandwidth: 4e11\nsource: a test\n")
    doc = cpattn.plan(preset="llama3-70b", seq=4096, cp=4, profile=str(profile), hardware="h200")
    assert doc["valid"] is False and any("--profile and --hardware" in e["message"] for e in doc["errors"]), doc


def test_plan_svg_draws_each_strategy_on_one_scale(tmp_path):
    # One group per possible strategy, named and timed as the JSON says, the recommended one marked; every
    # rank's compute bar on one seconds-to-pixels scale across strategies; ring and hybrid drawn with their
    # exposed time, the others with waiting and communication.
    import xml.etree.ElementTree as ET

    svg = tmp_path / "plan.svg"
    code, doc = cli("plan", "--preset", "qwen3.5-397b-a17b", "--seq", "65536", "--cp", "8", "--svg", str(svg))
    assert code == 0, doc
    ns = {"s": "http://www.w3.org/2000/svg"}
    groups = ET.parse(svg).getroot().findall("s:g", ns)
    possible = [s for s in doc["strategies"] if s["possible"]]
    assert [g.get("data-name") for g in groups] == [s["name"] for s in possible]
    scales = []
    for g, s in zip(groups, possible):
        layer = s["estimated_seconds"]["layer"]
        assert abs(float(g.get("data-layer-seconds")) - layer) <= 1e-3 * layer
        assert (g.get("data-recommended") == "true") == (s["name"] == doc["recommended"]["name"])
        compute = g.findall("s:rect[@class='compute']", ns)
        assert len(compute) == len(s["estimated_seconds"]["compute_per_rank"])
        for rect, seconds in zip(compute, s["estimated_seconds"]["compute_per_rank"]):
            scales.append(float(rect.get("width")) / seconds)
        ring = s["strategy"] in ("ring", "hybrid")
        assert bool(g.findall("s:rect[@class='exposed']", ns)) == ring, s["name"]
        assert bool(g.findall("s:rect[@class='communication']", ns)) == (not ring), s["name"]
    assert max(scales) <= min(scales) * (1 + 1e-3), "one scale for every bar"
