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

// The kernel calls of a step: the rank's shard against the visiting one run by run (contiguous: the whole
// shard; dual_chunk_swap: the zigzag's chunk products; per_document and solver: their pieces), each on a grid
// of its own, so that a run that is not a multiple of the block shares no tile with another. Calls the band
// hides whole are skipped.
struct Piece {
  std::int64_t first = 0, count = 0;    // local rows
  std::vector<std::int32_t> pos, seg;   // [B, count]; seg empty when not packed
  std::int32_t lo = 0, hi = 0;          // the smallest and largest position
  std::int32_t seg_lo = 0, seg_hi = 0;  // the smallest and largest segment id (packed), over the batch rows

  // Whether some query of this piece may see some key of `kv`: the band reaches it and (packed) their
  // documents meet.
  bool may_see(const Piece& kv, const PositionBand& band) const {
    if (!band.sees_any(lo, hi, kv.lo, kv.hi)) return false;
    return seg.empty() || kv.seg.empty() || (seg_lo <= kv.seg_hi && kv.seg_lo <= seg_hi);
  }
  void find_segment_range() {
    if (seg.empty()) return;
    const auto [a, b] = std::minmax_element(seg.begin(), seg.end());
    seg_lo = *a;
    seg_hi = *b;
  }
};

// `positions`: the shard's positions (one row); seg_of(b, t): the segment id of local token t in row b.
template <class SegOf>
std::vector<Piece> pieces(const std::vector<std::int32_t>& positions, const std::vector<std::int64_t>& runs,
                          std::int64_t batch, bool packed, SegOf seg_of) {
  std::vector<Piece> out;
  std::int64_t first = 0;
  for (const std::int64_t n : runs) {
    Piece p;
    p.first = first;
    p.count = n;
    first += n;
    if (n == 0) continue;
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
    p.find_segment_range();
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

// into[:, first:first+n, h0:h0+nh] += piece (fp32 [B, S, H, D] views with unit strides in D, and a
// contiguous [B, n, nh, D]).
void add_rows(TensorRef into, std::int64_t first, std::int64_t h0, ConstTensorRef piece) {
  const Shape4 s = into.shape;
  const std::int64_t n = piece.shape.s, nh = piece.shape.h;
  float* dst = static_cast<float*>(into.ptr);
  const float* src = static_cast<const float*>(piece.ptr);
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t j = 0; j < n; ++j) {
      float* d = dst + into.offset(b, first + j, h0);
      const float* x = src + (b * n + j) * nh * s.d;
      for (std::int64_t i = 0; i < nh * s.d; ++i) d[i] += x[i];
    }
  }
}

// The first `rows` rows of a [B, n, H, D] buffer as a contiguous [B, rows, H, D] tensor (a call on fewer keys
// than the buffer was made for).
TensorRef compact(Tensor& t, std::int64_t rows) {
  const Shape4 s = t.shape();
  return {t.raw(), t.dtype(), {s.b, rows, s.h, s.d}, {rows * s.h * s.d, s.h * s.d, s.d, 1}};
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

// The first local row of each run of these lengths.
std::vector<std::int64_t> run_starts(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> starts;
  std::int64_t first = 0;
  for (const std::int64_t n : lengths) {
    starts.push_back(first);
    first += n;
  }
  return starts;
}

// The visiting shard's pieces (src's positions; its segment ids from the gathered row), with the negative
// control that puts its two chunks at each other's positions.
std::vector<std::int32_t> visiting_positions(const RankPositions& positions, std::int64_t src, bool swapped) {
  std::vector<std::int32_t> theirs = positions[src];
  if (swapped) {
    std::rotate(theirs.begin(), theirs.begin() + static_cast<std::ptrdiff_t>(theirs.size() / 2),
                theirs.end());
  }
  return theirs;
}

std::vector<Piece> visiting(const RankPositions& positions, std::int64_t src, const RankRuns& runs,
                            std::int64_t batch, std::int64_t seq, const std::vector<std::int32_t>& seg_full,
                            bool swapped) {
  const std::vector<std::int32_t> theirs = visiting_positions(positions, src, swapped);
  return pieces(theirs, runs[static_cast<std::size_t>(src)], batch, !seg_full.empty(),
                [&](std::int64_t b, std::int64_t t) { return seg_full[b * seq + theirs[t]]; });
}

// The direct ring's pieces of src's rows that arrived: the seen span of each run, one after another in the
// message (first: the span's first row there).
std::vector<Piece> arrived(const RankPositions& positions, const RankRuns& runs, std::int64_t src,
                           const std::vector<RowSpan>& spans, std::int64_t batch, std::int64_t seq,
                           const std::vector<std::int32_t>& seg_full, bool swapped) {
  const std::vector<std::int32_t> theirs = visiting_positions(positions, src, swapped);
  const std::vector<std::int64_t> starts = run_starts(runs[static_cast<std::size_t>(src)]);
  std::vector<Piece> out;
  std::int64_t offset = 0;
  for (std::size_t part = 0; part < spans.size(); ++part) {
    const RowSpan& span = spans[part];
    if (span.size() == 0) continue;
    Piece p;
    p.first = offset;
    p.count = span.size();
    const std::int64_t t0 = starts[part] + span.begin;
    p.lo = p.hi = theirs[t0];
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t t = t0; t < t0 + span.size(); ++t) {
        p.pos.push_back(theirs[t]);
        p.lo = std::min(p.lo, theirs[t]);
        p.hi = std::max(p.hi, theirs[t]);
        if (!seg_full.empty()) p.seg.push_back(seg_full[b * seq + theirs[t]]);
      }
    }
    p.find_segment_range();
    offset += span.size();
    out.push_back(std::move(p));
  }
  return out;
}

// A direct ring's message: rows of K and V (or of their fp32 dK and dV), [2, B, rows, H, D] in one buffer
// sized once for the step with the most rows and reused (fresh pages are slow to touch on some machines).
class Rows {
 public:
  Rows(DType dtype, std::int64_t batch, std::int64_t max_rows, std::int64_t heads, std::int64_t dim)
      : buffer_(dtype, Shape4{2 * batch, std::max<std::int64_t>(max_rows, 1), heads, dim}),
        batch_(batch),
        capacity_(max_rows),
        heads_(heads),
        dim_(dim) {}
  void set_rows(std::int64_t rows) {
    CPATTN_ASSERT(rows >= 0 && rows <= capacity_);
    rows_ = rows;
  }
  std::int64_t rows() const { return rows_; }
  std::int64_t count() const { return 2 * batch_ * rows_ * heads_ * dim_; }
  void* data() { return buffer_.raw(); }
  TensorRef half(int i) {
    const std::int64_t e = static_cast<std::int64_t>(dtype_size(buffer_.dtype()));
    return {static_cast<char*>(buffer_.raw()) + i * batch_ * rows_ * heads_ * dim_ * e,
            buffer_.dtype(),
            {batch_, rows_, heads_, dim_},
            {rows_ * heads_ * dim_, heads_ * dim_, dim_, 1}};
  }
  ConstTensorRef chalf(int i) {
    const TensorRef r = half(i);
    return {r.ptr, r.dtype, r.shape, r.stride};
  }
  void zero() { std::fill_n(static_cast<float*>(buffer_.raw()), count(), 0.0f); }

 private:
  Tensor buffer_;
  std::int64_t batch_, capacity_, heads_, dim_, rows_ = 0;
};

// Copies the spans of this rank's rows (K [B, L, H, D] and V, runs starting at local rows `starts`) into a
// message, or adds a message's fp32 dK/dV rows into the accumulator's.
void pack_rows(const Tensor& k, const Tensor& v, const std::vector<RowSpan>& spans,
               const std::vector<std::int64_t>& starts, Rows& out) {
  std::int64_t rows = 0;
  for (const RowSpan& span : spans) rows += span.size();
  out.set_rows(rows);
  const Shape4 s = k.shape();
  const std::size_t row = static_cast<std::size_t>(s.h * s.d) * dtype_size(k.dtype());
  for (int i = 0; i < 2; ++i) {
    const auto* src = static_cast<const char*>((i == 0 ? k : v).raw());
    auto* dst = static_cast<char*>(out.half(i).ptr);
    for (std::int64_t b = 0; b < s.b; ++b) {
      std::int64_t offset = 0;
      for (std::size_t part = 0; part < spans.size(); ++part) {
        const RowSpan& span = spans[part];
        if (span.size() == 0) continue;
        std::memcpy(dst + static_cast<std::size_t>(b * rows + offset) * row,
                    src + static_cast<std::size_t>(b * s.s + starts[part] + span.begin) * row,
                    static_cast<std::size_t>(span.size()) * row);
        offset += span.size();
      }
    }
  }
}

void add_spans(Pair& acc, const std::vector<RowSpan>& spans, const std::vector<std::int64_t>& starts,
               Rows& in) {
  for (int i = 0; i < 2; ++i) {
    TensorRef into = i == 0 ? acc.first_mut() : acc.second_mut();
    const TensorRef from = in.half(i);
    std::int64_t offset = 0;
    for (std::size_t part = 0; part < spans.size(); ++part) {
      const RowSpan& span = spans[part];
      if (span.size() == 0) continue;
      const std::int64_t first = starts[part] + span.begin;
      const Shape4 s = into.shape;
      float* dst = static_cast<float*>(into.ptr);
      const float* src = static_cast<const float*>(from.ptr);
      for (std::int64_t b = 0; b < s.b; ++b) {
        for (std::int64_t j = 0; j < span.size(); ++j) {
          float* d = dst + into.offset(b, first + j, 0);
          const float* x = src + from.offset(b, offset + j, 0);
          for (std::int64_t e = 0; e < s.h * s.d; ++e) d[e] += x[e];
        }
      }
      offset += span.size();
    }
  }
}

std::int64_t most_rows(const std::vector<ReachStep>& steps, std::int64_t rank, bool sent) {
  std::int64_t most = 0;
  for (const ReachStep& step : steps)
    most = std::max(most, sent ? step.rows_sent(rank) : step.rows_received(rank));
  return most;
}

// Starts a direct ring's K||V message of `step`: this rank's rows its receiver (rank + distance) sees, into
// `out`; what it sees of rank - distance's rows arrives in `in`.
std::unique_ptr<PendingShift> start_rows(const cp::RingPass& ring, const Tensor& k, const Tensor& v,
                                         const ReachStep& step, Rows& out, Rows& in) {
  const std::int64_t R = ring.comm.size(), rank = ring.comm.rank();
  pack_rows(k, v, step.seen[static_cast<std::size_t>((rank + step.distance) % R)],
            run_starts(ring.runs[static_cast<std::size_t>(rank)]), out);
  in.set_rows(step.rows_received(rank));
  return ring.comm.start_shift_v(out.data(), out.count(), in.data(), in.count(),
                                 comm_dtype(ring.attention.dtype), static_cast<int>(step.distance));
}

// The backward's passes over ring_pass_backward's step(s, K, V, pieces, dk, dv), each leaving the rank's own
// shard's dK/dV in acc. Round the ring: K/V travel again, each shard's accumulator (fp32) with them, home
// after the last step.
template <class Step>
void relay_backward(const cp::RingPass& ring, const Tensor& k, const Tensor& v,
                    const std::vector<std::int32_t>& seg_full, Pair& acc, Step& step) {
  const AttentionSpec& a = ring.attention;
  const std::int64_t B = a.batch, S = a.seq_len, R = ring.comm.size(), rank = ring.comm.rank();
  const bool swapped = ring.control == NegativeControl::ring_zigzag_swapped;
  const Shape4 kv_shape = k.shape();
  const CommDType wire = comm_dtype(a.dtype);
  Tensor dk_step(DType::f32, kv_shape), dv_step(DType::f32, kv_shape);
  Pair current = kv_pair(k, v), next(a.dtype, kv_shape), acc_next(DType::f32, kv_shape);
  std::unique_ptr<PendingShift> acc_hop;
  for (std::int64_t s = 0; s < R; ++s) {
    const std::int64_t src = (rank - s + R) % R;
    std::unique_ptr<PendingShift> kv_hop;
    if (s + 1 < R) kv_hop = ring.comm.start_shift(current.both.raw(), next.both.raw(), current.count(), wire);
    std::fill_n(dk_step.data<float>(), dk_step.numel(), 0.0f);
    std::fill_n(dv_step.data<float>(), dv_step.numel(), 0.0f);
    step(s, current.first(), current.second(),
         visiting(ring.positions, src, ring.runs, B, S, seg_full, swapped), ref(dk_step), ref(dv_step));
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
}

// Direct (ring_route): K/V rows arrive straight from the ranks whose rows this rank sees (as in the forward);
// the dK/dV of those rows go straight back, and each rank adds what comes back into its accumulator in step
// order (the order round the ring).
template <class Step>
void reach_backward(const cp::RingPass& ring, const Tensor& k, const Tensor& v,
                    const std::vector<std::int32_t>& seg_full, Pair& acc, Step& step) {
  const AttentionSpec& a = ring.attention;
  const std::int64_t B = a.batch, S = a.seq_len, D = a.head_dim, R = ring.comm.size(),
                     rank = ring.comm.rank();
  const std::vector<std::int64_t> starts = run_starts(ring.runs[static_cast<std::size_t>(rank)]);
  const std::int64_t hkv = k.shape().h;
  const bool swapped = ring.control == NegativeControl::ring_zigzag_swapped;
  Tensor dk_step(DType::f32, k.shape()), dv_step(DType::f32, k.shape());
  const std::vector<ReachStep>& steps = ring.route->steps;
  const std::int64_t most_in = most_rows(steps, rank, false), most_out = most_rows(steps, rank, true);
  Rows kv_send[2] = {{a.dtype, B, most_out, hkv, D}, {a.dtype, B, most_out, hkv, D}};
  Rows kv_recv[2] = {{a.dtype, B, most_in, hkv, D}, {a.dtype, B, most_in, hkv, D}};
  Rows part_send[2] = {{DType::f32, B, most_in, hkv, D}, {DType::f32, B, most_in, hkv, D}};
  Rows part_recv[2] = {{DType::f32, B, most_out, hkv, D}, {DType::f32, B, most_out, hkv, D}};
  auto start = [&](std::size_t j) {
    return start_rows(ring, k, v, steps[j], kv_send[j % 2], kv_recv[j % 2]);
  };
  // The dK/dV that came back for step j: what rank r + distance saw of this rank's rows.
  auto take_back = [&](std::size_t j) {
    const ReachStep& st = steps[j];
    add_spans(acc, st.seen[static_cast<std::size_t>((rank + st.distance) % R)], starts, part_recv[j % 2]);
  };
  std::unique_ptr<PendingShift> kv_hop, back;
  if (!steps.empty()) kv_hop = start(0);
  step(0, cref(k), cref(v), visiting(ring.positions, rank, ring.runs, B, S, seg_full, swapped), ref(dk_step),
       ref(dv_step));
  accumulate(acc, dk_step, dv_step);
  for (std::size_t j = 0; j < steps.size(); ++j) {
    wait_for(*kv_hop, *ring.waited);
    kv_hop.reset();
    if (j + 1 < steps.size()) kv_hop = start(j + 1);
    const ReachStep& st = steps[j];
    const std::int64_t src = (rank - st.distance + R) % R;
    Rows& partial = part_send[j % 2];
    partial.set_rows(st.rows_received(rank));
    partial.zero();
    step(st.distance, kv_recv[j % 2].chalf(0), kv_recv[j % 2].chalf(1),
         arrived(ring.positions, ring.runs, src, st.seen[static_cast<std::size_t>(rank)], B, S, seg_full,
                 swapped),
         partial.half(0), partial.half(1));
    if (back) {
      wait_for(*back, *ring.waited);
      back.reset();
      take_back(j - 1);
    }
    Rows& in = part_recv[j % 2];
    in.set_rows(st.rows_sent(rank));
    back = ring.comm.start_shift_v(partial.data(), partial.count(), in.data(), in.count(), CommDType::f32,
                                   -static_cast<int>(st.distance));
  }
  if (back) {
    wait_for(*back, *ring.waited);
    if (ring.control != NegativeControl::ring_accumulator_one_hop_short) take_back(steps.size() - 1);
  }
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
  const std::int64_t L = q.shape().s, heads = q.shape().h;
  const bool swapped = ring.control == NegativeControl::ring_zigzag_swapped;
  Running run(q.shape());
  const bool packed = !seg_local.empty();
  const auto mine = pieces(ring.positions[rank], ring.runs[static_cast<std::size_t>(rank)], B, packed,
                           [&](std::int64_t b, std::int64_t t) { return seg_local[b * L + t]; });
  // Each call's O and LSE of each of this rank's pieces: [piece][call].
  std::vector<std::vector<Tensor>> o_call(mine.size());
  std::vector<std::vector<std::vector<float>>> lse_call(mine.size());
  for (std::size_t pi = 0; pi < mine.size(); ++pi) {
    for (const KernelCall& c : ring.calls) {
      o_call[pi].emplace_back(DType::f32, Shape4{B, mine[pi].count, c.nq, D});
      lse_call[pi].emplace_back(static_cast<std::size_t>(B * c.nq * mine[pi].count));
    }
  }
  *ring.tiles = TileCounts{};
  const bool keep_steps = ring.control == NegativeControl::ring_step_lse;
  if (ring.step_lses != nullptr) ring.step_lses->clear();
  if (keep_steps)
    ring.step_lses->assign(static_cast<std::size_t>(R),
                           std::vector<float>(static_cast<std::size_t>(B * heads * L)));
  // Step s: this rank's queries against the pieces of src's K/V in (K, V), folded in.
  auto step = [&](std::int64_t s, ConstTensorRef K, ConstTensorRef V, const std::vector<Piece>& theirs) {
    for (std::size_t pi = 0; pi < mine.size(); ++pi) {
      const Piece& qp = mine[pi];
      const std::int64_t n = qp.count;
      for (const Piece& kp : theirs) {
        if (!qp.may_see(kp, band)) continue;  // every key out of every query's band or document
        const AttentionMask m = a.mask(qp.pos, kp.pos, qp.seg, kp.seg);
        for (std::size_t i = 0; i < ring.calls.size(); ++i) {
          const KernelCall& c = ring.calls[i];
          Tensor& o_i = o_call[pi][i];
          std::vector<float>& lse_i = lse_call[pi][i];
          TileCounts t;
          flash_forward(rows(cref(q), qp.first, n).heads(c.q0, c.nq),
                        rows(K, kp.first, kp.count).heads(c.kv0, c.nkv),
                        rows(V, kp.first, kp.count).heads(c.kv0, c.nkv), m, a.scale(), ring.kernel, ref(o_i),
                        lse_i.data(), &t);
          add_call_tiles(*ring.tiles, t, B, heads, c);
          run.fold(o_i, lse_i, qp.first, c.q0);
          if (keep_steps) {
            for (std::int64_t b = 0; b < B; ++b) {
              for (std::int64_t h = 0; h < c.nq; ++h) {
                std::copy_n(lse_i.begin() + (b * c.nq + h) * n, n,
                            (*ring.step_lses)[s].begin() + ((b * heads + c.q0 + h) * L + qp.first));
              }
            }
          }
        }
      }
    }
  };
  const CommDType wire = comm_dtype(a.dtype);
  if (ring.route == nullptr || !ring.route->direct) {
    // Round the ring: at step s the shard of rank src = r - s, passed on one hop per step.
    Pair current = kv_pair(k, v), next(a.dtype, k.shape());
    for (std::int64_t s = 0; s < R; ++s) {
      const std::int64_t src = (rank - s + R) % R;
      std::unique_ptr<PendingShift> hop;
      if (s + 1 < R) hop = ring.comm.start_shift(current.both.raw(), next.both.raw(), current.count(), wire);
      step(s, current.first(), current.second(),
           visiting(ring.positions, src, ring.runs, B, S, seg_full, swapped));
      if (hop) {
        wait_for(*hop, *ring.waited);
        std::swap(current, next);
      }
    }
    return std::move(run).finish(a.dtype, ring.sinks);
  }
  // Direct: only the steps some rank's queries reach, each rank's rows straight to the ranks that see them.
  const std::vector<ReachStep>& steps = ring.route->steps;
  const std::int64_t hkv = k.shape().h, most_in = most_rows(steps, rank, false),
                     most_out = most_rows(steps, rank, true);
  Rows send[2] = {{a.dtype, B, most_out, hkv, D}, {a.dtype, B, most_out, hkv, D}};
  Rows recv[2] = {{a.dtype, B, most_in, hkv, D}, {a.dtype, B, most_in, hkv, D}};
  auto start = [&](std::size_t j) { return start_rows(ring, k, v, steps[j], send[j % 2], recv[j % 2]); };
  std::unique_ptr<PendingShift> hop;
  if (!steps.empty()) hop = start(0);
  step(0, cref(k), cref(v), visiting(ring.positions, rank, ring.runs, B, S, seg_full, swapped));
  for (std::size_t j = 0; j < steps.size(); ++j) {
    wait_for(*hop, *ring.waited);
    hop.reset();
    if (j + 1 < steps.size()) hop = start(j + 1);
    const std::int64_t src = (rank - steps[j].distance + R) % R;
    step(steps[j].distance, recv[j % 2].chalf(0), recv[j % 2].chalf(1),
         arrived(ring.positions, ring.runs, src, steps[j].seen[static_cast<std::size_t>(rank)], B, S,
                 seg_full, swapped));
  }
  return std::move(run).finish(a.dtype, ring.sinks);
}

RingGradients ring_pass_backward(const RingPass& ring, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& o, const std::vector<float>& lse_in, const Tensor& d_out,
                                 const std::vector<std::int32_t>& seg_local,
                                 const std::vector<std::int32_t>& seg_full) {
  const AttentionSpec& a = ring.attention;
  const PositionBand band = a.band();
  const std::int64_t B = a.batch, D = a.head_dim, rank = ring.comm.rank();
  const std::int64_t L = q.shape().s, heads = q.shape().h;
  const Shape4 kv_shape = k.shape();
  // The dK/dV accumulator of the shard this rank holds.
  Pair acc(DType::f32, kv_shape);
  Tensor dq(DType::f32, q.shape());
  // Each call's gradients of one kernel call, sized for the longest run of any ring rank.
  std::int64_t longest = 0;
  for (const auto& lengths : ring.runs) {
    for (const std::int64_t n : lengths) longest = std::max(longest, n);
  }
  std::vector<Tensor> dq_call, dk_call, dv_call;
  for (const KernelCall& c : ring.calls) {
    dq_call.emplace_back(DType::f32, Shape4{B, longest, c.nq, D});
    dk_call.emplace_back(DType::f32, Shape4{B, longest, c.nkv, D});
    dv_call.emplace_back(DType::f32, Shape4{B, longest, c.nkv, D});
  }
  const auto mine =
      pieces(ring.positions[rank], ring.runs[static_cast<std::size_t>(rank)], B, !seg_local.empty(),
             [&](std::int64_t b, std::int64_t t) { return seg_local[b * L + t]; });
  // Step s: dQ of this rank's rows, and the step's dK/dV of src's pieces in (K, V) added into (dk, dv) at
  // the pieces' rows.
  auto step = [&](std::int64_t s, ConstTensorRef K, ConstTensorRef V, const std::vector<Piece>& theirs,
                  TensorRef dk, TensorRef dv) {
    // Every step uses the final O and LSE.
    const std::vector<float>& lse =
        ring.control == NegativeControl::ring_step_lse ? (*ring.step_lses)[s] : lse_in;
    for (const Piece& qp : mine) {
      const std::int64_t n = qp.count;
      std::vector<std::vector<float>> lse_piece;
      for (const KernelCall& c : ring.calls)
        lse_piece.push_back(lse_rows(lse, B, heads, L, qp.first, n, c.q0, c.nq));
      for (const Piece& kp : theirs) {
        if (!qp.may_see(kp, band)) continue;
        const AttentionMask m = a.mask(qp.pos, kp.pos, qp.seg, kp.seg);
        for (std::size_t i = 0; i < ring.calls.size(); ++i) {
          const KernelCall& c = ring.calls[i];
          const TensorRef dq_i = compact(dq_call[i], n);
          const TensorRef dk_i = compact(dk_call[i], kp.count), dv_i = compact(dv_call[i], kp.count);
          flash_backward(
              rows(cref(q), qp.first, n).heads(c.q0, c.nq), rows(K, kp.first, kp.count).heads(c.kv0, c.nkv),
              rows(V, kp.first, kp.count).heads(c.kv0, c.nkv), rows(cref(o), qp.first, n).heads(c.q0, c.nq),
              lse_piece[i].data(), rows(cref(d_out), qp.first, n).heads(c.q0, c.nq), m, a.scale(),
              ring.kernel, dq_i, dk_i, dv_i);
          add_rows(ref(dq), qp.first, c.q0, {dq_i.ptr, dq_i.dtype, dq_i.shape, dq_i.stride});
          add_rows(dk, kp.first, c.kv0, {dk_i.ptr, dk_i.dtype, dk_i.shape, dk_i.stride});
          add_rows(dv, kp.first, c.kv0, {dv_i.ptr, dv_i.dtype, dv_i.shape, dv_i.stride});
        }
      }
    }
  };
  auto result = [&]() {
    RingGradients g{std::move(dq), Tensor(DType::f32, kv_shape), Tensor(DType::f32, kv_shape)};
    const std::size_t bytes = static_cast<std::size_t>(g.dk.numel()) * sizeof(float);
    std::memcpy(g.dk.raw(), acc.first().ptr, bytes);
    std::memcpy(g.dv.raw(), acc.second().ptr, bytes);
    return g;
  };
  if (ring.route != nullptr && ring.route->direct) {
    reach_backward(ring, k, v, seg_full, acc, step);
  } else {
    relay_backward(ring, k, v, seg_full, acc, step);
  }
  return result();
}

}  // namespace cp

cp::RingPass ContextParallelAttention::Impl::ring_pass(Communicator& ring, const RankPositions& at,
                                                       const RankRuns& at_runs, const RingRoute& moves,
                                                       std::vector<cp::KernelCall> calls) {
  return {ring,
          at,
          at_runs,
          std::move(calls),
          attention,
          kernel_config(),
          negative_control,
          &comm_wait_seconds,
          &tiles,
          &step_lses,
          {},
          &moves};
}

AttentionOutput ContextParallelAttention::Impl::ring_forward(const Tensor& q, const Tensor& k,
                                                             const Tensor& v, bool forward_only) {
  std::vector<std::int32_t> seg_full = row_segments;  // gathered before the schedule (Impl::forward)
  cp::RingPass pass = ring_pass(comm, ring_positions, ring_runs, *route, {{0, hq, 0, hkv}});
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
    s.route = route;
    saved = std::make_unique<cp::RingSaved>(std::move(s));
  }
  return out;
}

AttentionGradients ContextParallelAttention::Impl::ring_backward(const Tensor& d_out) {
  const cp::RingSaved& s = saved_as<cp::RingSaved>();
  const cp::RingPass pass = ring_pass(comm, ring_positions, ring_runs, *s.route, {{0, hq, 0, hkv}});
  cp::RingGradients g =
      cp::ring_pass_backward(pass, s.q, s.k, s.v, s.o, s.lse, d_out, s.seg_local, s.seg_full);
  AttentionGradients out{g.dq.to(attention.dtype), g.dk.to(attention.dtype), g.dv.to(attention.dtype), {}};
  if (!s.sinks.empty()) out.dsinks = cp::sink_parts(s.sinks, 0, s.o, s.lse, d_out);  // this rank's rows
  return out;
}

}  // namespace cpattn
