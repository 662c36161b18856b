// ulysses for any head counts (docs/design.md, "Head placement"): variable all-to-alls from
// sequence shards [B, S/cp, H, D] to head shards [B, S, n_r, D], rank r holding its q heads q[r] and exactly
// the kv heads they read, kv[r] (placement.hpp; at Hq=32, Hkv=2, cp=4 that is the seed's grouped replication
// [kv0, kv0, kv1, kv1]). The kernel runs locally over the whole sequence; O and LSE come back by the reverse
// all-to-all. In backward each rank's dK/dV of kv[r] holds its own q heads' contribution; they travel back as
// fp32 and each kv head's contributions are summed on arrival in rank order (the transpose of the fan-out; no
// 1/replication factor).
#include <algorithm>

#include "context_parallel_impl.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"
#include "head_parts.hpp"

namespace cpattn {

namespace cp {

UlyssesHeads run_placement(std::int64_t hq, std::int64_t hkv, std::int64_t ranks, NegativeControl control) {
  const std::int64_t cp = ranks;
  UlyssesHeads u = ulysses_heads(hq, hkv, cp);
  const std::int64_t group = hq / hkv;
  switch (control) {
    case NegativeControl::tiled_kv_order:  // slot r of [kv0, kv1, kv0, kv1] where each rank has one kv head
      if (std::all_of(u.kv.begin(), u.kv.end(), [](const HeadRange& r) { return r.size() == 1; })) {
        for (std::int64_t r = 0; r < cp; ++r) u.kv[r] = {r % hkv, r % hkv + 1};
      }
      break;
    case NegativeControl::shifted_kv_set:  // a rank starting a q group receives the kv set one head on
      for (std::int64_t r = 0; r < cp; ++r) {
        if (u.q[r].begin % group == 0 && u.kv[r].end < hkv) u.kv[r] = {u.kv[r].begin + 1, u.kv[r].end + 1};
      }
      break;
    case NegativeControl::extra_q_heads_on_highest_ranks: {  // q ranges reversed, kv sets as computed
      const std::vector<HeadRange> computed = u.q;
      std::int64_t begin = 0;
      for (std::int64_t r = 0; r < cp; ++r) {
        const std::int64_t n = computed[cp - 1 - r].size();
        u.q[r] = {begin, begin + n};
        begin += n;
      }
      break;
    }
    default:
      break;
  }
  return u;
}

std::vector<KernelCall> kernel_calls(const HeadRange& q, const HeadRange& kv, std::int64_t group) {
  const std::int64_t n = q.size(), nkv = kv.size();
  auto slot = [&](std::int64_t i) {
    return std::clamp((q.begin + i) / group - kv.begin, std::int64_t{0}, nkv - 1);
  };
  bool uniform = n % nkv == 0;
  for (std::int64_t i = 0; i < n && uniform; ++i) uniform = slot(i) == i / (n / nkv);
  if (uniform) return {{0, n, 0, nkv}};
  std::vector<KernelCall> calls;
  for (std::int64_t i = 0; i < n; ++i) {
    if (calls.empty() || calls.back().kv0 != slot(i)) {
      calls.push_back({i, 0, slot(i), 1});
    }
    ++calls.back().nq;
  }
  return calls;
}

Tensor sum_contributions(const Tensor& g, const std::vector<std::int64_t>& order, std::int64_t hkv,
                         NegativeControl control) {
  const Shape4 s = g.shape();
  Tensor out(DType::f32, {s.b, s.s, hkv, s.d});
  const float* src = g.data<float>();
  float* dst = out.data<float>();
  std::vector<int> taken(static_cast<std::size_t>(hkv));
  for (std::int64_t bt = 0; bt < s.b * s.s; ++bt) {
    std::fill(taken.begin(), taken.end(), 0);
    for (std::int64_t slot = 0; slot < s.h; ++slot) {
      const std::int64_t h = order[slot];
      if (control == NegativeControl::first_kv_replica_only && taken[h] > 0) continue;
      ++taken[h];
      float* o = dst + (bt * hkv + h) * s.d;
      const float* i = src + (bt * s.h + slot) * s.d;
      for (std::int64_t d = 0; d < s.d; ++d) o[d] += i[d];
    }
    if (control == NegativeControl::scaled_kv_grad_sum) {
      for (std::int64_t h = 0; h < hkv; ++h) {
        float* o = dst + (bt * hkv + h) * s.d;
        for (std::int64_t d = 0; d < s.d; ++d) o[d] *= 1.0f / static_cast<float>(std::max(taken[h], 1));
      }
    }
  }
  return out;
}

bool contributions_shared(const std::vector<std::int64_t>& order, std::int64_t hkv) {
  if (static_cast<std::int64_t>(order.size()) != hkv) return true;
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (order[i] != static_cast<std::int64_t>(i)) return true;
  }
  return false;
}

// Adds a call's tile counts (per_head [B, nq]) into the rank's ([B, n]).
void add_call_tiles(TileCounts& into, const TileCounts& call, std::int64_t batch, std::int64_t n,
                    const KernelCall& c) {
  if (into.per_head.empty()) into.per_head.assign(static_cast<std::size_t>(batch * n), 0);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i < c.nq; ++i) into.per_head[b * n + c.q0 + i] += call.per_head[b * c.nq + i];
  }
  into.full += call.full;
  into.partial += call.partial;
}

}  // namespace cp

namespace {

using cp::KernelCall;

// lse rows [B, n, S] <-> a call's [B, nq, S] (from q0 on).
void copy_lse_rows(const float* from, std::int64_t from_heads, std::int64_t from_h0, float* to,
                   std::int64_t to_heads, std::int64_t to_h0, std::int64_t batch, std::int64_t heads,
                   std::int64_t seq) {
  for (std::int64_t b = 0; b < batch; ++b) {
    std::copy_n(from + (b * from_heads + from_h0) * seq, heads * seq, to + (b * to_heads + to_h0) * seq);
  }
}

struct HeadSharded {
  Tensor q, k, v;  // [B, S, n_r, D], [B, S, nkv_r, D]
};

HeadSharded to_heads(Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
                     const UlyssesHeads& u) {
  HeadSharded h;
  h.q = cp::all_to_all_sequence_to_heads(comm, q, u.q);
  h.k = cp::all_to_all_sequence_to_heads(comm, k, u.kv);
  h.v = cp::all_to_all_sequence_to_heads(comm, v, u.kv);
  return h;
}

}  // namespace

namespace {

struct UlyssesSaved final : ContextParallelAttention::Impl::SavedState {
  UlyssesSaved() : SavedState(Strategy::ulysses) {}
  Tensor q, k, v;                      // head-sharded [B, S, n_r, D]; remat: the local shards
  Tensor o;                            // head-sharded O
  std::vector<float> lse;              // [B, n_r, S]
  std::vector<std::int32_t> seg_full;  // [B, S] natural (empty: no segments)
  std::int64_t bytes() const override {
    return cp::saved_bytes({&q, &k, &v, &o}, lse.size() * 4 + seg_full.size() * 4);
  }
};

}  // namespace

AttentionOutput ContextParallelAttention::Impl::ulysses_forward(const Tensor& q, const Tensor& k,
                                                                const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch, S = attention.seq_len;
  const UlyssesHeads u = cp::run_placement(hq, hkv, cp, negative_control);
  HeadSharded h = to_heads(comm, q, k, v, u);
  std::vector<std::int32_t> seg_full;
  if (!seg_local.empty()) seg_full = cp::all_gather_segments(comm, seg_local, B, positions);

  const auto pos = natural_positions(B, S);
  const AttentionMask m = mask(pos, pos, seg_full, seg_full);
  const std::int64_t n = u.q[rank].size();
  Tensor o_heads(attention.dtype, h.q.shape());
  std::vector<float> lse_heads(static_cast<std::size_t>(B * n * S));
  const auto calls = cp::kernel_calls(u.q[rank], u.kv[rank], hq / hkv);
  if (calls.size() == 1 && calls[0].nkv == u.kv[rank].size()) {  // every local head in one call
    AttentionMask mc = m;
    mc.sinks = cp::head_sinks(sinks_local, u.q[rank].begin, 0, n);
    flash_forward(cref(h.q), cref(h.k), cref(h.v), mc, attention.scale(), kernel_config(), ref(o_heads),
                  lse_heads.data(), &tiles);
  } else {
    tiles = TileCounts{};
    for (const KernelCall& c : calls) {
      std::vector<float> lse(static_cast<std::size_t>(B * c.nq * S));
      TileCounts t;
      AttentionMask mc = m;
      mc.sinks = cp::head_sinks(sinks_local, u.q[rank].begin, c.q0, c.nq);
      flash_forward(cref(h.q).heads(c.q0, c.nq), cref(h.k).heads(c.kv0, c.nkv), cref(h.v).heads(c.kv0, c.nkv),
                    mc, attention.scale(), kernel_config(), ref(o_heads).heads(c.q0, c.nq), lse.data(), &t);
      copy_lse_rows(lse.data(), c.nq, 0, lse_heads.data(), n, c.q0, B, c.nq, S);
      cp::add_call_tiles(tiles, t, B, n, c);
    }
  }

  AttentionOutput out;
  out.o = cp::all_to_all_heads_to_sequence(comm, o_heads, u.q);
  out.lse = cp::all_to_all_lse_heads_to_sequence(comm, lse_heads, B, S, u.q);
  if (!forward_only) {
    UlyssesSaved s;
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
    saved = std::make_unique<UlyssesSaved>(std::move(s));
  }
  return out;
}

AttentionGradients ContextParallelAttention::Impl::ulysses_backward(const Tensor& d_out) {
  UlyssesSaved& s = saved_as<UlyssesSaved>();
  const std::int64_t B = attention.batch, S = attention.seq_len;
  const UlyssesHeads u = cp::run_placement(hq, hkv, cp, negative_control);
  Tensor do_heads = cp::all_to_all_sequence_to_heads(comm, d_out, u.q);
  HeadSharded h;
  if (options.remat) {
    CollectiveCounters::PhaseScope phase(group.counters(), "remat");
    h = to_heads(comm, s.q, s.k, s.v, u);
  }
  const Tensor& q = options.remat ? h.q : s.q;
  const Tensor& k = options.remat ? h.k : s.k;
  const Tensor& v = options.remat ? h.v : s.v;

  const auto pos = natural_positions(B, S);
  const AttentionMask m = mask(pos, pos, s.seg_full, s.seg_full);
  const std::int64_t n = u.q[rank].size();
  Tensor dq_heads(attention.dtype, q.shape());
  Tensor dk_heads(DType::f32, k.shape()), dv_heads(DType::f32, v.shape());
  AttentionGradients g;
  g.dsinks.assign(s.sinks.size(), 0.0f);  // this rank's heads over every row, each call its own
  for (const KernelCall& c : cp::kernel_calls(u.q[rank], u.kv[rank], hq / hkv)) {
    const bool all = c.nq == n;
    std::vector<float> lse;
    if (!all) {
      lse.resize(static_cast<std::size_t>(B * c.nq * S));
      copy_lse_rows(s.lse.data(), n, c.q0, lse.data(), c.nq, 0, B, c.nq, S);
    }
    AttentionMask mc = m;
    mc.sinks = cp::head_sinks(s.sinks, u.q[rank].begin, c.q0, c.nq);
    flash_backward(cref(q).heads(c.q0, c.nq), cref(k).heads(c.kv0, c.nkv), cref(v).heads(c.kv0, c.nkv),
                   cref(s.o).heads(c.q0, c.nq), all ? s.lse.data() : lse.data(),
                   cref(do_heads).heads(c.q0, c.nq), mc, attention.scale(), kernel_config(),
                   ref(dq_heads).heads(c.q0, c.nq), ref(dk_heads).heads(c.kv0, c.nkv),
                   ref(dv_heads).heads(c.kv0, c.nkv), nullptr,
                   s.sinks.empty() ? nullptr : g.dsinks.data() + u.q[rank].begin + c.q0);
  }

  g.dq = cp::all_to_all_heads_to_sequence(comm, dq_heads, u.q);
  // [B, S, nkv_r, D] fp32 -> [B, S/cp, sum_r nkv_r, D] -> [B, S/cp, Hkv, D]
  const Tensor dk_all = cp::all_to_all_heads_to_sequence(comm, dk_heads, u.kv);
  const Tensor dv_all = cp::all_to_all_heads_to_sequence(comm, dv_heads, u.kv);
  const std::vector<std::int64_t> order = u.kv_head_order();
  const bool shared = cp::contributions_shared(order, hkv);
  g.dk = (shared ? cp::sum_contributions(dk_all, order, hkv, negative_control) : dk_all).to(attention.dtype);
  g.dv = (shared ? cp::sum_contributions(dv_all, order, hkv, negative_control) : dv_all).to(attention.dtype);
  return g;
}

}  // namespace cpattn
