// ring (docs/design.md, "Ring"): K and V of each shard travel around the ranks, one hop per step; at step s
// rank r holds the K/V of rank src = (r - s) mod cp and attends its own queries to them, at their global
// positions (contiguous shards, or the dual_chunk_swap layout with load balance: the kernel's tile
// classification skips what the causal mask hides). The next hop is started before the step's compute and
// waited after it. Each step's (O_s, LSE_s) is folded into a running maximum m, sum l and unnormalised O in
// fp32, in step order; O = O/l and LSE = m + log l once at the end. Backward: K/V travel again, each shard's
// dK/dV accumulator (fp32) travelling with it and going home after the last step; dQ sums locally in fp32.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "context_parallel_impl.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {

namespace {

// Two [B, S/cp, H, D] tensors in one buffer (first, then second), so that one shift moves both.
struct Pair {
  Tensor both;  // [2B, S/cp, H, D]
  std::int64_t batch = 0;

  Pair(DType dtype, const Shape4& s) : both(dtype, {2 * s.b, s.s, s.h, s.d}), batch(s.b) {}
  ConstTensorRef first() const { return half(0); }
  ConstTensorRef second() const { return half(1); }
  TensorRef first_mut() { return half_mut(0); }
  TensorRef second_mut() { return half_mut(1); }
  std::int64_t count() const { return both.numel(); }

 private:
  ConstTensorRef half(int i) const {
    ConstTensorRef r = cref(both);
    r.shape.b = batch;
    r.ptr = static_cast<const char*>(r.ptr) +
            i * batch * r.stride[0] * static_cast<std::int64_t>(dtype_size(r.dtype));
    return r;
  }
  TensorRef half_mut(int i) {
    TensorRef r = ref(both);
    r.shape.b = batch;
    r.ptr =
        static_cast<char*>(r.ptr) + i * batch * r.stride[0] * static_cast<std::int64_t>(dtype_size(r.dtype));
    return r;
  }
};

// K and V of this rank's shard, in the one buffer the ring sends.
Pair kv_pair(const Tensor& k, const Tensor& v) {
  Pair kv(k.dtype(), k.shape());
  const std::size_t bytes = static_cast<std::size_t>(k.numel()) * dtype_size(k.dtype());
  std::memcpy(kv.first_mut().ptr, k.raw(), bytes);
  std::memcpy(kv.second_mut().ptr, v.raw(), bytes);
  return kv;
}

// The pieces a shard is cut into for the kernel: both chunks of the dual_chunk_swap layout, or the whole
// shard.
std::int64_t parts_of(ShardLayout layout) {
  return layout == ShardLayout::dual_chunk_swap ? 2 : 1;
}

// The running softmax state of every row (b, h, i) of O [B, Sq, H, D] and LSE [B, H, Sq], in fp32.
struct Running {
  std::vector<float> m, l;  // [B, H, Sq]
  Tensor o;                 // [B, Sq, H, D] fp32, unnormalised

  explicit Running(const Shape4& s)
      : m(static_cast<std::size_t>(s.b * s.h * s.s), -std::numeric_limits<float>::infinity()),
        l(m.size(), 0.0f),
        o(DType::f32, s) {}

  // Folds one call's normalised (O_c, LSE_c) of rows [row0, row0 + n) (o_call [B, n, H, D], lse_call
  // [B, H, n]): rows with LSE_c = -inf saw no key and change nothing.
  void fold(const Tensor& o_call, const std::vector<float>& lse_call, std::int64_t row0) {
    const Shape4 s = o.shape();
    const std::int64_t n = o_call.shape().s;
    const float* src = o_call.data<float>();
    float* dst = o.data<float>();
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t h = 0; h < s.h; ++h) {
        for (std::int64_t j = 0; j < n; ++j) {
          const std::int64_t i = row0 + j;
          const std::size_t row = static_cast<std::size_t>((b * s.h + h) * s.s + i);
          const float x = lse_call[static_cast<std::size_t>((b * s.h + h) * n + j)];
          if (x == -std::numeric_limits<float>::infinity()) continue;
          const float m_new = std::max(m[row], x);
          const float keep = std::exp(m[row] - m_new), add = std::exp(x - m_new);
          m[row] = m_new;
          l[row] = l[row] * keep + add;
          const std::int64_t off = ((b * s.s + i) * s.h + h) * s.d, from = ((b * n + j) * s.h + h) * s.d;
          for (std::int64_t d = 0; d < s.d; ++d) dst[off + d] = dst[off + d] * keep + src[from + d] * add;
        }
      }
    }
  }

  // O = O / l in `dtype`, LSE = m + log l; rows that saw no key: O = 0, LSE = -inf (as the kernel gives).
  // Normalises in place (fresh pages are slow to touch on some machines: no second buffer).
  AttentionOutput finish(DType dtype) && {
    const Shape4 s = o.shape();
    std::vector<float> lse(m.size());
    float* x = o.data<float>();
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t h = 0; h < s.h; ++h) {
        for (std::int64_t i = 0; i < s.s; ++i) {
          const std::size_t row = static_cast<std::size_t>((b * s.h + h) * s.s + i);
          const bool none = l[row] == 0.0f;
          lse[row] = none ? -std::numeric_limits<float>::infinity() : m[row] + std::log(l[row]);
          const float inv = none ? 0.0f : 1.0f / l[row];
          const std::int64_t off = ((b * s.s + i) * s.h + h) * s.d;
          for (std::int64_t d = 0; d < s.d; ++d) x[off + d] = none ? 0.0f : x[off + d] * inv;
        }
      }
    }
    return {dtype == DType::f32 ? std::move(o) : o.to(dtype), std::move(lse)};
  }
};

// The kernel calls of a step: the rank's shard against the visiting one, whole (contiguous layout), or chunk
// by chunk (dual_chunk_swap: the zigzag's chunk products, each on a grid of its own, so that a chunk that is
// not a multiple of the block shares no tile with the other). Calls the causal mask hides whole are skipped.
struct Piece {
  std::int64_t first = 0, count = 0;   // local rows
  std::vector<std::int32_t> pos, seg;  // [B, count]; seg empty when not packed
  std::int32_t lo = 0, hi = 0;         // the smallest and largest position
};

// `positions`: the shard's positions (one row); seg_of(b, t): the segment id of local token t in row b.
template <class SegOf>
std::vector<Piece> pieces(const std::vector<std::int32_t>& positions, std::int64_t parts, std::int64_t batch,
                          bool packed, SegOf seg_of) {
  std::vector<Piece> out;
  const std::int64_t n = static_cast<std::int64_t>(positions.size()) / parts;
  for (std::int64_t part = 0; part < parts; ++part) {
    Piece p;
    p.first = part * n;
    p.count = n;
    p.lo = positions[p.first];
    p.hi = positions[p.first];
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t t = p.first; t < p.first + n; ++t) {
        p.pos.push_back(positions[t]);
        p.lo = std::min(p.lo, positions[t]);
        p.hi = std::max(p.hi, positions[t]);
        if (packed) p.seg.push_back(seg_of(b, t));
      }
    }
    out.push_back(std::move(p));
  }
  return out;
}

// Rows [first, first + count) of a [B, S, H, D] view.
template <class Ref>
Ref rows(Ref r, std::int64_t first, std::int64_t count) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(r.ptr)>>, const char, char>;
  r.ptr = static_cast<Byte*>(r.ptr) + first * r.stride[1] * static_cast<std::int64_t>(dtype_size(r.dtype));
  r.shape.s = count;
  return r;
}

// into[:, first:first+n] += piece (fp32 [B, S, H, D] and [B, n, H, D]).
void add_rows(Tensor& into, std::int64_t first, const Tensor& piece) {
  const Shape4 s = into.shape();
  const std::int64_t n = piece.shape().s, row = s.h * s.d;
  float* dst = into.data<float>();
  const float* src = piece.data<float>();
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t i = 0; i < n * row; ++i) dst[(b * s.s + first) * row + i] += src[b * n * row + i];
  }
}

// lse [B, H, S] rows [first, first + n) -> [B, H, n].
std::vector<float> lse_rows(const std::vector<float>& lse, std::int64_t batch, std::int64_t heads,
                            std::int64_t seq, std::int64_t first, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(batch * heads * n));
  for (std::int64_t bh = 0; bh < batch * heads; ++bh) {
    std::copy_n(lse.begin() + bh * seq + first, n, out.begin() + bh * n);
  }
  return out;
}

// Waits for a shift, adding the time spent to `waited`.
void wait_for(PendingShift& shift, double& waited) {
  const auto t0 = std::chrono::steady_clock::now();
  shift.wait();
  waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void add_tiles(TileCounts& into, const TileCounts& step) {
  if (into.per_head.empty()) into.per_head.assign(step.per_head.size(), 0);
  for (std::size_t i = 0; i < step.per_head.size(); ++i) into.per_head[i] += step.per_head[i];
  into.full += step.full;
  into.partial += step.partial;
}

// acc += (dk, dv) of one step, fp32.
void accumulate(Pair& acc, const Tensor& dk, const Tensor& dv) {
  float* a = static_cast<float*>(acc.first_mut().ptr);
  float* b = static_cast<float*>(acc.second_mut().ptr);
  const float* x = dk.data<float>();
  const float* y = dv.data<float>();
  for (std::int64_t i = 0; i < dk.numel(); ++i) {
    a[i] += x[i];
    b[i] += y[i];
  }
}

}  // namespace

namespace {

// The visiting shard's pieces (src's positions; its segment ids from the gathered row), with the negative
// control that puts its two chunks at each other's positions.
std::vector<Piece> visiting(const RankPositions& positions, std::int64_t src, std::int64_t parts,
                            std::int64_t batch, std::int64_t seq, const std::vector<std::int32_t>& seg_full,
                            bool swapped) {
  std::vector<std::int32_t> theirs = positions[src];
  if (swapped) {
    std::rotate(theirs.begin(), theirs.begin() + static_cast<std::ptrdiff_t>(theirs.size() / 2),
                theirs.end());
  }
  return pieces(theirs, parts, batch, !seg_full.empty(),
                [&](std::int64_t b, std::int64_t t) { return seg_full[b * seq + theirs[t]]; });
}

}  // namespace

AttentionOutput ContextParallelAttention::Impl::ring_forward(const Tensor& q, const Tensor& k,
                                                             const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch, S = attention.seq_len;
  std::vector<std::int32_t> seg_full;
  if (!seg_local.empty()) seg_full = cp::all_gather_segments(comm, seg_local, B, positions);

  Pair current = kv_pair(k, v), next(attention.dtype, k.shape());
  Running run(q.shape());
  const std::int64_t parts = parts_of(parallel.effective_layout());
  const std::int64_t n = local_seq / parts;
  Tensor o_call(DType::f32, {B, n, hq, attention.head_dim});
  std::vector<float> lse_call(static_cast<std::size_t>(B * hq * n));
  const bool packed = !seg_local.empty();
  const auto mine = pieces(positions[rank], parts, B, packed,
                           [&](std::int64_t b, std::int64_t t) { return seg_local[b * local_seq + t]; });
  tiles = TileCounts{};
  step_lses.clear();
  for (std::int64_t s = 0; s < cp; ++s) {
    const std::int64_t src = (rank - s + cp) % cp;
    std::unique_ptr<PendingShift> hop;
    if (s + 1 < cp)
      hop =
          comm.start_shift(current.both.raw(), next.both.raw(), current.count(), comm_dtype(attention.dtype));
    const auto theirs = visiting(positions, src, parts, B, S, seg_full,
                                 negative_control == NegativeControl::ring_zigzag_swapped);
    if (negative_control == NegativeControl::ring_step_lse) step_lses.emplace_back(lse_call.size() * parts);
    for (const Piece& qp : mine) {
      for (const Piece& kp : theirs) {
        if (attention.causal && qp.hi < kp.lo) continue;  // every key in the future of every query
        TileCounts t;
        flash_forward(rows(cref(q), qp.first, n), rows(current.first(), kp.first, n),
                      rows(current.second(), kp.first, n), mask(qp.pos, kp.pos, qp.seg, kp.seg),
                      attention.scale(), kernel_config(), ref(o_call), lse_call.data(), &t);
        add_tiles(tiles, t);
        run.fold(o_call, lse_call, qp.first);
        if (negative_control == NegativeControl::ring_step_lse) {
          for (std::int64_t bh = 0; bh < B * hq; ++bh) {
            std::copy_n(lse_call.begin() + bh * n, n, step_lses.back().begin() + bh * local_seq + qp.first);
          }
        }
      }
    }
    if (hop) {
      wait_for(*hop, comm_wait_seconds);
      std::swap(current, next);
    }
  }
  AttentionOutput out = std::move(run).finish(attention.dtype);
  if (!forward_only) {
    Saved saved_state;
    saved_state.q = q;
    saved_state.k = k;
    saved_state.v = v;
    saved_state.o = out.o;
    saved_state.lse = out.lse;
    saved_state.seg_local = seg_local;
    saved_state.seg_full = std::move(seg_full);
    saved = std::move(saved_state);
  }
  return out;
}

AttentionGradients ContextParallelAttention::Impl::ring_backward(const Tensor& d_out) {
  Saved& sv = *saved;
  const std::int64_t B = attention.batch, S = attention.seq_len;
  const Shape4 kv_shape = sv.k.shape();
  Pair current = kv_pair(sv.k, sv.v), next(attention.dtype, kv_shape);
  // The dK/dV accumulator of the shard this rank holds, and the one arriving with the next shard.
  Pair acc(DType::f32, kv_shape), acc_next(DType::f32, kv_shape);
  const std::int64_t parts = parts_of(parallel.effective_layout());
  const std::int64_t n = local_seq / parts;
  Tensor dq(DType::f32, sv.q.shape()), dq_call(DType::f32, {B, n, hq, attention.head_dim});
  Tensor dk_step(DType::f32, kv_shape), dv_step(DType::f32, kv_shape);
  Tensor dk_call(DType::f32, {B, n, hkv, attention.head_dim}),
      dv_call(DType::f32, {B, n, hkv, attention.head_dim});
  const auto mine = pieces(positions[rank], parts, B, !sv.seg_local.empty(),
                           [&](std::int64_t b, std::int64_t t) { return sv.seg_local[b * local_seq + t]; });
  std::unique_ptr<PendingShift> acc_hop;
  for (std::int64_t s = 0; s < cp; ++s) {
    const std::int64_t src = (rank - s + cp) % cp;
    std::unique_ptr<PendingShift> kv_hop;
    if (s + 1 < cp)
      kv_hop =
          comm.start_shift(current.both.raw(), next.both.raw(), current.count(), comm_dtype(attention.dtype));
    const auto theirs = visiting(positions, src, parts, B, S, sv.seg_full,
                                 negative_control == NegativeControl::ring_zigzag_swapped);
    // Every step uses the final O and LSE.
    const std::vector<float>& lse =
        negative_control == NegativeControl::ring_step_lse ? step_lses[s] : sv.lse;
    std::fill_n(dk_step.data<float>(), dk_step.numel(), 0.0f);
    std::fill_n(dv_step.data<float>(), dv_step.numel(), 0.0f);
    for (const Piece& qp : mine) {
      const std::vector<float> lse_piece = lse_rows(lse, B, hq, local_seq, qp.first, n);
      for (const Piece& kp : theirs) {
        if (attention.causal && qp.hi < kp.lo) continue;
        flash_backward(rows(cref(sv.q), qp.first, n), rows(current.first(), kp.first, n),
                       rows(current.second(), kp.first, n), rows(cref(sv.o), qp.first, n), lse_piece.data(),
                       rows(cref(d_out), qp.first, n), mask(qp.pos, kp.pos, qp.seg, kp.seg),
                       attention.scale(), kernel_config(), ref(dq_call), ref(dk_call), ref(dv_call));
        add_rows(dq, qp.first, dq_call);
        add_rows(dk_step, kp.first, dk_call);
        add_rows(dv_step, kp.first, dv_call);
      }
    }
    if (acc_hop) {
      wait_for(*acc_hop, comm_wait_seconds);  // src's accumulator, from the ranks before this one
      acc_hop.reset();
      std::swap(acc, acc_next);
    }
    accumulate(acc, dk_step, dv_step);
    // With its shard to the next rank, or (after the last step) home to its owner, rank r + 1.
    const bool last = s + 1 == cp;
    if (last && negative_control == NegativeControl::ring_accumulator_one_hop_short) break;
    if (cp > 1) acc_hop = comm.start_shift(acc.both.raw(), acc_next.both.raw(), acc.count(), CommDType::f32);
    if (kv_hop) {
      wait_for(*kv_hop, comm_wait_seconds);
      std::swap(current, next);
    }
  }
  if (acc_hop) {
    wait_for(*acc_hop, comm_wait_seconds);
    std::swap(acc, acc_next);
  }
  AttentionGradients g;
  g.dq = dq.to(attention.dtype);
  Tensor dk(DType::f32, kv_shape), dv(DType::f32, kv_shape);
  const std::size_t bytes = static_cast<std::size_t>(dk.numel()) * sizeof(float);
  std::memcpy(dk.raw(), acc.first().ptr, bytes);
  std::memcpy(dv.raw(), acc.second().ptr, bytes);
  g.dk = dk.to(attention.dtype);
  g.dv = dv.to(attention.dtype);
  return g;
}

}  // namespace cpattn
