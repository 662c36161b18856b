// Head placement: which q and kv heads each context-parallel rank holds. One source of truth for the
// strategies, the planner and the tests.
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/config.hpp"

namespace cpattn {

// rep: cp / Hkv when Hkv < cp (requires cp % Hkv == 0), else 1.
std::int64_t kv_replication_factor(std::int64_t num_kv_heads, std::int64_t cp);

// Each kv head repeated `rep` times in place: Hkv=2, rep=2 -> [0, 0, 1, 1]. What ulysses uses.
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

struct RankHeads {
  std::int64_t rank = 0;
  HeadRange q_heads;                   // q heads the rank attends for
  std::vector<std::int64_t> kv_heads;  // the distinct kv heads it holds (original indices)
  // For ulysses: the slots of the (replicated) kv head list it holds, [begin, end) of
  // grouped_repeat_heads(Hkv, rep). Equal to kv_heads when rep == 1.
  HeadRange kv_slots;
};

// Placement for the heads of one tp rank (Hq/tp, Hkv/tp local heads, numbered from 0). all_gather: every
// rank holds every head (the sequence is what is split). ulysses: rank r holds q heads
// [r*Hq/cp, (r+1)*Hq/cp) and kv slots [r*max(Hkv,cp)/cp, ...), which is exactly the kv heads its q heads
// read.
std::vector<RankHeads> head_placement(const AttentionSpec& attention, const ParallelSpec& parallel);

}  // namespace cpattn
