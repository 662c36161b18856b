// Flash kernel throughput (Google Benchmark). Reports GFLOP/s (forward 4*B*Sq*Skv*Hq*D, halved when causal;
// backward 2.5x forward) and, as `frac_peak`, the fraction of this machine's fp32 FMA peak measured in the
// same run (cpattn::measure_fma_peak_gflops; `cpattn bench kernel` is the fuller tool).
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "cpattn/flash.hpp"
#include "cpattn/sequence_layout.hpp"
#include "harness/whole_problem.hpp"
#include "kernels/machine_peak.hpp"

namespace {

double fma_peak() {
  static const double peak = cpattn::measure_fma_peak_gflops(1);
  return peak;
}

// Hkv: the kv heads (Hq = H for BM_Forward and BM_Backward, fewer for the GQA benchmarks).
void run(benchmark::State& state, bool backward, std::int64_t S, std::int64_t H, std::int64_t Hkv,
         std::int64_t D, bool causal, int threads, cpattn::DType dtype = cpattn::DType::f32) {
  cpattn::AttentionSpec spec;
  spec.dtype = dtype;
  spec.seq_len = S;
  spec.num_q_heads = H;
  spec.num_kv_heads = Hkv;
  spec.head_dim = D;
  const cpattn::harness::WholeProblem problem = cpattn::harness::random_problem(spec, 1);
  const cpattn::Tensor &q = problem.q, &k = problem.k, &v = problem.v, &d_out = problem.d_out;
  const std::vector<std::int32_t> pos = cpattn::natural_positions(1, S);
  const cpattn::AttentionMask mask{pos, pos, {}, {}, causal};
  cpattn::FlashConfig cfg;
  cfg.threads = threads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // The kernels write into outputs allocated once, as the strategies and `cpattn bench kernel` call them: the
  // convenience calls' fresh, zeroed outputs would add page faults and a memset to every iteration.
  auto fwd = cpattn::flash_attention_forward(q, k, v, mask, scale, cfg);
  cpattn::FlashBackwardResult grads;
  if (backward) {
    grads = cpattn::flash_attention_backward(q, k, v, fwd.o, fwd.lse, d_out, mask, scale, cfg, dtype);
  }
  for (auto _ : state) {
    if (backward) {
      cpattn::flash_backward(cpattn::cref(q), cpattn::cref(k), cpattn::cref(v), cpattn::cref(fwd.o),
                             fwd.lse.data(), cpattn::cref(d_out), mask, scale, cfg, cpattn::ref(grads.dq),
                             cpattn::ref(grads.dk), cpattn::ref(grads.dv));
      benchmark::DoNotOptimize(grads.dq.raw());
    } else {
      cpattn::flash_forward(cpattn::cref(q), cpattn::cref(k), cpattn::cref(v), mask, scale, cfg,
                            cpattn::ref(fwd.o), fwd.lse.data());
      benchmark::DoNotOptimize(fwd.o.raw());
    }
  }
  double flops = cpattn::attention_forward_flops(1, S, H, D, causal);
  if (backward) flops *= cpattn::kBackwardFlopsPerForward;
  state.counters["GFLOPs"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_GFLOPs"] = fma_peak() * threads;
  state.counters["frac_peak"] = benchmark::Counter(flops * 1e-9 / (fma_peak() * threads),
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

// Args: S, heads (Hq = Hkv), D, causal, threads.
void run_mha(benchmark::State& state, bool backward) {
  run(state, backward, state.range(0), state.range(1), state.range(1), state.range(2), state.range(3) != 0,
      static_cast<int>(state.range(4)));
}
// Args: S, Hq, Hkv, D, causal, threads.
void run_gqa(benchmark::State& state, bool backward) {
  run(state, backward, state.range(0), state.range(1), state.range(2), state.range(3), state.range(4) != 0,
      static_cast<int>(state.range(5)));
}

// bf16 on the best path this CPU has (cpattn::flash_bf16_path); `frac_peak` still against the fp32 peak.
// Args: S, heads (Hq = Hkv), D, causal, threads.
void run_bf16(benchmark::State& state, bool backward) {
  state.SetLabel(cpattn::to_string(cpattn::flash_bf16_path(cpattn::FlashConfig{})));
  run(state, backward, state.range(0), state.range(1), state.range(1), state.range(2), state.range(3) != 0,
      static_cast<int>(state.range(4)), cpattn::DType::bf16);
}

void BM_Forward(benchmark::State& state) {
  run_mha(state, false);
}
void BM_Backward(benchmark::State& state) {
  run_mha(state, true);
}
void BM_ForwardGqa(benchmark::State& state) {
  run_gqa(state, false);
}
void BM_BackwardGqa(benchmark::State& state) {
  run_gqa(state, true);
}

void BM_ForwardBf16(benchmark::State& state) {
  run_bf16(state, false);
}
void BM_BackwardBf16(benchmark::State& state) {
  run_bf16(state, true);
}

BENCHMARK(BM_ForwardBf16)
    ->Args({4096, 8, 128, 0, 1})
    ->Args({4096, 8, 64, 0, 1})
    ->Args({4096, 8, 256, 0, 1})
    ->Args({4096, 8, 128, 1, 1})
    ->Args({4096, 8, 128, 0, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_BackwardBf16)
    ->Args({4096, 8, 128, 0, 1})
    ->Args({4096, 8, 128, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Forward)
    ->Args({4096, 8, 128, 0, 1})
    ->Args({4096, 8, 64, 0, 1})
    ->Args({4096, 8, 128, 1, 1})
    ->Args({4096, 8, 128, 0, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Backward)
    ->Args({4096, 8, 128, 0, 1})
    ->Args({4096, 8, 128, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// The users' GQA shape (32 query heads on 2 kv heads), at S = 2048: the FLOPs of the S = 4096, 8-head rows.
// Args: S, Hq, Hkv, D, causal, threads.
BENCHMARK(BM_ForwardGqa)
    ->Args({2048, 32, 2, 128, 0, 1})
    ->Args({2048, 32, 2, 128, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_BackwardGqa)->Args({2048, 32, 2, 128, 0, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
