// One row (b, s, h) of a [B, S, H, D] tensor to and from fp32, with the dtype conversion: how every kernel
// reads its inputs and writes its outputs.
#pragma once

#include <cstdint>

#include "cpattn/flash.hpp"

namespace cpattn::kernels {

// D values of row (b, s, h) as floats times `factor` into out[0, width), zero-padded past D.
inline void load_row(const ConstTensorRef& t, std::int64_t b, std::int64_t s, std::int64_t h, float factor,
                     std::int64_t width, float* out) {
  const std::int64_t d = t.shape.d;
  const std::int64_t off = t.offset(b, s, h);
  if (t.dtype == DType::f32) {
    const float* src = static_cast<const float*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) out[i] = src[i] * factor;
  } else {
    const bf16* src = static_cast<const bf16*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) out[i] = bf16_to_float(src[i]) * factor;
  }
  for (std::int64_t i = d; i < width; ++i) out[i] = 0.0f;
}

inline void store_row(const TensorRef& t, std::int64_t b, std::int64_t s, std::int64_t h, const float* in,
                      float factor) {
  const std::int64_t d = t.shape.d;
  const std::int64_t off = t.offset(b, s, h);
  if (t.dtype == DType::f32) {
    float* dst = static_cast<float*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) dst[i] = in[i] * factor;
  } else {
    bf16* dst = static_cast<bf16*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) dst[i] = float_to_bf16(in[i] * factor);
  }
}

}  // namespace cpattn::kernels
