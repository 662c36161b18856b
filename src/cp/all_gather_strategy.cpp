// all_gather: K/V (and kv segment ids) all-gathered into natural order; this rank's queries, at their global
// positions, attend the whole sequence. Backward: dQ local; dK/dV partials (fp32) for the whole sequence,
// reduce-scattered (summed) back to the shards. With a sliding window, or on packed rows where a rank's
// documents leave it key blocks none of its queries reaches, only the key rows some local query sees move
// (all_gather_keys: whole kernel blocks, in natural order: the kernel's tiles are the single device's), each
// rank's from its owner by an all_to_all_v, and their dK/dV partials go back the same way, summed in rank
// order. On packed rows the segment ids move first (Impl::forward gathers them before the schedule is made:
// the keys each rank receives follow them).
#include "context_parallel_impl.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {
namespace {

// The key rows some query of the receiving rank sees (all_gather_keys, whole kernel blocks): each rank's seen
// ranges, this rank's key positions.
struct SeenKeys {
  std::vector<std::vector<PositionRange>> seen;  // every rank's; empty: the whole row to every rank
  std::vector<std::int32_t> positions;           // [B, V]: this rank's seen rows (natural: all S)
};

struct AllGatherSaved final : ContextParallelAttention::Impl::SavedState {
  AllGatherSaved() : SavedState(Strategy::all_gather) {}
  Tensor q, o;             // local shard, local O
  Tensor k, v;             // remat: the local K/V shards, gathered again in backward
  Tensor k_full, v_full;   // without remat: the gathered K/V, natural order
  std::vector<float> lse;  // [B, Hq, S/cp]
  // [B, S/cp], and the keys' [B, S] natural (with a window, [B, V]: the seen rows'); empty: no segments
  std::vector<std::int32_t> seg_local, seg_full;
  // Every rank's seen key ranges (all_gather_keys; empty: the whole row), the forward's: the backward's
  // partials go back to the rows' owners as they came.
  std::vector<std::vector<PositionRange>> seen;
  std::int64_t bytes() const override {
    return cp::saved_bytes({&q, &o, &k, &v, &k_full, &v_full},
                           lse.size() * 4 + (seg_local.size() + seg_full.size()) * 4);
  }
};

}  // namespace

namespace {

// This rank's key positions from every rank's seen ranges (the forward's, or the backward's from those it
// kept).
SeenKeys keys_of(const AttentionSpec& a, std::vector<std::vector<PositionRange>> seen, std::int64_t rank) {
  SeenKeys k;
  k.seen = std::move(seen);
  if (k.seen.empty()) {
    k.positions = natural_positions(a.batch, a.seq_len);
    return k;
  }
  std::vector<std::int64_t> mine;
  for (const PositionRange& r : k.seen[static_cast<std::size_t>(rank)]) {
    for (std::int64_t x = r.begin; x < r.end; ++x) mine.push_back(x);
  }
  k.positions = positions_as_int32(mine, a.batch);
  return k;
}

// This rank's positions, repeated for each of B rows: [B, S/cp].
std::vector<std::int32_t> rank_rows(const RankPositions& positions, std::int64_t rank, std::int64_t batch) {
  const std::vector<std::int32_t>& mine = positions[static_cast<std::size_t>(rank)];
  std::vector<std::int32_t> out;
  for (std::int64_t b = 0; b < batch; ++b) out.insert(out.end(), mine.begin(), mine.end());
  return out;
}

std::vector<std::int32_t> segments_at(const std::vector<std::int32_t>& seg_full, std::int64_t batch,
                                      std::int64_t seq, const std::vector<std::int32_t>& positions) {
  if (seg_full.empty()) return {};
  std::vector<std::int32_t> out;
  const std::int64_t n = static_cast<std::int64_t>(positions.size()) / batch;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i < n; ++i) out.push_back(seg_full[b * seq + positions[b * n + i]]);
  }
  return out;
}

}  // namespace

AttentionOutput ContextParallelAttention::Impl::all_gather_forward(const Tensor& q, const Tensor& k,
                                                                   const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch;
  SeenKeys keys = keys_of(attention, std::move(gather_keys), rank);  // worked out for the schedule
  // k, v: [B, S/cp, Hkv, D] -> [B, S, Hkv, D] natural order, or the rows this rank sees
  auto gather = [&](const Tensor& x) {
    return keys.seen.empty() ? cp::all_gather_sequence(comm, x, positions)
                             : cp::gather_seen(comm, x, positions, keys.seen);
  };
  Tensor k_full = gather(k);
  Tensor v_full = gather(v);
  // The row's segment ids: gathered before the schedule was made (Impl::forward).
  const std::vector<std::int32_t> kv_seg =
      keys.seen.empty() ? row_segments : segments_at(row_segments, B, attention.seq_len, keys.positions);

  const auto q_pos = rank_rows(positions, rank, B);
  AttentionOutput out;
  out.o = Tensor(attention.dtype, q.shape());
  out.lse.assign(static_cast<std::size_t>(B * hq * local_seq), 0.0f);
  AttentionMask m = mask(q_pos, keys.positions, seg_local, kv_seg);
  m.sinks = sinks_local;
  flash_forward(cref(q), cref(k_full), cref(v_full), m, attention.scale(), kernel_config(), ref(out.o),
                out.lse.data(), &tiles);
  if (!forward_only) {
    AllGatherSaved s;
    s.q = q;
    s.o = out.o;
    s.lse = out.lse;
    s.seg_local = seg_local;
    s.seg_full = kv_seg;
    s.seen = std::move(keys.seen);
    if (options.remat) {
      s.k = k;
      s.v = v;
    } else {
      s.k_full = std::move(k_full);
      s.v_full = std::move(v_full);
    }
    saved = std::make_unique<AllGatherSaved>(std::move(s));
  }
  return out;
}

AttentionGradients ContextParallelAttention::Impl::all_gather_backward(const Tensor& d_out) {
  AllGatherSaved& s = saved_as<AllGatherSaved>();
  const std::int64_t B = attention.batch;
  const SeenKeys keys = keys_of(attention, s.seen, rank);
  if (options.remat) {
    CollectiveCounters::PhaseScope phase(group.counters(), "remat");
    s.k_full = keys.seen.empty() ? cp::all_gather_sequence(comm, s.k, positions)
                                 : cp::gather_seen(comm, s.k, positions, keys.seen);
    s.v_full = keys.seen.empty() ? cp::all_gather_sequence(comm, s.v, positions)
                                 : cp::gather_seen(comm, s.v, positions, keys.seen);
  }
  const auto q_pos = rank_rows(positions, rank, B);
  AttentionGradients g;
  g.dq = Tensor(attention.dtype, s.q.shape());
  Tensor dk_partial(DType::f32, s.k_full.shape()), dv_partial(DType::f32, s.v_full.shape());
  AttentionMask m = mask(q_pos, keys.positions, s.seg_local, s.seg_full);
  m.sinks = s.sinks;
  g.dsinks.assign(s.sinks.size(), 0.0f);  // this rank's rows of every head
  flash_backward(cref(s.q), cref(s.k_full), cref(s.v_full), cref(s.o), s.lse.data(), cref(d_out), m,
                 attention.scale(), kernel_config(), ref(g.dq), ref(dk_partial), ref(dv_partial), nullptr,
                 s.sinks.empty() ? nullptr : g.dsinks.data());
  // [B, S (or the seen rows), Hkv, D] fp32 partials -> [B, S/cp, Hkv, D] sums
  auto scatter = [&](const Tensor& partial) {
    return keys.seen.empty() ? cp::reduce_scatter_sequence(comm, partial, positions)
                             : cp::scatter_seen(comm, partial, positions, keys.seen);
  };
  g.dk = scatter(dk_partial).to(attention.dtype);
  g.dv = scatter(dv_partial).to(attention.dtype);
  if (options.remat) {
    s.k_full = Tensor();
    s.v_full = Tensor();
  }
  return g;
}

}  // namespace cpattn
