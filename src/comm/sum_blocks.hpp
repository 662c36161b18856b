// The reduce_scatter's sum, shared by the backends so that they agree bit for bit: blocks summed in rank
// order, fp32 left to right; bf16 accumulated in fp32 in rank order and rounded once.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpattn/bf16.hpp"
#include "cpattn/comm.hpp"

namespace cpattn::detail {

// blocks[p]: rank p's `count` elements for this rank; out: `count` elements.
inline void sum_rank_blocks(const std::vector<const void*>& blocks, std::int64_t count, CommDType dtype,
                            void* out) {
  if (dtype == CommDType::f32) {
    float* o = static_cast<float*>(out);
    std::memcpy(o, blocks[0], static_cast<std::size_t>(count) * 4);
    for (std::size_t p = 1; p < blocks.size(); ++p) {
      const float* in = static_cast<const float*>(blocks[p]);
      for (std::int64_t i = 0; i < count; ++i) o[i] += in[i];
    }
    return;
  }
  std::vector<float> acc(static_cast<std::size_t>(count), 0.0f);
  for (const void* block : blocks) {
    const bf16* in = static_cast<const bf16*>(block);
    for (std::int64_t i = 0; i < count; ++i) acc[i] += bf16_to_float(in[i]);
  }
  bf16* o = static_cast<bf16*>(out);
  for (std::int64_t i = 0; i < count; ++i) o[i] = float_to_bf16(acc[i]);
}

}  // namespace cpattn::detail
