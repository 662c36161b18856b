// Flash kernel throughput (Google Benchmark). Reports GFLOP/s (forward 4*B*Sq*Skv*Hq*D, halved when causal;
// backward 2.5x forward) and, as `frac_peak`, the fraction of this machine's fp32 FMA peak measured in the
// same run by a register-only loop of 16 independent FMA chains.
#include <benchmark/benchmark.h>
#include <hwy/highway.h>

#include <chrono>
#include <cmath>
#include <random>

#include "cpattn/flash.hpp"

namespace {

namespace hn = hwy::HWY_NAMESPACE;

double measure_fma_peak_gflops() {
  const hn::ScalableTag<float> df;
  const std::int64_t n = static_cast<std::int64_t>(hn::Lanes(df));
  double best = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto a0 = hn::Set(df, 1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    auto a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
    const auto m = hn::Set(df, 0.9999999f), c = hn::Set(df, 1e-7f);
    const std::int64_t iters = 20'000'000;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iters; ++i) {
      a0 = hn::MulAdd(a0, m, c);
      a1 = hn::MulAdd(a1, m, c);
      a2 = hn::MulAdd(a2, m, c);
      a3 = hn::MulAdd(a3, m, c);
      a4 = hn::MulAdd(a4, m, c);
      a5 = hn::MulAdd(a5, m, c);
      a6 = hn::MulAdd(a6, m, c);
      a7 = hn::MulAdd(a7, m, c);
      a8 = hn::MulAdd(a8, m, c);
      a9 = hn::MulAdd(a9, m, c);
      a10 = hn::MulAdd(a10, m, c);
      a11 = hn::MulAdd(a11, m, c);
      a12 = hn::MulAdd(a12, m, c);
      a13 = hn::MulAdd(a13, m, c);
      a14 = hn::MulAdd(a14, m, c);
      a15 = hn::MulAdd(a15, m, c);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto sum = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)));
    sum = hn::Add(sum, hn::Add(hn::Add(hn::Add(a8, a9), hn::Add(a10, a11)),
                               hn::Add(hn::Add(a12, a13), hn::Add(a14, a15))));
    benchmark::DoNotOptimize(sum);
    best = std::max(best, 16.0 * 2.0 * static_cast<double>(n) * static_cast<double>(iters) / s / 1e9);
  }
  return best;
}

double fma_peak() {
  static const double peak = measure_fma_peak_gflops();
  return peak;
}

cpattn::Tensor random_tensor(cpattn::Shape4 shape, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(static_cast<std::size_t>(shape.numel()));
  for (auto& x : v) x = dist(gen);
  return cpattn::Tensor::from_floats(cpattn::DType::f32, shape, v);
}

void run(benchmark::State& state, bool backward) {
  const std::int64_t S = state.range(0), H = state.range(1), D = state.range(2);
  const bool causal = state.range(3) != 0;
  const int threads = static_cast<int>(state.range(4));
  const cpattn::Tensor q = random_tensor({1, S, H, D}, 1), k = random_tensor({1, S, H, D}, 2),
                       v = random_tensor({1, S, H, D}, 3), d_out = random_tensor({1, S, H, D}, 4);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(S));
  for (std::int64_t i = 0; i < S; ++i) pos[i] = static_cast<std::int32_t>(i);
  const cpattn::AttentionMask mask{pos, pos, {}, {}, causal};
  cpattn::FlashConfig cfg;
  cfg.threads = threads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto fwd = cpattn::flash_attention_forward(q, k, v, mask, scale, cfg);
  for (auto _ : state) {
    if (backward) {
      auto g = cpattn::flash_attention_backward(q, k, v, fwd.o, fwd.lse, d_out, mask, scale, cfg,
                                                cpattn::DType::f32);
      benchmark::DoNotOptimize(g.dq.raw());
    } else {
      fwd = cpattn::flash_attention_forward(q, k, v, mask, scale, cfg);
      benchmark::DoNotOptimize(fwd.o.raw());
    }
  }
  double flops =
      4.0 * static_cast<double>(S) * static_cast<double>(S) * static_cast<double>(H) * static_cast<double>(D);
  if (causal) flops /= 2;
  if (backward) flops *= 2.5;
  state.counters["GFLOPs"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_GFLOPs"] = fma_peak() * threads;
  const double seconds_per_iter = 0;  // filled by the rate counter; ratio below uses the same rate
  (void)seconds_per_iter;
  state.counters["frac_peak"] = benchmark::Counter(flops * 1e-9 / (fma_peak() * threads),
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Forward(benchmark::State& state) {
  run(state, false);
}
void BM_Backward(benchmark::State& state) {
  run(state, true);
}

// Args: S, heads (Hq = Hkv), D, causal, threads.
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

}  // namespace

BENCHMARK_MAIN();
