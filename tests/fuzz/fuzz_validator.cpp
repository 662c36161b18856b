// libFuzzer target: the validator on arbitrary sizes (zero, negative, huge) and strategies. It must return
// the broken rules (each naming a field) without crashing or overflowing; a configuration it accepts must
// place its heads consistently: ulysses ranks hold disjoint, equal q-head ranges that cover the local heads
// and the kv heads those q heads read.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

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
  p.strategy = in.ConsumeBool() ? cpattn::Strategy::ulysses : cpattn::Strategy::all_gather;
  p.load_balance = in.ConsumeBool();
  const auto errors = cpattn::validation_errors(a, p);
  for (const auto& e : errors) {
    if (e.fields.empty() || e.message.empty()) std::abort();
  }
  if (!errors.empty()) return 0;
  cpattn::validate(a, p);
  const auto ranks = cpattn::head_placement(a, p);
  if (static_cast<std::int64_t>(ranks.size()) != p.cp) std::abort();
  const std::int64_t hq = a.num_q_heads / p.tp, hkv = a.num_kv_heads / p.tp;
  std::int64_t next = 0;
  for (const auto& r : ranks) {
    if (p.strategy == cpattn::Strategy::all_gather) {
      if (r.q_heads.begin != 0 || r.q_heads.end != hq) std::abort();
      continue;
    }
    if (r.q_heads.begin != next || r.q_heads.size() != hq / p.cp) std::abort();
    next = r.q_heads.end;
    for (std::int64_t h = r.q_heads.begin; h < r.q_heads.end; ++h) {
      const std::int64_t kv = cpattn::kv_head_of_q_head(h, hq, hkv);
      bool held = false;
      for (std::int64_t k : r.kv_heads) held = held || k == kv;
      if (!held) std::abort();  // a q head whose kv head the rank does not hold: the wrong-order bug
    }
  }
  if (p.strategy == cpattn::Strategy::ulysses && next != hq) std::abort();
  return 0;
}
