// all_gather: K/V (and kv segment ids) all-gathered into natural order; this rank's queries, at their global
// positions, attend the whole sequence. Backward: dQ local; dK/dV partials (fp32) for the whole sequence,
// reduce-scattered (summed) back to the shards.
#include "context_parallel_impl.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {
namespace {

struct AllGatherSaved final : ContextParallelAttention::Impl::SavedState {
  AllGatherSaved() : SavedState(Strategy::all_gather) {}
  Tensor q, o;                                    // local shard, local O
  Tensor k, v;                                    // remat: the local K/V shards, gathered again in backward
  Tensor k_full, v_full;                          // without remat: the gathered K/V, natural order
  std::vector<float> lse;                         // [B, Hq, S/cp]
  std::vector<std::int32_t> seg_local, seg_full;  // [B, S/cp], [B, S] natural (empty: no segments)
  std::int64_t bytes() const override {
    return cp::saved_bytes({&q, &o, &k, &v, &k_full, &v_full},
                           lse.size() * 4 + (seg_local.size() + seg_full.size()) * 4);
  }
};

}  // namespace

AttentionOutput ContextParallelAttention::Impl::all_gather_forward(const Tensor& q, const Tensor& k,
                                                                   const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch;
  // k, v: [B, S/cp, Hkv, D] -> [B, S, Hkv, D] natural order
  Tensor k_full = cp::all_gather_sequence(comm, k, positions);
  Tensor v_full = cp::all_gather_sequence(comm, v, positions);
  std::vector<std::int32_t> seg_full;
  if (!seg_local.empty()) seg_full = cp::all_gather_segments(comm, seg_local, B, positions);

  const auto q_pos = positions_as_int32(
      cpattn::local_positions(parallel.effective_layout(), attention.seq_len, cp, rank), B);
  const auto kv_pos = natural_positions(B, attention.seq_len);
  AttentionOutput out;
  out.o = Tensor(attention.dtype, q.shape());
  out.lse.assign(static_cast<std::size_t>(B * hq * local_seq), 0.0f);
  AttentionMask m = mask(q_pos, kv_pos, seg_local, seg_full);
  m.sinks = sinks_local;
  flash_forward(cref(q), cref(k_full), cref(v_full), m, attention.scale(), kernel_config(), ref(out.o),
                out.lse.data(), &tiles);
  if (!forward_only) {
    AllGatherSaved s;
    s.q = q;
    s.o = out.o;
    s.lse = out.lse;
    s.seg_local = seg_local;
    s.seg_full = std::move(seg_full);
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
  if (options.remat) {
    CollectiveCounters::PhaseScope phase(group.counters(), "remat");
    s.k_full = cp::all_gather_sequence(comm, s.k, positions);
    s.v_full = cp::all_gather_sequence(comm, s.v, positions);
  }
  const auto q_pos = positions_as_int32(
      cpattn::local_positions(parallel.effective_layout(), attention.seq_len, cp, rank), B);
  const auto kv_pos = natural_positions(B, attention.seq_len);
  AttentionGradients g;
  g.dq = Tensor(attention.dtype, s.q.shape());
  Tensor dk_partial(DType::f32, s.k_full.shape()), dv_partial(DType::f32, s.v_full.shape());
  AttentionMask m = mask(q_pos, kv_pos, s.seg_local, s.seg_full);
  m.sinks = s.sinks;
  g.dsinks.assign(s.sinks.size(), 0.0f);  // this rank's rows of every head
  flash_backward(cref(s.q), cref(s.k_full), cref(s.v_full), cref(s.o), s.lse.data(), cref(d_out), m,
                 attention.scale(), kernel_config(), ref(g.dq), ref(dk_partial), ref(dv_partial), nullptr,
                 s.sinks.empty() ? nullptr : g.dsinks.data());
  // [B, S, Hkv, D] fp32 partials -> [B, S/cp, Hkv, D] sums
  g.dk = cp::reduce_scatter_sequence(comm, dk_partial, positions).to(attention.dtype);
  g.dv = cp::reduce_scatter_sequence(comm, dv_partial, positions).to(attention.dtype);
  if (options.remat) {
    s.k_full = Tensor();
    s.v_full = Tensor();
  }
  return g;
}

}  // namespace cpattn
