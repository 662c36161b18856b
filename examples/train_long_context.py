#!/usr/bin/env python3
"""Trains a small causal transformer whose attention is cpattn, sequence-sharded over MPI processes.

    mpirun -np 4 python3 examples/train_long_context.py --cp 4
    python3 examples/train_long_context.py --cp 1          (one process: the same seed, data and steps)

The task needs attention across the whole row: key-value retrieval. A row starts with --pairs (value, key)
pairs of tokens (keys drawn from --keys, values from as many value tokens), then filler tokens, and ends with
--queries of those keys asked again in another order: at each asked key the model must give the value that
stood before that key at the start of the row, up to a whole row back. The loss and the accuracy count those
answers only.

Rows grow as the model learns (a length curriculum, as long-context training does): they start at
--start-seq tokens and double, up to --seq, each time the accuracy of the last 10 steps' answers reaches
--grow-at; each step holds about --tokens-per-step tokens (rows = that / the row length). Held-out rows of
--seq tokens measure the retrieval accuracy every --eval-every steps; --target-accuracy stops there.

The model: token embeddings plus an embedding of the token before each one (a bigram input: the data loader
has the whole row, so no process needs its neighbour's tokens), --layers pre-norm blocks (RMSNorm, attention
with RoPE: --q-heads on --kv-heads heads of --d-model / --q-heads dims, then a GELU MLP of 4 x d_model), a final
norm and an output layer. Each process holds the tokens at attn.local_positions(S) (the strategy's layout) and
runs everything but attention on them alone; cpattn's ContextParallelAttention does attention across the
processes, with autograd. The loss is the sum over the processes' answers over the answers in the batch, so
the gradients are summed over the processes (one all-reduce per step) and every process takes the same step.

Prints one line per step (step, row length, loss, accuracy of the step's answers, tokens/s) and a summary.
"""

import argparse
import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import cpattn.torch as ct


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=1, help="processes the sequence is split over (mpirun -np)")
    p.add_argument("--strategy", default="ulysses", help="ulysses, all_gather, ring or hybrid")
    p.add_argument("--load-balance", action="store_true", help="the dual-chunk-swap layout")
    p.add_argument("--ulysses-degree", type=int, default=None, help="hybrid: ranks per ulysses group")
    p.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    p.add_argument("--seq", type=int, default=4096, help="tokens per row at the end of the curriculum")
    p.add_argument("--start-seq", type=int, default=64, help="tokens per row at the start (--seq: none)")
    p.add_argument("--grow-at", type=float, default=0.9, help="accuracy of the last 10 steps that doubles rows")
    p.add_argument("--tokens-per-step", type=int, default=8192, help="rows per step = this / row length")
    p.add_argument("--pairs", type=int, default=16, help="(value, key) pairs at the start of each row")
    p.add_argument("--queries", type=int, default=16, help="keys asked at the end of each row (<= pairs)")
    p.add_argument("--keys", type=int, default=64, help="distinct key tokens (and as many value tokens)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch and kernel threads per process")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations (0: none)")
    p.add_argument("--eval-rows", type=int, default=4, help="held-out rows of --seq tokens")
    p.add_argument("--target-accuracy", type=float, default=None, help="stop once held-out accuracy reaches it")
    p.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--losses", default=None, help="write the per-step losses to this JSON file (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = p.parse_args(argv)
    chunk = 2 * args.cp if args.load_balance else args.cp
    for name in ("seq", "start_seq"):
        n = getattr(args, name)
        if n < 2 * args.pairs + args.queries or n % chunk:
            p.error(f"--{name.replace('_', '-')} {n}: must be >= 2 * pairs + queries = "
                    f"{2 * args.pairs + args.queries} and a multiple of {chunk}")
    if args.queries > args.pairs or args.pairs > args.keys:
        p.error("need --queries <= --pairs <= --keys")
    return args


class Vocab:
    """Token ids: keys [0, K), values [K, 2K), filler [2K, 2K + 32); START (before the first token) = size."""

    def __init__(self, keys):
        self.keys = keys
        self.size = 2 * keys + 32
        self.start = self.size


def make_rows(vocab, rows, seq, pairs, queries, generator):
    """(tokens [rows, seq], targets [rows, seq] with -1 where there is no answer to give)."""
    tokens = torch.randint(2 * vocab.keys, vocab.size, (rows, seq), generator=generator)
    targets = torch.full((rows, seq), -1, dtype=torch.long)
    for r in range(rows):
        keys = torch.randperm(vocab.keys, generator=generator)[:pairs]
        values = vocab.keys + torch.randint(0, vocab.keys, (pairs,), generator=generator)
        tokens[r, 0:2 * pairs:2] = values
        tokens[r, 1:2 * pairs:2] = keys
        asked = torch.randperm(pairs, generator=generator)[:queries]
        tokens[r, seq - queries:] = keys[asked]
        targets[r, seq - queries:] = values[asked]  # at the asked key: the value that stood before it
    return tokens, targets


def previous_tokens(vocab, tokens):
    return torch.cat([torch.full((tokens.shape[0], 1), vocab.start), tokens[:, :-1]], 1)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, positions, base=10000.0):
    """x [B, S_local, H, D]; positions: each local token's place in the whole row."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv[None, :]  # [S_local, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(torch.nn.Module):
    def __init__(self, args, attention):
        super().__init__()
        self.hq, self.hkv, self.hd = args.q_heads, args.kv_heads, args.d_model // args.q_heads
        self.norm1, self.norm2 = RMSNorm(args.d_model), RMSNorm(args.d_model)
        self.wq = torch.nn.Linear(args.d_model, self.hq * self.hd, bias=False)
        self.wk = torch.nn.Linear(args.d_model, self.hkv * self.hd, bias=False)
        self.wv = torch.nn.Linear(args.d_model, self.hkv * self.hd, bias=False)
        self.wo = torch.nn.Linear(self.hq * self.hd, args.d_model, bias=False)
        self.up = torch.nn.Linear(args.d_model, 4 * args.d_model, bias=False)
        self.down = torch.nn.Linear(4 * args.d_model, args.d_model, bias=False)
        self.attention = attention

    def forward(self, x, positions):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = rope(self.wq(h).view(b, s, self.hq, self.hd), positions)
        k = rope(self.wk(h).view(b, s, self.hkv, self.hd), positions)
        v = self.wv(h).view(b, s, self.hkv, self.hd)
        x = x + self.wo(self.attention(q, k, v).reshape(b, s, self.hq * self.hd))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(torch.nn.Module):
    def __init__(self, args, vocab, attention):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab.size, args.d_model)
        self.embed_previous = torch.nn.Embedding(vocab.size + 1, args.d_model)
        self.blocks = torch.nn.ModuleList(Block(args, attention) for _ in range(args.layers))
        self.norm = RMSNorm(args.d_model)
        self.out = torch.nn.Linear(args.d_model, vocab.size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens, previous, positions):
        x = self.embed(tokens) + self.embed_previous(previous)
        for block in self.blocks:
            x = block(x, positions)
        return self.out(self.norm(x))


class Processes:
    """The processes the sequence is split over: a float64 all-reduce (sum), nothing to do at cp 1."""

    def __init__(self, cp):
        self.cp = cp
        self.comm = None
        if cp > 1:
            from mpi4py import MPI

            self.MPI = MPI
            self.comm = MPI.COMM_WORLD
            if self.comm.size != cp:
                raise SystemExit(f"--cp {cp} but {self.comm.size} processes: run mpirun -np {cp}")
        self.rank = self.comm.rank if self.comm else 0

    def sum(self, values):
        if self.comm is None:
            return values
        out = np.empty_like(values)
        self.comm.Allreduce(values, out, op=self.MPI.SUM)
        return out


def attention_layer(args, procs):
    if args.cp == 1:
        return lambda q, k, v: ct.attention(q, k, v, causal=True, threads=args.threads)
    return ct.ContextParallelAttention(procs.comm, strategy=args.strategy, causal=True,
                                       load_balance=args.load_balance, ulysses_degree=args.ulysses_degree,
                                       threads=args.threads)


def positions_of(args, attention, seq):
    return torch.arange(seq) if args.cp == 1 else attention.local_positions(seq)


def answers_of(model, vocab, rows, positions):
    """(logits at this process's tokens, its targets) for rows = (tokens, targets)."""
    tokens, targets = rows
    previous = previous_tokens(vocab, tokens)
    return model(tokens[:, positions], previous[:, positions], positions), targets[:, positions]


def evaluate(model, vocab, procs, positions, rows):
    with torch.no_grad():
        logits, targets = answers_of(model, vocab, rows, positions)
    mask = targets >= 0
    correct = (logits.argmax(-1)[mask] == targets[mask]).sum().item()
    total = procs.sum(np.array([correct, mask.sum().item()], dtype=np.float64))
    return total[0] / total[1]


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    procs = Processes(args.cp)
    torch.manual_seed(args.seed)
    vocab = Vocab(args.keys)
    attention = attention_layer(args, procs)
    model = Model(args, vocab, attention)  # the same seed: the same weights on every process
    params = list(model.parameters())
    optimiser = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(args.seed + 1)
    held_out = make_rows(vocab, args.eval_rows, args.seq, args.pairs, args.queries,
                         torch.Generator().manual_seed(args.seed + 2))
    final_positions = positions_of(args, attention, args.seq)
    seq = min(args.start_seq, args.seq)
    recent = []
    losses, evals = [], []
    tokens_seen = 0
    reached = None
    start = time.perf_counter()
    step = 0
    for step in range(1, args.steps + 1):
        rows = max(1, args.tokens_per_step // seq)
        batch = make_rows(vocab, rows, seq, args.pairs, args.queries, data)
        positions = positions_of(args, attention, seq)
        answers = rows * args.queries  # over the whole batch: the same on every process
        for group in optimiser.param_groups:
            group["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
        logits, targets = answers_of(model, vocab, batch, positions)
        mask = targets >= 0
        loss_sum = F.cross_entropy(logits[mask], targets[mask], reduction="sum") if mask.any() else logits.sum() * 0
        optimiser.zero_grad(set_to_none=False)
        (loss_sum / answers).backward()
        correct = (logits.detach().argmax(-1)[mask] == targets[mask]).sum().item()
        # one all-reduce: every gradient, the loss and the count of right answers
        flat = torch.cat([p.grad.reshape(-1) for p in params]).double().numpy()
        # the time limit decided by rank 0 alone, so that every process stops at the same step
        over = float(procs.rank == 0 and args.time_limit is not None and time.perf_counter() - start > args.time_limit)
        summed = procs.sum(np.concatenate([flat, [over, loss_sum.item(), correct]]))
        offset = 0
        for p in params:
            p.grad.copy_(torch.from_numpy(summed[offset:offset + p.numel()]).view_as(p.grad))
            offset += p.numel()
        optimiser.step()
        loss, accuracy = summed[-2] / answers, summed[-1] / answers
        losses.append(loss)
        tokens_seen += rows * seq
        elapsed = time.perf_counter() - start
        if procs.rank == 0 and not args.quiet:
            print(f"step {step:4d}  seq {seq:5d} x {rows:3d}  loss {loss:.5f}  accuracy {accuracy:.3f}  "
                  f"tokens/s {tokens_seen / elapsed:7.0f}  {elapsed:7.1f} s", flush=True)
        recent = (recent + [accuracy])[-10:]
        if seq < args.seq and len(recent) == 10 and sum(recent) / 10 >= args.grow_at:
            seq = min(2 * seq, args.seq)
            recent = []
            if procs.rank == 0:
                print(f"rows grow to {seq} tokens at step {step} ({elapsed:.1f} s)", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            held = evaluate(model, vocab, procs, final_positions, held_out)
            evals.append((step, held, time.perf_counter() - start))
            if procs.rank == 0:
                print(f"eval step {step}: held-out retrieval accuracy {held:.3f} on rows of {args.seq} tokens "
                      f"at {evals[-1][2]:.1f} s", flush=True)
            if args.target_accuracy is not None and held >= args.target_accuracy:
                reached = evals[-1]
                break
        if summed[-3] > 0:
            break
    elapsed = time.perf_counter() - start
    if procs.rank == 0:
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump({"cp": args.cp, "losses": losses, "evals": evals}, f)
        where = f"cp {args.cp} ({args.strategy})" if args.cp > 1 else "cp 1 (one process)"
        print(f"summary: {where}, {step} steps, {tokens_seen} tokens in {elapsed:.1f} s "
              f"({tokens_seen / elapsed:.0f} tokens/s); rows of {seq} tokens at the end; "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
              + (f"; held-out accuracy {evals[-1][1]:.3f} on rows of {args.seq}" if evals else "")
              + (f"; reached {args.target_accuracy} at step {reached[0]} ({reached[2]:.0f} s)" if reached else ""),
              flush=True)
    return 0 if math.isfinite(losses[-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
