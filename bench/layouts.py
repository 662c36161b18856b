#!/usr/bin/env python3
"""The layouts on a packed row, measured against the planner: for ring and all_gather, the slowest rank's
kernel CPU time in the solver (or per_document) layout against the dual chunk swap, beside the ratio the
planner predicts for the same row.

    /usr/bin/python3 bench/layouts.py [--cpattn build/tools/cpattn/cpattn] [--seq 16384] [--cp 4]
        [--segments 9000,3000,...] [--heads 8] [--kv-heads 8] [--head-dim 128] [--repeat 3]
        [--layouts solver,per_document] [--strategies ring,all_gather] [--profile FILE] [--forward-only]

Each run is `cpattn run --threads 1` on the in-process group: the ranks share the machine's cores, so wall
time counts the others' turns; each rank's own kernel CPU time (kernel_cpu_seconds_per_rank: its forward and
backward kernel calls, best of --repeat) is what a layout balances. The prediction is `cpattn plan`'s on a
profile of this machine: `cpattn bench calibrate` first, in the same run (about a minute), or `--profile FILE`
calibrated here before; its kernel fit prices each call by its tiles, its partial tiles, its query and key rows.
The straggler's compute seconds (estimated_seconds.compute_per_rank, at the kernel's block of 64) of the layout's
entry over the dual chunk swap's is the predicted ratio, beside the same for its tiles alone (tiles_per_rank).
Prints one line per (strategy, layout), each rank's measured over predicted seconds, and the JSON of all of them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

# A long-tailed pack of 16384 tokens: one long document, a few middling ones, short ones.
DEFAULT_SEGMENTS = "9000,3000,1500,1200,700,500,300,184"


def run_json(args):
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpattn", default="build/tools/cpattn/cpattn")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--segments", default=DEFAULT_SEGMENTS)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--layouts", default="solver,per_document")
    p.add_argument("--strategies", default="ring,all_gather")
    p.add_argument("--profile", help="a profile `cpattn bench calibrate` wrote on this machine (default: calibrate now)")
    p.add_argument("--forward-only", action="store_true", help="the forward kernels alone (prefill)")
    a = p.parse_args()
    if sum(int(x) for x in a.segments.split(",")) != a.seq:
        sys.exit(f"--segments must sum to --seq ({a.seq})")
    shape = ["--seq", str(a.seq), "--cp", str(a.cp), "--q-heads", str(a.heads), "--kv-heads", str(a.kv_heads),
             "--head-dim", str(a.head_dim), "--segments", a.segments]
    profile = a.profile
    if profile is None:
        profile = os.path.join(tempfile.mkdtemp(prefix="cpattn-layouts-"), "this-machine.yaml")
        calibrated = subprocess.run([a.cpattn, "bench", "calibrate", "--output", profile], capture_output=True,
                                    text=True)
        if calibrated.returncode != 0:
            sys.exit(f"cpattn bench calibrate failed:\n{calibrated.stderr}")
        print(f"calibrated this machine: {profile} (--profile {profile} to plan on it again)")
    forward_only = ["--forward-only"] if a.forward_only else []
    plan = run_json([a.cpattn, "plan", *shape, "--block", "64", "--profile", profile, *forward_only, "--json"])
    entries = {s["name"]: s for s in plan["strategies"]}
    rows = []
    for strategy in a.strategies.split(","):
        def measured(layout):
            r = run_json([a.cpattn, "run", "--strategy", strategy, "--layout", layout, *shape, "--threads", "1",
                          "--repeat", str(a.repeat), *forward_only, "--json"])
            return max(r["kernel_cpu_seconds_per_rank"]), r["kernel_cpu_seconds_per_rank"], r["tiles_per_rank"]

        base_s, base_ranks, base_tiles = measured("dual_chunk_swap")
        base_plan = entries[f"{strategy}_load_balanced"]
        per_rank = [m / e for m, e in zip(base_ranks, base_plan["estimated_seconds"]["compute_per_rank"])]
        print(f"{strategy:11s} dual_chunk_swap measured / predicted per rank: {' '.join(f'{x:.3f}' for x in per_rank)}")
        for layout in a.layouts.split(","):
            s, ranks, tiles = measured(layout)
            entry = entries[f"{strategy}_{layout}"]
            predicted = (max(entry["estimated_seconds"]["compute_per_rank"]) /
                         max(base_plan["estimated_seconds"]["compute_per_rank"]))
            predicted_tiles = max(entry["tiles_per_rank"]) / max(base_plan["tiles_per_rank"])
            row = {"strategy": strategy, "layout": layout, "slowest_kernel_cpu_seconds": s,
                   "dual_chunk_swap_slowest_kernel_cpu_seconds": base_s, "measured_ratio": s / base_s,
                   "predicted_ratio": predicted, "predicted_tiles_ratio": predicted_tiles,
                   "kernel_cpu_seconds_per_rank": ranks, "dual_chunk_swap_kernel_cpu_seconds_per_rank": base_ranks,
                   "tiles_per_rank": tiles, "dual_chunk_swap_tiles_per_rank": base_tiles}
            rows.append(row)
            per_rank = [m / e for m, e in zip(ranks, entry["estimated_seconds"]["compute_per_rank"])]
            print(f"{strategy:11s} {layout} measured / predicted per rank: {' '.join(f'{x:.3f}' for x in per_rank)}")
            print(f"{strategy:11s} {layout:13s} slowest rank's kernels {s:.3f} s vs dual_chunk_swap {base_s:.3f} s:"
                  f" measured {s / base_s:.3f}, planner {predicted:.3f} (tiles {predicted_tiles:.3f}),"
                  f" measured / planner {s / base_s / predicted:.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
