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

void copy_into(const Tensor& from, const TensorRef& to) {
  const std::size_t bytes = static_cast<std::size_t>(from.numel()) * dtype_size(from.dtype());
  std::memcpy(to.ptr, from.raw(), bytes);
}

// The running softmax state of every row (b, h, i) of O [B, Sq, H, D] and LSE [B, H, Sq], in fp32.
struct Running {
  std::vector<float> m, l;  // [B, H, Sq]
  Tensor o;                 // [B, Sq, H, D] fp32, unnormalised

  explicit Running(const Shape4& s)
      : m(static_cast<std::size_t>(s.b * s.h * s.s), -std::numeric_limits<float>::infinity()),
        l(m.size(), 0.0f),
        o(DType::f32, s) {}

  // Folds one step's normalised (O_s, LSE_s): rows with LSE_s = -inf saw no key and change nothing.
  void fold(const Tensor& o_step, const std::vector<float>& lse_step) {
    const Shape4 s = o.shape();
    const float* src = o_step.data<float>();
    float* dst = o.data<float>();
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t h = 0; h < s.h; ++h) {
        for (std::int64_t i = 0; i < s.s; ++i) {
          const std::size_t row = static_cast<std::size_t>((b * s.h + h) * s.s + i);
          const float x = lse_step[row];
          if (x == -std::numeric_limits<float>::infinity()) continue;
          const float m_new = std::max(m[row], x);
          const float keep = std::exp(m[row] - m_new), add = std::exp(x - m_new);
          m[row] = m_new;
          l[row] = l[row] * keep + add;
          const std::int64_t off = ((b * s.s + i) * s.h + h) * s.d;
          for (std::int64_t d = 0; d < s.d; ++d) dst[off + d] = dst[off + d] * keep + src[off + d] * add;
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

// A ring step's mask metadata: this rank's queries against the shard of rank src.
struct StepMask {
  std::vector<std::int32_t> q_pos, kv_pos, kv_seg;
};

// swapped: the negative control that puts the visiting shard's two chunks at each other's positions.
StepMask step_mask(const RankPositions& positions, std::int64_t rank, std::int64_t src, std::int64_t batch,
                   std::int64_t seq, const std::vector<std::int32_t>& seg_full, bool swapped) {
  StepMask m;
  const auto& mine = positions[rank];
  std::vector<std::int32_t> theirs = positions[src];
  if (swapped)
    std::rotate(theirs.begin(), theirs.begin() + static_cast<std::ptrdiff_t>(theirs.size() / 2),
                theirs.end());
  for (std::int64_t b = 0; b < batch; ++b) {
    m.q_pos.insert(m.q_pos.end(), mine.begin(), mine.end());
    m.kv_pos.insert(m.kv_pos.end(), theirs.begin(), theirs.end());
    if (!seg_full.empty()) {
      for (std::int32_t p : theirs) m.kv_seg.push_back(seg_full[b * seq + p]);
    }
  }
  return m;
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

AttentionOutput ContextParallelAttention::Impl::ring_forward(const Tensor& q, const Tensor& k,
                                                             const Tensor& v, bool forward_only) {
  const std::int64_t B = attention.batch, S = attention.seq_len;
  std::vector<std::int32_t> seg_full;
  if (!seg_local.empty()) seg_full = cp::all_gather_segments(comm, seg_local, B, positions);

  Pair current(attention.dtype, k.shape()), next(attention.dtype, k.shape());
  copy_into(k, current.first_mut());
  copy_into(v, current.second_mut());
  Running run(q.shape());
  Tensor o_step(DType::f32, q.shape());
  std::vector<float> lse_step(static_cast<std::size_t>(B * hq * local_seq));
  tiles = TileCounts{};
  step_lses.clear();
  for (std::int64_t s = 0; s < cp; ++s) {
    const std::int64_t src = (rank - s + cp) % cp;
    std::unique_ptr<PendingShift> hop;
    if (s + 1 < cp)
      hop =
          comm.start_shift(current.both.raw(), next.both.raw(), current.count(), comm_dtype(attention.dtype));
    const StepMask sm = step_mask(positions, rank, src, B, S, seg_full,
                                  negative_control == NegativeControl::ring_zigzag_swapped);
    TileCounts t;
    flash_forward(cref(q), current.first(), current.second(), mask(sm.q_pos, sm.kv_pos, seg_local, sm.kv_seg),
                  attention.scale(), kernel_config(), ref(o_step), lse_step.data(), &t);
    add_tiles(tiles, t);
    run.fold(o_step, lse_step);
    if (negative_control == NegativeControl::ring_step_lse) step_lses.push_back(lse_step);
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
  Pair current(attention.dtype, kv_shape), next(attention.dtype, kv_shape);
  copy_into(sv.k, current.first_mut());
  copy_into(sv.v, current.second_mut());
  // The dK/dV accumulator of the shard this rank holds, and the one arriving with the next shard.
  Pair acc(DType::f32, kv_shape), acc_next(DType::f32, kv_shape);
  Tensor dq(DType::f32, sv.q.shape()), dq_step(DType::f32, sv.q.shape());
  Tensor dk_step(DType::f32, kv_shape), dv_step(DType::f32, kv_shape);
  std::unique_ptr<PendingShift> acc_hop;
  for (std::int64_t s = 0; s < cp; ++s) {
    const std::int64_t src = (rank - s + cp) % cp;
    std::unique_ptr<PendingShift> kv_hop;
    if (s + 1 < cp)
      kv_hop =
          comm.start_shift(current.both.raw(), next.both.raw(), current.count(), comm_dtype(attention.dtype));
    const StepMask sm = step_mask(positions, rank, src, B, S, sv.seg_full,
                                  negative_control == NegativeControl::ring_zigzag_swapped);
    // Every step uses the final O and LSE.
    const float* lse =
        negative_control == NegativeControl::ring_step_lse ? step_lses[s].data() : sv.lse.data();
    flash_backward(cref(sv.q), current.first(), current.second(), cref(sv.o), lse, cref(d_out),
                   mask(sm.q_pos, sm.kv_pos, sv.seg_local, sm.kv_seg), attention.scale(), kernel_config(),
                   ref(dq_step), ref(dk_step), ref(dv_step));
    float* q_acc = dq.data<float>();
    const float* q_add = dq_step.data<float>();
    for (std::int64_t i = 0; i < dq.numel(); ++i) q_acc[i] += q_add[i];
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
