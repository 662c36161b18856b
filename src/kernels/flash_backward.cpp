// Flash attention backward (FA2: P recomputed from LSE, D_i = rowsum(dO * O)) in one pass of five products
// per tile (S, dP, dV, dK, dQ), deterministic without atomics: one task per (batch row, q head) walks groups
// of kv blocks in order and, for each group, the q blocks in order (each q block's tiles with the group's kv
// blocks in order). dQ of a row then sums over kv blocks in their order (its own [Sq][Dp] accumulator per
// task), dK/dV of a kv block over the q blocks in theirs; the q heads of a group each leave an fp64 partial
// that is summed in head order at the end. One pass, not two (dK/dV by kv block, dQ by q block): two need
// no partials but compute S and dP twice, 7 products per tile instead of 5.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel_for.hpp"
#include "kernels/aligned_vector.hpp"
#include "kernels/block_grid.hpp"
#include "kernels/exp2_poly.hpp"
#include "kernels/flash_bf16.hpp"
#include "kernels/kernel_args.hpp"
#include "kernels/kernel_clock.hpp"
#include "kernels/masking.hpp"
#include "kernels/packing.hpp"
#include "kernels/prefetch.hpp"
#include "kernels/row_io.hpp"
#include "kernels/simd_target.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/flash_backward.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/flash_simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace cpattn::kernels::HWY_NAMESPACE {

// p[r][j] = exp2(s[r][j] - lse2[r]) in place, then ds[r][j] = p[r][j] * (dp[r][j] - delta[r]).
void probabilities_and_ds(float* s, float* dp, std::int64_t rows, std::int64_t cols, const float* lse2,
                          const float* delta) {
  const DF df;
  for (std::int64_t r = 0; r < rows; ++r) {
    const VF l2 = hn::Set(df, lse2[r]);
    const VF dl = hn::Set(df, delta[r]);
    for (std::int64_t j = 0; j < cols; j += lanes()) {
      const VF p = exp2_approx(hn::Sub(hn::LoadU(df, s + r * cols + j), l2));
      hn::StoreU(p, df, s + r * cols + j);
      // dS of a masked pair (P = 0) is exactly 0 even where dP is not finite (a non-finite V or dO).
      const VF ds = hn::IfThenZeroElse(hn::Eq(p, hn::Zero(df)),
                                       hn::Mul(p, hn::Sub(hn::LoadU(df, dp + r * cols + j), dl)));
      hn::StoreU(ds, df, dp + r * cols + j);
    }
  }
}

namespace {

constexpr std::int64_t kKvGroup = 4;  // kv blocks per walk over the q blocks
constexpr std::int64_t kKvTail = 4;   // a group's last q blocks, which fetch the next group's kv blocks

// A worker's buffers, reused by its tasks.
struct Workspace {
  AlignedVector<float> s, dp, t, row_a, row_b;  // t: tanh of soft-capped scores
  AlignedVector<double> sum_a, sum_b;           // dK, dV running sums over tiles, per kv block of the group
  PrefetchQueue prefetch;            // the next q block's operands (and near a group's end the next group's)
  std::int64_t pf_lines = 0;         // of them before each register tile
  std::vector<std::int64_t> q_todo;  // the q blocks that see any kv block of the group, in order
};

// What every task of a call reads and writes: the inputs, the packed operands, the accumulators and the
// outputs. Every operand block is packed once per call (converted to fp32, zero-padded, Q pre-scaled for the
// base-2 scores) and then read by every tile that needs it: Q' and dO as rows [Bq][Dp], K^T and V^T as
// [Dp][Bk], K as rows for dQ.
struct BackwardCall {
  const AttentionMask& mask;
  const BlockGrid& grid;
  const std::vector<float>& lse2;
  const std::vector<float>& delta;
  bool guard;
  const TensorRef& dk;
  const TensorRef& dv;
  const PackedBlocks& qs;
  const PackedBlocks& dop;
  const PackedBlocks& kt;
  const PackedBlocks& vt;
  const PackedBlocks& krows;
  std::int64_t Sq, Skv, Hq, Hkv, D, G, Bq, Bk, Dp, q_blocks, kv_blocks, sq_padded, stripe;
  bool segments;
  float softcap_b;  // the soft-cap in the scores' base-2 units (cap log2 e), 0 for none
  double dk_scale;
  const PooledArray<double>& head_dk;  // [B][Hq][stripe][Bk][Dp] when G > 1
  const PooledArray<double>& head_dv;
  const PooledArray<float>& dq_acc;  // [B][Hq][Sq padded][Dp]
  std::vector<std::int64_t>& task_tiles;
  std::atomic<std::int64_t>& full;
  std::atomic<std::int64_t>& partial;
};

// One task of a stripe: batch row b, q head h (kv head hk), the stripe's kv blocks [s0, s1).
struct HeadTask {
  std::int64_t task = 0, b = 0, h = 0, hk = 0, s0 = 0, s1 = 0;
  float* dq_head = nullptr;  // the head's rows of dq_acc
  std::int64_t computed = 0, computed_full = 0;
};

// S, P and dS for one tile from packed rows of Q' and dO ([rows][Dp]) and K^T, V^T ([Dp][Bk]); rows padded
// to the tile height.
HWY_INLINE void tile_ds(const BackwardCall& call, Workspace& w, const float* qs, const float* dop,
                        const float* kt, const float* vt, std::int64_t b, std::int64_t h, const BlockMeta& qb,
                        const BlockMeta& kb, TileKind kind, std::int64_t rows) {
  const std::int64_t Bk = call.Bk, Dp = call.Dp, D = call.D;
  w.s.resize(call.Bq * Bk);
  w.dp.resize(call.Bq * Bk);
  dot_rows(qs, Dp, kt, Bk, D, rows, Bk, w.s.data(), Bk, &w.prefetch, w.pf_lines);
  dot_rows(dop, Dp, vt, Bk, D, rows, Bk, w.dp.data(), Bk, &w.prefetch, w.pf_lines);
  const std::int64_t row0 = (b * call.Hq + h) * call.sq_padded + qb.begin;
  const bool capped = call.softcap_b > 0;
  if (capped) {  // the forward's capped scores, and tanh kept for dS through the cap
    w.t.resize(call.Bq * Bk);
    softcap_scores(w.s.data(), rows * Bk, call.softcap_b, w.t.data());
  }
  probabilities_and_ds(w.s.data(), w.dp.data(), rows, Bk, call.lse2.data() + row0, call.delta.data() + row0);
  if (capped) softcap_gradient(w.dp.data(), w.t.data(), rows * Bk);
  // The mask is applied to P and dS (not to S): a masked pair's P and dS are then exactly 0 even for a row
  // whose LSE is NaN (exp2(-inf - NaN) is NaN), and a NaN row cannot reach the keys it may not see.
  if (kind == TileKind::partial) {
    apply_mask(w.s.data(), rows, Bk, Bk, 1, qb, kb, b, call.mask, call.Sq, call.Skv, 0.0f);
    apply_mask(w.dp.data(), rows, Bk, Bk, 1, qb, kb, b, call.mask, call.Sq, call.Skv, 0.0f);
  }
}

// Whether q block qi sees any kv block of [a0, a1).
HWY_INLINE bool sees_any(const BackwardCall& call, std::int64_t b, std::int64_t qi, std::int64_t a0,
                         std::int64_t a1) {
  for (std::int64_t kvi = a0; kvi < a1; ++kvi) {
    if (classify_tile(call.grid.q[b][qi], call.grid.kv[b][kvi], call.mask.band(), call.segments, call.Bk) !=
        TileKind::empty)
      return true;
  }
  return false;
}

// The q blocks that see the kv group [g0, g1), in w.q_todo; returns the first q block that sees the next
// group [g1, g2), or -1. Only those are walked and prefetched: under a causal mask the first ones see none of
// the group, and their prefetches (96 KB a q block) would drain in a burst with nothing computed between
// (docs/performance.md, decisions).
HWY_INLINE std::int64_t plan_q_blocks(const BackwardCall& call, const HeadTask& t, Workspace& w,
                                      std::int64_t g0, std::int64_t g1, std::int64_t g2) {
  w.q_todo.clear();
  for (std::int64_t qi = 0; qi < call.q_blocks; ++qi) {
    if (sees_any(call, t.b, qi, g0, g1)) w.q_todo.push_back(qi);
  }
  std::int64_t next_group_first = -1;
  for (std::int64_t qi = 0; qi < call.q_blocks && next_group_first < 0 && g1 < t.s1; ++qi) {
    if (sees_any(call, t.b, qi, g1, g2)) next_group_first = qi;
  }
  return next_group_first;
}

// The prefetches of the at-th q block of the group [g0, g1): the next q block's Q', dO and dQ rows (after the
// last, the next group's first) are fetched into L2 a few lines before each register tile of this one's
// products (the head's 6 MB of them at S = 4096, D = 128 stream from L3 once per group); the group's last
// kKvTail q blocks fetch a share each of the next group's K^T, V^T and K blocks. Lines per issue point: what
// was queued over 64 points per kv block of the group (there are 55 at D = 128, Bk = 64: 11 row tiles in each
// of the five products), so a rest goes out when the q block ends.
HWY_INLINE void queue_prefetches(const BackwardCall& call, const HeadTask& t, Workspace& w, std::int64_t at,
                                 std::int64_t g0, std::int64_t g1, std::int64_t g2,
                                 std::int64_t next_group_first) {
  const std::int64_t todo = static_cast<std::int64_t>(w.q_todo.size());
  PrefetchQueue& pf = w.prefetch;
  pf.clear();
  std::int64_t queued = 0;
  const std::int64_t next = at + 1 < todo ? w.q_todo[at + 1] : next_group_first;
  if (next >= 0) {
    const std::int64_t bytes = call.Bq * call.Dp * static_cast<std::int64_t>(sizeof(float));
    pf.add(call.qs.at(t.b, t.h, next), bytes);
    pf.add(call.dop.at(t.b, t.h, next), bytes);
    pf.add(t.dq_head + call.grid.q[t.b][next].begin * call.Dp, bytes);
    queued += 3 * bytes;
  }
  const std::int64_t tail = std::min(kKvTail, todo);
  if (g1 < t.s1 && at >= todo - tail) {
    const std::int64_t bytes = (g2 - g1) * call.Bk * call.Dp * static_cast<std::int64_t>(sizeof(float));
    const std::int64_t part = round_up((bytes + tail - 1) / tail, kCacheLine);
    const std::int64_t from = (at - (todo - tail)) * part;
    const std::int64_t size = std::min(part, bytes - from);
    for (const PackedBlocks* op : {&call.kt, &call.vt, &call.krows})
      pf.add(reinterpret_cast<const char*>(op->at(t.b, t.hk, g1)) + from, size);
    queued += 3 * std::max<std::int64_t>(0, size);
  }
  w.pf_lines = std::max<std::int64_t>(1, queued / kCacheLine / ((g1 - g0) * 64));
}

// q block qi's tiles with the kv blocks [g0, g1) in order: dS, then dV and dK into the group's fp64 sums and
// dQ into the head's rows.
HWY_INLINE void q_block_tiles(const BackwardCall& call, HeadTask& t, Workspace& w, std::int64_t qi,
                              std::int64_t g0, std::int64_t g1) {
  const std::int64_t Bk = call.Bk, Dp = call.Dp;
  const std::size_t block_floats = static_cast<std::size_t>(Bk * Dp);
  const BlockMeta& qb = call.grid.q[t.b][qi];
  PrefetchQueue& pf = w.prefetch;
  for (std::int64_t kvi = g0; kvi < g1; ++kvi) {
    const BlockMeta& kb = call.grid.kv[t.b][kvi];
    const TileKind kind = classify_tile(qb, kb, call.mask.band(), call.segments, Bk);
    if (kind == TileKind::empty) continue;
    ++t.computed;
    t.computed_full += kind == TileKind::full;
    const std::size_t slot = static_cast<std::size_t>(kvi - g0) * block_floats;
    const std::int64_t rows = round_up(qb.length, kTileRows);
    const float* qs_block = call.qs.at(t.b, t.h, qi);
    const float* dop_block = call.dop.at(t.b, t.h, qi);
    tile_ds(call, w, qs_block, dop_block, call.kt.at(t.b, t.hk, kvi), call.vt.at(t.b, t.hk, kvi), t.b, t.h,
            qb, kb, kind, rows);
    // dV[j] += sum_i P[i][j] dO[i]; dK[j] += sum_i dS[i][j] Q'[i]  (keys as output rows)
    axpy_rows(w.s.data(), Bk, 1, dop_block, Dp, rows, Bk, Dp, w.sum_b.data() + slot, Dp, call.guard, &pf,
              w.pf_lines);
    axpy_rows(w.dp.data(), Bk, 1, qs_block, Dp, rows, Bk, Dp, w.sum_a.data() + slot, Dp, call.guard, &pf,
              w.pf_lines);
    // dQ[i] += sum_j dS[i][j] K[j], continuing the row's sum over the kv blocks in order
    axpy_rows(w.dp.data(), 1, Bk, call.krows.at(t.b, t.hk, kvi), Dp, Bk, rows, Dp, t.dq_head + qb.begin * Dp,
              Dp, call.guard, &pf, w.pf_lines);
  }
}

// The group's dK and dV sums: a q head's partials when its kv head serves several (G > 1), else the rows of
// dK and dV themselves.
HWY_INLINE void finish_kv_group(const BackwardCall& call, const HeadTask& t, Workspace& w, std::int64_t g0,
                                std::int64_t g1) {
  const std::int64_t Bk = call.Bk, Dp = call.Dp;
  const std::size_t block_floats = static_cast<std::size_t>(Bk * Dp);
  for (std::int64_t kvi = g0; kvi < g1; ++kvi) {
    const std::size_t slot = static_cast<std::size_t>(kvi - g0) * block_floats;
    const double* sum_a = w.sum_a.data() + slot;
    const double* sum_b = w.sum_b.data() + slot;
    if (call.G > 1) {
      const std::size_t at = static_cast<std::size_t>((t.task * call.stripe + (kvi - t.s0)) * Bk * Dp);
      std::copy(sum_a, sum_a + block_floats, call.head_dk.begin() + at);
      std::copy(sum_b, sum_b + block_floats, call.head_dv.begin() + at);
      continue;
    }
    const BlockMeta& kb = call.grid.kv[t.b][kvi];
    w.row_a.resize(static_cast<std::size_t>(Dp));
    w.row_b.resize(static_cast<std::size_t>(Dp));
    for (std::int64_t j = 0; j < kb.length; ++j) {
      for (std::int64_t d = 0; d < Dp; ++d) {
        w.row_a[d] = static_cast<float>(sum_a[j * Dp + d] * call.dk_scale);
        w.row_b[d] = static_cast<float>(sum_b[j * Dp + d]);
      }
      store_row(call.dk, t.b, kb.begin + j, t.hk, w.row_a.data(), 1.0f);
      store_row(call.dv, t.b, kb.begin + j, t.hk, w.row_b.data(), 1.0f);
    }
  }
}

// Task `task` of the stripe [s0, s1): one q head's tiles with the stripe's kv blocks. A group of kKvGroup kv
// blocks walks the q blocks once: each q block's Q', dO and dQ rows are read for all of the group's tiles
// while they are in cache (per tile they are 96 KB at D = 128, the head's 6 MB at S = 4096 streaming from L3
// otherwise). Each kv block's dK/dV still sum over the q blocks in order, and each dQ row over the kv blocks
// in order, as with one kv block at a time.
void backward_head(const BackwardCall& call, std::int64_t task, std::int64_t s0, std::int64_t s1,
                   Workspace& w) {
  HeadTask t;
  t.task = task;
  t.b = task / call.Hq;
  t.h = task % call.Hq;
  t.hk = t.h / call.G;
  t.s0 = s0;
  t.s1 = s1;
  t.dq_head = call.dq_acc.data() + task * call.sq_padded * call.Dp;
  const std::size_t block_floats = static_cast<std::size_t>(call.Bk * call.Dp);
  w.sum_a.resize(kKvGroup * block_floats);
  w.sum_b.resize(kKvGroup * block_floats);
  for (std::int64_t g0 = s0; g0 < s1; g0 += kKvGroup) {
    const std::int64_t g1 = std::min(s1, g0 + kKvGroup);
    const std::int64_t g2 = std::min(s1, g1 + kKvGroup);  // the next group: [g1, g2)
    const std::int64_t next_group_first = plan_q_blocks(call, t, w, g0, g1, g2);
    const std::int64_t todo = static_cast<std::int64_t>(w.q_todo.size());
    // dK and dV of a kv block sum over the q blocks: each tile's rows in fp32 registers, the running sum over
    // tiles in fp64 (axpy_rows into double), so the error does not grow with the sequence and the group size
    // (strategies that split the sum differently then agree to ~1e-7 of max |grad|).
    std::fill(w.sum_a.begin(), w.sum_a.end(), 0.0);
    std::fill(w.sum_b.begin(), w.sum_b.end(), 0.0);
    for (std::int64_t at = 0; at < todo; ++at) {
      queue_prefetches(call, t, w, at, g0, g1, g2, next_group_first);
      q_block_tiles(call, t, w, w.q_todo[at], g0, g1);
      w.prefetch.drain();
    }
    finish_kv_group(call, t, w, g0, g1);
  }
  call.task_tiles[task] += t.computed;
  call.full += t.computed_full;
  call.partial += t.computed - t.computed_full;
}

// dK, dV of the stripe's keys [j0, j1) = the group's per-head sums, added in head order.
void sum_head_partials(const BackwardCall& call, std::int64_t batch, std::int64_t j0, std::int64_t j1,
                       int threads) {
  const std::int64_t Hq = call.Hq, Hkv = call.Hkv, G = call.G, Bk = call.Bk, Dp = call.Dp;
  parallel_for(batch * Hkv, threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / Hkv, hk = task % Hkv;
    std::vector<float> rk(static_cast<std::size_t>(Dp)), rv(rk.size());
    for (std::int64_t j = j0; j < j1; ++j) {
      for (std::int64_t d = 0; d < Dp; ++d) {
        double sk = 0.0, sv = 0.0;
        for (std::int64_t g = 0; g < G; ++g) {
          const std::size_t at =
              static_cast<std::size_t>(((b * Hq + hk * G + g) * call.stripe * Bk + (j - j0)) * Dp + d);
          sk += call.head_dk[at];
          sv += call.head_dv[at];
        }
        rk[d] = static_cast<float>(sk * call.dk_scale);
        rv[d] = static_cast<float>(sv);
      }
      store_row(call.dk, b, j, hk, rk.data(), 1.0f);
      store_row(call.dv, b, j, hk, rv.data(), 1.0f);
    }
  });
}

}  // namespace

// The vector path of flash_backward after its checks: lse2 and delta as flash_backward computes them.
void backward_vector(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                     const ConstTensorRef& d_out, const AttentionMask& mask, double scale,
                     const FlashConfig& config, const BlockGrid& grid, const std::vector<float>& lse2,
                     const std::vector<float>& delta, bool guard, const TensorRef& dq, const TensorRef& dk,
                     const TensorRef& dv, std::vector<std::int64_t>& task_tiles,
                     std::atomic<std::int64_t>& full, std::atomic<std::int64_t>& partial) {
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, Hkv = k.shape.h;
  const std::int64_t G = Hq / Hkv;
  const std::int64_t Bq = config.block_q, Bk = config.block_kv;
  const std::int64_t Dp = padded_head_dim(q.shape.d);
  const float q_factor = static_cast<float>(scale * kLog2eDouble);
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq, kv_blocks = (Skv + Bk - 1) / Bk;
  const std::int64_t sq_padded = q_blocks * Bq;
  const PackedBlocks qs(q, grid.q, Bq, Dp, PackLayout::rows, q_factor, config.threads);
  const PackedBlocks dop(d_out, grid.q, Bq, Dp, PackLayout::rows, 1.0f, config.threads);
  const PackedBlocks kt(k, grid.kv, Bk, Dp, PackLayout::transposed, 1.0f, config.threads);
  const PackedBlocks vt(v, grid.kv, Bk, Dp, PackLayout::transposed, 1.0f, config.threads);

  // The kv blocks are walked in stripes. Within a stripe one task per (batch row, q head) computes its
  // tiles; a kv head serving several q heads (G > 1) gets one fp64 partial per q head,
  // [B][Hq][stripe][Bk][Dp], summed over the group in head order when the stripe ends. The stripe is as
  // many kv blocks as keep those partials under config.backward_partial_bytes, so their memory does not
  // grow with the sequence; with G = 1 there are no partials and one stripe. dQ accumulates in fp32 over
  // every stripe, [B][Hq][Sq padded][Dp].
  const std::int64_t stripe = backward_stripe_blocks(config, B, Hq, G, Dp, kv_blocks);
  const PooledArray<double> head_dk(G > 1 ? static_cast<std::size_t>(B * Hq * stripe * Bk * Dp) : 0);
  const PooledArray<double> head_dv(head_dk.size());
  const PackedBlocks krows(k, grid.kv, Bk, Dp, PackLayout::rows, 1.0f, config.threads);  // K as rows, for dQ
  const PooledArray<float> dq_acc(static_cast<std::size_t>(B * Hq * sq_padded * Dp));
  // dK is summed from Q' = q_factor * Q (the packed scores operand) instead of a second, unscaled copy of Q:
  // dK = scale * sum dS Q = (scale / q_factor) * sum dS Q'.
  const double dk_scale = scale / static_cast<double>(q_factor);
  const BackwardCall call{.mask = mask,
                          .grid = grid,
                          .lse2 = lse2,
                          .delta = delta,
                          .guard = guard,
                          .dk = dk,
                          .dv = dv,
                          .qs = qs,
                          .dop = dop,
                          .kt = kt,
                          .vt = vt,
                          .krows = krows,
                          .Sq = Sq,
                          .Skv = Skv,
                          .Hq = Hq,
                          .Hkv = Hkv,
                          .D = q.shape.d,
                          .G = G,
                          .Bq = Bq,
                          .Bk = Bk,
                          .Dp = Dp,
                          .q_blocks = q_blocks,
                          .kv_blocks = kv_blocks,
                          .sq_padded = sq_padded,
                          .stripe = stripe,
                          .segments = mask.has_segments(),
                          .softcap_b = static_cast<float>(mask.softcap * kLog2eDouble),
                          .dk_scale = dk_scale,
                          .head_dk = head_dk,
                          .head_dv = head_dv,
                          .dq_acc = dq_acc,
                          .task_tiles = task_tiles,
                          .full = full,
                          .partial = partial};
  std::vector<Workspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));
  for_each_backward_stripe(
      kv_blocks, stripe, B * Hq, config.threads, G > 1,
      [&](std::int64_t task, std::int64_t s0, std::int64_t s1, int worker) {
        backward_head(call, task, s0, s1, spaces[worker]);
      },
      [&](std::int64_t s0, std::int64_t s1) {
        sum_head_partials(call, B, s0 * Bk, std::min(Skv, s1 * Bk), config.threads);
      });
  const float grad_scale = static_cast<float>(scale);
  parallel_for(B * Hq, config.threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / Hq, h = task % Hq;
    for (std::int64_t i = 0; i < Sq; ++i) {
      store_row(dq, b, i, h, dq_acc.data() + (task * sq_padded + i) * Dp, grad_scale);
    }
  });
}

}  // namespace cpattn::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cpattn {

namespace kernels {
HWY_EXPORT(backward_vector);
}  // namespace kernels

using namespace kernels;

void flash_backward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                    const ConstTensorRef& o, const float* lse, const ConstTensorRef& d_out,
                    const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& dq,
                    const TensorRef& dk, const TensorRef& dv, TileCounts* tiles, float* dsinks) {
  const KernelClock clock;
  const trace::Scope event("kernel", "flash_backward", trace::enabled() ? trace_args(q, k, mask) : "");
  check_forward_args(q, k, v, mask, config);
  check_same_shape("o", o.shape, q.shape);
  check_same_shape("d_out", d_out.shape, q.shape);
  check_same_shape("dq", dq.shape, q.shape);
  check_same_shape("dk", dk.shape, k.shape);
  check_same_shape("dv", dv.shape, k.shape);
  CPATTN_ASSERT(lse != nullptr);
  apply_simd_target_env();
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, D = q.shape.d;
  const std::int64_t Bq = config.block_q;
  const BlockGrid grid = make_block_grid(mask, B, Sq, Skv, config);
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float pos_inf = std::numeric_limits<float>::infinity();

  // Per row (b, h, i): lse2 = LSE * log2(e) (+inf for a row that sees nothing, so its P is 0) and
  // delta = rowsum(dO * O), padded per q block so that tiles can read whole blocks.
  const std::int64_t sq_padded = q_blocks * Bq;
  std::vector<float> lse2(static_cast<std::size_t>(B * Hq * sq_padded), pos_inf);
  std::vector<float> delta(lse2.size(), 0.0f);
  parallel_for(B * Hq, config.threads, [&](std::int64_t bh, int) {
    const std::int64_t b = bh / Hq, h = bh % Hq;
    std::vector<float> orow(D), drow(D);
    for (std::int64_t i = 0; i < Sq; ++i) {
      const float l = lse[(b * Hq + h) * Sq + i];
      lse2[bh * sq_padded + i] = l == neg_inf ? pos_inf : l * kLog2e;
      load_row(o, b, i, h, 1.0f, D, orow.data());
      load_row(d_out, b, i, h, 1.0f, D, drow.data());
      float sum = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) sum += orow[d] * drow[d];
      delta[bh * sq_padded + i] = sum;
    }
  });

  std::vector<std::int64_t> task_tiles(static_cast<std::size_t>(B * Hq), 0);
  std::atomic<std::int64_t> full{0}, partial{0};
  // With a non-finite Q, K or dO the products skip the masked pairs' zero coefficients (0 * Inf = NaN would
  // reach rows and keys that may not see each other); the tile unit cannot, so such inputs take the vector
  // path.
  const bool guard = any_nonfinite(q) || any_nonfinite(k) || any_nonfinite(d_out);
  const bool bf16_inputs = q.dtype == DType::bf16 && k.dtype == DType::bf16 && v.dtype == DType::bf16 &&
                           d_out.dtype == DType::bf16;
  if (bf16_inputs && !guard && !any_nonfinite(v) && flash_bf16_path(config) != Bf16Path::vector) {
    flash_backward_bf16(q, k, v, d_out, mask, scale, config, grid, lse2, delta, dq, dk, dv, task_tiles, full,
                        partial);
  } else {
    HWY_DYNAMIC_DISPATCH(backward_vector)
    (q, k, v, d_out, mask, scale, config, grid, lse2, delta, guard, dq, dk, dv, task_tiles, full, partial);
  }

  if (tiles != nullptr) {
    tiles->per_head = task_tiles;
    tiles->full = full;
    tiles->partial = partial;
  }
  if (dsinks != nullptr) {
    CPATTN_ASSERT(!mask.sinks.empty());
    // delta as [B][Hq][S] (it is padded per q block above)
    std::vector<float> rows(static_cast<std::size_t>(B * Hq * Sq));
    for (std::int64_t bh = 0; bh < B * Hq; ++bh)
      std::copy_n(delta.data() + bh * sq_padded, Sq, rows.data() + bh * Sq);
    sink_gradients(mask.sinks, lse, rows.data(), B, Hq, Sq, dsinks);
  }
}

void sink_gradients(std::span<const float> sinks, const float* lse, const float* delta, std::int64_t batch,
                    std::int64_t q_heads, std::int64_t seq, float* dsinks) {
  for (std::int64_t h = 0; h < q_heads; ++h) {
    const double sink = sinks[static_cast<std::size_t>(h)];
    double sum = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t at = (b * q_heads + h) * seq;
      for (std::int64_t i = 0; i < seq; ++i) {
        if (delta[at + i] == 0.0f) continue;  // O = 0 (a row that saw no key), or orthogonal: nothing to add
        sum -= std::exp(sink - static_cast<double>(lse[at + i])) * static_cast<double>(delta[at + i]);
      }
    }
    dsinks[h] = static_cast<float>(sum);
  }
}

FlashBackwardResult flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& o, const std::vector<float>& lse,
                                             const Tensor& d_out, const AttentionMask& mask, double scale,
                                             const FlashConfig& config, DType kv_grad_dtype) {
  FlashBackwardResult r;
  r.dq = Tensor(q.dtype(), q.shape());
  r.dk = Tensor(kv_grad_dtype, k.shape());
  r.dv = Tensor(kv_grad_dtype, k.shape());
  if (static_cast<std::int64_t>(lse.size()) != q.shape().b * q.shape().h * q.shape().s) {
    throw Error(ErrorKind::invalid_input, "lse", std::to_string(lse.size()),
                "lse holds " + std::to_string(lse.size()) +
                    " values; expected B*Hq*Sq = " + std::to_string(q.shape().b * q.shape().h * q.shape().s));
  }
  if (!mask.sinks.empty()) r.dsinks.resize(mask.sinks.size());
  flash_backward(cref(q), cref(k), cref(v), cref(o), lse.data(), cref(d_out), mask, scale, config, ref(r.dq),
                 ref(r.dk), ref(r.dv), &r.tiles, mask.sinks.empty() ? nullptr : r.dsinks.data());
  return r;
}

}  // namespace cpattn
#endif  // HWY_ONCE
