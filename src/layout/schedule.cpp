#include "cpattn/schedule.hpp"

#include "cpattn/placement.hpp"

namespace cpattn {

namespace {

// The all_to_all_v of a ulysses swap: rank r sends rank p `elements(r, p)`.
template <class F>
ScheduledCollective variable(const char* phase, const char* tensor, CommDType dtype, std::int64_t cp,
                             F elements) {
  ScheduledCollective c{CollectiveKind::all_to_all, phase, tensor, 0, dtype, {}};
  for (std::int64_t r = 0; r < cp; ++r) {
    c.blocks.emplace_back();
    for (std::int64_t p = 0; p < cp; ++p) c.blocks.back().push_back(elements(r, p));
  }
  return c;
}

// Any head counts (placement.hpp): q, d_out: [B, S/cp, Hq, D] -> [B, S, n_u, D], rank r sending rank p the
// p's q heads of its tokens; k, v: [B, S/cp, Hkv, D] -> [B, S, nkv_u, D] likewise with KV(p); o, dq (and the
// lse [B, n_u, S] -> [B, Hq, S/cp]) back, rank r sending its own heads of p's tokens; dk, dv: fp32
// [B, S, nkv_u, D] -> [B, S/cp, sum_u nkv_u, D], each kv head's contributions summed on arrival.
StrategySchedule ulysses_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t cp = p.cp, B = a.batch, D = a.head_dim, sl = a.seq_len / cp;
  const UlyssesHeads u = ulysses_heads(a.num_q_heads / p.tp, a.num_kv_heads / p.tp, cp);
  const CommDType e = comm_dtype(a.dtype), f32 = CommDType::f32;
  auto to_heads = [&](const char* phase, const char* tensor, CommDType t, const std::vector<HeadRange>& h) {
    return variable(phase, tensor, t, cp,
                    [&](std::int64_t, std::int64_t q) { return B * sl * h[q].size() * D; });
  };
  auto to_sequence = [&](const char* phase, const char* tensor, CommDType t, const std::vector<HeadRange>& h,
                         std::int64_t row) {
    return variable(phase, tensor, t, cp,
                    [&](std::int64_t r, std::int64_t) { return B * sl * h[r].size() * row; });
  };
  StrategySchedule s;
  s.forward = {to_heads("forward", "q", e, u.q), to_heads("forward", "k", e, u.kv),
               to_heads("forward", "v", e, u.kv)};
  if (o.packed)
    s.forward.push_back({CollectiveKind::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}});
  s.forward.push_back(to_sequence("forward", "o", e, u.q, D));
  s.forward.push_back(to_sequence("forward", "lse", f32, u.q, 1));

  s.backward = {to_heads("backward", "d_out", e, u.q)};
  if (o.remat) {
    s.backward.push_back(to_heads("remat", "q", e, u.q));
    s.backward.push_back(to_heads("remat", "k", e, u.kv));
    s.backward.push_back(to_heads("remat", "v", e, u.kv));
  }
  s.backward.push_back(to_sequence("backward", "dq", e, u.q, D));
  s.backward.push_back(to_sequence("backward", "dk", f32, u.kv, D));
  s.backward.push_back(to_sequence("backward", "dv", f32, u.kv, D));
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
  s.forward = {{K::all_gather, "forward", "k", kv, e, {}}, {K::all_gather, "forward", "v", kv, e, {}}};
  if (o.packed) s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}});
  if (o.remat) {
    s.backward.push_back({K::all_gather, "remat", "k", kv, e, {}});
    s.backward.push_back({K::all_gather, "remat", "v", kv, e, {}});
  }
  s.backward.push_back({K::reduce_scatter, "backward", "dk", kv, CommDType::f32, {}});
  s.backward.push_back({K::reduce_scatter, "backward", "dv", kv, CommDType::f32, {}});
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
  if (o.packed) s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}});
  for (std::int64_t step = 0; step + 1 < cp; ++step)
    s.forward.push_back({K::collective_permute, "forward", "kv", kv, e, {}});
  for (std::int64_t step = 0; step < cp && cp > 1; ++step) {
    if (step + 1 < cp) s.backward.push_back({K::collective_permute, "backward", "kv", kv, e, {}});
    s.backward.push_back({K::collective_permute, "backward", "dkv", kv, CommDType::f32, {}});
  }
  return s;
}

}  // namespace

StrategySchedule strategy_schedule(const AttentionSpec& attention, const ParallelSpec& parallel,
                                   const ScheduleOptions& options) {
  switch (parallel.strategy) {
    case Strategy::ring:
      return ring_schedule(attention, parallel, options);
    case Strategy::ulysses:
      return ulysses_schedule(attention, parallel, options);
    case Strategy::all_gather:
      return all_gather_schedule(attention, parallel, options);
  }
  CPATTN_ASSERT(false);
}

std::vector<CollectiveRecord> scheduled_records(const StrategySchedule& schedule, std::int64_t cp) {
  std::vector<CollectiveRecord> records;
  for (const auto* calls : {&schedule.forward, &schedule.backward}) {
    for (const ScheduledCollective& c : *calls) {
      const std::size_t e = comm_dtype_size(c.dtype);
      // A scheduled collective_permute is the ring's shift.
      const std::vector<int> ring = ring_destinations(static_cast<int>(cp));
      add_to_records(records, c.kind, c.phase,
                     c.blocks.empty() ? collective_cost(c.kind, c.count, e, static_cast<int>(cp), &ring)
                                      : all_to_all_v_cost(c.blocks, e));
    }
  }
  return records;
}

}  // namespace cpattn
