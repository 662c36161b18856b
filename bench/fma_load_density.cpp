// Whether the fp32 FMA rate depends on how many FMAs read an operand from L1 (AVX-512 x86 only).
//
// Each round runs, one after another, the same loop of 16 independent FMA chains on full zmm vectors (~15 ms
// each) with K of every 16 FMAs taking their multiplier as a broadcast from L1 (vfmadd...{1to16}) and the
// others from a register, for K in {0, 1, 2, 4, 6, 8, 16}. Printed per K: the loads per FMA and the rate's
// maximum, 99th and 90th percentiles and median over the rounds, and how many of its windows ran faster than
// the K = 16 loop's fastest (a burst). On the 2-core KVM guest of docs/performance.md (session 9) the
// register-only loop and K = 1 burst to ~158 GFLOP/s in 3-5 % of the windows, K = 4 to ~148, and K >= 8 never
// passes ~139: a register tile of R rows x C vectors loads (R + C) / (R * C) values per FMA, at least ~0.39
// with 32 zmm registers (8 x 3: 0.46), so no fp32 GEMM-like loop reaches the register-only loop's bursts
// there.
//   cpattn_fma_load_density [ROUNDS]   (default 300)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace {

constexpr int kChains = 16;
constexpr std::int64_t kIters = 4'000'000;  // 64 M FMAs: ~15 ms at 2 FMAs a cycle and 2 GHz

alignas(64) float g_operands[kChains];

// GFLOP/s of kIters rounds of kChains FMAs, K of which read their multiplier from L1.
template <int K>
__attribute__((target("avx512f"), noinline)) double window() {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.001f * static_cast<float>(c));
  __m512 m = _mm512_set1_ps(0.99999994f), add = _mm512_set1_ps(1e-7f);
  asm volatile("" : "+v"(m), "+v"(add));
  const float* p = g_operands;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) {
      if ((c * K) % kChains < K) {  // K of the 16, spread out
        acc[c] = _mm512_fmadd_ps(acc[c], _mm512_set1_ps(p[c]), add);
      } else {
        acc[c] = _mm512_fmadd_ps(acc[c], m, add);
      }
    }
    asm volatile("" : "+r"(p));  // the operands are reloaded every round
  }
  for (int c = 0; c < kChains; ++c) asm volatile("" : "+v"(acc[c]));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * kChains * 16 * static_cast<double>(kIters) / s * 1e-9;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 300;
  if (rounds < 1) {
    std::fprintf(stderr, "ROUNDS must be a positive integer, got '%s'\n", argv[1]);
    return 2;
  }
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("skipped: this CPU has no AVX-512F\n");
    return 0;
  }
  for (float& v : g_operands) v = 0.99999994f;
  constexpr int kLoads[] = {0, 1, 2, 4, 6, 8, 16};
  constexpr int kVariants = sizeof(kLoads) / sizeof(kLoads[0]);
  double (*const loops[kVariants])() = {window<0>, window<1>, window<2>, window<4>,
                                        window<6>, window<8>, window<16>};
  std::vector<std::vector<double>> rates(kVariants);
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < kVariants; ++k) rates[k].push_back(loops[k]());
  }
  const double burst = quantile(rates[kVariants - 1], 1.0);
  std::printf(
      "%d rounds of ~15 ms windows; a burst: above %.1f GFLOP/s (the fastest window of 1 load per FMA)\n",
      rounds, burst);
  std::printf("loads/FMA    max    p99    p90 median  bursts\n");
  for (int k = 0; k < kVariants; ++k) {
    const auto bursts = std::count_if(rates[k].begin(), rates[k].end(), [&](double g) { return g > burst; });
    std::printf("%9.4f %6.1f %6.1f %6.1f %6.1f  %6ld\n", kLoads[k] / 16.0, quantile(rates[k], 1.0),
                quantile(rates[k], 0.99), quantile(rates[k], 0.9), quantile(rates[k], 0.5),
                static_cast<long>(bursts));
  }
  return 0;
}

#else
int main() {
  std::printf("skipped: an x86-64 AVX-512 experiment\n");
  return 0;
}
#endif
