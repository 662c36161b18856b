#include "cpattn/schedule.hpp"

#include "cpattn/placement.hpp"

namespace cpattn {

namespace {

// q: [B, S/cp, Hq, D] <-> [B, S, Hq/cp, D]; k, v: [B, S/cp, Hkv*rep, D] <-> [B, S, Hkv*rep/cp, D] (grouped
// replication when Hkv < cp); the all_to_all's block is what one rank sends one peer.
StrategySchedule ulysses_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t cp = p.cp, B = a.batch, D = a.head_dim, sl = a.seq_len / cp;
  const std::int64_t hq = a.num_q_heads / p.tp, hkv = a.num_kv_heads / p.tp;
  const std::int64_t slots = hkv * kv_replication_factor(hkv, cp);
  const std::int64_t q = B * sl * (hq / cp) * D, kv = B * sl * (slots / cp) * D;
  const CommDType e = comm_dtype(a.dtype);
  using K = CollectiveKind;
  StrategySchedule s;
  s.forward = {{K::all_to_all, "forward", "q", q, e},
               {K::all_to_all, "forward", "k", kv, e},
               {K::all_to_all, "forward", "v", kv, e}};
  if (o.packed) s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32});
  s.forward.push_back({K::all_to_all, "forward", "o", q, e});
  s.forward.push_back({K::all_to_all, "forward", "lse", B * (hq / cp) * sl, CommDType::f32});

  s.backward = {{K::all_to_all, "backward", "d_out", q, e}};
  if (o.remat) {
    s.backward.push_back({K::all_to_all, "remat", "q", q, e});
    s.backward.push_back({K::all_to_all, "remat", "k", kv, e});
    s.backward.push_back({K::all_to_all, "remat", "v", kv, e});
  }
  // dK/dV travel as fp32 replica gradients, summed on their owner.
  s.backward.push_back({K::all_to_all, "backward", "dq", q, e});
  s.backward.push_back({K::all_to_all, "backward", "dk", kv, CommDType::f32});
  s.backward.push_back({K::all_to_all, "backward", "dv", kv, CommDType::f32});
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
  s.forward = {{K::all_gather, "forward", "k", kv, e}, {K::all_gather, "forward", "v", kv, e}};
  if (o.packed) s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32});
  if (o.remat) {
    s.backward.push_back({K::all_gather, "remat", "k", kv, e});
    s.backward.push_back({K::all_gather, "remat", "v", kv, e});
  }
  s.backward.push_back({K::reduce_scatter, "backward", "dk", kv, CommDType::f32});
  s.backward.push_back({K::reduce_scatter, "backward", "dv", kv, CommDType::f32});
  return s;
}

}  // namespace

StrategySchedule strategy_schedule(const AttentionSpec& attention, const ParallelSpec& parallel,
                                   const ScheduleOptions& options) {
  switch (parallel.strategy) {
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
      add_to_records(records, c.kind, c.phase,
                     collective_cost(c.kind, c.count, comm_dtype_size(c.dtype), static_cast<int>(cp)));
    }
  }
  return records;
}

}  // namespace cpattn
