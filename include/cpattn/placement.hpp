// Head placement: which q and kv heads each context-parallel rank holds. One source of truth for the
// strategies, the planner and the tests (docs/design.md, "Head placement").
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/config.hpp"

namespace cpattn {

// Each kv head repeated `rep` times in place: Hkv=2, rep=2 -> [0, 0, 1, 1]: the seed's grouped replication,
// the kv head order of ulysses when cp is a multiple of Hkv.
std::vector<std::int64_t> grouped_repeat_heads(std::int64_t num_kv_heads, std::int64_t rep);
// The whole list repeated `rep` times: [0, 1, 0, 1]. Wrong for ulysses; kept only as a negative control.
std::vector<std::int64_t> tiled_repeat_heads(std::int64_t num_kv_heads, std::int64_t rep);

// The GQA map: q head h reads kv head h / (Hq / Hkv).
std::int64_t kv_head_of_q_head(std::int64_t q_head, std::int64_t num_q_heads, std::int64_t num_kv_heads);

struct HeadRange {
  std::int64_t begin = 0, end = 0;  // [begin, end)
  std::int64_t size() const { return end - begin; }
  bool operator==(const HeadRange&) const = default;
};

// Ulysses over `ranks` ranks for Hq q heads reading Hkv kv heads (Hq % Hkv == 0, 1 <= ranks <= Hq): rank u
// holds the contiguous q heads q[u], n_u = floor(Hq/U) + (u < Hq mod U) of them (the extra heads on the
// lowest ranks), and receives exactly the kv heads they read, kv[u] = { h / G : h in q[u] } (contiguous; a kv
// head may go to several ranks). No padding heads.
struct UlyssesHeads {
  std::vector<HeadRange> q, kv;  // per rank
  // kv_head_order: the concatenation of the kv[u] ([0, 0, 1, 1] at Hq=32, Hkv=2, U=4): the kv heads' slots
  // in the order the ranks receive them.
  std::vector<std::int64_t> kv_head_order() const;
  // The most ranks that share one kv head (1: every kv head on one rank).
  std::int64_t replication() const;
  // The most q heads on a rank over the fewest: the slowest rank does n_max / (Hq/U) of the average work.
  double work_skew() const;
  std::int64_t max_q_heads() const;
};
UlyssesHeads ulysses_heads(std::int64_t num_q_heads, std::int64_t num_kv_heads, std::int64_t ranks);

struct RankHeads {
  std::int64_t rank = 0;
  HeadRange q_heads;                   // q heads the rank attends for
  std::vector<std::int64_t> kv_heads;  // the distinct kv heads it holds (original indices)
  // For ulysses: the rank's slots in UlyssesHeads::kv_head_order(). Equal to kv_heads when no kv head is
  // shared by two ranks.
  HeadRange kv_slots;
};

// Placement for the heads of one tp rank (Hq/tp, Hkv/tp local heads, numbered from 0). all_gather: every
// rank holds every head (the sequence is what is split). ulysses: ulysses_heads(Hq/tp, Hkv/tp, cp). hybrid:
// ulysses_heads(Hq/tp, Hkv/tp, U) in each ulysses group, rank r holding ulysses rank r % U's heads (kv_slots
// within its group).
// Validates first (Error(invalid_config)).
std::vector<RankHeads> head_placement(const AttentionSpec& attention, const ParallelSpec& parallel);

}  // namespace cpattn
