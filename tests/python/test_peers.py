"""bench/peers/peers.py's checks: its float64 reference against cpattn's kernels, its bf16 rounding against
torch's, and a whole run at a tiny size: every contender within its tolerance, and one made wrong (its tokens
reversed) marked WRONG and left out of the ratios."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import torch

import cpattn

PEERS = os.path.join(os.environ.get("CPATTN_BENCH", os.path.join(os.path.dirname(__file__), "../../bench")),
                     "peers", "peers.py")


def load_peers():
    spec = importlib.util.spec_from_file_location("peers", PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_matches_cpattn():
    peers = load_peers()
    q, k, v, do = peers.inputs(40, 4, 16, seed=3, kv_heads=2)  # GQA: the kv heads' gradients sum two q heads
    for causal in (True, False):
        ref = peers.reference(q, k, v, do, causal, backward=True)
        o, lse = cpattn.attention(q, k, v, causal=causal, threads=1)
        dq, dk, dv = cpattn.attention_backward(q, k, v, o, lse, do, causal=causal, threads=1)
        for name, got in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert peers.relative_error(got, ref[name]) < 1e-5, (name, causal)
        # and the reference is not blind to a mask: the other mask's reference differs
        other = peers.reference(q, k, v, do, not causal, backward=False)
        assert peers.relative_error(o, other["o"]) > 1e-2


def test_bf16_words_round_like_torch():
    peers = load_peers()
    rng = np.random.default_rng(5)
    x = rng.standard_normal(4096).astype(np.float32)
    # exact ties (a set bit 15 and nothing below) round to even, both ways
    ties = (np.arange(64, dtype=np.uint32) << np.uint32(16) | np.uint32(0x3F808000)).view(np.float32)
    x = np.concatenate([x, ties, -ties])
    words = peers.to_bf16_words(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(words, want)
    assert np.array_equal(peers.from_bf16_words(words), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_a_run_checks_every_output_and_leaves_a_wrong_one_out(tmp_path):
    run = subprocess.run([sys.executable, PEERS, "--seq", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                          "--repeats", "1",
                          "--allocators", "glibc", "--ort", str(tmp_path / "no-ort"), "--wrong", "torch:bf16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith(("fp32 ", "bf16 "))]
    contenders = {(r[0], r[1], r[2]) for r in rows}
    for dtype in ("fp32", "bf16"):
        for pass_ in ("forward", "backward"):
            assert (dtype, pass_, f"cpattn:{dtype}") in contenders
            assert (dtype, pass_, f"torch:{dtype}") in contenders
    for r in rows:
        assert (r[-1] == "WRONG") == (r[2] == "torch:bf16"), r
    ratios = [line.split() for line in run.stdout.splitlines() if line.startswith("  ") and "cpattn " in line]
    assert {(r[0], r[1]) for r in ratios} == {("fp32", "forward"), ("fp32", "backward")}
    assert all("torch:fp32" in " ".join(r) for r in ratios)
    assert "onnxruntime-node not under" in run.stdout
