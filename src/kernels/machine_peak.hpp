// The machine's arithmetic ceilings, measured: what the kernels' GFLOP/s are divided by. Each is a
// register-only loop of independent FMA chains (enough of them to cover latency x ports on every x86 core of
// the last years: 16 chains for 2 ports x 4 cycles, and Zen 5's 4 x 2-cycle FP pipes), each chain started
// from its own value so that no compiler can merge them, best of several tries.
#pragma once

namespace cpattn {

// fp32 FMA peak of the vector width the kernels are compiled for, on `threads` threads running at once (the
// sum of their rates), in GFLOP/s (an FMA counts 2 FLOPs per lane).
double measure_fma_peak_gflops(int threads = 1);

// The flash forward's own inner loop on data that stays in L1 (its 8 x 3 score register tile: 24 FMAs per
// step on 3 loaded vectors and 8 broadcast values), on `threads` threads, in GFLOP/s: what any kernel built
// from that tile could reach at best: a loop that reads L1 can stay below the register-only loop's bursts,
// so the FMA peak alone can be out of reach (docs/performance.md).
double measure_tile_peak_gflops(int threads = 1);

// Peak of the bf16 dot product (AVX512_BF16 vdpbf16ps: 32 bf16 pairs multiplied and added into 16 fp32 lanes,
// 64 FLOPs per instruction), on `threads` threads; 0 when the CPU does not have it.
double measure_bf16_dot_peak_gflops(int threads = 1);

}  // namespace cpattn
