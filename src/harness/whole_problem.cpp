#include "harness/whole_problem.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <tuple>

#include "cp/sequence_collectives.hpp"
#include "cpattn/error.hpp"
#include "cpattn/inproc.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/shard.hpp"

namespace cpattn::harness {

WholeProblem random_problem(const AttentionSpec& a, std::uint32_t seed,
                            const std::vector<std::int64_t>& document_lengths) {
  const Shape4 q_shape{a.batch, a.seq_len, a.num_q_heads, a.head_dim};
  const Shape4 kv_shape{a.batch, a.seq_len, a.num_kv_heads, a.head_dim};
  WholeProblem p;
  p.q = random_normal(a.dtype, q_shape, seed);
  p.k = random_normal(a.dtype, kv_shape, seed + 1);
  p.v = random_normal(a.dtype, kv_shape, seed + 2);
  p.d_out = random_normal(a.dtype, q_shape, seed + 3);
  if (!document_lengths.empty()) p.segment_ids = segment_ids_from_lengths(a.batch, document_lengths);
  return p;
}

WholeResult make_whole_result(const AttentionSpec& a, const ParallelSpec& p, bool forward_only) {
  const std::int64_t hq = a.num_q_heads / p.tp, hkv = a.num_kv_heads / p.tp;
  WholeResult r;
  r.o = Tensor(a.dtype, {a.batch, a.seq_len, hq, a.head_dim});
  r.lse.assign(static_cast<std::size_t>(a.batch * hq * a.seq_len), 0.0f);
  if (!forward_only) {
    r.dq = Tensor(a.dtype, {a.batch, a.seq_len, hq, a.head_dim});
    r.dk = Tensor(a.dtype, {a.batch, a.seq_len, hkv, a.head_dim});
    r.dv = Tensor(a.dtype, {a.batch, a.seq_len, hkv, a.head_dim});
  }
  r.ranks.resize(static_cast<std::size_t>(p.cp));
  return r;
}

namespace {
// The sinks' gradient: the ranks' shares summed in rank order (empty without sinks).
std::vector<float> sum_shares(const std::vector<RankReport>& ranks) {
  std::vector<float> sum;
  for (const RankReport& r : ranks) {
    if (sum.empty()) sum.assign(r.dsinks.size(), 0.0f);
    for (std::size_t h = 0; h < r.dsinks.size() && h < sum.size(); ++h) sum[h] += r.dsinks[h];
  }
  return sum;
}
}  // namespace

void run_rank(Communicator& comm, const AttentionSpec& a, const ParallelSpec& p, const RunSettings& settings,
              const WholeProblem& problem, WholeResult& result) {
  const bool forward_only = settings.forward_only;
  using clock = std::chrono::steady_clock;
  const int rank = comm.rank();
  trace::set_thread_rank(rank);
  const std::int64_t sl = a.seq_len / p.cp;
  const auto pos = layout_of(a, p).positions(rank);
  ContextParallelAttention attn(a, p, comm, settings.options);
  ContextParallelInternals::set_negative_control(attn, settings.negative_control);
  const Tensor q = take_tokens(problem.q, pos), k = take_tokens(problem.k, pos),
               v = take_tokens(problem.v, pos);
  const auto seg = take_tokens(problem.segment_ids, a.batch, pos);
  RankReport& report = result.ranks[rank];

  std::vector<CollectiveRecord> first_records;
  for (int iteration = 0; iteration < std::max(1, settings.repeat); ++iteration) {
    comm.barrier();
    auto t0 = clock::now();
    double k0 = flash_cpu_seconds();
    const AttentionOutput out = attn.forward(q, k, v, seg, forward_only, problem.sinks);
    const double forward_k = flash_cpu_seconds() - k0;
    comm.barrier();
    const double forward_s = std::chrono::duration<double>(clock::now() - t0).count();
    report.forward_seconds = iteration == 0 ? forward_s : std::min(report.forward_seconds, forward_s);
    report.forward_kernel_cpu_seconds =
        iteration == 0 ? forward_k : std::min(report.forward_kernel_cpu_seconds, forward_k);
    if (iteration == 0) {
      put_tokens(result.o, out.o, pos);
      const std::int64_t hq = out.o.shape().h;
      for (std::int64_t b = 0; b < a.batch; ++b) {
        for (std::int64_t h = 0; h < hq; ++h) {
          for (std::int64_t i = 0; i < sl; ++i) {
            result.lse[(b * hq + h) * a.seq_len + pos[i]] = out.lse[(b * hq + h) * sl + i];
          }
        }
      }
      report.saved_bytes = attn.saved_bytes();
      report.tiles_per_head = attn.forward_tiles().per_head;
      for (auto t : report.tiles_per_head) report.tiles += t;
    }
    if (!forward_only) {
      const Tensor d_out = take_tokens(problem.d_out, pos);
      comm.barrier();
      t0 = clock::now();
      k0 = flash_cpu_seconds();
      const AttentionGradients g = attn.backward(d_out);
      const double backward_k = flash_cpu_seconds() - k0;
      comm.barrier();
      const double backward_s = std::chrono::duration<double>(clock::now() - t0).count();
      report.backward_seconds = iteration == 0 ? backward_s : std::min(report.backward_seconds, backward_s);
      report.backward_kernel_cpu_seconds =
          iteration == 0 ? backward_k : std::min(report.backward_kernel_cpu_seconds, backward_k);
      if (iteration == 0) {
        put_tokens(result.dq, g.dq, pos);
        put_tokens(result.dk, g.dk, pos);
        put_tokens(result.dv, g.dv, pos);
        report.dsinks = g.dsinks;
      }
    }
    if (iteration == 0) first_records = comm.counters().records();
  }
  report.collectives = first_records;
  trace::set_thread_rank(-1);  // the caller's thread (rank 0 in process) records for no rank afterwards
  report.comm_wait_seconds = attn.comm_wait_seconds();
}

std::vector<trace::Event> gather_trace(Communicator& comm, const std::vector<trace::Event>& mine) {
  const std::string text = trace::to_lines(mine);
  const int n = comm.size();
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(n), 0);
  sizes[comm.rank()] = static_cast<std::int64_t>(text.size());
  comm.all_reduce(sizes.data(), n, ReduceOp::sum);
  const std::int64_t words = (*std::max_element(sizes.begin(), sizes.end()) + 3) / 4;
  std::vector<std::int32_t> send(static_cast<std::size_t>(std::max<std::int64_t>(words, 1)), 0);
  std::vector<std::int32_t> recv(send.size() * static_cast<std::size_t>(n));
  std::memcpy(send.data(), text.data(), text.size());
  comm.all_gather(send.data(), recv.data(), static_cast<std::int64_t>(send.size()), CommDType::i32);
  std::string all;
  for (int r = 0; r < n; ++r) {
    all.append(reinterpret_cast<const char*>(recv.data() + static_cast<std::size_t>(r) * send.size()),
               static_cast<std::size_t>(sizes[r]));
  }
  return trace::from_lines(all);
}

void share_whole_result(Communicator& comm, const AttentionSpec& a, const ParallelSpec& p, bool forward_only,
                        WholeResult& result) {
  const int rank = comm.rank();
  const SequenceLayout layout = layout_of(a, p);
  const RankPositions positions = layout.rank_positions();
  const auto mine = layout.positions(rank);
  auto share = [&](Tensor& whole) {
    whole = cp::all_gather_sequence(comm, take_tokens(whole, mine), positions);
  };
  share(result.o);
  if (const std::vector<float>& mine_ds = result.ranks.at(static_cast<std::size_t>(rank)).dsinks;
      !mine_ds.empty()) {
    // every rank's share, in rank order
    std::vector<float> all(mine_ds.size() * static_cast<std::size_t>(comm.size()));
    comm.all_gather(mine_ds.data(), all.data(), static_cast<std::int64_t>(mine_ds.size()), CommDType::f32);
    for (int r = 0; r < comm.size(); ++r) {
      result.ranks.at(static_cast<std::size_t>(r))
          .dsinks.assign(all.begin() + r * static_cast<std::ptrdiff_t>(mine_ds.size()),
                         all.begin() + (r + 1) * static_cast<std::ptrdiff_t>(mine_ds.size()));
    }
    result.dsinks = sum_shares(result.ranks);
  }
  if (!forward_only) {
    share(result.dq);
    share(result.dk);
    share(result.dv);
  }
  // lse [B, H, S]: gathered as a [B, S, H, 1] tensor.
  const std::int64_t hq = result.o.shape().h, S = a.seq_len;
  Tensor lse_t(DType::f32, {a.batch, S, hq, 1});
  for (std::int64_t b = 0; b < a.batch; ++b) {
    for (std::int64_t h = 0; h < hq; ++h) {
      for (std::int64_t i = 0; i < S; ++i)
        lse_t.data<float>()[(b * S + i) * hq + h] = result.lse[(b * hq + h) * S + i];
    }
  }
  share(lse_t);
  for (std::int64_t b = 0; b < a.batch; ++b) {
    for (std::int64_t h = 0; h < hq; ++h) {
      for (std::int64_t i = 0; i < S; ++i)
        result.lse[(b * hq + h) * S + i] = lse_t.data<float>()[(b * S + i) * hq + h];
    }
  }
  // Tiles and timings: each rank fills its slot, the sum gives everyone all of them.
  std::vector<std::int64_t> values(static_cast<std::size_t>(6 * p.cp), 0);
  values[rank] = result.ranks[rank].tiles;
  values[p.cp + rank] = static_cast<std::int64_t>(result.ranks[rank].forward_seconds * 1e9);
  values[2 * p.cp + rank] = static_cast<std::int64_t>(result.ranks[rank].backward_seconds * 1e9);
  values[3 * p.cp + rank] = result.ranks[rank].saved_bytes;
  values[4 * p.cp + rank] = static_cast<std::int64_t>(result.ranks[rank].forward_kernel_cpu_seconds * 1e9);
  values[5 * p.cp + rank] = static_cast<std::int64_t>(result.ranks[rank].backward_kernel_cpu_seconds * 1e9);
  // Each rank's bytes of each call (the calls are the same on every rank: the schedule checks them).
  const std::vector<CollectiveRecord>& counted = result.ranks[rank].collectives;
  const auto calls = static_cast<std::int64_t>(counted.size());
  std::int64_t agree[2] = {calls, -calls};
  comm.all_reduce(agree, 2, ReduceOp::max);
  if (agree[0] != -agree[1])
    throw Error(ErrorKind::communication, "collectives", std::to_string(calls),
                "the ranks counted " + std::to_string(-agree[1]) + " to " + std::to_string(agree[0]) +
                    " kinds of collectives; every rank makes the same calls");
  values.resize(static_cast<std::size_t>(6 * p.cp + 2 * p.cp * calls), 0);
  for (std::int64_t i = 0; i < calls; ++i) {
    values[static_cast<std::size_t>(6 * p.cp + 2 * (rank * calls + i))] = counted[i].bytes;
    values[static_cast<std::size_t>(6 * p.cp + 2 * (rank * calls + i) + 1)] = counted[i].bytes_sent_per_rank;
  }
  comm.all_reduce(values.data(), static_cast<int>(values.size()), ReduceOp::sum);
  for (std::int64_t r = 0; r < p.cp; ++r) {
    if (r != rank) {
      result.ranks[r].collectives = counted;
      for (std::int64_t i = 0; i < calls; ++i) {
        CollectiveRecord& x = result.ranks[r].collectives[static_cast<std::size_t>(i)];
        x.bytes = values[static_cast<std::size_t>(6 * p.cp + 2 * (r * calls + i))];
        x.bytes_sent_per_rank = values[static_cast<std::size_t>(6 * p.cp + 2 * (r * calls + i) + 1)];
      }
    }
    result.ranks[r].tiles = values[r];
    result.ranks[r].forward_seconds = static_cast<double>(values[p.cp + r]) * 1e-9;
    result.ranks[r].backward_seconds = static_cast<double>(values[2 * p.cp + r]) * 1e-9;
    result.ranks[r].saved_bytes = values[3 * p.cp + r];
    result.ranks[r].forward_kernel_cpu_seconds = static_cast<double>(values[4 * p.cp + r]) * 1e-9;
    result.ranks[r].backward_kernel_cpu_seconds = static_cast<double>(values[5 * p.cp + r]) * 1e-9;
  }
}

std::vector<CollectiveRecord> largest_over_ranks(const std::vector<RankReport>& ranks) {
  CPATTN_ASSERT(!ranks.empty());
  std::vector<CollectiveRecord> largest = ranks.front().collectives;
  for (const RankReport& r : ranks) {
    CPATTN_ASSERT(r.collectives.size() == largest.size());
    for (std::size_t i = 0; i < largest.size(); ++i) {
      const CollectiveRecord& x = r.collectives[i];
      CPATTN_ASSERT(std::tie(x.kind, x.phase, x.group, x.count) ==
                    std::tie(largest[i].kind, largest[i].phase, largest[i].group, largest[i].count));
      largest[i].bytes = std::max(largest[i].bytes, x.bytes);
      largest[i].bytes_sent_per_rank = std::max(largest[i].bytes_sent_per_rank, x.bytes_sent_per_rank);
    }
  }
  return largest;
}

WholeResult run_in_process(const AttentionSpec& a, const ParallelSpec& p, const RunSettings& settings,
                           const WholeProblem& problem) {
  validate(a, p);
  WholeResult result = make_whole_result(a, p, settings.forward_only);
  InProcessGroup group(static_cast<int>(p.cp), InProcessOptions{settings.comm_timeout});
  if (settings.trace) trace::start();
  try {
    group.run([&](Communicator& comm) { run_rank(comm, a, p, settings, problem, result); });
  } catch (...) {
    if (settings.trace) trace::stop();
    throw;
  }
  if (settings.trace) result.trace = trace::stop();
  result.dsinks = sum_shares(result.ranks);
  return result;
}

}  // namespace cpattn::harness
