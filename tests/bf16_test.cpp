#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "cpattn/bf16.hpp"

namespace cpattn {
namespace {

std::uint16_t bits_of(float f) {
  return float_to_bf16(f).bits;
}

TEST(Bf16, ExactValuesRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.0f, 0.5f, 3.0f, 65280.0f}) EXPECT_EQ(round_to_bf16(f), f) << f;
  EXPECT_TRUE(std::signbit(round_to_bf16(-0.0f)));
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 is exactly half way between 1 (even mantissa) and 1 + 2^-7: ties go to even (1).
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  // 1 + 3*2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  // Just above / below half way.
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x3f807fffu)), 0x3f80);
}

TEST(Bf16, InfinityAndOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(bits_of(inf), 0x7f80);
  EXPECT_EQ(bits_of(-inf), 0xff80);
  // The largest float rounds past the largest bf16 (0x7f7f) to infinity.
  EXPECT_EQ(bits_of(std::numeric_limits<float>::max()), 0x7f80);
  // The largest bf16 itself stays.
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x7f7f0000u)), 0x7f7f);
}

TEST(Bf16, NanStaysQuietNanWithSign) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(round_to_bf16(qnan)));
  // A signalling NaN whose payload sits only in the low 16 bits would become infinity if truncated naively.
  const float snan_low = std::bit_cast<float>(0x7f800001u);
  EXPECT_TRUE(std::isnan(round_to_bf16(snan_low)));
  EXPECT_EQ(bits_of(snan_low) & 0x0040, 0x0040);
  const float neg_nan = std::bit_cast<float>(0xffc00000u);
  EXPECT_TRUE(std::isnan(round_to_bf16(neg_nan)));
  EXPECT_TRUE(std::signbit(round_to_bf16(neg_nan)));
}

TEST(Bf16, Subnormals) {
  // The smallest bf16 subnormal (0x0001) is 2^-133; float subnormals keep their top bits.
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x00010000u)), 0x0001);
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x00008000u)), 0x0000);  // tie, to even (0)
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x00018000u)), 0x0002);  // tie, to even (2)
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x00008001u)), 0x0001);
  // The largest subnormal rounds up into the smallest normal.
  EXPECT_EQ(bits_of(std::bit_cast<float>(0x007fffffu)), 0x0080);
  EXPECT_EQ(bf16_to_float(bf16{0x0001}), std::bit_cast<float>(0x00010000u));
}

TEST(Bf16, RelativeErrorIsAtMostHalfUlp) {
  for (float f = -100.0f; f < 100.0f; f += 0.37f) {
    if (f == 0.0f) continue;
    EXPECT_LE(std::abs(round_to_bf16(f) - f), std::abs(f) * (1.0f / 256.0f) + 1e-30f) << f;
  }
}

}  // namespace
}  // namespace cpattn
