#include "kernels/machine_peak.hpp"

#include "core/start_thread.hpp"
#include "kernels/aligned_vector.hpp"
#include "kernels/simd_target.hpp"

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPATTN_X86 1
#endif

#ifndef CPATTN_MACHINE_PEAK_CONSTANTS_
#define CPATTN_MACHINE_PEAK_CONSTANTS_  // once, though foreach_target.h includes this file once per target
namespace cpattn::peak {
constexpr int kChains = 16;
constexpr int kTries = 5;
}  // namespace cpattn::peak
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/machine_peak.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/flash_simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace cpattn::peak::HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

// Defeats constant folding and keeps each accumulator a live register the optimizer cannot reason about.
template <class V>
HWY_INLINE void opaque(V& v) {
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
  asm volatile("" : : "r"(&v) : "memory");  // not a vector register: keep it in memory
#elif defined(__GNUC__) && defined(CPATTN_X86)
  asm volatile("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// Seconds for `iters` rounds of kChains independent FMAs on full vectors; returns FLOPs done through `flops`.
double fma_loop_seconds(std::int64_t iters, double& flops) {
  const hn::ScalableTag<float> df;
  using V = hn::Vec<decltype(df)>;
  std::array<V, kChains> acc;
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(df, 1.0f + 0.001f * static_cast<float>(c));
  V m = hn::Set(df, 0.99999994f), add = hn::Set(df, 1e-7f);
  opaque(m);
  opaque(add);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], m, add);
  }
  for (int c = 0; c < kChains; ++c) opaque(acc[c]);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  flops = 2.0 * kChains * static_cast<double>(hn::Lanes(df)) * static_cast<double>(iters);
  return s;
}

// Seconds for `iters` rounds of the flash forward's score tiles (dot_tile 8 x 3, as forward_vector calls it)
// over four groups of 8 keys against one panel of 3 vectors of rows, depth 64 (with 16 lanes: 8 KB of keys,
// 12 KB of Q'^T, 6 KB of scores, all in L1). FLOPs done through `flops`.
double tile_loop_seconds(std::int64_t iters, double& flops) {
  namespace k = cpattn::kernels::HWY_NAMESPACE;
  constexpr int kRows = 8, kVectors = 3, kKeys = 32, kDepth = 64;
  const auto stride = k::vectors_stride<kVectors>();
  const std::int64_t panel = stride;
  kernels::AlignedVector<float> qt(static_cast<std::size_t>(kDepth * panel)), keys(kKeys * kDepth),
      scores(static_cast<std::size_t>(kKeys * panel));
  for (std::size_t i = 0; i < qt.size(); ++i) qt[i] = 0.001f * static_cast<float>(i % 97);
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = 0.002f * static_cast<float>(i % 89);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int r = 0; r < kKeys; r += kRows) {
      k::dot_tile<kRows, kVectors>(keys.data() + r * kDepth, k::kAdjacent(), kRows, qt.data(), stride, kDepth,
                                   scores.data() + r * panel, stride);
    }
    asm volatile("" : : "r"(scores.data()) : "memory");  // the scores are used: each round is computed
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  flops = 2.0 * kKeys * kDepth * static_cast<double>(panel) * static_cast<double>(iters);
  return s;
}

}  // namespace cpattn::peak::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cpattn {
namespace peak {
HWY_EXPORT(fma_loop_seconds);
HWY_EXPORT(tile_loop_seconds);
double dispatched_fma_loop_seconds(std::int64_t iters, double& flops) {
  return HWY_DYNAMIC_DISPATCH(fma_loop_seconds)(iters, flops);
}
double dispatched_tile_loop_seconds(std::int64_t iters, double& flops) {
  return HWY_DYNAMIC_DISPATCH(tile_loop_seconds)(iters, flops);
}
}  // namespace peak

namespace {

using peak::kChains;
using peak::kTries;

#if defined(CPATTN_X86)
__attribute__((target("avx512f,avx512bf16"))) double bf16_loop_seconds(std::int64_t iters, double& flops) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.001f * static_cast<float>(c));
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3400);
  asm volatile("" : "+v"(a), "+v"(b));
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  for (int c = 0; c < kChains; ++c) asm volatile("" : "+v"(acc[c]));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  flops = 64.0 * kChains * static_cast<double>(iters);
  return s;
}
#endif

// Runs `loop` on `threads` threads started together, each the best of kTries of `iters` rounds, and sums
// their rates.
template <class Loop>
double peak_on_threads(int threads, Loop loop, std::int64_t iters = 4'000'000) {
  threads = std::max(1, threads);
  std::vector<double> best(static_cast<std::size_t>(threads), 0.0);
  std::barrier sync(threads);
  auto body = [&](int t) {
    for (int attempt = 0; attempt < kTries; ++attempt) {
      sync.arrive_and_wait();
      double flops = 0;
      const double s = loop(iters, flops);
      best[t] = std::max(best[t], flops / s * 1e-9);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  try {
    for (int t = 1; t < threads; ++t)
      pool.push_back(start_thread("the FMA peak's thread " + std::to_string(t), body, t));
  } catch (...) {
    // The threads that did start run their tries with the missing ones and this one dropped from the barrier,
    // and end.
    for (int t = static_cast<int>(pool.size()) + 1; t <= threads; ++t) sync.arrive_and_drop();
    for (auto& t : pool) t.join();
    throw;
  }
  body(0);
  for (auto& t : pool) t.join();
  double sum = 0;
  for (double b : best) sum += b;
  return sum;
}

}  // namespace

double measure_fma_peak_gflops(int threads) {
  kernels::apply_simd_target_env();
  // The target the kernels dispatch to (flash_vector_target()), so the peak is that vector width's.
  return peak_on_threads(threads, peak::dispatched_fma_loop_seconds);
}

double measure_tile_peak_gflops(int threads) {
  kernels::apply_simd_target_env();
  // 10000 rounds: 61 M FMA instructions with 16 lanes, about as many as one try of the FMA loop.
  return peak_on_threads(threads, peak::dispatched_tile_loop_seconds, 10'000);
}

double measure_bf16_dot_peak_gflops(int threads) {
#if defined(CPATTN_X86)
  if (!__builtin_cpu_supports("avx512bf16")) return 0.0;
  return peak_on_threads(threads, bf16_loop_seconds);
#else
  (void)threads;
  return 0.0;
#endif
}

}  // namespace cpattn
#endif  // HWY_ONCE
