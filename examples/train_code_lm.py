#!/usr/bin/env python3
"""A byte-level causal language model trained on the Python standard library's source files as Debian ships
them (/usr/lib/python3.X, tests and installed packages excluded), with context-parallel attention:
cpattn.torch.context_parallel_sdpa over a torch.distributed gloo group, inside data parallelism.

    python3 -m cpattn.launch --nproc 4 examples/train_code_lm.py --cp 4 --dp 1 --steps 300
    python3 -m cpattn.launch --nproc 4 examples/train_code_lm.py --cp 2 --dp 2
    python3 examples/train_code_lm.py --cp 1 --steps 300       (one process: no launcher needed)

Data: every file is a document; files are packed into rows of --seq bytes (segment ids per file: a byte sees
only its own file), the next byte the target (none across files). A fixed tenth of the modules (by a hash of
their path) is held out. Model: byte embedding, --layers blocks of RMSNorm, attention (8 q heads on 2 kv heads,
RoPE on each byte's position in its row), RMSNorm, SwiGLU; tied output. Each process holds its shard of every
row (the strategy's layout: cpattn.local_positions) and computes its bytes' losses; the gradients are summed
over every process (the context-parallel group's shards and the data-parallel replicas: the all-reduce is
this script's), so one step is the same optimisation step at any --cp, and at any --dp for the same rows per
step (--dp x --batch).

Per step it prints the loss, tokens/s and attention's share of the step; every --eval-every steps the held-out
loss by position within the document (0-1k, 1k-4k, 4k-16k bytes) with the full context and with the context
cut to the last 1k bytes (a sliding window at evaluation: each byte sees itself and the 1023 before it, the
attention's window=1023), so that what the long context buys shows, against the unigram baseline (the bytes'
entropy). --out DIR gets the numbers as JSON and, where matplotlib imports, the loss curves and the
by-position losses as a PNG.
"""

import argparse
import json
import math
import os
import random
import sys
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpattn
import cpattn.torch as ct

BUCKETS = ((0, 1024), (1024, 4096), (4096, 16384))


def source_files(root):
    """The library's .py files under root, sorted: tests, caches and installed packages left out."""
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("test"))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test")]
    return sorted(out)


def split_files(root):
    train, held = [], []
    for path in source_files(root):
        with open(path, "rb") as f:
            data = f.read()
        if not data:
            continue
        (held if zlib.crc32(os.path.relpath(path, root).encode()) % 10 == 0 else train).append(data)
    return train, held


def pack_rows(files, seq, rng):
    """Rows of `seq` bytes packed from the files in a shuffled order: (bytes, segment ids, targets), a file
    continuing past a row's end as a new document in the next row; a last row left short is dropped."""
    order = list(range(len(files)))
    rng.shuffle(order)
    stream, seg = bytearray(), []
    doc = 0
    rows = []
    for i in order:
        data = files[i]
        while data:
            room = seq - len(stream)
            piece, data = data[:room], data[room:]
            stream += piece
            seg += [doc] * len(piece)
            doc += 1
            if len(stream) == seq:
                rows.append(_row(stream, seg))
                stream, seg = bytearray(), []
    return rows


def _row(stream, seg, pad_to=None):
    n = pad_to or len(stream)
    x = torch.zeros(n, dtype=torch.long)
    x[: len(stream)] = torch.tensor(list(stream), dtype=torch.long)
    s = torch.full((n,), -1, dtype=torch.int32)
    s[: len(seg)] = torch.tensor(seg, dtype=torch.int32)
    y = torch.full((n,), -1, dtype=torch.long)
    same = s[1:] == s[:-1]
    y[:-1] = torch.where(same & (s[:-1] >= 0), x[1:], torch.full_like(x[1:], -1))
    s[len(seg):] = (s[len(seg) - 1] + 1) if seg else 0  # padding: a document of its own
    return x, s, y


def eval_rows(files, seq, count):
    """One held-out file per row (its first `seq` bytes, the rest padding): (bytes, segment ids, targets,
    each byte's position in its file)."""
    rows = []
    for data in sorted(files, key=len, reverse=True)[:count]:
        piece = data[:seq]
        x, s, y = _row(bytearray(piece), [0] * len(piece), pad_to=seq)
        rows.append((x, s, y, torch.arange(seq)))
    return rows


# The evaluation's cut context: each byte sees itself and the WINDOW bytes before it.
WINDOW = 1023


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, cos, sin):  # x [B, L, H, D]; cos, sin [L, D/2]
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


class Block(torch.nn.Module):
    def __init__(self, d, hq, hkv, hidden):
        super().__init__()
        self.hq, self.hkv, self.dh = hq, hkv, d // hq
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.wq = torch.nn.Linear(d, hq * self.dh, bias=False)
        self.wkv = torch.nn.Linear(d, 2 * hkv * self.dh, bias=False)
        self.wo = torch.nn.Linear(hq * self.dh, d, bias=False)
        self.w13 = torch.nn.Linear(d, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin, seg, attend):
        B, L, _ = x.shape
        h = self.n1(x)
        q = rope(self.wq(h).view(B, L, self.hq, self.dh), cos, sin)
        k, v = self.wkv(h).view(B, L, 2, self.hkv, self.dh).unbind(2)
        k = rope(k, cos, sin)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), seg)  # [B, Hq, L, D]
        x = x + self.wo(o.transpose(1, 2).reshape(B, L, -1))
        a, b = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(a) * b)


class ByteLM(torch.nn.Module):
    def __init__(self, d, layers, hq, hkv):
        super().__init__()
        self.embed = torch.nn.Embedding(256, d)
        torch.nn.init.normal_(self.embed.weight, std=d ** -0.5)  # tied: logits of order 1 at the start
        self.blocks = torch.nn.ModuleList(Block(d, hq, hkv, 8 * d // 3 // 8 * 8) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.dh = d // hq

    def forward(self, x, positions, seg, attend):
        inv = 1.0 / (10000 ** (torch.arange(0, self.dh, 2, dtype=torch.float32) / self.dh))
        ang = positions.float()[:, None] * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h, cos, sin, seg, attend)
        return self.norm(h) @ self.embed.weight.t()


class AttentionClock:
    """Seconds inside attention, forward and backward (hooks on its output and inputs)."""

    def __init__(self, attend):
        self.attend, self.seconds = attend, 0.0

    def __call__(self, q, k, v, seg, window=None):
        t0 = time.perf_counter()
        o = self.attend(q, k, v, seg, window)
        self.seconds += time.perf_counter() - t0
        if o.requires_grad:
            mark = {}
            o.register_hook(lambda g: mark.__setitem__("t", time.perf_counter()) or g)
            q.register_hook(lambda g: self._add(mark) or g)
        return o

    def _add(self, mark):
        if "t" in mark:
            self.seconds += time.perf_counter() - mark.pop("t")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=1, help="processes per context-parallel group")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (cp x dp processes in all)")
    ap.add_argument("--strategy", default="ulysses", help="ulysses, all_gather, ring or hybrid")
    ap.add_argument("--layout", default="contiguous", help="contiguous or dual_chunk_swap")
    ap.add_argument("--ulysses-degree", type=int, default=None, help="hybrid's")
    ap.add_argument("--seq", type=int, default=16384, help="bytes per row")
    ap.add_argument("--batch", type=int, default=1, help="rows per step per data-parallel replica")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=None, help="kernel and torch threads per process")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
    ap.add_argument("--out", default=None, help="directory for the JSON and the PNG")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    if "RANK" in os.environ or a.cp * a.dp > 1:
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    if world != a.cp * a.dp:
        raise SystemExit(f"--cp {a.cp} x --dp {a.dp} = {a.cp * a.dp} processes; {world} were started")
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    cp_rank, dp_rank = rank % a.cp, rank // a.cp
    group = None
    if world > 1:
        groups = [dist.new_group(list(range(r * a.cp, (r + 1) * a.cp))) for r in range(a.dp)]
        group = groups[dp_rank]
    options = dict(strategy=a.strategy, layout=a.layout, load_balance=a.layout == "dual_chunk_swap",
                   ulysses_degree=a.ulysses_degree, threads=threads)
    if a.cp > 1:
        def attend(q, k, v, seg, window):
            return ct.context_parallel_sdpa(q, k, v, is_causal=True, segment_ids=seg, group=group, window=window,
                                            **options)
    else:
        def attend(q, k, v, seg, window):
            o = ct.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                             segment_ids=seg, threads=threads, window=window)
            return o.transpose(1, 2)
    clock = AttentionClock(attend)
    positions = torch.from_numpy(cpattn.local_positions(a.seq, a.cp, cp_rank, a.layout)).long()

    train, held = split_files(a.root)
    counts = torch.zeros(256, dtype=torch.float64)
    for data in train:
        counts += torch.bincount(torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), minlength=256)
    p = counts / counts.sum()
    unigram = float(-(p[p > 0] * p[p > 0].log()).sum())
    torch.manual_seed(a.seed)
    model = ByteLM(a.d_model, a.layers, 8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rows = pack_rows(train, a.seq, random.Random(a.seed))
    held_rows = eval_rows(held, a.seq, a.eval_rows)
    if rank == 0:
        print(f"{len(train)} training files ({sum(map(len, train)) / 2**20:.1f} MiB, {len(rows)} rows of {a.seq}), "
              f"{len(held)} held out; unigram baseline {unigram:.4f} nats/byte; cp {a.cp} x dp {a.dp}, "
              f"{a.strategy}, {threads} threads per process; {sum(t.numel() for t in model.parameters())} "
              f"parameters", flush=True)

    def step_loss(batch_rows):
        """This process's share of the loss: its bytes' summed cross-entropy over all targets of the step."""
        xs = torch.stack([r[0][positions] for r in batch_rows])
        ss = torch.stack([r[1][positions] for r in batch_rows])
        ys = torch.stack([r[2][positions] for r in batch_rows])
        logits = model(xs, positions, ss, clock)
        total = torch.tensor([float((torch.stack([r[2] for r in batch_rows]) >= 0).sum())])
        if world > 1:
            dist.all_reduce(total)  # every process sees every row's target count for its replica ...
            total /= a.cp  # ... once per context-parallel rank
        return F.cross_entropy(logits.flatten(0, 1), ys.flatten(), ignore_index=-1, reduction="sum") / total

    history = {"step": [], "loss": [], "tokens_per_s": [], "attention_share": [], "eval": []}
    start = time.perf_counter()
    for step in range(1, a.steps + 1):
        lr = a.lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * min(step, a.steps) / a.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.perf_counter()
        clock.seconds = 0.0
        first = ((step - 1) * a.dp + dp_rank) * a.batch
        batch_rows = [rows[(first + i) % len(rows)] for i in range(a.batch)]
        loss = step_loss(batch_rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        shown = loss.detach().clone()
        if world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
            dist.all_reduce(shown)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        tokens = a.seq * a.batch * a.dp
        history["step"].append(step)
        history["loss"].append(float(shown))
        history["tokens_per_s"].append(tokens / dt)
        history["attention_share"].append(clock.seconds / dt)
        if rank == 0:
            print(f"step {step:4d}  loss {float(shown):.5f}  tokens/s {tokens / dt:8.0f}  attention "
                  f"{100 * clock.seconds / dt:4.1f} %  {time.perf_counter() - start:7.1f} s", flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            history["eval"].append(dict(step=step, **evaluate(model, held_rows, positions, clock, a, world, rank)))
            if rank == 0:
                e = history["eval"][-1]
                print("held out, nats/byte by position:  " + "  ".join(
                    f"{lo // 1024}k-{hi // 1024}k full {e['full'][i]:.4f} window {e['window'][i]:.4f}"
                    for i, (lo, hi) in enumerate(BUCKETS)) + f"  all {e['full_all']:.4f}", flush=True)
    if rank == 0:
        history.update(unigram=unigram, seconds=time.perf_counter() - start, args=vars(a))
        if a.out:
            write_out(a.out, history)
    if world > 1:
        dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, held_rows, positions, clock, a, world, rank):
    """Held-out loss by position within the file, with the full context and with it cut to the last 1k bytes (a
    sliding window of WINDOW); every process its shard, summed over the context-parallel group (each replica
    evaluates the same rows)."""
    sums = torch.zeros(2, len(BUCKETS) + 1, dtype=torch.float64)
    counts = torch.zeros(len(BUCKETS) + 1, dtype=torch.float64)
    def windowed(q, k, v, seg):
        return clock(q, k, v, seg, WINDOW)

    for x, s, y, pos in held_rows:
        for which, attend in enumerate((clock, windowed)):
            logits = model(x[positions][None], positions, s[positions][None], attend)
            ce = F.cross_entropy(logits[0], y[positions].clamp(min=0), reduction="none").double()
            ok = y[positions] >= 0
            for i, (lo, hi) in enumerate(BUCKETS + ((0, a.seq),)):
                m = ok & (pos[positions] >= lo) & (pos[positions] < hi)
                sums[which, i] += ce[m].sum()
                if which == 0:
                    counts[i] += m.sum()
    if world > 1:
        dist.all_reduce(sums)
        dist.all_reduce(counts)
        sums /= a.dp
        counts /= a.dp
    mean = (sums / counts.clamp(min=1)).tolist()
    return {"full": mean[0][:-1], "window": mean[1][:-1], "full_all": mean[0][-1], "window_all": mean[1][-1],
            "bytes": counts.tolist()[:-1]}


def write_out(out, history):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train_code_lm.json"), "w") as f:
        json.dump(history, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (Debian: python3-matplotlib): no PNG", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(history["step"], history["loss"], label="training loss (its rows)")
    ev = history["eval"]
    left.plot([e["step"] for e in ev], [e["full_all"] for e in ev], "o-", label="held out, full context")
    left.plot([e["step"] for e in ev], [e["window_all"] for e in ev], "s--", label="held out, last 1k bytes")
    left.axhline(history["unigram"], color="grey", linestyle=":", label="unigram baseline")
    left.set_xlabel("step")
    left.set_ylabel("nats per byte")
    left.legend()
    last = ev[-1]
    labels = [f"{lo // 1024}k-{hi // 1024}k" for lo, hi in BUCKETS]
    xs = range(len(labels))
    right.bar([i - 0.2 for i in xs], last["full"], width=0.4, label="full context")
    right.bar([i + 0.2 for i in xs], last["window"], width=0.4, label="context cut to the last 1k bytes")
    low = min(last["full"] + last["window"])
    right.set_ylim(0.9 * low, 1.02 * max(last["full"] + last["window"]))  # the gap, not the bars' height, matters
    for i in xs:
        right.annotate(f"{last['window'][i] - last['full'][i]:+.3f}", (i + 0.2, last["window"][i]), ha="center",
                       va="bottom", fontsize=8)
    right.set_xticks(list(xs))
    right.set_xticklabels(labels)
    right.set_xlabel("position within the file (bytes)")
    right.set_ylabel(f"held-out nats per byte, step {last['step']}")
    right.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "train_code_lm.png"), dpi=110)
    print(f"wrote {out}/train_code_lm.json and train_code_lm.png", flush=True)


if __name__ == "__main__":
    main()
