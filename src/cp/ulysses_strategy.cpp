// ulysses: all-to-all from sequence shards [B, S/cp, H, D] to head shards [B, S, H/cp, D]; the kernel runs
// locally over the whole sequence; O and LSE come back by the reverse all-to-all. When Hkv < cp the kv heads
// are first repeated rep = cp/Hkv times in grouped order ([kv0, kv0, kv1, kv1] at Hkv=2, cp=4), so rank r
// holds kv head r/rep: exactly the one its q heads [r*Hq/cp, (r+1)*Hq/cp) read. In backward each replica's
// gradient holds its own q heads' contribution; the rep replicas are summed back onto their head (the
// transpose of the repeat; no 1/rep factor).
#include <cstring>

#include "context_parallel_impl.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {

namespace {

// x: [B, S/cp, Hkv, D] -> [B, S/cp, Hkv*rep, D], slot s holding kv head order[s].
Tensor repeat_heads(const Tensor& x, const std::vector<std::int64_t>& order) {
  const Shape4 s = x.shape();
  const std::int64_t slots = static_cast<std::int64_t>(order.size());
  Tensor y(x.dtype(), {s.b, s.s, slots, s.d});
  const std::size_t run = static_cast<std::size_t>(s.d) * dtype_size(x.dtype());
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  for (std::int64_t bt = 0; bt < s.b * s.s; ++bt) {
    for (std::int64_t slot = 0; slot < slots; ++slot) {
      std::memcpy(dst + (bt * slots + slot) * run, src + (bt * s.h + order[slot]) * run, run);
    }
  }
  return y;
}

// g: [B, S/cp, slots, D] fp32 replica gradients -> [B, S/cp, Hkv, D]: for each head the sum over its slots in
// slot order (the transpose of repeat_heads), or one of the wrong variants kept as negative controls.
Tensor sum_replicas(const Tensor& g, const std::vector<std::int64_t>& order, std::int64_t hkv,
                    std::int64_t rep, NegativeControl control) {
  const Shape4 s = g.shape();
  Tensor out(DType::f32, {s.b, s.s, hkv, s.d});
  const float* src = g.data<float>();
  float* dst = out.data<float>();
  std::vector<int> taken(static_cast<std::size_t>(hkv));
  for (std::int64_t bt = 0; bt < s.b * s.s; ++bt) {
    std::fill(taken.begin(), taken.end(), 0);
    for (std::int64_t slot = 0; slot < s.h; ++slot) {
      const std::int64_t h = order[slot];
      if (control == NegativeControl::first_kv_replica_only && taken[h]++ > 0) continue;
      float* o = dst + (bt * hkv + h) * s.d;
      const float* i = src + (bt * s.h + slot) * s.d;
      for (std::int64_t d = 0; d < s.d; ++d) o[d] += i[d];
    }
  }
  if (control == NegativeControl::scaled_kv_grad_sum) {
    const float f = 1.0f / static_cast<float>(rep);
    for (std::int64_t i = 0; i < out.numel(); ++i) dst[i] *= f;
  }
  return out;
}

}  // namespace

namespace {

struct HeadSharded {
  Tensor q, k, v;  // [B, S, Hq/cp, D], [B, S, slots/cp, D]
};

HeadSharded to_heads(Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::vector<std::int64_t>& order) {
  const bool replicate = static_cast<std::int64_t>(order.size()) != k.shape().h;
  HeadSharded h;
  h.q = cp::all_to_all_sequence_to_heads(comm, q);
  h.k = cp::all_to_all_sequence_to_heads(comm, replicate ? repeat_heads(k, order) : k);
  h.v = cp::all_to_all_sequence_to_heads(comm, replicate ? repeat_heads(v, order) : v);
  return h;
}

}  // namespace

AttentionOutput ContextParallelAttention::Impl::ulysses_forward(const Tensor& q, const Tensor& k,
                                                                const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch, S = attention.seq_len;
  const std::int64_t rep = kv_replication_factor(hkv, cp);
  const auto order = negative_control == NegativeControl::tiled_kv_order ? tiled_repeat_heads(hkv, rep)
                                                                         : grouped_repeat_heads(hkv, rep);
  HeadSharded h = to_heads(comm, q, k, v, order);
  std::vector<std::int32_t> seg_full;
  if (!seg_local.empty()) seg_full = cp::all_gather_segments(comm, seg_local, B, positions);

  const auto pos = natural_positions(B, S);
  const std::int64_t local_heads = hq / cp;
  Tensor o_heads(attention.dtype, h.q.shape());
  std::vector<float> lse_heads(static_cast<std::size_t>(B * local_heads * S));
  flash_forward(cref(h.q), cref(h.k), cref(h.v), mask(pos, pos, seg_full, seg_full), attention.scale(),
                kernel_config(), ref(o_heads), lse_heads.data(), &tiles);

  AttentionOutput out;
  out.o = cp::all_to_all_heads_to_sequence(comm, o_heads);
  out.lse = cp::all_to_all_lse_heads_to_sequence(comm, lse_heads, B, local_heads, S);
  if (!forward_only) {
    Saved s;
    if (options.remat) {
      s.q = q;
      s.k = k;
      s.v = v;
    } else {
      s.q = std::move(h.q);
      s.k = std::move(h.k);
      s.v = std::move(h.v);
    }
    s.o = std::move(o_heads);
    s.lse = std::move(lse_heads);
    s.seg_full = std::move(seg_full);
    saved = std::move(s);
  }
  return out;
}

AttentionGradients ContextParallelAttention::Impl::ulysses_backward(const Tensor& d_out) {
  Saved& s = *saved;
  const std::int64_t B = attention.batch, S = attention.seq_len;
  const std::int64_t rep = kv_replication_factor(hkv, cp);
  const auto order = negative_control == NegativeControl::tiled_kv_order ? tiled_repeat_heads(hkv, rep)
                                                                         : grouped_repeat_heads(hkv, rep);
  Tensor do_heads = cp::all_to_all_sequence_to_heads(comm, d_out);
  HeadSharded h;
  if (options.remat) {
    CollectiveCounters::PhaseScope phase(group.counters(), "remat");
    h = to_heads(comm, s.q, s.k, s.v, order);
  }
  const Tensor& q = options.remat ? h.q : s.q;
  const Tensor& k = options.remat ? h.k : s.k;
  const Tensor& v = options.remat ? h.v : s.v;

  const auto pos = natural_positions(B, S);
  Tensor dq_heads(attention.dtype, q.shape());
  Tensor dk_heads(DType::f32, k.shape()), dv_heads(DType::f32, v.shape());
  flash_backward(cref(q), cref(k), cref(v), cref(s.o), s.lse.data(), cref(do_heads),
                 mask(pos, pos, s.seg_full, s.seg_full), attention.scale(), kernel_config(), ref(dq_heads),
                 ref(dk_heads), ref(dv_heads));

  AttentionGradients g;
  g.dq = cp::all_to_all_heads_to_sequence(comm, dq_heads);
  // [B, S, slots/cp, D] fp32 -> [B, S/cp, slots, D] -> [B, S/cp, Hkv, D]
  const Tensor dk_rep = cp::all_to_all_heads_to_sequence(comm, dk_heads);
  const Tensor dv_rep = cp::all_to_all_heads_to_sequence(comm, dv_heads);
  const bool replicated = static_cast<std::int64_t>(order.size()) != hkv;
  const NegativeControl control = negative_control;
  g.dk = (replicated ? sum_replicas(dk_rep, order, hkv, rep, control) : dk_rep).to(attention.dtype);
  g.dv = (replicated ? sum_replicas(dv_rep, order, hkv, rep, control) : dv_rep).to(attention.dtype);
  return g;
}

}  // namespace cpattn
