#include "cpattn/schedule.hpp"

#include "cpattn/placement.hpp"

namespace cpattn {

namespace {

// The all_to_all_v of a ulysses swap over `ranks` ranks: rank r sends rank p `elements(r, p)`.
template <class F>
ScheduledCollective variable(const char* phase, const char* tensor, CommDType dtype, std::int64_t ranks,
                             F elements) {
  ScheduledCollective c{CollectiveKind::all_to_all, phase, tensor, 0, dtype, {}, "", 0};
  for (std::int64_t r = 0; r < ranks; ++r) {
    c.blocks.emplace_back();
    for (std::int64_t p = 0; p < ranks; ++p) c.blocks.back().push_back(elements(r, p));
  }
  return c;
}

// The swaps of one ulysses group of `ranks` ranks holding `sl` tokens each, over any head counts
// (placement.hpp): q, d_out: [B, sl, Hq, D] -> [B, ranks*sl, n_u, D], rank r sending rank p the p's q heads
// of its tokens; k, v: [B, sl, Hkv, D] -> [B, ranks*sl, nkv_u, D] likewise with KV(p); o, dq (and the lse
// [B, n_u, ranks*sl] -> [B, Hq, sl]) back, rank r sending its own heads of p's tokens; dk, dv: fp32
// [B, ranks*sl, nkv_u, D] -> [B, sl, sum_u nkv_u, D], each kv head's contributions summed on arrival.
struct Swaps {
  std::int64_t ranks, batch, sl, head_dim;
  UlyssesHeads heads;
  const char* group;

  ScheduledCollective to_heads(const char* phase, const char* tensor, CommDType t, bool kv) const {
    const std::vector<HeadRange>& h = kv ? heads.kv : heads.q;
    return label(variable(phase, tensor, t, ranks,
                          [&](std::int64_t, std::int64_t p) { return batch * sl * h[p].size() * head_dim; }));
  }
  ScheduledCollective to_sequence(const char* phase, const char* tensor, CommDType t, bool kv,
                                  std::int64_t row) const {
    const std::vector<HeadRange>& h = kv ? heads.kv : heads.q;
    return label(variable(phase, tensor, t, ranks,
                          [&](std::int64_t r, std::int64_t) { return batch * sl * h[r].size() * row; }));
  }
  ScheduledCollective label(ScheduledCollective c) const {
    c.group = group;
    c.ranks = *group != 0 ? ranks : 0;
    return c;
  }
};

StrategySchedule ulysses_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t cp = p.cp, B = a.batch, D = a.head_dim, sl = a.seq_len / cp;
  const Swaps w{cp, B, sl, D, ulysses_heads(a.num_q_heads / p.tp, a.num_kv_heads / p.tp, cp), ""};
  const CommDType e = comm_dtype(a.dtype), f32 = CommDType::f32;
  StrategySchedule s;
  s.forward = {w.to_heads("forward", "q", e, false), w.to_heads("forward", "k", e, true),
               w.to_heads("forward", "v", e, true)};
  if (o.packed)
    s.forward.push_back(
        {CollectiveKind::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, "", 0});
  s.forward.push_back(w.to_sequence("forward", "o", e, false, D));
  s.forward.push_back(w.to_sequence("forward", "lse", f32, false, 1));

  s.backward = {w.to_heads("backward", "d_out", e, false)};
  if (o.remat) {
    s.backward.push_back(w.to_heads("remat", "q", e, false));
    s.backward.push_back(w.to_heads("remat", "k", e, true));
    s.backward.push_back(w.to_heads("remat", "v", e, true));
  }
  s.backward.push_back(w.to_sequence("backward", "dq", e, false, D));
  s.backward.push_back(w.to_sequence("backward", "dk", f32, true, D));
  s.backward.push_back(w.to_sequence("backward", "dv", f32, true, D));
  return s;
}

// hybrid (U x R): the ulysses swaps inside the rank's group of U (none at U = 1), the packed segment ids
// gathered in the group and then around the ring, and between the swaps the ring over R ranks holding the
// rank's ulysses heads for U*S/cp tokens: per step but the last, K||V [2, B, U*S/cp, nkv_u, D]; backward
// K||V again and the fp32 dK||dV accumulator (none at R = 1).
StrategySchedule hybrid_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t U = p.ulysses_degree, R = p.cp / U, B = a.batch, D = a.head_dim, sl = a.seq_len / p.cp;
  const Swaps w{U, B, sl, D, ulysses_heads(a.num_q_heads / p.tp, a.num_kv_heads / p.tp, U), kUlyssesGroup};
  const std::int64_t kv = 2 * B * U * sl * w.heads.kv[p.ulysses_rank(o.rank)].size() * D;
  const CommDType e = comm_dtype(a.dtype), f32 = CommDType::f32;
  using K = CollectiveKind;
  auto ring = [&](const char* phase, const char* tensor, CommDType t) {
    return ScheduledCollective{K::collective_permute, phase, tensor, kv, t, {}, kRingGroup, R};
  };
  StrategySchedule s;
  if (U > 1) {
    s.forward = {w.to_heads("forward", "q", e, false), w.to_heads("forward", "k", e, true),
                 w.to_heads("forward", "v", e, true)};
  }
  if (o.packed && U > 1)
    s.forward.push_back(
        {K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, kUlyssesGroup, U});
  if (o.packed && R > 1)
    s.forward.push_back(
        {K::all_gather, "forward", "segment_ids", B * U * sl, CommDType::i32, {}, kRingGroup, R});
  for (std::int64_t step = 0; step + 1 < R; ++step) s.forward.push_back(ring("forward", "kv", e));
  if (U > 1) {
    s.forward.push_back(w.to_sequence("forward", "o", e, false, D));
    s.forward.push_back(w.to_sequence("forward", "lse", f32, false, 1));
    s.backward.push_back(w.to_heads("backward", "d_out", e, false));
  }
  for (std::int64_t step = 0; step < R && R > 1; ++step) {
    if (step + 1 < R) s.backward.push_back(ring("backward", "kv", e));
    s.backward.push_back(ring("backward", "dkv", f32));
  }
  if (U > 1) {
    s.backward.push_back(w.to_sequence("backward", "dq", e, false, D));
    s.backward.push_back(w.to_sequence("backward", "dk", f32, true, D));
    s.backward.push_back(w.to_sequence("backward", "dv", f32, true, D));
  }
  return s;
}

// k, v: [B, S/cp, Hkv, D] gathered into [B, S, Hkv, D]; dK/dV fp32 partials [B, S, Hkv, D] reduce-scattered.
StrategySchedule all_gather_schedule(const AttentionSpec& a, const ParallelSpec& p,
                                     const ScheduleOptions& o) {
  const std::int64_t B = a.batch, sl = a.seq_len / p.cp;
  const std::int64_t kv = B * sl * (a.num_kv_heads / p.tp) * a.head_dim;
  const CommDType e = comm_dtype(a.dtype);
  using K = CollectiveKind;
  StrategySchedule s;
  s.forward = {{K::all_gather, "forward", "k", kv, e, {}, "", 0},
               {K::all_gather, "forward", "v", kv, e, {}, "", 0}};
  if (o.packed)
    s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, "", 0});
  if (o.remat) {
    s.backward.push_back({K::all_gather, "remat", "k", kv, e, {}, "", 0});
    s.backward.push_back({K::all_gather, "remat", "v", kv, e, {}, "", 0});
  }
  s.backward.push_back({K::reduce_scatter, "backward", "dk", kv, CommDType::f32, {}, "", 0});
  s.backward.push_back({K::reduce_scatter, "backward", "dv", kv, CommDType::f32, {}, "", 0});
  return s;
}

// ring: the packed segment ids gathered once; then per step but the last, K and V of one shard as one message
// [2, B, S/cp, Hkv, D] to the next rank. Backward: per step, K||V again (but the last step) and then the
// dK||dV accumulator (fp32) that travels with them, its last hop going home; nothing at cp = 1.
StrategySchedule ring_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t cp = p.cp, B = a.batch, D = a.head_dim, sl = a.seq_len / cp;
  const std::int64_t kv = 2 * B * sl * (a.num_kv_heads / p.tp) * D;
  const CommDType e = comm_dtype(a.dtype);
  using K = CollectiveKind;
  StrategySchedule s;
  if (o.packed)
    s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, "", 0});
  for (std::int64_t step = 0; step + 1 < cp; ++step)
    s.forward.push_back({K::collective_permute, "forward", "kv", kv, e, {}, "", 0});
  for (std::int64_t step = 0; step < cp && cp > 1; ++step) {
    if (step + 1 < cp) s.backward.push_back({K::collective_permute, "backward", "kv", kv, e, {}, "", 0});
    s.backward.push_back({K::collective_permute, "backward", "dkv", kv, CommDType::f32, {}, "", 0});
  }
  return s;
}

StrategySchedule strategy_schedule_of(const AttentionSpec& attention, const ParallelSpec& parallel,
                                      const ScheduleOptions& options) {
  switch (parallel.strategy) {
    case Strategy::ring:
      return ring_schedule(attention, parallel, options);
    case Strategy::ulysses:
      return ulysses_schedule(attention, parallel, options);
    case Strategy::all_gather:
      return all_gather_schedule(attention, parallel, options);
    case Strategy::hybrid:
      return hybrid_schedule(attention, parallel, options);
  }
  CPATTN_ASSERT(false);
}

}  // namespace

StrategySchedule strategy_schedule(const AttentionSpec& attention, const ParallelSpec& parallel,
                                   const ScheduleOptions& options) {
  return strategy_schedule_of(attention, parallel, options);
}

std::vector<CollectiveRecord> scheduled_records(const StrategySchedule& schedule, std::int64_t cp) {
  std::vector<CollectiveRecord> records;
  for (const auto* calls : {&schedule.forward, &schedule.backward}) {
    for (const ScheduledCollective& c : *calls) {
      const std::size_t e = comm_dtype_size(c.dtype);
      const int ranks = static_cast<int>(c.ranks > 0 ? c.ranks : cp);
      // A scheduled collective_permute is the ring's shift.
      const std::vector<int> ring = ring_destinations(ranks);
      add_to_records(records, c.kind, c.phase,
                     c.blocks.empty() ? collective_cost(c.kind, c.count, e, ranks, &ring)
                                      : all_to_all_v_cost(c.blocks, e),
                     c.group);
    }
  }
  return records;
}

}  // namespace cpattn
