#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "context_parallel_impl.hpp"
#include "cpattn/agreement.hpp"
#include "cpattn/error.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/trace.hpp"

namespace cpattn {

ContextParallelAttention::Impl::Impl(const AttentionSpec& a, const ParallelSpec& p, Communicator& c,
                                     ContextParallelOptions o)
    : attention(a), parallel(p), group(c), comm(c), options(o) {
  // Before the rules, so that ranks that differ hear of the difference (a rank's spec that breaks a rule
  // then breaks it on every rank alike).
  Agreement agreement;
  add_specs(agreement, attention, parallel);
  agreement.add("remat", options.remat)
      .add("kernel.block_q", options.kernel.block_q)
      .add("kernel.block_kv", options.kernel.block_kv)
      .add("kernel.allow_amx", options.kernel.allow_amx)
      .add("kernel.allow_avx512_bf16", options.kernel.allow_avx512_bf16);
  agree(group, agreement);
  validate(attention, parallel);
  if (comm.size() != parallel.cp) {
    throw Error(ErrorKind::invalid_config, "cp", std::to_string(parallel.cp),
                "cp (" + std::to_string(parallel.cp) + ") differs from the communicator's size (" +
                    std::to_string(comm.size()) + ")");
  }
  if (auto refusal = remat_refusal(parallel.strategy, options.remat)) {
    throw Error(ErrorKind::invalid_config, {std::move(*refusal)});
  }
  cp = parallel.cp;
  rank = comm.rank();
  local_seq = attention.seq_len / cp;
  hq = attention.num_q_heads / parallel.tp;
  hkv = attention.num_kv_heads / parallel.tp;
  const SequenceLayout layout = layout_of(attention, parallel);
  positions = layout.rank_positions();
  runs = layout.rank_run_lengths();
  if (parallel.traits().ring) {
    // The ring's rows: the caller's shards for the ring (a ring of one rank: the whole row, one run), the
    // ulysses group's tokens for the hybrid.
    const SequenceLayout ring = ring_layout_of(attention, parallel);
    ring_positions = ring.rank_positions();
    ring_runs = ring.rank_run_lengths();
  }
  if (parallel.traits().sub_groups) {
    const auto u_rank = static_cast<int>(parallel.ulysses_rank(rank));
    const auto r_rank = static_cast<int>(parallel.ring_rank(rank));
    ulysses_group = group.split(r_rank, u_rank);
    ring_group = group.split(u_rank, r_rank);
    ulysses_group->report_to(group.counters(), kUlyssesGroup);
    ring_group->report_to(group.counters(), kRingGroup);
    ulysses_comm = std::make_unique<cp::ScheduledCommunicator>(*ulysses_group, kUlyssesGroup);
    ring_comm = std::make_unique<cp::ScheduledCommunicator>(*ring_group, kRingGroup);
  }
}

namespace {

// The calls of one group (hybrid: "ulysses" or "ring"; the single-group strategies: "").
std::vector<ScheduledCollective> of_group(const std::vector<ScheduledCollective>& calls, const char* group) {
  std::vector<ScheduledCollective> out;
  for (const ScheduledCollective& c : calls) {
    if (c.group == group) out.push_back(c);
  }
  return out;
}

}  // namespace

void ContextParallelAttention::Impl::expect(const std::vector<ScheduledCollective>& calls, bool unchecked) {
  std::vector<std::pair<cp::ScheduledCommunicator*, const char*>> comms = {{&comm, ""}};
  if (ulysses_comm) comms.push_back({ulysses_comm.get(), kUlyssesGroup});
  if (ring_comm) comms.push_back({ring_comm.get(), kRingGroup});
  for (auto& [c, name] : comms) {
    if (unchecked) {
      c->expect_anything();
    } else {
      c->expect(of_group(calls, name));
    }
  }
}

// The negative controls that move other amounts than the schedule's run unchecked, so that the comparison
// with the reference is what catches them.
bool ContextParallelAttention::Impl::unscheduled() const {
  return negative_control == NegativeControl::extra_q_heads_on_highest_ranks ||
         negative_control == NegativeControl::ring_accumulator_one_hop_short;
}

void ContextParallelAttention::Impl::finish() {
  comm.finish();
  if (ulysses_comm) ulysses_comm->finish();
  if (ring_comm) ring_comm->finish();
}

FlashConfig ContextParallelAttention::Impl::kernel_config() const {
  FlashConfig cfg = options.kernel;
  cfg.threads = threads_per_rank(options.threads, cp);
  return cfg;
}

int threads_per_rank(int threads, std::int64_t cp) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return threads > 0 ? threads : std::max(1, cores / static_cast<int>(std::max<std::int64_t>(cp, 1)));
}

namespace cp {

std::vector<float> sink_parts(const std::vector<float>& sinks, std::int64_t h0, const Tensor& o,
                              const std::vector<float>& lse, const Tensor& d_out) {
  const Shape4 s = o.shape();
  CPATTN_ASSERT(d_out.shape() == s && static_cast<std::int64_t>(lse.size()) == s.b * s.h * s.s);
  std::vector<float> delta(lse.size()), parts(sinks.size(), 0.0f);
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t h = 0; h < s.h; ++h) {
      for (std::int64_t i = 0; i < s.s; ++i) {
        double sum = 0;
        for (std::int64_t d = 0; d < s.d; ++d) sum += o.get(b, i, h, d) * d_out.get(b, i, h, d);
        delta[static_cast<std::size_t>((b * s.h + h) * s.s + i)] = static_cast<float>(sum);
      }
    }
  }
  sink_gradients(
      std::span<const float>(sinks).subspan(static_cast<std::size_t>(h0), static_cast<std::size_t>(s.h)),
      lse.data(), delta.data(), s.b, s.h, s.s, parts.data() + h0);
  return parts;
}

}  // namespace cp

AttentionMask ContextParallelAttention::Impl::mask(const std::vector<std::int32_t>& q_pos,
                                                   const std::vector<std::int32_t>& kv_pos,
                                                   const std::vector<std::int32_t>& q_seg,
                                                   const std::vector<std::int32_t>& kv_seg) const {
  return attention.mask(q_pos, kv_pos, q_seg, kv_seg);
}

void ContextParallelAttention::Impl::check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  std::span<const std::int32_t> seg, bool forward_only,
                                                  std::span<const float> sinks) {
  const std::int64_t B = attention.batch, D = attention.head_dim;
  const Shape4 want_q{B, local_seq, hq, D}, want_kv{B, local_seq, hkv, D};
  std::string problem;
  std::string field;
  auto expect = [&](const char* name, const Tensor& t, const Shape4& want) {
    if (!problem.empty()) return;
    if (!(t.shape() == want)) {
      field = name;
      problem = std::string(name) + " has shape " + to_string(t.shape()) + "; the spec needs " +
                to_string(want) + " ([B, S/cp, heads/tp, D])";
    } else if (t.dtype() != attention.dtype) {
      field = name;
      problem =
          std::string(name) + " is " + to_string(t.dtype()) + "; the spec says " + to_string(attention.dtype);
    }
  };
  expect("q", q, want_q);
  expect("k", k, want_kv);
  expect("v", v, want_kv);
  if (problem.empty() && !seg.empty() && static_cast<std::int64_t>(seg.size()) != B * local_seq) {
    field = "segment_ids";
    problem = "segment_ids holds " + std::to_string(seg.size()) +
              " values; expected [B, S/cp] = " + std::to_string(B * local_seq);
  }
  if (problem.empty() && attention.sinks != !sinks.empty()) {
    field = "sinks";
    problem = attention.sinks
                  ? "sinks are missing: the spec has sinks (AttentionSpec::sinks), give one per q head"
                  : "sinks were given but the spec has none (set AttentionSpec::sinks)";
  }
  if (problem.empty() && !sinks.empty() && static_cast<std::int64_t>(sinks.size()) != hq) {
    field = "sinks";
    problem = "sinks holds " + std::to_string(sinks.size()) + " values; expected one per local q head (" +
              std::to_string(hq) + ")";
  }
  for (std::size_t h = 0; problem.empty() && h < sinks.size(); ++h) {
    if (std::isnan(sinks[h]) || sinks[h] == std::numeric_limits<float>::infinity()) {
      field = "sinks";
      problem = "sinks[" + std::to_string(h) + "] is " + (std::isnan(sinks[h]) ? "NaN" : "+inf") +
                "; valid: a finite logit, or -inf for no sink";
    }
  }
  // One all_reduce: every rank learns whether any rank is wrong (and which), and whether all agree on having
  // segments, on keeping state and on the sinks' values (the largest of each and of its complement, ~ the
  // smallest).
  const std::int64_t has_seg = seg.empty() ? 0 : 1, keeps = forward_only ? 0 : 1;
  std::int64_t sink_hash = 1469598103934665603LL;  // FNV-1a over the sinks' bytes
  for (const float x : sinks) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &x, sizeof bits);
    for (int byte = 0; byte < 4; ++byte) {
      sink_hash ^= static_cast<std::int64_t>((bits >> (8 * byte)) & 0xffu);
      sink_hash = static_cast<std::int64_t>(static_cast<std::uint64_t>(sink_hash) * 1099511628211ULL);
    }
  }
  std::int64_t flags[7] = {
      problem.empty() ? -1 : rank, has_seg, ~has_seg, keeps, ~keeps, sink_hash, ~sink_hash};
  comm.all_reduce(flags, 7, ReduceOp::max);
  if (!problem.empty()) {
    throw Error(ErrorKind::invalid_input, field, "", "rank " + std::to_string(rank) + ": " + problem);
  }
  if (flags[0] >= 0) {
    throw Error(
        ErrorKind::invalid_input, "rank", std::to_string(flags[0]),
        "rank " + std::to_string(rank) + ": rank " + std::to_string(flags[0]) +
            " passed tensors that disagree with the spec (its error names them); nothing was computed");
  }
  if (flags[1] != ~flags[2]) {
    throw Error(ErrorKind::invalid_input, "segment_ids", has_seg != 0 ? "given" : "none",
                "the ranks disagree on segment_ids: some ranks passed them and others did not (this rank: " +
                    std::string(has_seg != 0 ? "passed" : "did not") + ")");
  }
  if (flags[5] != ~flags[6]) {
    throw Error(
        ErrorKind::invalid_input, "sinks", "",
        "the ranks disagree on sinks: their values differ between ranks (every rank must pass the same "
        "sinks, one per q head)");
  }
  if (flags[3] != ~flags[4]) {
    throw Error(ErrorKind::invalid_config, "forward_only", forward_only ? "true" : "false",
                "the ranks disagree on forward_only: some ranks keep state for a backward and others do not "
                "(this rank: forward_only " +
                    std::string(forward_only ? "true" : "false") + "); every rank must pass the same");
  }
}

void ContextParallelAttention::Impl::check_grad_input(const Tensor& d_out) {
  std::string problem;
  if (!saved) {
    problem = "backward needs a forward that kept its state (forward_only was set, or no forward ran)";
  } else if (saved->owner != this) {
    problem = "backward was given the state another ContextParallelAttention's forward kept";
  }
  const Shape4 want{attention.batch, local_seq, hq, attention.head_dim};
  if (problem.empty() && !(d_out.shape() == want && d_out.dtype() == attention.dtype)) {
    problem = "d_out has shape " + to_string(d_out.shape()) + " " + to_string(d_out.dtype()) + "; expected " +
              to_string(want) + " " + to_string(attention.dtype);
  }
  std::int64_t bad = problem.empty() ? -1 : rank;
  comm.all_reduce(&bad, 1, ReduceOp::max);
  if (!problem.empty())
    throw Error(ErrorKind::invalid_input, "d_out", "", "rank " + std::to_string(rank) + ": " + problem);
  if (bad >= 0) {
    throw Error(ErrorKind::invalid_input, "rank", std::to_string(bad),
                "rank " + std::to_string(rank) + ": rank " + std::to_string(bad) +
                    " cannot run backward (its error says why)");
  }
}

// One case per strategy and no default: a new enumerator does not build until it is dispatched here.
AttentionOutput ContextParallelAttention::Impl::run_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            bool forward_only) {
  switch (parallel.strategy) {
    case Strategy::all_gather:
      return all_gather_forward(q, k, v, forward_only);
    case Strategy::ulysses:
      return ulysses_forward(q, k, v, forward_only);
    case Strategy::ring:
      return ring_forward(q, k, v, forward_only);
    case Strategy::hybrid:
      return hybrid_forward(q, k, v, forward_only);
  }
  CPATTN_ASSERT(false);
}

AttentionGradients ContextParallelAttention::Impl::run_backward(const Tensor& d_out) {
  switch (parallel.strategy) {
    case Strategy::all_gather:
      return all_gather_backward(d_out);
    case Strategy::ulysses:
      return ulysses_backward(d_out);
    case Strategy::ring:
      return ring_backward(d_out);
    case Strategy::hybrid:
      return hybrid_backward(d_out);
  }
  CPATTN_ASSERT(false);
}

AttentionOutput ContextParallelAttention::Impl::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                        std::span<const std::int32_t> seg, bool forward_only,
                                                        std::span<const float> sinks) {
  check_inputs(q, k, v, seg, forward_only, sinks);
  saved.reset();
  comm_wait_seconds = 0;
  seg_local.assign(seg.begin(), seg.end());
  sinks_local.assign(sinks.begin(), sinks.end());
  CollectiveCounters::PhaseScope phase(group.counters(), "forward");
  // On packed rows the all_gather sends each rank the key blocks of its documents (all_gather_keys), the ring
  // the rows of them (ring_route): the segment ids, the schedule's first call, move before the rest of the
  // schedule is made from them.
  row_segments.clear();
  const bool segments_first = parallel.strategy != Strategy::ulysses && !seg.empty();
  if (segments_first) {
    const StrategySchedule before =
        strategy_schedule(attention, parallel, {options.remat, true, rank, nullptr, options.kernel.block_kv});
    expect({before.forward.front()}, unscheduled());
    row_segments = cp::all_gather_segments(comm, seg_local, attention.batch, positions);
    finish();
  }
  auto found = std::make_shared<RingRoute>();
  if (parallel.traits().ring && parallel.ring_degree() > 1)
    *found = ring_route(ring_positions, ring_runs, attention.band(), attention.windowed(), row_segments);
  route = std::move(found);
  gather_keys.clear();
  if (parallel.strategy == Strategy::all_gather) {
    gather_keys = all_gather_keys(positions, runs, attention.seq_len, attention.band(), attention.windowed(),
                                  options.kernel.block_kv, row_segments);
  }
  StrategySchedule schedule =
      strategy_schedule(attention, parallel,
                        {options.remat, !seg.empty(), rank, route.get(), options.kernel.block_kv,
                         segments_first ? &row_segments : nullptr,
                         parallel.strategy == Strategy::all_gather ? &gather_keys : nullptr});
  if (segments_first) schedule.forward.erase(schedule.forward.begin());
  expect(schedule.forward, unscheduled());
  AttentionOutput out = run_forward(q, k, v, forward_only);
  std::vector<std::int32_t>().swap(row_segments);  // what the backward needs is in `saved`
  if (saved) {
    saved->owner = this;
    saved->sinks = sinks_local;
  }
  finish();
  backward_calls = std::move(schedule.backward);
  return out;
}

AttentionGradients ContextParallelAttention::Impl::backward(const Tensor& d_out) {
  check_grad_input(d_out);
  CollectiveCounters::PhaseScope phase(group.counters(), "backward");
  expect(backward_calls, unscheduled());
  AttentionGradients grads = run_backward(d_out);
  CPATTN_ASSERT(static_cast<std::int64_t>(grads.dsinks.size()) == (attention.sinks ? hq : 0));
  finish();
  return grads;
}

ContextParallelAttention::ContextParallelAttention(const AttentionSpec& attention,
                                                   const ParallelSpec& parallel, Communicator& comm,
                                                   ContextParallelOptions options)
    : impl_(std::make_unique<Impl>(attention, parallel, comm, options)) {}

ContextParallelAttention::~ContextParallelAttention() = default;

AttentionOutput ContextParallelAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  std::span<const std::int32_t> segment_ids,
                                                  bool forward_only, std::span<const float> sinks) {
  const trace::Scope event("layer", "attention forward");
  return impl_->forward(q, k, v, segment_ids, forward_only, sinks);
}

AttentionGradients ContextParallelAttention::backward(const Tensor& d_out) {
  const trace::Scope event("layer", "attention backward");
  return impl_->backward(d_out);
}

class ContextParallelAttention::Saved {
 public:
  std::unique_ptr<Impl::SavedState> saved;
  std::vector<ScheduledCollective> backward_calls;
};

std::shared_ptr<ContextParallelAttention::Saved> ContextParallelAttention::take_saved() {
  if (!impl_->saved) {
    throw Error(ErrorKind::invalid_input, "forward_only", "",
                "take_saved needs a forward that kept its state (forward_only was set, or no forward ran)");
  }
  auto out = std::make_shared<Saved>();
  out->saved = std::move(impl_->saved);
  out->backward_calls = impl_->backward_calls;
  impl_->saved.reset();
  return out;
}

AttentionGradients ContextParallelAttention::backward(const Tensor& d_out, Saved& saved) {
  // The state goes into the object for the call and back into `saved` whatever happens (another object's
  // state is refused on every rank by check_grad_input).
  std::swap(impl_->saved, saved.saved);
  std::swap(impl_->backward_calls, saved.backward_calls);
  struct Restore {
    Impl& impl;
    Saved& saved;
    ~Restore() {
      std::swap(impl.saved, saved.saved);
      std::swap(impl.backward_calls, saved.backward_calls);
    }
  } restore{*impl_, saved};
  return impl_->backward(d_out);
}

const TileCounts& ContextParallelAttention::forward_tiles() const {
  return impl_->tiles;
}

std::int64_t ContextParallelAttention::saved_bytes() const {
  return impl_->saved ? impl_->saved->bytes() : 0;
}

double ContextParallelAttention::comm_wait_seconds() const {
  return impl_->comm_wait_seconds;
}

void ContextParallelInternals::set_negative_control(ContextParallelAttention& attention,
                                                    NegativeControl control) {
  ContextParallelAttention::Impl& impl = *attention.impl_;
  impl.negative_control = control;
  if (control != NegativeControl::layout_runs_swapped) return;
  // Rank 0's first two runs trade places in what every rank reads of the layout (the ring's rows too, where
  // the ring holds the caller's shards).
  auto swap_runs = [](RankPositions& positions, RankRuns& runs) {
    if (positions.empty() || runs[0].size() < 2) return;
    std::vector<std::int32_t>& p = positions[0];
    const auto a = static_cast<std::ptrdiff_t>(runs[0][0]), b = static_cast<std::ptrdiff_t>(runs[0][1]);
    std::rotate(p.begin(), p.begin() + a, p.begin() + a + b);
    std::swap(runs[0][0], runs[0][1]);
  };
  const bool ring_is_shards = impl.ring_positions == impl.positions;
  swap_runs(impl.positions, impl.runs);
  if (ring_is_shards) swap_runs(impl.ring_positions, impl.ring_runs);
}

const std::vector<std::int32_t>& ContextParallelAttention::local_positions() const {
  return impl_->positions[impl_->rank];
}

}  // namespace cpattn
