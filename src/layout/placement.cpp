#include "cpattn/placement.hpp"

#include <algorithm>

#include "cpattn/error.hpp"

namespace cpattn {

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

UlyssesHeads ulysses_heads(std::int64_t num_q_heads, std::int64_t num_kv_heads, std::int64_t ranks) {
  CPATTN_ASSERT(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && ranks >= 1 && ranks <= num_q_heads);
  const std::int64_t group = num_q_heads / num_kv_heads;
  UlyssesHeads u;
  std::int64_t begin = 0;
  for (std::int64_t r = 0; r < ranks; ++r) {
    const std::int64_t n = num_q_heads / ranks + (r < num_q_heads % ranks ? 1 : 0);
    u.q.push_back({begin, begin + n});
    u.kv.push_back({begin / group, (begin + n - 1) / group + 1});
    begin += n;
  }
  return u;
}

std::vector<std::int64_t> UlyssesHeads::kv_head_order() const {
  std::vector<std::int64_t> order;
  for (const HeadRange& r : kv) {
    for (std::int64_t h = r.begin; h < r.end; ++h) order.push_back(h);
  }
  return order;
}

std::int64_t UlyssesHeads::replication() const {
  std::vector<std::int64_t> holders;
  for (const HeadRange& r : kv) {
    if (holders.size() < static_cast<std::size_t>(r.end)) holders.resize(static_cast<std::size_t>(r.end));
    for (std::int64_t h = r.begin; h < r.end; ++h) ++holders[h];
  }
  return holders.empty() ? 0 : *std::max_element(holders.begin(), holders.end());
}

std::int64_t UlyssesHeads::max_q_heads() const {
  std::int64_t most = 0;
  for (const HeadRange& r : q) most = std::max(most, r.size());
  return most;
}

double UlyssesHeads::work_skew() const {
  std::int64_t fewest = max_q_heads();
  for (const HeadRange& r : q) fewest = std::min(fewest, r.size());
  return fewest > 0 ? static_cast<double>(max_q_heads()) / static_cast<double>(fewest) : 1.0;
}

std::vector<RankHeads> head_placement(const AttentionSpec& attention, const ParallelSpec& parallel) {
  validate(attention, parallel);
  const std::int64_t hq = attention.num_q_heads / parallel.tp;
  const std::int64_t hkv = attention.num_kv_heads / parallel.tp;
  const std::int64_t cp = parallel.cp;
  std::vector<RankHeads> ranks;
  // Heads split over groups (ulysses: one of cp ranks; hybrid: of U): rank r holds its ulysses rank's heads.
  const bool by_heads = parallel.traits().heads != HeadSplit::none;
  const UlyssesHeads u = by_heads ? ulysses_heads(hq, hkv, parallel.head_group_size()) : UlyssesHeads{};
  std::int64_t slot = 0;
  for (std::int64_t r = 0; r < cp; ++r) {
    RankHeads rh;
    rh.rank = r;
    if (by_heads) {
      const std::int64_t g = parallel.ulysses_rank(r);
      if (g == 0) slot = 0;
      rh.q_heads = u.q[g];
      rh.kv_slots = {slot, slot + u.kv[g].size()};
      slot += u.kv[g].size();
      for (std::int64_t h = u.kv[g].begin; h < u.kv[g].end; ++h) rh.kv_heads.push_back(h);
    } else {
      rh.q_heads = {0, hq};
      rh.kv_slots = {0, hkv};
      for (std::int64_t h = 0; h < hkv; ++h) rh.kv_heads.push_back(h);
    }
    ranks.push_back(std::move(rh));
  }
  return ranks;
}

}  // namespace cpattn
