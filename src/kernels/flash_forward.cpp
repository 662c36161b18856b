// Flash attention forward. One task per (batch row, q head, group of q blocks); each walks the kv blocks of
// the fixed global grid in order with an online softmax in base 2 (scale * log2(e) folded into Q when it is
// packed). Per query row the operations are the same whatever its lane or block: the score is a sequential
// FMA chain over d, the max and the sum run over the keys in kv order, the rescale and P V accumulate over kv
// blocks in order.
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "../core/parallel_for.hpp"
#include "aligned_vector.hpp"
#include "flash_amx.hpp"
#include "flash_common.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/flash_forward.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "flash_simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace cpattn::kernels::HWY_NAMESPACE {

// The vector path (Highway): fp32 arithmetic for fp32 and bf16 inputs alike.
void forward_vector(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                    const AttentionMask& mask, double scale, const FlashConfig& config, const BlockGrid& grid,
                    const TensorRef& o, float* lse, std::vector<std::int64_t>& task_tiles,
                    std::atomic<std::int64_t>& full, std::atomic<std::int64_t>& partial) {
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, D = q.shape.d;
  const std::int64_t G = Hq / k.shape.h;
  const std::int64_t Bq = config.block_q, Bk = config.block_kv;
  const std::int64_t Dp = padded_head_dim(D);
  const float q_factor = static_cast<float>(scale * 1.4426950408889634);
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq;
  const bool segments = mask.has_segments();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // K and V packed once and shared by every q block and q head of the group, in register-tile order: the
  // score tile of R keys from key r broadcasts K^T[d][r..r+R) for d in order, stored as [Dp][R] at r * Dp
  // (PackLayout::row_tiles); the O^T tile of R head-dim rows from d = r broadcasts V[j][r..r+R) for j in
  // order, stored as [Bk][R] at r * Bk (PackLayout::column_tiles). Each register tile then reads its operand
  // as one sequential run (32 bytes a step at R = 8) that the hardware prefetchers follow from L2; in the
  // plain [Dp][Bk] and [Bk][Dp] blocks a step's values would sit 256 or 512 bytes after the last step's.
  const PackedBlocks kt(k, grid.kv, Bk, Dp, PackLayout::row_tiles, 1.0f, config.threads);
  const PackedBlocks vp(v, grid.kv, Bk, Dp, PackLayout::column_tiles, 1.0f, config.threads);
  const std::int64_t n = lanes();
  // A non-finite V reaches only the rows that may see its key (its P is 0 for the others).
  const bool guard = any_nonfinite(v);

  // The tile is computed transposed, S^T = K Q'^T, with the q rows along the vector axis: the online softmax
  // then runs lane-wise (one lane per query row, max and sum over the keys in order, no horizontal
  // reductions), and O^T += V^T P^T reuses the same register tiles. The rows are computed in panels of
  // kPanelVectors vectors of query rows (48 rows with 16 lanes) with 8 x 3 register tiles: the score phase
  // keeps a panel's Q'^T and S^T (24 + 12 KB at D = 128) in the 48 KB L1 while K streams past, the P V phase
  // its S^T and O^T (12 + 24 KB) while V does. 8 x 3 tiles load 11 values per 24 FMAs (12 x 2: 14) and a
  // 48-row panel reads each K and V block once per 48 rows, not 32 (docs/performance.md, decisions). A panel
  // may span two q blocks; each row's arithmetic is the same in any panel.
  constexpr int kPanelVectors = 3;
  constexpr int kRowTile = 8;  // 8 x 3 register tiles: 24 accumulators
  static_assert(kRowTile == kForwardRowTile, "the packed K and V tiles are the register tiles");
  const std::int64_t tile_count = (Bk + kRowTile - 1) / kRowTile + (Dp + kRowTile - 1) / kRowTile;
  // The tiles' row stride: a compile-time constant where the vector length is one (vectors_stride).
  const auto panel_stride = vectors_stride<kPanelVectors>();
  const std::int64_t panel = panel_stride;
  // Cache blocking: a task takes a group of up to kGroupBlocks q blocks (768 rows at Bq = 64: 16 panels) and
  // walks the kv blocks once for all of their panels, so each packed K and V block (32 + 32 KB at D = 128) is
  // read from L3 once per group and from L2 by its other panels; the panels' Q'^T and O^T (24 + 24 KB each,
  // 768 KB for the group) stay in the 2 MB L2. A K/V head at S = 4096 (4 MB) does not fit L2, so without the
  // group every panel would stream it from L3. Groups of 12 q blocks: each K/V block is read from L3 half as
  // often as with 6, and 768 rows are a whole number of panels (docs/performance.md, decisions). Each row's
  // operations and their order are the same as with one panel at a time.
  constexpr std::int64_t kGroupBlocks = 12;
  constexpr std::int64_t kRowsAhead = 4;  // Q and O rows are prefetched this many rows before their use
  const std::int64_t groups = (q_blocks + kGroupBlocks - 1) / kGroupBlocks;
  struct Panel {
    BlockMeta rows;                    // the panel's rows [begin, begin + length)
    std::int64_t first = 0, last = 0;  // the q blocks it spans, relative to the group
    bool started = false;              // whether acc holds a sum (its first kv block starts it from zero)
    AlignedVector<float> qt, acc, m, l;
  };
  struct Workspace {
    AlignedVector<float> st, alpha;
    std::vector<Panel> panels;
    PrefetchQueue prefetch;
    std::vector<std::int64_t> todo;                         // the kv blocks the group computes, in order
    std::vector<std::array<TileKind, kGroupBlocks>> kinds;  // each q block's tile against them
  };
  std::vector<Workspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));

  // A head's groups are taken last first: under a causal mask the later q blocks see the most keys, and the
  // largest tasks first leave the smallest for the end, when threads run out of work unevenly.
  parallel_for(B * Hq * groups, config.threads, [&](std::int64_t task, int worker) {
    const std::int64_t b = task / (Hq * groups);
    const std::int64_t h = (task / groups) % Hq;
    const std::int64_t hk = h / G;
    const std::int64_t qi0 = (groups - 1 - task % groups) * kGroupBlocks;
    const std::int64_t qi1 = std::min(q_blocks, qi0 + kGroupBlocks);
    Workspace& w = spaces[worker];
    w.st.resize(Bk * panel);
    w.alpha.resize(panel);
    std::vector<float> row(static_cast<std::size_t>(std::max(D, Dp)));
    const DF df;
    std::int64_t computed[kGroupBlocks] = {}, computed_full[kGroupBlocks] = {};
    w.todo.clear();
    w.kinds.clear();
    for (std::size_t kv_index = 0; kv_index < grid.kv[b].size(); ++kv_index) {
      const BlockMeta& kb = grid.kv[b][kv_index];
      std::array<TileKind, kGroupBlocks> kinds{};
      bool any = false;
      for (std::int64_t qi = qi0; qi < qi1; ++qi) {
        // Tiles are classified on the whole (Bq, Bk) block, whatever its panels.
        const TileKind kind = classify_tile(grid.q[b][qi], kb, mask.causal, segments, Bk);
        kinds[qi - qi0] = kind;
        if (kind == TileKind::empty) continue;
        any = true;
        ++computed[qi - qi0];
        computed_full[qi - qi0] += kind == TileKind::full;
      }
      if (!any) continue;
      w.todo.push_back(static_cast<std::int64_t>(kv_index));
      w.kinds.push_back(kinds);
    }
    const std::int64_t block_bytes = Dp * Bk * static_cast<std::int64_t>(sizeof(float));
    // The first kv block's K and V are fetched while the panels' Q'^T are built (a few lines per row).
    PrefetchQueue& pf = w.prefetch;
    pf.clear();
    if (!w.todo.empty()) {
      pf.add(kt.at(b, hk, w.todo[0]), block_bytes);
      pf.add(vp.at(b, hk, w.todo[0]), block_bytes);
    }
    const std::int64_t setup_lines =
        (2 * block_bytes / kCacheLine + kGroupBlocks * Bq - 1) / (kGroupBlocks * Bq);
    std::size_t used = 0;
    // The group's rows (its q blocks are contiguous: block i holds rows [i * Bq, (i + 1) * Bq)).
    CPATTN_ASSERT(grid.q[b][qi0].begin == qi0 * Bq);
    const std::int64_t row0 = grid.q[b][qi0].begin;
    const std::int64_t row1 = grid.q[b][qi1 - 1].begin + grid.q[b][qi1 - 1].length;
    for (std::int64_t p0 = row0; p0 < row1; p0 += panel) {
      if (w.panels.size() <= used) w.panels.emplace_back();
      Panel& pn = w.panels[used++];
      pn.rows = BlockMeta{p0, std::min(panel, row1 - p0), 0, 0, 0, 0};
      pn.first = p0 / Bq - qi0;
      pn.last = (p0 + pn.rows.length - 1) / Bq - qi0;
      pn.started = false;
      pn.qt.resize(D * panel);  // every value is written below, acc's by the first kv block's tiles
      pn.acc.resize(Dp * panel);
      pn.m.assign(panel, neg_inf);
      pn.l.assign(panel, 0.0f);
      for (std::int64_t r = 0; r < pn.rows.length; ++r) {  // Q'^T: [D][panel]
        pf.issue(setup_lines);
        prefetch_row(q, b, pn.rows.begin + r + kRowsAhead, h);
        load_row(q, b, pn.rows.begin + r, h, q_factor, D, row.data());
        for (std::int64_t d = 0; d < D; ++d) pn.qt[d * panel + r] = row[d];
      }
      for (std::int64_t d = 0; d < D && pn.rows.length < panel; ++d) {  // the lanes of no row: zero scores
        std::fill(pn.qt.begin() + d * panel + pn.rows.length, pn.qt.begin() + (d + 1) * panel, 0.0f);
      }
    }
    pf.drain();
    for (std::size_t step = 0; step < w.todo.size(); ++step) {
      const std::int64_t kvi = w.todo[step];
      const BlockMeta& kb = grid.kv[b][kvi];
      const std::array<TileKind, kGroupBlocks>& kinds = w.kinds[step];
      const float* kblock = kt.at(b, hk, kvi);
      const float* vblock = vp.at(b, hk, kvi);
      // The next kv block's K and V are fetched into L2 while this one is in use, a share per panel (the
      // group's first panel would otherwise wait on L3 for every line of them), a few lines before each
      // register tile (PrefetchQueue).
      const bool prefetch = step + 1 < w.todo.size();
      const std::int64_t share = round_up(
          (block_bytes + static_cast<std::int64_t>(used) - 1) / static_cast<std::int64_t>(used), kCacheLine);
      // The share of both blocks over all but the last of a panel's register tiles (24 at D = 128).
      const std::int64_t spread = std::max<std::int64_t>(1, tile_count - 1);
      const std::int64_t pf_chunk = (2 * share / kCacheLine + spread - 1) / spread;
      for (std::size_t pi = 0; pi < used; ++pi) {
        Panel& pn = w.panels[pi];
        pf.clear();
        if (prefetch) {
          const std::int64_t from = static_cast<std::int64_t>(pi) * share;
          const std::int64_t bytes = std::min(share, block_bytes - from);
          pf.add(reinterpret_cast<const char*>(kt.at(b, hk, w.todo[step + 1])) + from, bytes);
          pf.add(reinterpret_cast<const char*>(vp.at(b, hk, w.todo[step + 1])) + from, bytes);
        }
        // A panel's tile: its q blocks' kind when they agree, else partial (the mask then gives the rows of a
        // q block that sees none of the kv block -inf scores: P = 0, alpha = 1 and m, l and O^T unchanged,
        // exactly as if the block were skipped for them).
        TileKind kind = kinds[pn.first];
        for (std::int64_t blk = pn.first + 1; blk <= pn.last; ++blk) {
          if (kinds[blk] != kind) kind = TileKind::partial;
        }
        if (kind == TileKind::empty) {
          pf.drain();
          continue;
        }
        // st: [Bk][panel] = K Q'^T; a full tile's row maxima are taken as it is stored, a partial tile's
        // after its mask, from st. Either way the maximum is exact, whatever the order.
        VF colmax[kPanelVectors];
        for (int c = 0; c < kPanelVectors; ++c) colmax[c] = hn::LoadU(df, pn.m.data() + c * n);
        VF* fused_max = kind == TileKind::full ? colmax : nullptr;
        for_row_tiles<kRowTile>(Bk, [&](auto R, std::int64_t r) {
          pf.issue(pf_chunk);
          dot_tile<decltype(R)::value, kPanelVectors>(kblock + r * Dp, kAdjacent(), R, pn.qt.data(),
                                                      panel_stride, D, w.st.data() + r * panel, panel_stride,
                                                      fused_max);
        });
        if (kind == TileKind::partial) {
          apply_mask(w.st.data(), panel, Bk, 1, panel, pn.rows, kb, b, mask, Sq, Skv, neg_inf);
          for (int c = 0; c < kPanelVectors; ++c) {
            // Four chains: the maximum is exact in any order, and one chain waits on each max's latency.
            VF m4[4] = {colmax[c], colmax[c], colmax[c], colmax[c]};
            for (std::int64_t j = 0; j < Bk; j += 4) {
              for (int u = 0; u < 4; ++u)
                m4[u] = hn::Max(m4[u], hn::LoadU(df, w.st.data() + (j + u) * panel + c * n));
            }
            colmax[c] = hn::Max(hn::Max(m4[0], m4[1]), hn::Max(m4[2], m4[3]));
          }
        }
        // P = exp2(S - m) in place, both vectors of a key's row per step (two independent exp2 chains); each
        // lane's sum still runs over the keys in order. A separate pass: fused into the score tiles' epilogue
        // with FlashAttention-4's lazy rescale it did not pay (docs/performance.md, decisions).
        VF m_use[kPanelVectors], sum[kPanelVectors];
        for (int c = 0; c < kPanelVectors; ++c) {
          const VF m_old = hn::LoadU(df, pn.m.data() + c * n);
          // A row that has seen nothing yet subtracts 0: its P is exp2(-inf) = 0 and its alpha 0 (acc is 0).
          m_use[c] = hn::IfThenZeroElse(hn::Eq(colmax[c], hn::Set(df, neg_inf)), colmax[c]);
          hn::StoreU(exp2_approx(hn::Sub(m_old, m_use[c])), df, w.alpha.data() + c * n);
          hn::StoreU(colmax[c], df, pn.m.data() + c * n);
          sum[c] = hn::Zero(df);
        }
        // Locals, not the lambda's captures: GCC reloads a captured value after each vector store (a
        // may_alias store could change it), and so read Bk, panel and n from memory at every step.
        const std::int64_t keys = Bk, row_floats = panel, vec = n;
        float* at = w.st.data();
        for (std::int64_t j = 0; j < keys; ++j, at += row_floats) {
          for (int c = 0; c < kPanelVectors; ++c) {
            const VF p = exp2_approx(hn::Sub(hn::LoadU(df, at + c * vec), m_use[c]));
            hn::StoreU(p, df, at + c * vec);
            sum[c] = hn::Add(sum[c], p);
          }
        }
        for (int c = 0; c < kPanelVectors; ++c) {
          const VF alpha = hn::LoadU(df, w.alpha.data() + c * n);
          hn::StoreU(hn::MulAdd(hn::LoadU(df, pn.l.data() + c * n), alpha, sum[c]), df, pn.l.data() + c * n);
        }
        // acc: [Dp][panel] = acc * alpha + V^T P^T; the panel's first kv block starts it from zero (its alpha
        // is 0: m was -inf).
        const auto pv = [&](auto kGuard, auto kFromZero) {
          for_row_tiles<kRowTile>(Dp, [&](auto R, std::int64_t r) {
            pf.issue(pf_chunk);
            scale_axpy_tile_adjacent<decltype(R)::value, kPanelVectors, kGuard(), kFromZero()>(
                w.alpha.data(), vblock + r * Bk, R, w.st.data(), panel_stride, Bk, pn.acc.data() + r * panel,
                panel_stride);
          });
        };
        using Yes = std::true_type;
        using No = std::false_type;
        if (guard) {
          pn.started ? pv(Yes(), No()) : pv(Yes(), Yes());
        } else {
          pn.started ? pv(No(), No()) : pv(No(), Yes());
        }
        pn.started = true;
        pf.drain();
      }
    }
    for (std::size_t pi = 0; pi < used; ++pi) {
      Panel& pn = w.panels[pi];
      if (!pn.started) std::fill(pn.acc.begin(), pn.acc.end(), 0.0f);  // it saw no key: O = 0
      // O^T / l in place, a vector of rows at a time (IEEE division: the same quotient as one row at a time);
      // a row that saw no key gets 0.
      for (int c = 0; c < kPanelVectors; ++c) {
        const VF l = hn::LoadU(df, pn.l.data() + c * n);
        const auto none = hn::Eq(l, hn::Zero(df));
        for (std::int64_t d = 0; d < D; ++d) {
          float* const at = pn.acc.data() + d * panel + c * n;
          hn::StoreU(hn::IfThenZeroElse(none, hn::Div(hn::LoadU(df, at), l)), df, at);
        }
      }
      for (std::int64_t r = 0; r < pn.rows.length; ++r) {
        const std::int64_t i = pn.rows.begin + r;
        prefetch_row<true>(o, b, i + kRowsAhead, h);
        const float l = pn.l[r];
        for (std::int64_t d = 0; d < D; ++d) row[d] = pn.acc[d * panel + r];
        store_row(o, b, i, h, row.data(), 1.0f);
        if (lse != nullptr) {
          lse[(b * Hq + h) * Sq + i] =
              l != 0.0f
                  ? static_cast<float>((static_cast<double>(pn.m[r]) + std::log2(static_cast<double>(l))) *
                                       0.6931471805599453)
                  : neg_inf;
        }
      }
    }
    for (std::int64_t qi = qi0; qi < qi1; ++qi) {
      task_tiles[(b * Hq + h) * q_blocks + qi] = computed[qi - qi0];
      full += computed_full[qi - qi0];
      partial += computed[qi - qi0] - computed_full[qi - qi0];
    }
  });
}

// The SIMD target this copy of the kernels was compiled for (Highway's name).
const char* vector_target_name() {
  return hwy::TargetName(HWY_TARGET);
}

}  // namespace cpattn::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cpattn {

namespace kernels {
HWY_EXPORT(forward_vector);
HWY_EXPORT(vector_target_name);
}  // namespace kernels

using namespace kernels;

void flash_forward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                   const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& o,
                   float* lse, TileCounts* tiles) {
  check_forward_args(q, k, v, mask, config);
  check_same_shape("o", o.shape, q.shape);
  apply_simd_target_env();
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h;
  const std::int64_t q_blocks = (Sq + config.block_q - 1) / config.block_q;
  const BlockGrid grid = make_block_grid(mask, B, Sq, Skv, config);

  // Tiles computed by each task, [B][Hq][q_blocks], summed per head afterwards.
  std::vector<std::int64_t> task_tiles(static_cast<std::size_t>(B * Hq * q_blocks), 0);
  std::atomic<std::int64_t> full{0}, partial{0};
  const bool bf16_inputs = q.dtype == DType::bf16 && k.dtype == DType::bf16 && v.dtype == DType::bf16;
  // The tile unit cannot skip a masked pair, so a non-finite V (0 * Inf = NaN) takes the vector path.
  if (bf16_inputs && flash_uses_amx(DType::bf16, config) && !any_nonfinite(v)) {
    flash_forward_amx(q, k, v, mask, scale, config, grid, o, lse, task_tiles, full, partial);
  } else {
    HWY_DYNAMIC_DISPATCH(forward_vector)
    (q, k, v, mask, scale, config, grid, o, lse, task_tiles, full, partial);
  }

  if (tiles != nullptr) {
    tiles->per_head.assign(static_cast<std::size_t>(B * Hq), 0);
    for (std::int64_t t = 0; t < B * Hq * q_blocks; ++t) tiles->per_head[t / q_blocks] += task_tiles[t];
    tiles->full = full;
    tiles->partial = partial;
  }
}

namespace {
std::int64_t forced_target = 0;  // flash_force_vector_target's, 0: none

// Every compiled target this CPU supports, whatever is forced now.
std::vector<std::int64_t> all_vector_targets() {
  hwy::SetSupportedTargetsForTest(0);
  std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  hwy::SetSupportedTargetsForTest(forced_target);
  return targets;
}

void force_vector_target(const std::string& name) {
  std::int64_t chosen = 0;
  std::string valid;
  for (const std::int64_t t : all_vector_targets()) {
    if (name == hwy::TargetName(t)) chosen = t;
    valid += (valid.empty() ? "" : ", ") + std::string(hwy::TargetName(t));
  }
  if (!name.empty() && chosen == 0) {
    throw Error(
        ErrorKind::invalid_input, "simd_target", name,
        "SIMD target '" + name + "' is not compiled in or not supported by this CPU (valid: " + valid + ")");
  }
  forced_target = chosen;
  hwy::SetSupportedTargetsForTest(forced_target);
}
}  // namespace

std::vector<std::string> flash_vector_targets() {
  kernels::apply_simd_target_env();
  std::vector<std::string> names;
  for (const std::int64_t t : all_vector_targets()) names.emplace_back(hwy::TargetName(t));
  return names;
}

std::string flash_vector_target() {
  kernels::apply_simd_target_env();
  return HWY_DYNAMIC_DISPATCH(vector_target_name)();
}

void flash_force_vector_target(const std::string& name) {
  kernels::apply_simd_target_env();
  force_vector_target(name);
}

namespace kernels {
// CPATTN_SIMD_TARGET, read once before the kernels first run (an invalid name is an error on every call).
void apply_simd_target_env() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("CPATTN_SIMD_TARGET");
    if (env == nullptr || *env == 0) return;
    try {
      force_vector_target(env);
    } catch (const Error& e) {
      throw Error(ErrorKind::invalid_config, "CPATTN_SIMD_TARGET", env,
                  std::string("environment variable CPATTN_SIMD_TARGET=") + env + ": " + e.what());
    }
  });
}
}  // namespace kernels

bool flash_uses_amx(DType dtype, const FlashConfig& config) {
  return dtype == DType::bf16 && config.allow_amx && amx_bf16_usable();
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
#endif  // HWY_ONCE
