#!/usr/bin/env python3
"""cpattn.torch.attention against PyTorch's naive attention, forward + backward, measured in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=build/python \\
        /usr/bin/python3 bench/python_attention.py [--seq 4096] [--heads 8] [--head-dim 128] [--repeats 3]

Each contender runs in a fresh process (one thread; the same float32 inputs, causal and not), so that its peak
memory is its own: the process's peak resident set less what it held once the inputs existed. Times are the
best of --repeats, forward alone and forward + backward. "numpy level" is cpattn.attention and
cpattn.attention_backward on the arrays (the kernels behind a thin binding). The binding's cost is bounded from
above by a whole call at S = 64 (compute included), many times over: that time over the big call's. The BLAS
PyTorch loaded is named.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def blas_loaded():
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line.lower() and ".so" in line}
    return sorted(os.path.realpath(p) for p in libs)


def contender(name, seq, heads, head_dim, causal, repeats):
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import cpattn
    import cpattn.torch as ct

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, seq, heads, head_dim, generator=g) for _ in range(4))
    base = peak_rss_bytes()

    def naive():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", qg, kg) * head_dim ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vg)
        o.backward(do)

    def torch_level():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        ct.attention(qg, kg, vg, causal=causal, threads=1).backward(do)

    arrays = [t.numpy() for t in (q, k, v, do)]

    def numpy_level():
        o, lse = cpattn.attention(*arrays[:3], causal=causal, threads=1)
        cpattn.attention_backward(*arrays[:3], o, lse, arrays[3], causal=causal, threads=1)

    def naive_forward():
        with torch.no_grad():
            s = torch.einsum("bqhd,bkhd->bhqk", q, k) * head_dim ** -0.5
            if causal:
                s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
            torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)

    def torch_forward():
        with torch.no_grad():
            ct.attention(q, k, v, causal=causal, threads=1)

    def numpy_forward():
        cpattn.attention(*arrays[:3], causal=causal, threads=1)

    runs = {"naive": (naive_forward, naive), "cpattn.torch": (torch_forward, torch_level),
            "cpattn numpy level": (numpy_forward, numpy_level)}[name]
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return {"forward": best[0], "seconds": best[1], "peak_bytes": peak_rss_bytes() - base,
            "blas": blas_loaded(), "torch": torch.__version__, "numpy": np.__version__}


def per_call_at_s64(calls=300):
    """Seconds per forward + backward call of cpattn.torch and of the numpy level at S = 64 (H 8, D 128)."""
    import torch

    torch.set_num_threads(1)
    import cpattn
    import cpattn.torch as ct

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 64, 8, 128, generator=g) for _ in range(4))
    arrays = [t.numpy() for t in (q, k, v, do)]
    out = {}
    for name in ("cpattn.torch", "cpattn numpy level"):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                if name == "cpattn.torch":
                    qg = q.clone().requires_grad_()
                    ct.attention(qg, k, v, threads=1).backward(do)
                else:
                    o, lse = cpattn.attention(*arrays[:3], threads=1)
                    cpattn.attention_backward(*arrays[:3], o, lse, arrays[3], threads=1)
            best = min(best, (time.perf_counter() - start) / calls)
        out[name] = best
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--causal", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one == "small":
        print(json.dumps(per_call_at_s64()))
        return
    if args.one:
        print(json.dumps(contender(args.one, args.seq, args.heads, args.head_dim, bool(args.causal), args.repeats)))
        return
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"S={args.seq} H={args.heads} D={args.head_dim} float32, forward + backward, one thread; {cpu}")
    big = {}
    for causal in (1, 0):
        results = {}
        for name in ("naive", "cpattn.torch", "cpattn numpy level"):
            out = subprocess.run([sys.executable, __file__, "--one", name, "--seq", str(args.seq), "--heads",
                                  str(args.heads), "--head-dim", str(args.head_dim), "--repeats",
                                  str(args.repeats), "--causal", str(causal)], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(out.stderr)
            results[name] = json.loads(out.stdout)
        naive, tl, nl = results["naive"], results["cpattn.torch"], results["cpattn numpy level"]
        if causal:
            print(f"torch {naive['torch']}, BLAS loaded: {', '.join(naive['blas']) or 'none found'}")
        print(f"{'causal' if causal else 'not causal'}:")
        for name, r in results.items():
            print(f"  {name:20s} forward {r['forward']:8.3f} s, forward + backward {r['seconds']:8.3f} s, "
                  f"peak {r['peak_bytes'] / 2**20:8.1f} MiB")
        print(f"  cpattn.torch is {naive['forward'] / tl['forward']:.2f}x naive forward, "
              f"{naive['seconds'] / tl['seconds']:.2f}x naive forward + backward; "
              f"{naive['peak_bytes'] / max(1, tl['peak_bytes']):.1f}x less memory at peak")
        big[causal] = tl["seconds"]
    out = subprocess.run([sys.executable, __file__, "--one", "small"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr)
    small = json.loads(out.stdout)
    for name, t in small.items():
        print(f"binding bound: {name} forward + backward at S = 64 takes {t * 1e6:.0f} us a call, "
              f"{100 * t / big[1]:.3f}% of the causal S = {args.seq} call")


if __name__ == "__main__":
    main()
