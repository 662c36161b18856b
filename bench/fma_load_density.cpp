// Whether the fp32 FMA rate depends on how many FMAs read an operand from L1 (AVX-512 x86 only).
//
// Each round runs, one after another, the same loop of 16 independent FMA chains on full zmm vectors (~15 ms
// each) with K of every 16 FMAs taking their multiplier as a broadcast from L1 (vfmadd...{1to16}) and the
// others from a register, for K in {0, 1, 2, 4, 6, 8, 16}. Printed per K: the loads per FMA and the rate's
// maximum, 99th and 90th percentiles and median over the rounds, and how many of its windows ran faster than
// the K = 16 loop's fastest (a burst). The question it answers: a register tile of R rows x C vectors loads
// (R + C) / (R * C) values per FMA, at least ~0.39 with 32 zmm registers (8 x 3: 0.46), so can any fp32
// GEMM-like loop reach the register-only loop's bursts? (Results: docs/performance.md.)
// The same rounds also run register tiles as the kernels' loops are built (dot_tile: R broadcasts and C
// vector loads from L1 per step of R x C FMAs into R x C zmm accumulators, depth 64, stored after): 8 x 3
// (the forward's), 6 x 4, 5 x 5 (the fewest loads per FMA with 32 registers) and 4 x 4, printed the same way
// with their median against the register-only loop's median, which shows how far the machine's phase
// separates loops that read L1 from loops that do not.
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

// Register tiles on L1-resident operands: four R x C tiles of depth 64 per round, ~64 M FMAs a window.
alignas(64) float g_tile_a[4 * 64 * 8];        // per tile: [64][R] broadcast operands (R <= 8)
alignas(64) float g_tile_b[64 * 5 * 16];       // [64][C vectors] (C <= 5)
alignas(64) float g_tile_out[4 * 8 * 5 * 16];  // per tile: R x C vectors

template <int R, int C>
__attribute__((target("avx512f"), always_inline)) inline void tile(const float* a, const float* b,
                                                                   float* out) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int d = 0; d < 64; ++d) {
    __m512 bv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) bv[c] = _mm512_load_ps(b + (d * C + c) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[d * R + r]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_store_ps(out + (r * C + c) * 16, acc[r][c]);
  }
}

template <int R, int C>
__attribute__((target("avx512f"), noinline)) double tile_window() {
  constexpr std::int64_t kTileFmas = 64 * R * C;
  const std::int64_t rounds = kChains * kIters / (4 * kTileFmas);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < rounds; ++i) {
    for (int t = 0; t < 4; ++t) tile<R, C>(g_tile_a + t * 64 * R, g_tile_b, g_tile_out + t * R * C * 16);
    asm volatile("" : : : "memory");  // each round's tiles are stored and read again
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 16 * static_cast<double>(4 * kTileFmas * rounds) / s * 1e-9;
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
  for (std::size_t i = 0; i < sizeof(g_tile_a) / sizeof(float); ++i)
    g_tile_a[i] = 0.001f * static_cast<float>(i % 97);
  for (std::size_t i = 0; i < sizeof(g_tile_b) / sizeof(float); ++i)
    g_tile_b[i] = 0.002f * static_cast<float>(i % 89);
  struct Tile {
    const char* name;
    double loads_per_fma;
    double (*window)();
  };
  const Tile tiles[] = {{"8 x 3", 11.0 / 24, tile_window<8, 3>},
                        {"6 x 4", 10.0 / 24, tile_window<6, 4>},
                        {"5 x 5", 10.0 / 25, tile_window<5, 5>},
                        {"4 x 4", 8.0 / 16, tile_window<4, 4>}};
  constexpr int kTiles = sizeof(tiles) / sizeof(tiles[0]);
  std::vector<std::vector<double>> rates(kVariants), tile_rates(kTiles);
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < kVariants; ++k) rates[k].push_back(loops[k]());
    for (int k = 0; k < kTiles; ++k) tile_rates[k].push_back(tiles[k].window());
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
  const double register_median = quantile(rates[0], 0.5);
  std::printf("register tile (loads/FMA)    max    p99    p90 median  bursts  median/register-only median\n");
  for (int k = 0; k < kTiles; ++k) {
    const std::vector<double>& v = tile_rates[k];
    const auto bursts = std::count_if(v.begin(), v.end(), [&](double g) { return g > burst; });
    std::printf("%-6s (%.4f)            %6.1f %6.1f %6.1f %6.1f  %6ld  %.3f\n", tiles[k].name,
                tiles[k].loads_per_fma, quantile(v, 1.0), quantile(v, 0.99), quantile(v, 0.9),
                quantile(v, 0.5), static_cast<long>(bursts), quantile(v, 0.5) / register_median);
  }
  return 0;
}

#else
int main() {
  std::printf("skipped: an x86-64 AVX-512 experiment\n");
  return 0;
}
#endif
