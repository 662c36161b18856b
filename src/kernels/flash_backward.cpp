// Flash attention backward (FA2: P recomputed from LSE, D_i = rowsum(dO * O)), in two deterministic passes:
//   dK/dV: one task per (batch row, kv head, kv block); sums over the group's q heads and q blocks in order.
//   dQ:    one task per (batch row, q head, q block); sums over kv blocks in order.
// Splitting the passes recomputes S and dP once more, but no two tasks ever write the same row, so there are
// no atomics and the sums have one order whatever the thread count.
#include <atomic>
#include <cmath>

#include "../core/parallel_for.hpp"
#include "flash_common.hpp"

namespace cpattn {

using namespace kernels;

namespace {

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
      hn::StoreU(hn::Mul(p, hn::Sub(hn::LoadU(df, dp + r * cols + j), dl)), df, dp + r * cols + j);
    }
  }
}

}  // namespace

void flash_backward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                    const ConstTensorRef& o, const float* lse, const ConstTensorRef& d_out,
                    const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& dq,
                    const TensorRef& dk, const TensorRef& dv, TileCounts* tiles) {
  check_forward_args(q, k, v, mask, config);
  check_same_shape("o", o.shape, q.shape);
  check_same_shape("d_out", d_out.shape, q.shape);
  check_same_shape("dq", dq.shape, q.shape);
  check_same_shape("dk", dk.shape, k.shape);
  check_same_shape("dv", dv.shape, k.shape);
  CPATTN_ASSERT(lse != nullptr);
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, Hkv = k.shape.h;
  const std::int64_t D = q.shape.d, G = Hq / Hkv;
  const std::int64_t Bq = config.block_q, Bk = config.block_kv;
  const std::int64_t Dp = round_up(D, lanes());
  const float q_factor = static_cast<float>(scale * 1.4426950408889634);
  const float grad_scale = static_cast<float>(scale);
  const BlockGrid grid = make_block_grid(mask, B, Sq, Skv, config);
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq, kv_blocks = (Skv + Bk - 1) / Bk;
  const bool segments = mask.has_segments();
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

  struct Workspace {
    std::vector<float> qs, qraw, dop, kt, vt, krows, s, dp, acc_a, acc_b, row;
    std::vector<double> sum_a, sum_b;  // dK, dV running sums over tiles
  };
  std::vector<Workspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));
  auto prepare = [&](Workspace& w) {
    w.qs.resize(Bq * Dp);
    w.qraw.resize(Bq * Dp);
    w.dop.resize(Bq * Dp);
    w.kt.resize(D * Bk);
    w.vt.resize(D * Bk);
    w.krows.resize(Bk * Dp);
    w.s.resize(Bq * Bk);
    w.dp.resize(Bq * Bk);
    w.row.resize(Dp);
  };
  // S, P and dS for one tile; rows padded to the tile height.
  auto tile_ds = [&](Workspace& w, std::int64_t b, std::int64_t h, const BlockMeta& qb, const BlockMeta& kb,
                     TileKind kind, std::int64_t rows) {
    dot_rows(w.qs.data(), Dp, w.kt.data(), Bk, D, rows, Bk, w.s.data(), Bk);
    if (kind == TileKind::partial) apply_mask(w.s.data(), rows, Bk, Bk, 1, qb, kb, b, mask, Sq, Skv, neg_inf);
    dot_rows(w.dop.data(), Dp, w.vt.data(), Bk, D, rows, Bk, w.dp.data(), Bk);
    const std::int64_t row0 = (b * Hq + h) * sq_padded + qb.begin;
    probabilities_and_ds(w.s.data(), w.dp.data(), rows, Bk, lse2.data() + row0, delta.data() + row0);
  };

  // Pass 1: dK, dV.
  std::vector<std::int64_t> task_tiles(static_cast<std::size_t>(B * Hkv * kv_blocks * G), 0);
  std::atomic<std::int64_t> full{0}, partial{0};
  parallel_for(B * Hkv * kv_blocks, config.threads, [&](std::int64_t task, int worker) {
    const std::int64_t b = task / (Hkv * kv_blocks);
    const std::int64_t hk = (task / kv_blocks) % Hkv;
    const BlockMeta& kb = grid.kv[b][task % kv_blocks];
    Workspace& w = spaces[worker];
    prepare(w);
    // dK and dV sum over every (q head, q block) tile: each tile's 64-row sum in fp32 registers, the running
    // sum over tiles in fp64, so the error does not grow with the sequence and the group size (strategies
    // that split the sum differently then agree to ~1e-7 of max |grad|).
    w.acc_a.resize(Bk * Dp);
    w.acc_b.resize(Bk * Dp);
    w.sum_a.assign(Bk * Dp, 0.0);
    w.sum_b.assign(Bk * Dp, 0.0);
    pack_transposed(k, b, hk, kb, Bk, w.row.data(), w.kt.data());
    pack_transposed(v, b, hk, kb, Bk, w.row.data(), w.vt.data());
    std::int64_t computed_full = 0, computed_partial = 0;
    for (std::int64_t g = 0; g < G; ++g) {
      const std::int64_t h = hk * G + g;
      std::int64_t computed = 0;
      for (const BlockMeta& qb : grid.q[b]) {
        const TileKind kind = classify_tile(qb, kb, mask.causal, segments, Bk);
        if (kind == TileKind::empty) continue;
        ++computed;
        (kind == TileKind::full ? computed_full : computed_partial) += 1;
        const std::int64_t rows = round_up(qb.length, kTileRows);
        pack_rows(q, b, h, qb, rows, Dp, q_factor, w.qs.data());
        pack_rows(q, b, h, qb, rows, Dp, 1.0f, w.qraw.data());
        pack_rows(d_out, b, h, qb, rows, Dp, 1.0f, w.dop.data());
        tile_ds(w, b, h, qb, kb, kind, rows);
        // dV[j] += sum_i P[i][j] dO[i]; dK[j] += sum_i dS[i][j] Q[i]  (keys as output rows)
        std::fill(w.acc_a.begin(), w.acc_a.end(), 0.0f);
        std::fill(w.acc_b.begin(), w.acc_b.end(), 0.0f);
        axpy_rows(w.s.data(), Bk, 1, w.dop.data(), Dp, rows, Bk, Dp, w.acc_b.data(), Dp);
        axpy_rows(w.dp.data(), Bk, 1, w.qraw.data(), Dp, rows, Bk, Dp, w.acc_a.data(), Dp);
        for (std::int64_t i = 0; i < Bk * Dp; ++i) {
          w.sum_a[i] += w.acc_a[i];
          w.sum_b[i] += w.acc_b[i];
        }
      }
      task_tiles[task * G + g] = computed;
    }
    full += computed_full;
    partial += computed_partial;
    for (std::int64_t i = 0; i < Bk * Dp; ++i) {
      w.acc_a[i] = static_cast<float>(w.sum_a[i] * scale);
      w.acc_b[i] = static_cast<float>(w.sum_b[i]);
    }
    for (std::int64_t j = 0; j < kb.length; ++j) {
      store_row(dk, b, kb.begin + j, hk, w.acc_a.data() + j * Dp, 1.0f);
      store_row(dv, b, kb.begin + j, hk, w.acc_b.data() + j * Dp, 1.0f);
    }
  });

  // Pass 2: dQ.
  parallel_for(B * Hq * q_blocks, config.threads, [&](std::int64_t task, int worker) {
    const std::int64_t b = task / (Hq * q_blocks);
    const std::int64_t h = (task / q_blocks) % Hq;
    const std::int64_t hk = h / G;
    const BlockMeta& qb = grid.q[b][task % q_blocks];
    Workspace& w = spaces[worker];
    prepare(w);
    w.acc_a.assign(Bq * Dp, 0.0f);
    const std::int64_t rows = round_up(qb.length, kTileRows);
    pack_rows(q, b, h, qb, rows, Dp, q_factor, w.qs.data());
    pack_rows(d_out, b, h, qb, rows, Dp, 1.0f, w.dop.data());
    for (const BlockMeta& kb : grid.kv[b]) {
      const TileKind kind = classify_tile(qb, kb, mask.causal, segments, Bk);
      if (kind == TileKind::empty) continue;
      pack_transposed(k, b, hk, kb, Bk, w.row.data(), w.kt.data());
      pack_transposed(v, b, hk, kb, Bk, w.row.data(), w.vt.data());
      pack_rows(k, b, hk, kb, Bk, Dp, 1.0f, w.krows.data());
      tile_ds(w, b, h, qb, kb, kind, rows);
      // dQ[i] += sum_j dS[i][j] K[j]
      axpy_rows(w.dp.data(), 1, Bk, w.krows.data(), Dp, Bk, rows, Dp, w.acc_a.data(), Dp);
    }
    for (std::int64_t r = 0; r < qb.length; ++r)
      store_row(dq, b, qb.begin + r, h, w.acc_a.data() + r * Dp, grad_scale);
  });

  if (tiles != nullptr) {
    tiles->per_head.assign(static_cast<std::size_t>(B * Hq), 0);
    for (std::int64_t t = 0; t < B * Hkv * kv_blocks; ++t) {
      const std::int64_t b = t / (Hkv * kv_blocks), hk = (t / kv_blocks) % Hkv;
      for (std::int64_t g = 0; g < G; ++g) tiles->per_head[b * Hq + hk * G + g] += task_tiles[t * G + g];
    }
    tiles->full = full;
    tiles->partial = partial;
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
  flash_backward(cref(q), cref(k), cref(v), cref(o), lse.data(), cref(d_out), mask, scale, config, ref(r.dq),
                 ref(r.dk), ref(r.dv), &r.tiles);
  return r;
}

}  // namespace cpattn
