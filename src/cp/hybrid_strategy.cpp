// hybrid (docs/design.md, "Ring attention and the hybrid strategy"): cp = U x R ranks, rank c = ring_rank * U
// + ulysses_rank. Inside each ulysses group of U ranks the ulysses swap (any head counts, placement.hpp)
// gives each rank its heads for the whole group's tokens; the ring then runs over the R ranks that share a
// ulysses rank, with those heads, and the reverse swap brings O and LSE back. With load balance the inputs
// are in the dual_chunk_swap layout over all cp ranks and the receiver places member u's two chunks at slots
// u and 2U-1-u, so that each ring rank holds the ring-level zigzag (its group's chunks r and 2R-1-r) with no
// extra communication; in the per_document and solver layouts a ring rank holds its members' runs one after
// another (ring_layout_of), as they arrive. Backward mirrors it: the ring's dK/dV accumulators come home, and
// each kv head's fp32 contributions from the group's ranks are summed in rank order after the reverse swap.
#include <algorithm>
#include <cstring>

#include "context_parallel_impl.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"
#include "head_parts.hpp"

namespace cpattn {

namespace {

// dst's chunk j = src's chunk from[j], per outer row: `outer` rows of from.size() chunks of `chunk` bytes.
void move_chunks(const void* src, void* dst, std::int64_t outer, std::size_t chunk,
                 const std::vector<std::int64_t>& from) {
  const auto n = static_cast<std::int64_t>(from.size());
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t j = 0; j < n; ++j) {
      std::memcpy(d + (o * n + j) * chunk, s + (o * n + from[j]) * chunk, chunk);
    }
  }
}

// The 2U chunks of a group's rows as they arrive (member u's chunks at 2u, 2u + 1) and as the ring holds them
// (slots u and 2U-1-u): to_slots[j] = the arriving chunk at slot j; to_members, the inverse.
std::vector<std::int64_t> to_slots(std::int64_t u) {
  std::vector<std::int64_t> from(static_cast<std::size_t>(2 * u));
  for (std::int64_t m = 0; m < u; ++m) {
    from[m] = 2 * m;
    from[2 * u - 1 - m] = 2 * m + 1;
  }
  return from;
}
std::vector<std::int64_t> to_members(std::int64_t u) {
  const std::vector<std::int64_t> slots = to_slots(u);
  std::vector<std::int64_t> from(slots.size());
  for (std::size_t j = 0; j < slots.size(); ++j) from[slots[j]] = static_cast<std::int64_t>(j);
  return from;
}

// x: [B, L, h, D] with L = 2U chunks, reordered by `from`.
Tensor reorder_rows(const Tensor& x, const std::vector<std::int64_t>& from) {
  const Shape4 s = x.shape();
  Tensor y(x.dtype(), s);
  const std::int64_t chunk = s.s / static_cast<std::int64_t>(from.size());
  move_chunks(x.raw(), y.raw(), s.b, static_cast<std::size_t>(chunk * s.h * s.d) * dtype_size(x.dtype()),
              from);
  return y;
}

// What forward and backward share: the placement over U, and whether the rows change places (only the
// load-balanced layout's chunks do, and only when a group gathers rows from several ranks).
struct HybridPlan {
  UlyssesHeads heads;
  std::int64_t u_rank;
  bool reorder;

  Tensor in_slots(Tensor t) const {
    if (!reorder) return t;
    return reorder_rows(t, to_slots(static_cast<std::int64_t>(heads.q.size())));
  }
  Tensor in_members(Tensor t) const {
    if (!reorder) return t;
    return reorder_rows(t, to_members(static_cast<std::int64_t>(heads.q.size())));
  }
};

HybridPlan hybrid_plan(const ContextParallelAttention::Impl& impl) {
  const ParallelSpec& p = impl.parallel;
  return {cp::run_placement(impl.hq, impl.hkv, p.ulysses_degree, impl.negative_control),
          p.ulysses_rank(impl.rank),
          p.ulysses_degree > 1 && p.effective_layout() == ShardLayout::dual_chunk_swap};
}

}  // namespace

AttentionOutput ContextParallelAttention::Impl::hybrid_forward(const Tensor& q, const Tensor& k,
                                                               const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch, U = parallel.head_group_size(), L = U * local_seq;
  const HybridPlan h = hybrid_plan(*this);
  const UlyssesHeads& u = h.heads;
  const std::int64_t u_rank = h.u_rank;
  const bool reorder = h.reorder;
  Tensor qh, kh, vh;
  if (U > 1) {
    qh = h.in_slots(cp::all_to_all_sequence_to_heads(*ulysses_comm, q, u.q));
    kh = h.in_slots(cp::all_to_all_sequence_to_heads(*ulysses_comm, k, u.kv));
    vh = h.in_slots(cp::all_to_all_sequence_to_heads(*ulysses_comm, v, u.kv));
  }
  const Tensor& qr = U > 1 ? qh : q;
  const Tensor& kr = U > 1 ? kh : k;
  const Tensor& vr = U > 1 ? vh : v;

  // Segment ids: the whole row in natural order (gathered before the schedule: Impl::forward), and the ring
  // rank's rows of it in slot order.
  const std::vector<std::int32_t>& seg_full = row_segments;
  std::vector<std::int32_t> seg_rows;
  if (!seg_full.empty()) {
    const std::vector<std::int32_t>& at = ring_positions[static_cast<std::size_t>(ring_comm->rank())];
    seg_rows.resize(static_cast<std::size_t>(B * L));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t t = 0; t < L; ++t) seg_rows[b * L + t] = seg_full[b * attention.seq_len + at[t]];
    }
  }

  cp::RingPass pass = ring_pass(*ring_comm, ring_positions, ring_runs, *route,
                                cp::kernel_calls(u.q[u_rank], u.kv[u_rank], hq / hkv));
  pass.sinks = cp::head_sinks(sinks_local, u.q[u_rank].begin, 0, u.q[u_rank].size());
  AttentionOutput heads = cp::ring_pass_forward(pass, qr, kr, vr, seg_rows, seg_full);

  AttentionOutput out;
  if (U == 1) {
    if (forward_only) return heads;
    out = heads;  // a copy: backward needs heads
  } else if (reorder) {
    std::vector<float> lse(heads.lse.size());
    move_chunks(heads.lse.data(), lse.data(), B * u.q[u_rank].size(),
                static_cast<std::size_t>(local_seq / 2) * sizeof(float), to_members(U));
    out.o = cp::all_to_all_heads_to_sequence(*ulysses_comm, h.in_members(heads.o), u.q);
    out.lse = cp::all_to_all_lse_heads_to_sequence(*ulysses_comm, lse, B, L, u.q);
  } else {
    out.o = cp::all_to_all_heads_to_sequence(*ulysses_comm, heads.o, u.q);
    out.lse = cp::all_to_all_lse_heads_to_sequence(*ulysses_comm, heads.lse, B, L, u.q);
  }
  if (forward_only) return out;
  cp::RingSaved s(Strategy::hybrid);
  if (U > 1) {
    s.q = std::move(qh);
    s.k = std::move(kh);
    s.v = std::move(vh);
  } else {
    s.q = q;
    s.k = k;
    s.v = v;
  }
  s.o = std::move(heads.o);
  s.lse = std::move(heads.lse);
  s.seg_local = std::move(seg_rows);
  s.seg_full = seg_full;
  s.route = route;
  saved = std::make_unique<cp::RingSaved>(std::move(s));
  return out;
}

AttentionGradients ContextParallelAttention::Impl::hybrid_backward(const Tensor& d_out) {
  const cp::RingSaved& s = saved_as<cp::RingSaved>();
  const std::int64_t U = parallel.head_group_size();
  const HybridPlan h = hybrid_plan(*this);
  const UlyssesHeads& u = h.heads;
  Tensor do_heads;
  if (U > 1) do_heads = h.in_slots(cp::all_to_all_sequence_to_heads(*ulysses_comm, d_out, u.q));
  const cp::RingPass pass = ring_pass(*ring_comm, ring_positions, ring_runs, *s.route,
                                      cp::kernel_calls(u.q[h.u_rank], u.kv[h.u_rank], hq / hkv));
  cp::RingGradients g = cp::ring_pass_backward(pass, s.q, s.k, s.v, s.o, s.lse, U > 1 ? do_heads : d_out,
                                               s.seg_local, s.seg_full);
  // This rank's part of dsinks: its ring rows of its ulysses heads.
  std::vector<float> dsinks;
  if (!s.sinks.empty())
    dsinks = cp::sink_parts(s.sinks, u.q[h.u_rank].begin, s.o, s.lse, U > 1 ? do_heads : d_out);
  if (U == 1) {
    return {g.dq.to(attention.dtype), g.dk.to(attention.dtype), g.dv.to(attention.dtype), std::move(dsinks)};
  }

  AttentionGradients out;
  out.dsinks = std::move(dsinks);
  out.dq = cp::all_to_all_heads_to_sequence(*ulysses_comm, h.in_members(g.dq.to(attention.dtype)), u.q);
  // [B, L, nkv_u, D] fp32 -> [B, S/cp, sum_u nkv_u, D] -> [B, S/cp, Hkv, D]
  const Tensor dk_all = cp::all_to_all_heads_to_sequence(*ulysses_comm, h.in_members(std::move(g.dk)), u.kv);
  const Tensor dv_all = cp::all_to_all_heads_to_sequence(*ulysses_comm, h.in_members(std::move(g.dv)), u.kv);
  const std::vector<std::int64_t> order = u.kv_head_order();
  const bool shared = cp::contributions_shared(order, hkv);
  out.dk =
      (shared ? cp::sum_contributions(dk_all, order, hkv, negative_control) : dk_all).to(attention.dtype);
  out.dv =
      (shared ? cp::sum_contributions(dv_all, order, hkv, negative_control) : dv_all).to(attention.dtype);
  return out;
}

}  // namespace cpattn
