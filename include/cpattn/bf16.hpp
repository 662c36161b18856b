// bfloat16 storage: the upper 16 bits of an IEEE-754 binary32. Conversion from float rounds to nearest, ties
// to even; NaN stays NaN (quiet, sign kept); overflow past the largest bf16 rounds to infinity as IEEE says.
#pragma once

#include <bit>
#include <cstdint>

namespace cpattn {

struct bf16 {
  std::uint16_t bits = 0;
};

inline bf16 float_to_bf16(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, force a quiet NaN
    return bf16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
  }
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<std::uint16_t>((u + rounding) >> 16)};
}

inline float bf16_to_float(bf16 value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

// The float that a round trip through bf16 gives (what a bf16 tensor holds).
inline float round_to_bf16(float value) {
  return bf16_to_float(float_to_bf16(value));
}

}  // namespace cpattn
