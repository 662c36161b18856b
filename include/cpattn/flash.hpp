// Flash attention on the CPU: what each rank runs locally. Online softmax over a fixed grid of kv blocks,
// GQA without materializing repeated K/V, causal and packed-segment masks from token metadata (mask.hpp),
// fp32 and bf16 inputs with fp32 accumulation. The kernels know nothing of ranks.
//
// Determinism (docs/design.md "Invariants"): the forward O and LSE of a query row, and its dQ, depend only on
// that row, the keys it may see and their positions, never on which rows share its block, the thread count or
// where it sits in a shard. The kv grid starts at kv index 0 with a fixed block size; tail rows and keys are
// padded with zeros and run the same vector code; masks are applied by selection; fully masked tiles are
// exact no-ops.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpattn/mask.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn {

// A strided, dtype-tagged view of a Tensor (the last axis must be contiguous): the one view type. Lets a
// strategy hand the kernel a head slice of a larger tensor without copying.
template <class Ptr>
struct BasicTensorRef {
  Ptr ptr = nullptr;
  DType dtype = DType::f32;
  Shape4 shape;
  std::array<std::int64_t, 4> stride{};  // in elements

  std::int64_t offset(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return b * stride[0] + s * stride[1] + h * stride[2];
  }
  // Heads [h0, h0 + count) of the same tensor, no copy; a range outside it is an internal error, not a
  // read past its end.
  BasicTensorRef heads(std::int64_t h0, std::int64_t count) const {
    CPATTN_ASSERT(h0 >= 0 && count >= 0 && h0 + count <= shape.h);
    BasicTensorRef r = *this;
    r.ptr = static_cast<Ptr>(
        static_cast<std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char*, char*>>(
            ptr) +
        h0 * stride[2] * static_cast<std::int64_t>(dtype_size(dtype)));
    r.shape.h = count;
    return r;
  }
};
using TensorRef = BasicTensorRef<void*>;
using ConstTensorRef = BasicTensorRef<const void*>;

inline TensorRef ref(Tensor& t) {
  const Shape4 s = t.shape();
  return {t.raw(), t.dtype(), s, {s.s * s.h * s.d, s.h * s.d, s.d, 1}};
}
inline ConstTensorRef cref(const Tensor& t) {
  const Shape4 s = t.shape();
  return {t.raw(), t.dtype(), s, {s.s * s.h * s.d, s.h * s.d, s.d, 1}};
}

struct FlashConfig {
  int threads = 1;
  std::int64_t block_q = 64;   // Bq: a multiple of 4
  std::int64_t block_kv = 64;  // Bk: a multiple of 64
  // Backward with GQA: the most memory the per-q-head fp64 dK/dV partials may take; the kv blocks are walked
  // in stripes that fit. Results do not depend on it (each kv block's sums are the same in any stripe).
  double backward_partial_bytes = 64.0 * 1024 * 1024;
  // bf16 forward and backward on AMX tiles where the CPU has them (src/kernels/flash_bf16.hpp); off: the next
  // path of flash_bf16_path.
  bool allow_amx = true;
  // bf16 products with AVX512-BF16 dot products where the CPU has them and AMX is not used; off: the vector
  // path (bf16 converted to fp32).
  bool allow_avx512_bf16 = true;
};

// The paths bf16 inputs can take: products on AMX tiles, products with AVX512-BF16 dot products (both round P
// and dS to bf16 and accumulate in fp32), or the vector path (bf16 converted to fp32, every product in fp32).
enum class Bf16Path { amx, avx512_bf16, vector };
const char* to_string(Bf16Path path);

// The path bf16 inputs take under this config on this CPU: AMX where allowed and usable, else AVX512-BF16
// where allowed and present, else the vector path. Whatever this says, a forward whose V holds NaN or Inf,
// and a backward with any non-finite input, take the vector path (a product cannot skip a masked pair's 0 *
// Inf; NaN or Inf in Q or K reach only the scores, which the mask replaces by selection).
Bf16Path flash_bf16_path(const FlashConfig& config);

// Tiles the kernel computed, counted on its own (Bq, Bk) grid. For one causal document of S tokens at
// positions 0..S-1, q block a (rows [a*Bq, min((a+1)*Bq, S))) computes kv blocks 0..floor((min((a+1)*Bq, S) -
// 1) / Bk), so the count per head is sum_a (floor((min((a+1)*Bq, S) - 1) / Bk) + 1); with Bq = Bk and S = T*B
// that is T(T+1)/2. Non-causal: ceil(S/Bq) * ceil(S/Bk). Segments can only remove tiles.
struct TileCounts {
  std::vector<std::int64_t> per_head;  // [B * Hq]: tiles computed for (batch row, q head)
  std::int64_t full = 0;               // computed without mask arithmetic
  std::int64_t partial = 0;            // computed with the mask applied by selection
  std::int64_t total() const { return full + partial; }
};

// q: [B, Sq, Hq, D]; k, v: [B, Skv, Hkv, D]; o: [B, Sq, Hq, D] (q's dtype); lse: [B, Hq, Sq] fp32 natural
// log, or nullptr when not needed. Rows that see no key get O = 0 and LSE = -inf. The kernel keeps no state:
// forward-only use simply skips the backward.
void flash_forward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                   const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& o,
                   float* lse, TileCounts* tiles = nullptr);

// Whether flash_forward runs on AMX tiles for inputs of this dtype under this config (bf16, allow_amx, and a
// CPU with AMX-BF16 whose kernel grants the tile state); otherwise it runs the vector path.
bool flash_uses_amx(DType dtype, const FlashConfig& config);

// The vector path is compiled for several SIMD targets when the library is built for a generic CPU
// (CPATTN_MARCH empty: SSSE3, SSE4, AVX2, AVX3 and a portable scalar one, Highway's names) and for the build
// machine's own when it is built with -march=native (the default); the best target this CPU supports is
// chosen at run time, or the one named by the environment variable CPATTN_SIMD_TARGET (read before the first
// kernel runs; an unknown name is an Error(invalid_config) listing the valid ones).
// flash_vector_targets(): the compiled targets this CPU supports, best first; flash_vector_target(): the one
// the kernels use now.
std::vector<std::string> flash_vector_targets();
std::string flash_vector_target();
// Restricts the kernels to one of flash_vector_targets() ("" lifts the restriction): for tests and
// comparisons. Process-wide; not to be called while a kernel runs. Throws Error(invalid_input) naming the
// valid targets for any other name.
void flash_force_vector_target(const std::string& name);

// The CPU time the calling thread's flash_forward and flash_backward calls have taken since it began, their
// worker threads' included (seconds): what a rank's kernels cost where ranks share cores and wall time counts
// the others' turns.
double flash_cpu_seconds();

// The kernels pack their operands and keep their accumulators in scratch blocks; a freed block of 2 MiB or
// more is kept (up to 1 GiB in all, or an eighth of the machine's memory where that is less) for the next
// call that needs one of its size, so that calls of one shape do not take fresh pages each time.
// flash_kept_scratch_bytes(): what is kept now; flash_release_scratch(): frees it.
std::size_t flash_kept_scratch_bytes();
void flash_release_scratch();

// FA2 backward: P recomputed from LSE, D_i = rowsum(dO * O). dq: q's shape; dk, dv: k's shape, in the inputs'
// dtype or fp32 (a bf16 backward can hand fp32 partials to a reduce-scatter). One pass, parallel over (batch,
// q head): each task walks the kv blocks in order; a dQ row sums over the kv blocks in that order, dK/dV of a
// kv block over the q blocks in theirs and over a group's q heads in head order (fp64 partials, kept under
// FlashConfig::backward_partial_bytes by walking the kv blocks in stripes): deterministic, no atomics.
// o and lse are the forward's, the mask's sinks folded in (so P of every key already leaves the sink its
// share); dsinks [Hq], where given (with the mask's sinks), gets each sink's gradient
// -sum_rows e^(sink - LSE) D_i, summed over (batch row, row) in order in fp64.
void flash_backward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                    const ConstTensorRef& o, const float* lse, const ConstTensorRef& d_out,
                    const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& dq,
                    const TensorRef& dk, const TensorRef& dv, TileCounts* tiles = nullptr,
                    float* dsinks = nullptr);

// The sinks' gradient from rows' natural-log LSE ([B][Hq][S], the sinks folded in) and D_i = rowsum(dO * O)
// ([B][Hq][S], the same layout): dsinks[h] = -sum over (b, i) in order of e^(sinks[h] - LSE) D_i, in fp64. A
// rank holding a shard of the rows gets its part; the parts add up over the rows.
void sink_gradients(std::span<const float> sinks, const float* lse, const float* delta, std::int64_t batch,
                    std::int64_t q_heads, std::int64_t seq, float* dsinks);

// The FLOPs of attention over S queries and S keys, counting 2 per multiply-add: Q K^T and P V make
// 4 B S^2 Hq D, halved when causal. The backward's five products count kBackwardFlopsPerForward times that.
inline double attention_forward_flops(std::int64_t batch, std::int64_t seq_len, std::int64_t q_heads,
                                      std::int64_t head_dim, bool causal) {
  const double flops = 4.0 * static_cast<double>(batch) * static_cast<double>(seq_len) *
                       static_cast<double>(seq_len) * static_cast<double>(q_heads) *
                       static_cast<double>(head_dim);
  return causal ? flops / 2 : flops;
}
// The same over the (query, key) pairs a band leaves on one row of S tokens at positions 0..S-1 (a sliding
// window: 4 B Hq D times the pairs, each query i seeing keys max(0, i-L)..min(S-1, i+R)); plain and causal
// bands, the formula above.
inline double attention_forward_flops(std::int64_t batch, std::int64_t seq_len, std::int64_t q_heads,
                                      std::int64_t head_dim, const PositionBand& band) {
  if (!band.bounded()) return attention_forward_flops(batch, seq_len, q_heads, head_dim, false);
  if (!band.windowed() && band.right == 0)
    return attention_forward_flops(batch, seq_len, q_heads, head_dim, true);
  double pairs = 0;
  for (std::int64_t i = 0; i < seq_len; ++i) {
    const std::int64_t lo = std::max<std::int64_t>(0, i - band.left),
                       hi = std::min<std::int64_t>(seq_len - 1, i + band.right);
    pairs += static_cast<double>(std::max<std::int64_t>(0, hi - lo + 1));
  }
  return 4.0 * static_cast<double>(batch) * static_cast<double>(q_heads) * static_cast<double>(head_dim) *
         pairs;
}
inline constexpr double kBackwardFlopsPerForward = 2.5;

// Owning conveniences over the two calls above.
struct FlashForwardResult {
  Tensor o;
  std::vector<float> lse;  // [B, Hq, Sq]
  TileCounts tiles;
};
FlashForwardResult flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const AttentionMask& mask, double scale,
                                           const FlashConfig& config);

struct FlashBackwardResult {
  Tensor dq, dk, dv;
  TileCounts tiles;
  std::vector<float> dsinks;  // [Hq] with the mask's sinks, else empty
};
FlashBackwardResult flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& o, const std::vector<float>& lse,
                                             const Tensor& d_out, const AttentionMask& mask, double scale,
                                             const FlashConfig& config, DType kv_grad_dtype);

}  // namespace cpattn
