#include "cpattn/schedule.hpp"

#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"

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

// The shifts of a ring of R ranks (ring: every rank; hybrid: its ring group) holding `rows` rows each, a row
// `row` elements of K (V alike), as ring rank `me` issues them (ring_strategy.cpp). Round the ring: per step
// but the last, K||V of one shard to the next rank; backward per step K||V again (but the last step) and the
// fp32 dK||dV accumulator that travels with them, its last hop going home. Direct (ring_route: a window, or
// packed documents that leave rows unseen): only the steps some query reaches, each K||V message holding the
// rows its receiver sees, sent `distance` ranks on; backward the same K||V messages, and after each step its
// fp32 dK||dV rows back to their owner.
void ring_shifts(StrategySchedule& s, const AttentionSpec& a, const ParallelSpec& p, std::int64_t rows,
                 std::int64_t row, std::int64_t me, const char* group, const ScheduleOptions& o) {
  const std::int64_t R = p.ring_degree();
  const CommDType e = comm_dtype(a.dtype), f32 = CommDType::f32;
  const std::int64_t ranks = *group != 0 ? R : 0;
  auto shift = [&](const char* phase, const char* tensor, std::int64_t count, CommDType t, std::int64_t d) {
    return ScheduledCollective{
        CollectiveKind::collective_permute, phase, tensor, count, t, {}, group, ranks, d};
  };
  if (R <= 1) return;
  RingRoute found;
  if (o.route == nullptr) {
    const SequenceLayout ring = ring_layout_of(a, p);
    found = ring_route(ring.rank_positions(), ring.rank_run_lengths(), a.band(), a.windowed(),
                       o.segments != nullptr ? *o.segments : std::vector<std::int32_t>{});
  }
  const RingRoute& route = o.route != nullptr ? *o.route : found;
  if (!route.direct) {
    const std::int64_t kv = 2 * a.batch * rows * row;
    for (std::int64_t step = 0; step + 1 < R; ++step) s.forward.push_back(shift("forward", "kv", kv, e, 1));
    for (std::int64_t step = 0; step < R; ++step) {
      if (step + 1 < R) s.backward.push_back(shift("backward", "kv", kv, e, 1));
      s.backward.push_back(shift("backward", "dkv", kv, f32, 1));
    }
    return;
  }
  const std::vector<ReachStep>& steps = route.steps;
  auto kv = [&](const char* phase, const ReachStep& st) {
    return shift(phase, "kv", 2 * a.batch * st.rows_sent(me) * row, e, st.distance);
  };
  for (const ReachStep& st : steps) s.forward.push_back(kv("forward", st));
  if (!steps.empty()) s.backward.push_back(kv("backward", steps[0]));
  for (std::size_t j = 0; j < steps.size(); ++j) {
    if (j + 1 < steps.size()) s.backward.push_back(kv("backward", steps[j + 1]));
    s.backward.push_back(
        shift("backward", "dkv", 2 * a.batch * steps[j].rows_received(me) * row, f32, -steps[j].distance));
  }
}

// hybrid (U x R): the packed segment ids gathered first over all cp ranks (the ring's route follows them),
// the ulysses swaps inside the rank's group of U (none at U = 1), and between the swaps the ring over R ranks
// holding the rank's ulysses heads for U*S/cp tokens: per step but the last, K||V [2, B, U*S/cp, nkv_u, D];
// backward K||V again and the fp32 dK||dV accumulator (none at R = 1).
StrategySchedule hybrid_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t U = p.ulysses_degree, B = a.batch, D = a.head_dim, sl = a.seq_len / p.cp;
  const Swaps w{U, B, sl, D, ulysses_heads(a.num_q_heads / p.tp, a.num_kv_heads / p.tp, U), kUlyssesGroup};
  const CommDType e = comm_dtype(a.dtype), f32 = CommDType::f32;
  using K = CollectiveKind;
  StrategySchedule s;
  if (o.packed)
    s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, "", 0});
  if (U > 1) {
    for (const char* t : {"q", "k", "v"}) s.forward.push_back(w.to_heads("forward", t, e, *t != 'q'));
  }
  StrategySchedule ring;
  ring_shifts(ring, a, p, U * sl, w.heads.kv[p.ulysses_rank(o.rank)].size() * D, p.ring_rank(o.rank),
              kRingGroup, o);
  s.forward.insert(s.forward.end(), ring.forward.begin(), ring.forward.end());
  if (U > 1) {
    s.forward.push_back(w.to_sequence("forward", "o", e, false, D));
    s.forward.push_back(w.to_sequence("forward", "lse", f32, false, 1));
    s.backward.push_back(w.to_heads("backward", "d_out", e, false));
  }
  s.backward.insert(s.backward.end(), ring.backward.begin(), ring.backward.end());
  if (U > 1) {
    s.backward.push_back(w.to_sequence("backward", "dq", e, false, D));
    s.backward.push_back(w.to_sequence("backward", "dk", f32, true, D));
    s.backward.push_back(w.to_sequence("backward", "dv", f32, true, D));
  }
  return s;
}

// The packed rows' segment ids gathered first; k, v: [B, S/cp, Hkv, D] gathered into [B, S, Hkv, D]; dK/dV
// fp32 partials [B, S, Hkv, D] reduce-scattered. With a window, or on packed rows where some rank's documents
// leave it blocks no query of it reaches, all_to_all_v's of the rows each rank sees (all_gather_keys, in
// blocks of o.block): rank r sends rank p its rows in p's seen ranges; the partials come back the same way.
StrategySchedule all_gather_schedule(const AttentionSpec& a, const ParallelSpec& p,
                                     const ScheduleOptions& o) {
  const std::int64_t B = a.batch, sl = a.seq_len / p.cp;
  const std::int64_t row = (a.num_kv_heads / p.tp) * a.head_dim, kv = B * sl * row;
  const CommDType e = comm_dtype(a.dtype);
  using K = CollectiveKind;
  std::vector<std::vector<std::int64_t>> seen_rows;  // [r][p]: what rank r sends rank p
  if (o.keys != nullptr || a.windowed() || (o.segments && !o.segments->empty())) {
    const SequenceLayout layout = layout_of(a, p);
    std::vector<std::vector<PositionRange>> found;
    if (o.keys == nullptr) {
      found = all_gather_keys(layout.rank_positions(), layout.rank_run_lengths(), a.seq_len, a.band(),
                              a.windowed(), o.block, o.segments ? *o.segments : std::vector<std::int32_t>{});
    }
    const std::vector<std::vector<PositionRange>>& seen = o.keys != nullptr ? *o.keys : found;
    for (std::int64_t r = 0; r < p.cp && !seen.empty(); ++r) {
      const std::vector<PositionRange>& mine = layout.runs[static_cast<std::size_t>(r)];
      seen_rows.emplace_back();
      for (std::int64_t q = 0; q < p.cp; ++q) seen_rows.back().push_back(B * overlap(mine, seen[q]) * row);
    }
  }
  auto gather = [&](const char* phase, const char* tensor) {
    if (seen_rows.empty()) return ScheduledCollective{K::all_gather, phase, tensor, kv, e, {}, "", 0};
    return ScheduledCollective{K::all_to_all, phase, tensor, 0, e, seen_rows, "", 0};
  };
  auto scatter = [&](const char* tensor) {
    if (seen_rows.empty())
      return ScheduledCollective{K::reduce_scatter, "backward", tensor, kv, CommDType::f32, {}, "", 0};
    std::vector<std::vector<std::int64_t>> back(seen_rows.size(),
                                                std::vector<std::int64_t>(seen_rows.size()));
    for (std::size_t r = 0; r < seen_rows.size(); ++r) {
      for (std::size_t q = 0; q < seen_rows.size(); ++q) back[r][q] = seen_rows[q][r];
    }
    return ScheduledCollective{K::all_to_all, "backward", tensor, 0, CommDType::f32, back, "", 0};
  };
  StrategySchedule s;
  if (o.packed)
    s.forward.push_back({K::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, "", 0});
  s.forward.push_back(gather("forward", "k"));
  s.forward.push_back(gather("forward", "v"));
  if (o.remat) {
    s.backward.push_back(gather("remat", "k"));
    s.backward.push_back(gather("remat", "v"));
  }
  s.backward.push_back(scatter("dk"));
  s.backward.push_back(scatter("dv"));
  return s;
}

// ring: the packed segment ids gathered once, then the ring's shifts over all cp ranks (ring_shifts).
StrategySchedule ring_schedule(const AttentionSpec& a, const ParallelSpec& p, const ScheduleOptions& o) {
  const std::int64_t B = a.batch, sl = a.seq_len / p.cp;
  StrategySchedule s;
  if (o.packed)
    s.forward.push_back(
        {CollectiveKind::all_gather, "forward", "segment_ids", B * sl, CommDType::i32, {}, "", 0});
  ring_shifts(s, a, p, sl, (a.num_kv_heads / p.tp) * a.head_dim, o.rank, "", o);
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
      CollectiveCost cost;
      if (c.kind == CollectiveKind::collective_permute) {
        // A scheduled collective_permute is a ring shift (collective_cost's rule without the destinations:
        // it moves something unless it goes a whole number of turns).
        const auto bytes = c.count * static_cast<std::int64_t>(e);
        cost = {bytes, c.distance % ranks != 0 ? bytes : 0, 0};
      } else {
        cost = c.blocks.empty() ? collective_cost(c.kind, c.count, e, ranks) : all_to_all_v_cost(c.blocks, e);
      }
      add_to_records(records, c.kind, c.phase, cost, c.group);
    }
  }
  return records;
}

}  // namespace cpattn
