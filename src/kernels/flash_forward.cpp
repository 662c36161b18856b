// Flash attention forward. One task per (batch row, q head, q block); each walks the kv blocks of the fixed
// global grid in order with an online softmax in base 2 (scale * log2(e) folded into Q when it is packed).
#include <atomic>
#include <cmath>

#include "../core/parallel_for.hpp"
#include "flash_common.hpp"

namespace cpattn {

using namespace kernels;

void flash_forward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                   const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& o,
                   float* lse, TileCounts* tiles) {
  check_forward_args(q, k, v, mask, config);
  check_same_shape("o", o.shape, q.shape);
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, D = q.shape.d;
  const std::int64_t G = Hq / k.shape.h;
  const std::int64_t Bq = config.block_q, Bk = config.block_kv;
  const std::int64_t Dp = round_up(D, lanes());
  const float q_factor = static_cast<float>(scale * 1.4426950408889634);
  const BlockGrid grid = make_block_grid(mask, B, Sq, Skv, config);
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq;
  const bool segments = mask.has_segments();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Tiles computed by each task, [B][Hq][q_blocks], summed per head afterwards.
  std::vector<std::int64_t> task_tiles(static_cast<std::size_t>(B * Hq * q_blocks), 0);
  std::atomic<std::int64_t> full{0}, partial{0};

  // K transposed and V as rows, packed once and shared by every q block and q head of the group.
  const PackedBlocks kt(k, grid.kv, Bk, Dp, true, 1.0f, config.threads);
  const PackedBlocks vp(v, grid.kv, Bk, Dp, false, 1.0f, config.threads);

  struct Workspace {
    std::vector<float> qp, s, acc, m, l;
  };
  std::vector<Workspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));

  parallel_for(B * Hq * q_blocks, config.threads, [&](std::int64_t task, int worker) {
    const std::int64_t b = task / (Hq * q_blocks);
    const std::int64_t h = (task / q_blocks) % Hq;
    const std::int64_t hk = h / G;
    const BlockMeta& qb = grid.q[b][task % q_blocks];
    Workspace& w = spaces[worker];
    w.qp.resize(Bq * Dp);
    w.s.resize(Bq * Bk);
    w.acc.assign(Bq * Dp, 0.0f);
    w.m.assign(Bq, neg_inf);
    w.l.assign(Bq, 0.0f);
    const std::int64_t rows = round_up(qb.length, kTileRows);
    pack_rows(q, b, h, qb, rows, Dp, q_factor, w.qp.data());

    std::int64_t computed = 0, computed_full = 0;
    for (std::size_t kv_index = 0; kv_index < grid.kv[b].size(); ++kv_index) {
      const BlockMeta& kb = grid.kv[b][kv_index];
      const TileKind kind = classify_tile(qb, kb, mask.causal, segments, Bk);
      if (kind == TileKind::empty) continue;
      ++computed;
      computed_full += kind == TileKind::full;
      const std::int64_t kvi = static_cast<std::int64_t>(kv_index);
      // s: [rows][Bk] = Q' K^T
      dot_rows(w.qp.data(), Dp, kt.at(b, hk, kvi), Bk, D, rows, Bk, w.s.data(), Bk);
      if (kind == TileKind::partial) apply_mask(w.s.data(), rows, Bk, qb, kb, b, mask, Sq, Skv, neg_inf);
      for (std::int64_t r = 0; r < rows; ++r) {
        float* srow = w.s.data() + r * Bk;
        const float m_new = std::max(w.m[r], max_of(srow, Bk));
        if (m_new == neg_inf) {  // nothing visible yet: the tile must leave this row exactly as it was
          std::fill(srow, srow + Bk, 0.0f);
          continue;
        }
        const float alpha = exp2_scalar(w.m[r] - m_new);
        const float sum = exp2_shifted_sum(srow, Bk, m_new);
        w.l[r] = w.l[r] * alpha + sum;
        scale_row(w.acc.data() + r * Dp, Dp, alpha);
        w.m[r] = m_new;
      }
      // acc: [rows][Dp] += P V
      axpy_rows(w.s.data(), 1, Bk, vp.at(b, hk, kvi), Dp, Bk, rows, Dp, w.acc.data(), Dp);
    }
    task_tiles[task] = computed;
    full += computed_full;
    partial += computed - computed_full;

    for (std::int64_t r = 0; r < qb.length; ++r) {
      const std::int64_t i = qb.begin + r;
      float* a = w.acc.data() + r * Dp;
      const float l = w.l[r];
      if (l > 0.0f) {
        for (std::int64_t d = 0; d < D; ++d) a[d] = a[d] / l;
      } else {
        std::fill(a, a + D, 0.0f);
      }
      store_row(o, b, i, h, a, 1.0f);
      if (lse != nullptr) {
        lse[(b * Hq + h) * Sq + i] =
            l > 0.0f ? static_cast<float>((static_cast<double>(w.m[r]) + std::log2(static_cast<double>(l))) *
                                          0.6931471805599453)
                     : neg_inf;
      }
    }
  });

  if (tiles != nullptr) {
    tiles->per_head.assign(static_cast<std::size_t>(B * Hq), 0);
    for (std::int64_t t = 0; t < B * Hq * q_blocks; ++t) tiles->per_head[t / q_blocks] += task_tiles[t];
    tiles->full = full;
    tiles->partial = partial;
  }
}

FlashForwardResult flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const AttentionMask& mask, double scale,
                                           const FlashConfig& config) {
  FlashForwardResult r;
  r.o = Tensor(q.dtype(), q.shape());
  r.lse.assign(static_cast<std::size_t>(q.shape().b * q.shape().h * q.shape().s), 0.0f);
  flash_forward(cref(q), cref(k), cref(v), mask, scale, config, ref(r.o), r.lse.data(), &r.tiles);
  return r;
}

}  // namespace cpattn
