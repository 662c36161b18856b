// The kernels' grid: per batch row, the q and kv blocks of the call's fixed (Bq, Bk) partition, and the
// rounding of rows and sizes up to whole blocks and tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/parallel_for.hpp"
#include "cpattn/flash.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn::kernels {

inline constexpr int kTileRows = 4;  // q rows of a backward tile are padded to a multiple of it

inline std::int64_t round_up(std::int64_t x, std::int64_t m) {
  return (x + m - 1) / m * m;
}

// Per batch row, the q and kv block metadata.
struct BlockGrid {
  std::vector<std::vector<BlockMeta>> q, kv;  // [B][blocks]
};

inline BlockGrid make_block_grid(const AttentionMask& mask, std::int64_t batch, std::int64_t sq,
                                 std::int64_t skv, const FlashConfig& config) {
  BlockGrid g;
  for (std::int64_t b = 0; b < batch; ++b) {
    g.q.push_back(block_meta(mask.q_positions, mask.q_segments, b * sq, sq, config.block_q));
    g.kv.push_back(block_meta(mask.kv_positions, mask.kv_segments, b * skv, skv, config.block_kv));
  }
  return g;
}

// The backward's stripe: how many kv blocks of per-q-head fp64 dK and dV partials
// ([B][Hq][stripe][Bk][width], two of them) fit in config.backward_partial_bytes (at least 1, at most
// kv_blocks); every kv block when a kv head serves one q head (group == 1: no partials).
inline std::int64_t backward_stripe_blocks(const FlashConfig& config, std::int64_t batch,
                                           std::int64_t q_heads, std::int64_t group, std::int64_t width,
                                           std::int64_t kv_blocks) {
  if (group == 1) return kv_blocks;
  const double bytes_per_block = 2.0 * 8.0 * static_cast<double>(batch * q_heads * config.block_kv * width);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(config.backward_partial_bytes / bytes_per_block),
                                  1, kv_blocks);
}

// The backward's outer loop, the vector and the bf16 paths alike: the kv blocks in stripes of `stripe`; in
// each, head(task, s0, s1, worker) for every (batch row, q head) task in parallel, then, where a kv head
// serves several q heads, sum(s0, s1) adds the group's per-head dK/dV partials of kv blocks [s0, s1) in head
// order.
template <class Head, class Sum>
void for_each_backward_stripe(std::int64_t kv_blocks, std::int64_t stripe, std::int64_t tasks, int threads,
                              bool grouped, const Head& head, const Sum& sum) {
  for (std::int64_t s0 = 0; s0 < kv_blocks; s0 += stripe) {
    const std::int64_t s1 = std::min(kv_blocks, s0 + stripe);
    parallel_for(tasks, threads, [&](std::int64_t task, int worker) { head(task, s0, s1, worker); });
    if (grouped) sum(s0, s1);
  }
}

}  // namespace cpattn::kernels
