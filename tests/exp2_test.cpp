// The kernels' exp2 (kernels/flash_simd.hpp exp2_approx) on every SIMD target compiled in: its promises
// (exactly 0 below -126, exactly 1 at 0, exact powers of two, NaN kept, within 2 ulp of std::exp2) and the
// same values on every target with FMA (AVX-512 applies the power of two with vscalefps, AVX2 builds its
// bits); targets without FMA round the polynomial's multiply and add separately, so they may differ in the
// last bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "exp2_test.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/flash_simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace cpattn::test::HWY_NAMESPACE {

// out[i] = exp2_approx(in[i]) for n a multiple of every target's lane count.
void exp2_many(const float* in, float* out, std::int64_t n) {
  namespace hn = hwy::HWY_NAMESPACE;
  namespace k = cpattn::kernels::HWY_NAMESPACE;
  const k::DF df;
  for (std::int64_t i = 0; i < n; i += k::lanes())
    hn::StoreU(k::exp2_approx(hn::LoadU(df, in + i)), df, out + i);
}

const char* exp2_target() {
  return hwy::TargetName(HWY_TARGET);
}

// Whether MulAdd is one fused operation here (SSSE3, SSE4 and SCALAR: a multiply, then an add).
bool exp2_fused() {
  return HWY_NATIVE_FMA != 0;
}

}  // namespace cpattn::test::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include "cpattn/flash.hpp"
#include "kernels/exp2_avx512.hpp"

namespace cpattn::test {
HWY_EXPORT(exp2_many);
HWY_EXPORT(exp2_target);
HWY_EXPORT(exp2_fused);

namespace {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx512f,avx512dq"))) void exp2_bf16_block(const float* in, float* out) {
  _mm512_storeu_ps(out, kernels::exp2_bf16_avx512(_mm512_loadu_ps(in)));
}
#endif

std::uint32_t bits(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
}  // namespace

TEST(Exp2, EveryTargetKeepsItsPromisesAndThoseWithFmaGiveTheSameValues) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> in;
  for (int i = 0; i <= 262144; ++i) in.push_back(-130.0f + 130.5f * static_cast<float>(i) / 262144.0f);
  for (int k = 0; k <= 126; ++k) in.push_back(-static_cast<float>(k));  // exact powers of two
  // Halfway between two integers: every target rounds them to even (f = +-0.5 by the same tie rule).
  for (int k = 0; k <= 125; ++k) in.push_back(-0.5f - static_cast<float>(k));
  const std::vector<float> special = {-inf,
                                      -1000.0f,
                                      -127.0f,
                                      -126.5f,
                                      std::nextafter(-126.0f, -inf),
                                      -126.0f,
                                      0.0f,
                                      -0.0f,
                                      std::numeric_limits<float>::quiet_NaN()};
  in.insert(in.end(), special.begin(), special.end());
  while (in.size() % 64 != 0) in.push_back(0.0f);
  const std::int64_t n = static_cast<std::int64_t>(in.size());

  std::vector<float> first;
  std::string first_target;
  for (const std::string& t : flash_vector_targets()) {
    SCOPED_TRACE(t);
    flash_force_vector_target(t);
    ASSERT_EQ(std::string(HWY_DYNAMIC_DISPATCH(exp2_target)()), t)
        << "this test is not built for that target";
    std::vector<float> out(in.size());
    HWY_DYNAMIC_DISPATCH(exp2_many)(in.data(), out.data(), n);
    double worst = 0.0;
    std::int64_t wrong = 0, first_wrong = -1;
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = in[i], y = out[i];
      bool ok = true;
      if (std::isnan(x)) {
        ok = std::isnan(y);
      } else if (x < -126.0f) {
        ok = bits(y) == 0;  // +0 exactly
      } else if (x == std::round(x)) {
        ok = y == std::ldexp(1.0f, static_cast<int>(x));  // 2^k exactly, 1 at 0
      } else {
        const double want = std::exp2(static_cast<double>(x));
        worst = std::max(worst, std::fabs(y - want) / want);
      }
      if (!ok && first_wrong < 0) first_wrong = i;
      wrong += !ok;
    }
    if (first_wrong >= 0) ADD_FAILURE() << "exp2(" << in[first_wrong] << ") = " << out[first_wrong];
    EXPECT_EQ(wrong, 0);
    EXPECT_LT(worst, 2.4e-7) << "relative error (2 ulp = 2.4e-7)";
    if (!HWY_DYNAMIC_DISPATCH(exp2_fused)()) continue;
    if (first.empty()) {
      first = out;
      first_target = t;
      continue;
    }
    int differ = 0;
    for (std::int64_t i = 0; i < n; ++i) differ += !std::isnan(in[i]) && bits(out[i]) != bits(first[i]);
    EXPECT_EQ(differ, 0) << "values that differ from " << first_target << "'s";
  }
  flash_force_vector_target("");
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The bf16 product paths' probabilities (exp2_bf16_avx512, degree 3): the same range handling as the kernels'
// exp2 (NaN stays NaN, exactly +0 below -126, exactly 2^k at integers, 1 at 0) and at most 1.02e-4 relative
// error elsewhere, 1/19 of bf16's half-ulp.
TEST(Exp2, TheBf16PolynomialKeepsItsPromises) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq")) {
    GTEST_SKIP() << "no AVX512F/AVX512DQ on this CPU";
  }
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> in;
  for (int i = 0; i <= 262144; ++i) in.push_back(-130.0f + 130.5f * static_cast<float>(i) / 262144.0f);
  for (int k = 0; k <= 126; ++k) in.push_back(-static_cast<float>(k));
  for (float x : {-inf, -1000.0f, -127.0f, -126.5f, std::nextafter(-126.0f, -inf), -126.0f, 0.0f, -0.0f,
                  std::numeric_limits<float>::quiet_NaN()}) {
    in.push_back(x);
  }
  while (in.size() % 16 != 0) in.push_back(0.0f);
  std::vector<float> out(in.size());
  for (std::size_t i = 0; i < in.size(); i += 16) exp2_bf16_block(in.data() + i, out.data() + i);
  double worst = 0.0;
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const float x = in[i], y = out[i];
    if (std::isnan(x)) {
      wrong += !std::isnan(y);
    } else if (x < -126.0f) {
      wrong += bits(y) != 0;
    } else if (x == std::round(x)) {
      wrong += y != std::ldexp(1.0f, static_cast<int>(x));
    } else {
      const double want = std::exp2(static_cast<double>(x));
      worst = std::max(worst, std::fabs(y - want) / want);
    }
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_LT(worst, 1.02e-4);
  EXPECT_GT(worst, 1e-5) << "not the degree-3 polynomial";
}
#endif

}  // namespace cpattn::test
#endif  // HWY_ONCE
