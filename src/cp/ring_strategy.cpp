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
#include "ring_pass.hpp"

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

// The running softmax state of every row (b, h, i) of O [B, Sq, H, D] and LSE [B, H, Sq], in fp32.
struct Running {
  std::vector<float> m, l;  // [B, H, Sq]
  Tensor o;                 // [B, Sq, H, D] fp32, unnormalised

  explicit Running(const Shape4& s)
      : m(static_cast<std::size_t>(s.b * s.h * s.s), -std::numeric_limits<float>::infinity()),
        l(m.size(), 0.0f),
        o(DType::f32, s) {}

  // Folds one call's normalised (O_c, LSE_c) of rows [row0, row0 + n) and heads [h0, h0 + nh) (o_call
  // [B, n, nh, D], lse_call [B, nh, n]): rows with LSE_c = -inf saw no key and change nothing.
  void fold(const Tensor& o_call, const std::vector<float>& lse_call, std::int64_t row0, std::int64_t h0) {
    const Shape4 s = o.shape();
    const std::int64_t n = o_call.shape().s, nh = o_call.shape().h;
    const float* src = o_call.data<float>();
    float* dst = o.data<float>();
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t c = 0; c < nh; ++c) {
        const std::int64_t h = h0 + c;
        for (std::int64_t j = 0; j < n; ++j) {
          const std::int64_t i = row0 + j;
          const std::size_t row = static_cast<std::size_t>((b * s.h + h) * s.s + i);
          const float x = lse_call[static_cast<std::size_t>((b * nh + c) * n + j)];
          if (x == -std::numeric_limits<float>::infinity()) continue;
          const float m_new = std::max(m[row], x);
          const float keep = std::exp(m[row] - m_new), add = std::exp(x - m_new);
          m[row] = m_new;
          l[row] = l[row] * keep + add;
          const std::int64_t off = ((b * s.s + i) * s.h + h) * s.d, from = ((b * n + j) * nh + c) * s.d;
          for (std::int64_t d = 0; d < s.d; ++d) dst[off + d] = dst[off + d] * keep + src[from + d] * add;
        }
      }
    }
  }

  // O = O / l in `dtype`, LSE = m + log l; rows that saw no key: O = 0, LSE = -inf (as the kernel gives).
  // With sinks ([H]) each row's sink is folded in as the kernels fold it (sinks.hpp): LSE' = log(e^LSE +
  // e^sink), O scaled by e^(LSE - LSE'). Normalises in place (fresh pages are slow to touch on some machines:
  // no second buffer).
  AttentionOutput finish(DType dtype, std::span<const float> sinks) && {
    const Shape4 s = o.shape();
    std::vector<float> lse(m.size());
    float* x = o.data<float>();
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t h = 0; h < s.h; ++h) {
        for (std::int64_t i = 0; i < s.s; ++i) {
          const std::size_t row = static_cast<std::size_t>((b * s.h + h) * s.s + i);
          const bool none = l[row] == 0.0f;
          lse[row] = none ? -std::numeric_limits<float>::infinity() : m[row] + std::log(l[row]);
          float inv = none ? 0.0f : 1.0f / l[row];
          if (!sinks.empty() &&
              sinks[static_cast<std::size_t>(h)] != -std::numeric_limits<float>::infinity()) {
            const double keys = lse[row], sink = sinks[static_cast<std::size_t>(h)];
            const double hi = std::max(keys, sink);
            const double both = hi + std::log(std::exp(keys - hi) + std::exp(sink - hi));
            inv = none ? 0.0f : static_cast<float>(std::exp(keys - both)) / l[row];
            lse[row] = static_cast<float>(both);
          }
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

// into[:, first:first+n, h0:h0+nh] += piece (fp32 [B, S, H, D] and [B, n, nh, D]).
void add_rows(Tensor& into, std::int64_t first, std::int64_t h0, const Tensor& piece) {
  const Shape4 s = into.shape();
  const std::int64_t n = piece.shape().s, nh = piece.shape().h;
  float* dst = into.data<float>();
  const float* src = piece.data<float>();
  if (nh == s.h) {  // whole rows: one run per batch row
    const std::int64_t row = s.h * s.d;
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t i = 0; i < n * row; ++i) dst[(b * s.s + first) * row + i] += src[b * n * row + i];
    }
    return;
  }
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t j = 0; j < n; ++j) {
      float* d = dst + ((b * s.s + first + j) * s.h + h0) * s.d;
      const float* x = src + (b * n + j) * nh * s.d;
      for (std::int64_t i = 0; i < nh * s.d; ++i) d[i] += x[i];
    }
  }
}

// lse [B, H, S] rows [first, first + n) of heads [h0, h0 + nh) -> [B, nh, n].
std::vector<float> lse_rows(const std::vector<float>& lse, std::int64_t batch, std::int64_t heads,
                            std::int64_t seq, std::int64_t first, std::int64_t n, std::int64_t h0,
                            std::int64_t nh) {
  std::vector<float> out(static_cast<std::size_t>(batch * nh * n));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t c = 0; c < nh; ++c) {
      std::copy_n(lse.begin() + ((b * heads + h0 + c) * seq + first), n, out.begin() + (b * nh + c) * n);
    }
  }
  return out;
}

// Waits for a shift, adding the time spent to `waited`.
void wait_for(PendingShift& shift, double& waited) {
  const auto t0 = std::chrono::steady_clock::now();
  shift.wait();
  waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

namespace cp {

AttentionOutput ring_pass_forward(const RingPass& ring, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const std::vector<std::int32_t>& seg_local,
                                  const std::vector<std::int32_t>& seg_full) {
  const AttentionSpec& a = ring.attention;
  const PositionBand band = a.band();
  const std::int64_t B = a.batch, S = a.seq_len, D = a.head_dim;
  const std::int64_t R = ring.comm.size(), rank = ring.comm.rank();
  const std::int64_t L = q.shape().s, heads = q.shape().h, n = L / ring.parts;
  Pair current = kv_pair(k, v), next(a.dtype, k.shape());
  Running run(q.shape());
  std::vector<Tensor> o_call;
  std::vector<std::vector<float>> lse_call;
  for (const KernelCall& c : ring.calls) {
    o_call.emplace_back(DType::f32, Shape4{B, n, c.nq, D});
    lse_call.emplace_back(static_cast<std::size_t>(B * c.nq * n));
  }
  const bool packed = !seg_local.empty();
  const auto mine = pieces(ring.positions[rank], ring.parts, B, packed,
                           [&](std::int64_t b, std::int64_t t) { return seg_local[b * L + t]; });
  *ring.tiles = TileCounts{};
  if (ring.step_lses != nullptr) ring.step_lses->clear();
  const bool keep_steps = ring.control == NegativeControl::ring_step_lse;
  for (std::int64_t s = 0; s < R; ++s) {
    const std::int64_t src = (rank - s + R) % R;
    std::unique_ptr<PendingShift> hop;
    if (s + 1 < R)
      hop = ring.comm.start_shift(current.both.raw(), next.both.raw(), current.count(), comm_dtype(a.dtype));
    const auto theirs = visiting(ring.positions, src, ring.parts, B, S, seg_full,
                                 ring.control == NegativeControl::ring_zigzag_swapped);
    if (keep_steps) ring.step_lses->emplace_back(static_cast<std::size_t>(B * heads * L));
    for (const Piece& qp : mine) {
      for (const Piece& kp : theirs) {
        if (!band.sees_any(qp.lo, qp.hi, kp.lo, kp.hi)) continue;  // every key out of every query's band
        const AttentionMask m = a.mask(qp.pos, kp.pos, qp.seg, kp.seg);
        for (std::size_t i = 0; i < ring.calls.size(); ++i) {
          const KernelCall& c = ring.calls[i];
          TileCounts t;
          flash_forward(rows(cref(q), qp.first, n).heads(c.q0, c.nq),
                        rows(current.first(), kp.first, n).heads(c.kv0, c.nkv),
                        rows(current.second(), kp.first, n).heads(c.kv0, c.nkv), m, a.scale(), ring.kernel,
                        ref(o_call[i]), lse_call[i].data(), &t);
          add_call_tiles(*ring.tiles, t, B, heads, c);
          run.fold(o_call[i], lse_call[i], qp.first, c.q0);
          if (keep_steps) {
            for (std::int64_t b = 0; b < B; ++b) {
              for (std::int64_t h = 0; h < c.nq; ++h) {
                std::copy_n(lse_call[i].begin() + (b * c.nq + h) * n, n,
                            ring.step_lses->back().begin() + ((b * heads + c.q0 + h) * L + qp.first));
              }
            }
          }
        }
      }
    }
    if (hop) {
      wait_for(*hop, *ring.waited);
      std::swap(current, next);
    }
  }
  return std::move(run).finish(a.dtype, ring.sinks);
}

RingGradients ring_pass_backward(const RingPass& ring, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& o, const std::vector<float>& lse_in, const Tensor& d_out,
                                 const std::vector<std::int32_t>& seg_local,
                                 const std::vector<std::int32_t>& seg_full) {
  const AttentionSpec& a = ring.attention;
  const PositionBand band = a.band();
  const std::int64_t B = a.batch, S = a.seq_len, D = a.head_dim;
  const std::int64_t R = ring.comm.size(), rank = ring.comm.rank();
  const std::int64_t L = q.shape().s, heads = q.shape().h, n = L / ring.parts;
  const Shape4 kv_shape = k.shape();
  Pair current = kv_pair(k, v), next(a.dtype, kv_shape);
  // The dK/dV accumulator of the shard this rank holds, and the one arriving with the next shard.
  Pair acc(DType::f32, kv_shape), acc_next(DType::f32, kv_shape);
  Tensor dq(DType::f32, q.shape());
  std::vector<Tensor> dq_call, dk_call, dv_call;
  for (const KernelCall& c : ring.calls) {
    dq_call.emplace_back(DType::f32, Shape4{B, n, c.nq, D});
    dk_call.emplace_back(DType::f32, Shape4{B, n, c.nkv, D});
    dv_call.emplace_back(DType::f32, Shape4{B, n, c.nkv, D});
  }
  Tensor dk_step(DType::f32, kv_shape), dv_step(DType::f32, kv_shape);
  const auto mine = pieces(ring.positions[rank], ring.parts, B, !seg_local.empty(),
                           [&](std::int64_t b, std::int64_t t) { return seg_local[b * L + t]; });
  std::unique_ptr<PendingShift> acc_hop;
  for (std::int64_t s = 0; s < R; ++s) {
    const std::int64_t src = (rank - s + R) % R;
    std::unique_ptr<PendingShift> kv_hop;
    if (s + 1 < R)
      kv_hop =
          ring.comm.start_shift(current.both.raw(), next.both.raw(), current.count(), comm_dtype(a.dtype));
    const auto theirs = visiting(ring.positions, src, ring.parts, B, S, seg_full,
                                 ring.control == NegativeControl::ring_zigzag_swapped);
    // Every step uses the final O and LSE.
    const std::vector<float>& lse =
        ring.control == NegativeControl::ring_step_lse ? (*ring.step_lses)[s] : lse_in;
    std::fill_n(dk_step.data<float>(), dk_step.numel(), 0.0f);
    std::fill_n(dv_step.data<float>(), dv_step.numel(), 0.0f);
    for (const Piece& qp : mine) {
      std::vector<std::vector<float>> lse_piece;
      for (const KernelCall& c : ring.calls)
        lse_piece.push_back(lse_rows(lse, B, heads, L, qp.first, n, c.q0, c.nq));
      for (const Piece& kp : theirs) {
        if (!band.sees_any(qp.lo, qp.hi, kp.lo, kp.hi)) continue;
        const AttentionMask m = a.mask(qp.pos, kp.pos, qp.seg, kp.seg);
        for (std::size_t i = 0; i < ring.calls.size(); ++i) {
          const KernelCall& c = ring.calls[i];
          flash_backward(rows(cref(q), qp.first, n).heads(c.q0, c.nq),
                         rows(current.first(), kp.first, n).heads(c.kv0, c.nkv),
                         rows(current.second(), kp.first, n).heads(c.kv0, c.nkv),
                         rows(cref(o), qp.first, n).heads(c.q0, c.nq), lse_piece[i].data(),
                         rows(cref(d_out), qp.first, n).heads(c.q0, c.nq), m, a.scale(), ring.kernel,
                         ref(dq_call[i]), ref(dk_call[i]), ref(dv_call[i]));
          add_rows(dq, qp.first, c.q0, dq_call[i]);
          add_rows(dk_step, kp.first, c.kv0, dk_call[i]);
          add_rows(dv_step, kp.first, c.kv0, dv_call[i]);
        }
      }
    }
    if (acc_hop) {
      wait_for(*acc_hop, *ring.waited);  // src's accumulator, from the ranks before this one
      acc_hop.reset();
      std::swap(acc, acc_next);
    }
    accumulate(acc, dk_step, dv_step);
    // With its shard to the next rank, or (after the last step) home to its owner, rank r + 1.
    const bool last = s + 1 == R;
    if (last && ring.control == NegativeControl::ring_accumulator_one_hop_short) break;
    if (R > 1)
      acc_hop = ring.comm.start_shift(acc.both.raw(), acc_next.both.raw(), acc.count(), CommDType::f32);
    if (kv_hop) {
      wait_for(*kv_hop, *ring.waited);
      std::swap(current, next);
    }
  }
  if (acc_hop) {
    wait_for(*acc_hop, *ring.waited);
    std::swap(acc, acc_next);
  }
  RingGradients g{std::move(dq), Tensor(DType::f32, kv_shape), Tensor(DType::f32, kv_shape)};
  const std::size_t bytes = static_cast<std::size_t>(g.dk.numel()) * sizeof(float);
  std::memcpy(g.dk.raw(), acc.first().ptr, bytes);
  std::memcpy(g.dv.raw(), acc.second().ptr, bytes);
  return g;
}

}  // namespace cp

cp::RingPass ContextParallelAttention::Impl::ring_pass(Communicator& ring, const RankPositions& at,
                                                       std::int64_t parts,
                                                       std::vector<cp::KernelCall> calls) {
  return {ring,
          at,
          parts,
          std::move(calls),
          attention,
          kernel_config(),
          negative_control,
          &comm_wait_seconds,
          &tiles,
          &step_lses};
}

AttentionOutput ContextParallelAttention::Impl::ring_forward(const Tensor& q, const Tensor& k,
                                                             const Tensor& v, bool forward_only) {
  std::vector<std::int32_t> seg_full;
  if (!seg_local.empty()) seg_full = cp::all_gather_segments(comm, seg_local, attention.batch, positions);
  cp::RingPass pass = ring_pass(comm, positions, parallel.ring_parts(), {{0, hq, 0, hkv}});
  pass.sinks = sinks_local;
  AttentionOutput out = cp::ring_pass_forward(pass, q, k, v, seg_local, seg_full);
  if (!forward_only) {
    cp::RingSaved s(Strategy::ring);
    s.q = q;
    s.k = k;
    s.v = v;
    s.o = out.o;
    s.lse = out.lse;
    s.seg_local = seg_local;
    s.seg_full = std::move(seg_full);
    saved = std::make_unique<cp::RingSaved>(std::move(s));
  }
  return out;
}

AttentionGradients ContextParallelAttention::Impl::ring_backward(const Tensor& d_out) {
  const cp::RingSaved& s = saved_as<cp::RingSaved>();
  const cp::RingPass pass = ring_pass(comm, positions, parallel.ring_parts(), {{0, hq, 0, hkv}});
  cp::RingGradients g =
      cp::ring_pass_backward(pass, s.q, s.k, s.v, s.o, s.lse, d_out, s.seg_local, s.seg_full);
  AttentionGradients out{g.dq.to(attention.dtype), g.dk.to(attention.dtype), g.dv.to(attention.dtype), {}};
  if (!s.sinks.empty()) out.dsinks = cp::sink_parts(s.sinks, 0, s.o, s.lse, d_out);  // this rank's rows
  return out;
}

}  // namespace cpattn
