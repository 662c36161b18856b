// libFuzzer target: the validator on arbitrary sizes (zero, negative, huge) and all four strategies. It must
// return the broken rules (each naming a field) without crashing or overflowing; a configuration it accepts
// must place its heads as docs/design.md says: all_gather and ring ranks hold every head; in each ulysses
// group (the whole group for ulysses, U = ulysses_degree ranks for hybrid) rank u holds the contiguous q
// heads q[u], floor(Hq/U) + (u < Hq mod U) of them, ranges that cover the local heads in order, and the kv
// heads those q heads read.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>

#include "cpattn/config.hpp"
#include "cpattn/error.hpp"
#include "cpattn/placement.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  auto any_size = [&] {
    // Mostly small values (where the rules interact), sometimes anything at all.
    return in.ConsumeBool() ? in.ConsumeIntegralInRange<std::int64_t>(-2, 70)
                            : in.ConsumeIntegral<std::int64_t>();
  };
  cpattn::AttentionSpec a;
  a.batch = any_size();
  a.seq_len = any_size();
  a.num_q_heads = any_size();
  a.num_kv_heads = any_size();
  a.head_dim = any_size();
  a.causal = in.ConsumeBool();
  a.dtype = in.ConsumeBool() ? cpattn::DType::bf16 : cpattn::DType::f32;
  cpattn::ParallelSpec p;
  p.cp = any_size();
  p.tp = any_size();
  // One past the last strategy too: a value cast from an integer must be refused.
  const int strategy = in.ConsumeIntegralInRange<int>(0, static_cast<int>(std::size(cpattn::kStrategies)));
  p.strategy = static_cast<cpattn::Strategy>(strategy);
  if (p.strategy == cpattn::Strategy::hybrid || in.ConsumeBool()) p.ulysses_degree = any_size();
  p.load_balance = in.ConsumeBool();
  const auto errors = cpattn::validation_errors(a, p);
  for (const auto& e : errors) {
    if (e.fields.empty() || e.message.empty()) std::abort();
  }
  if (strategy == static_cast<int>(std::size(cpattn::kStrategies)) && errors.empty()) std::abort();
  if (!errors.empty()) return 0;
  cpattn::validate(a, p);
  // A placement holds each rank's kv heads (all of them under all_gather and ring): past this, memory rather
  // than rules.
  if (static_cast<double>(p.cp) * static_cast<double>(a.num_kv_heads / p.tp + 1) > 1 << 22) return 0;
  const auto ranks = cpattn::head_placement(a, p);
  if (static_cast<std::int64_t>(ranks.size()) != p.cp) std::abort();
  const std::int64_t hq = a.num_q_heads / p.tp, hkv = a.num_kv_heads / p.tp;
  const bool split_heads = p.strategy == cpattn::Strategy::ulysses || p.strategy == cpattn::Strategy::hybrid;
  const std::int64_t group = p.strategy == cpattn::Strategy::hybrid ? p.ulysses_degree : p.cp;
  std::int64_t next = 0;
  for (const auto& r : ranks) {
    if (!split_heads) {
      if (r.q_heads.begin != 0 || r.q_heads.end != hq) std::abort();
      continue;
    }
    const std::int64_t u = r.rank % group;
    if (u == 0) next = 0;
    if (r.q_heads.begin != next || r.q_heads.size() != hq / group + (u < hq % group ? 1 : 0)) std::abort();
    next = r.q_heads.end;
    // Exactly the kv heads its q heads read, in order (the GQA map is monotone, so they are contiguous); a q
    // head whose kv head the rank does not hold is the wrong-order bug.
    const std::int64_t first = cpattn::kv_head_of_q_head(r.q_heads.begin, hq, hkv);
    const std::int64_t last = cpattn::kv_head_of_q_head(r.q_heads.end - 1, hq, hkv);
    if (static_cast<std::int64_t>(r.kv_heads.size()) != last - first + 1) std::abort();
    for (std::size_t i = 0; i < r.kv_heads.size(); ++i) {
      if (r.kv_heads[i] != first + static_cast<std::int64_t>(i)) std::abort();
    }
    if (u == group - 1 && next != hq) std::abort();  // the group's ranges cover every local head
  }
  return 0;
}
