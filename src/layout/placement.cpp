#include "cpattn/placement.hpp"

#include <algorithm>

namespace cpattn {

std::int64_t kv_replication_factor(std::int64_t num_kv_heads, std::int64_t cp) {
  CPATTN_ASSERT(num_kv_heads > 0 && cp > 0);
  if (num_kv_heads >= cp) return 1;
  CPATTN_ASSERT(cp % num_kv_heads == 0);
  return cp / num_kv_heads;
}

std::vector<std::int64_t> grouped_repeat_heads(std::int64_t num_kv_heads, std::int64_t rep) {
  std::vector<std::int64_t> heads;
  heads.reserve(static_cast<std::size_t>(num_kv_heads * rep));
  for (std::int64_t h = 0; h < num_kv_heads; ++h) heads.insert(heads.end(), static_cast<std::size_t>(rep), h);
  return heads;
}

std::vector<std::int64_t> tiled_repeat_heads(std::int64_t num_kv_heads, std::int64_t rep) {
  std::vector<std::int64_t> heads;
  heads.reserve(static_cast<std::size_t>(num_kv_heads * rep));
  for (std::int64_t r = 0; r < rep; ++r) {
    for (std::int64_t h = 0; h < num_kv_heads; ++h) heads.push_back(h);
  }
  return heads;
}

std::int64_t kv_head_of_q_head(std::int64_t q_head, std::int64_t num_q_heads, std::int64_t num_kv_heads) {
  return q_head / (num_q_heads / num_kv_heads);
}

std::vector<RankHeads> head_placement(const AttentionSpec& attention, const ParallelSpec& parallel) {
  validate(attention, parallel);
  const std::int64_t hq = attention.num_q_heads / parallel.tp;
  const std::int64_t hkv = attention.num_kv_heads / parallel.tp;
  const std::int64_t cp = parallel.cp;
  std::vector<RankHeads> ranks;
  for (std::int64_t r = 0; r < cp; ++r) {
    RankHeads rh;
    rh.rank = r;
    if (parallel.strategy == Strategy::all_gather) {
      rh.q_heads = {0, hq};
      rh.kv_slots = {0, hkv};
      for (std::int64_t h = 0; h < hkv; ++h) rh.kv_heads.push_back(h);
    } else {
      const std::int64_t rep = kv_replication_factor(hkv, cp);
      const std::vector<std::int64_t> slots = grouped_repeat_heads(hkv, rep);
      const std::int64_t per_rank = static_cast<std::int64_t>(slots.size()) / cp;
      rh.q_heads = {r * hq / cp, (r + 1) * hq / cp};
      rh.kv_slots = {r * per_rank, (r + 1) * per_rank};
      for (std::int64_t s = rh.kv_slots.begin; s < rh.kv_slots.end; ++s) {
        if (rh.kv_heads.empty() || rh.kv_heads.back() != slots[s]) rh.kv_heads.push_back(slots[s]);
      }
    }
    ranks.push_back(std::move(rh));
  }
  return ranks;
}

}  // namespace cpattn
