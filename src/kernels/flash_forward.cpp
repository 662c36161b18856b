// Flash attention forward. One task per (batch row, q head, group of q blocks); each walks the kv blocks of
// the fixed global grid in order with an online softmax in base 2 (scale * log2(e) folded into Q when it is
// packed). Per query row the operations are the same whatever its lane or block: the score is a sequential
// FMA chain over d, the max and the sum run over the keys in kv order, the rescale and P V accumulate over kv
// blocks in order.
#include <algorithm>
#include <array>
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
#include "kernels/sinks.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/flash_forward.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/flash_simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace cpattn::kernels::HWY_NAMESPACE {
namespace {

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
// Cache blocking: a task takes a group of up to kGroupBlocks q blocks (768 rows at Bq = 64: 16 panels) and
// walks the kv blocks once for all of their panels, so each packed K and V block (32 + 32 KB at D = 128) is
// read from L3 once per group and from L2 by its other panels; the panels' Q'^T and O^T (24 + 24 KB each,
// 768 KB for the group) stay in the 2 MB L2. A K/V head at S = 4096 (4 MB) does not fit L2, so without the
// group every panel would stream it from L3. Groups of 12 q blocks: each K/V block is read from L3 half as
// often as with 6, and 768 rows are a whole number of panels (docs/performance.md, decisions). Each row's
// operations and their order are the same as with one panel at a time.
constexpr std::int64_t kGroupBlocks = 12;
constexpr std::int64_t kRowsAhead = 4;  // Q and O rows are prefetched this many rows before their use

using GroupKinds = std::array<TileKind, kGroupBlocks>;  // each q block of a group against one kv block

// The panels' row stride: a compile-time constant where the vector length is one (vectors_stride), so that
// the tiles' addresses fold into displacements. Each phase takes it as a local of its own.
HWY_INLINE auto panel_stride() {
  return vectors_stride<kPanelVectors>();
}

struct Panel {
  BlockMeta rows;                    // the panel's rows [begin, begin + length)
  std::int64_t first = 0, last = 0;  // the q blocks it spans, relative to the group
  bool started = false;              // whether acc holds a sum (its first kv block starts it from zero)
  AlignedVector<float> qt, acc, m, l;
};

// A worker's buffers, reused by its tasks.
struct Workspace {
  AlignedVector<float> st, alpha;
  std::vector<float> row;
  std::vector<Panel> panels;
  PrefetchQueue prefetch;
  std::vector<std::int64_t> todo;  // the kv blocks the group computes, in order
  std::vector<GroupKinds> kinds;   // each q block's tile against them
};

// What every task of a call reads: the inputs, outputs and sizes, the packed K and V, the tile counts.
struct ForwardCall {
  const ConstTensorRef& q;
  const AttentionMask& mask;
  const BlockGrid& grid;
  const TensorRef& o;
  float* lse;
  // K and V packed once and shared by every q block and q head of the group, in register-tile order: the
  // score tile of R keys from key r broadcasts K^T[d][r..r+R) for d in order, stored as [Dp][R] at r * Dp
  // (PackLayout::row_tiles); the O^T tile of R head-dim rows from d = r broadcasts V[j][r..r+R) for j in
  // order, stored as [Bk][R] at r * Bk (PackLayout::column_tiles). Each register tile then reads its operand
  // as one sequential run (32 bytes a step at R = 8) that the hardware prefetchers follow from L2; in the
  // plain [Dp][Bk] and [Bk][Dp] blocks a step's values would sit 256 or 512 bytes after the last step's.
  const PackedBlocks& kt;
  const PackedBlocks& vp;
  std::int64_t Sq, Skv, Hq, D, G, Bq, Bk, Dp, q_blocks, groups;
  float q_factor;
  float softcap_b;  // the soft-cap in the scores' base-2 units (cap log2 e), 0 for none
  bool segments;
  bool guard;  // a non-finite V reaches only the rows that may see its key (its P is 0 for the others)
  std::vector<std::int64_t>& task_tiles;
  std::atomic<std::int64_t>& full;
  std::atomic<std::int64_t>& partial;
};

// One task: batch row b, q head h (kv head hk), q blocks [qi0, qi1) in `used` panels.
struct Group {
  std::int64_t b = 0, h = 0, hk = 0, qi0 = 0, qi1 = 0;
  std::int64_t computed[kGroupBlocks] = {}, computed_full[kGroupBlocks] = {};
  std::size_t used = 0;
};

// The kv blocks the group computes (those any of its q blocks sees), in order, with each q block's tile kind
// against them; tiles are classified on the whole (Bq, Bk) block, whatever its panels.
HWY_INLINE void plan_kv_blocks(const ForwardCall& call, Group& g, Workspace& w) {
  w.todo.clear();
  w.kinds.clear();
  const std::vector<BlockMeta>& kv = call.grid.kv[g.b];
  for (std::size_t kv_index = 0; kv_index < kv.size(); ++kv_index) {
    const BlockMeta& kb = kv[kv_index];
    GroupKinds kinds{};
    bool any = false;
    for (std::int64_t qi = g.qi0; qi < g.qi1; ++qi) {
      const TileKind kind = classify_tile(call.grid.q[g.b][qi], kb, call.mask.band(), call.segments, call.Bk);
      kinds[qi - g.qi0] = kind;
      if (kind == TileKind::empty) continue;
      any = true;
      ++g.computed[qi - g.qi0];
      g.computed_full[qi - g.qi0] += kind == TileKind::full;
    }
    if (!any) continue;
    w.todo.push_back(static_cast<std::int64_t>(kv_index));
    w.kinds.push_back(kinds);
  }
}

// The group's panels over its rows (its q blocks are contiguous: block i holds rows [i * Bq, (i + 1) * Bq)),
// each with its Q'^T ([D][panel], zeros in the lanes of no row) and a fresh softmax state. The first kv
// block's K and V are fetched meanwhile, a few lines per row.
HWY_INLINE void build_panels(const ForwardCall& call, Group& g, Workspace& w) {
  const std::int64_t panel = panel_stride();
  const std::int64_t D = call.D, Bq = call.Bq;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const std::int64_t block_bytes = call.Dp * call.Bk * static_cast<std::int64_t>(sizeof(float));
  PrefetchQueue& pf = w.prefetch;
  pf.clear();
  if (!w.todo.empty()) {
    pf.add(call.kt.at(g.b, g.hk, w.todo[0]), block_bytes);
    pf.add(call.vp.at(g.b, g.hk, w.todo[0]), block_bytes);
  }
  const std::int64_t setup_lines =
      (2 * block_bytes / kCacheLine + kGroupBlocks * Bq - 1) / (kGroupBlocks * Bq);
  std::size_t used = 0;
  const std::vector<BlockMeta>& qblocks = call.grid.q[g.b];
  CPATTN_ASSERT(qblocks[g.qi0].begin == g.qi0 * Bq);
  const std::int64_t row0 = qblocks[g.qi0].begin;
  const std::int64_t row1 = qblocks[g.qi1 - 1].begin + qblocks[g.qi1 - 1].length;
  for (std::int64_t p0 = row0; p0 < row1; p0 += panel) {
    if (w.panels.size() <= used) w.panels.emplace_back();
    Panel& pn = w.panels[used++];
    pn.rows = BlockMeta{p0, std::min(panel, row1 - p0), 0, 0, 0, 0};
    pn.first = p0 / Bq - g.qi0;
    pn.last = (p0 + pn.rows.length - 1) / Bq - g.qi0;
    pn.started = false;
    pn.qt.resize(D * panel);  // every value is written below, acc's by the first kv block's tiles
    pn.acc.resize(call.Dp * panel);
    pn.m.assign(panel, neg_inf);
    pn.l.assign(panel, 0.0f);
    for (std::int64_t r = 0; r < pn.rows.length; ++r) {  // Q'^T: [D][panel]
      pf.issue(setup_lines);
      prefetch_row(call.q, g.b, pn.rows.begin + r + kRowsAhead, g.h);
      load_row(call.q, g.b, pn.rows.begin + r, g.h, call.q_factor, D, w.row.data());
      for (std::int64_t d = 0; d < D; ++d) pn.qt[d * panel + r] = w.row[d];
    }
    for (std::int64_t d = 0; d < D && pn.rows.length < panel; ++d) {  // the lanes of no row: zero scores
      std::fill(pn.qt.begin() + d * panel + pn.rows.length, pn.qt.begin() + (d + 1) * panel, 0.0f);
    }
  }
  pf.drain();
  g.used = used;
}

// A panel's tile: its q blocks' kind when they agree, else partial (the mask then gives the rows of a q block
// that sees none of the kv block -inf scores: P = 0, alpha = 1 and m, l and O^T unchanged, exactly as if the
// block were skipped for them).
HWY_INLINE TileKind panel_kind(const GroupKinds& kinds, const Panel& pn) {
  TileKind kind = kinds[pn.first];
  for (std::int64_t blk = pn.first + 1; blk <= pn.last; ++blk) {
    if (kinds[blk] != kind) kind = TileKind::partial;
  }
  return kind;
}

// st: [Bk][panel] = K Q'^T, and colmax each row's maximum over m and the tile: a full tile's taken as it is
// stored, a partial tile's after its mask, from st. Either way the maximum is exact, whatever the order.
// Soft-capped scores are capped first (every tile), then masked and their maximum taken from st.
HWY_INLINE void panel_scores(const ForwardCall& call, const Group& g, Workspace& w, const Panel& pn,
                             TileKind kind, const BlockMeta& kb, const float* kblock, std::int64_t pf_chunk,
                             VF* colmax) {
  const DF df;
  const std::int64_t n = lanes();
  const auto stride = panel_stride();
  const std::int64_t panel = stride;
  const std::int64_t Bk = call.Bk, Dp = call.Dp, D = call.D;
  PrefetchQueue& pf = w.prefetch;
  for (int c = 0; c < kPanelVectors; ++c) colmax[c] = hn::LoadU(df, pn.m.data() + c * n);
  const bool capped = call.softcap_b > 0;
  VF* fused_max = kind == TileKind::full && !capped ? colmax : nullptr;
  for_row_tiles<kRowTile>(Bk, [&](auto R, std::int64_t r) {
    pf.issue(pf_chunk);
    dot_tile<decltype(R)::value, kPanelVectors>(kblock + r * Dp, kAdjacent(), R, pn.qt.data(), stride, D,
                                                w.st.data() + r * panel, stride, fused_max);
  });
  if (capped) softcap_scores(w.st.data(), Bk * panel, call.softcap_b, nullptr);
  if (kind == TileKind::full && !capped) return;
  if (kind == TileKind::partial) {
    apply_mask(w.st.data(), panel, Bk, 1, panel, pn.rows, kb, g.b, call.mask, call.Sq, call.Skv,
               -std::numeric_limits<float>::infinity());
  }
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

// The online softmax step: m becomes colmax, alpha = exp2(m_old - m), P = exp2(S - m) in place and
// l = l * alpha + rowsum(P). Both vectors of a key's row per step (two independent exp2 chains); each lane's
// sum still runs over the keys in order. A separate pass: fused into the score tiles' epilogue with
// FlashAttention-4's lazy rescale it did not pay (docs/performance.md, decisions).
HWY_INLINE void panel_softmax(const ForwardCall& call, Workspace& w, Panel& pn, const VF* colmax) {
  const DF df;
  const std::int64_t n = lanes();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  VF m_use[kPanelVectors], sum[kPanelVectors];
  for (int c = 0; c < kPanelVectors; ++c) {
    const VF m_old = hn::LoadU(df, pn.m.data() + c * n);
    // A row that has seen nothing yet subtracts 0: its P is exp2(-inf) = 0 and its alpha 0 (acc is 0).
    m_use[c] = hn::IfThenZeroElse(hn::Eq(colmax[c], hn::Set(df, neg_inf)), colmax[c]);
    hn::StoreU(exp2_approx(hn::Sub(m_old, m_use[c])), df, w.alpha.data() + c * n);
    hn::StoreU(colmax[c], df, pn.m.data() + c * n);
    sum[c] = hn::Zero(df);
  }
  // Locals, not fields of call: GCC reloads a value it reads through a pointer or reference after each
  // vector store (a may_alias store could change it), and so would read Bk at every step.
  const std::int64_t keys = call.Bk, row_floats = panel_stride(), vec = n;
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
}

// acc: [Dp][panel] = acc * alpha + V^T P^T; the panel's first kv block starts it from zero (its alpha is 0:
// m was -inf). The guard and the start are template arguments, so that each tile's loop has neither test.
HWY_INLINE void panel_pv(const ForwardCall& call, Workspace& w, Panel& pn, const float* vblock,
                         std::int64_t pf_chunk) {
  const auto stride = panel_stride();
  const std::int64_t panel = stride;
  const std::int64_t Bk = call.Bk, Dp = call.Dp;
  PrefetchQueue& pf = w.prefetch;
  const auto pv = [&](auto kGuard, auto kFromZero) {
    for_row_tiles<kRowTile>(Dp, [&](auto R, std::int64_t r) {
      pf.issue(pf_chunk);
      scale_axpy_tile_adjacent<decltype(R)::value, kPanelVectors, kGuard(), kFromZero()>(
          w.alpha.data(), vblock + r * Bk, R, w.st.data(), stride, Bk, pn.acc.data() + r * panel, stride);
    });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (call.guard) {
    pn.started ? pv(Yes(), No()) : pv(Yes(), Yes());
  } else {
    pn.started ? pv(No(), No()) : pv(No(), Yes());
  }
  pn.started = true;
}

// Every panel against the group's kv blocks in order: scores, softmax, P V. The next kv block's K and V are
// fetched into L2 while this one is in use, a share per panel (the group's first panel would otherwise wait
// on L3 for every line of them), a few lines before each register tile (PrefetchQueue).
HWY_INLINE void walk_kv_blocks(const ForwardCall& call, const Group& g, Workspace& w) {
  const std::int64_t block_bytes = call.Dp * call.Bk * static_cast<std::int64_t>(sizeof(float));
  const std::int64_t used = static_cast<std::int64_t>(g.used);
  // The share of both blocks over all but the last of a panel's register tiles (24 at D = 128).
  const std::int64_t tile_count = (call.Bk + kRowTile - 1) / kRowTile + (call.Dp + kRowTile - 1) / kRowTile;
  const std::int64_t spread = std::max<std::int64_t>(1, tile_count - 1);
  PrefetchQueue& pf = w.prefetch;
  for (std::size_t step = 0; step < w.todo.size(); ++step) {
    const std::int64_t kvi = w.todo[step];
    const BlockMeta& kb = call.grid.kv[g.b][kvi];
    const GroupKinds& kinds = w.kinds[step];
    const float* kblock = call.kt.at(g.b, g.hk, kvi);
    const float* vblock = call.vp.at(g.b, g.hk, kvi);
    const bool prefetch = step + 1 < w.todo.size();
    const std::int64_t share = round_up((block_bytes + used - 1) / used, kCacheLine);
    const std::int64_t pf_chunk = (2 * share / kCacheLine + spread - 1) / spread;
    for (std::int64_t pi = 0; pi < used; ++pi) {
      Panel& pn = w.panels[pi];
      pf.clear();
      if (prefetch) {
        const std::int64_t from = pi * share;
        const std::int64_t bytes = std::min(share, block_bytes - from);
        pf.add(reinterpret_cast<const char*>(call.kt.at(g.b, g.hk, w.todo[step + 1])) + from, bytes);
        pf.add(reinterpret_cast<const char*>(call.vp.at(g.b, g.hk, w.todo[step + 1])) + from, bytes);
      }
      const TileKind kind = panel_kind(kinds, pn);
      if (kind == TileKind::empty) {
        pf.drain();
        continue;
      }
      VF colmax[kPanelVectors];
      panel_scores(call, g, w, pn, kind, kb, kblock, pf_chunk, colmax);
      panel_softmax(call, w, pn, colmax);
      panel_pv(call, w, pn, vblock, pf_chunk);
      pf.drain();
    }
  }
}

// O = O^T / l per row (a row that saw no key gets 0) and LSE = (m + log2 l) * ln 2, written out row by row.
HWY_INLINE void write_outputs(const ForwardCall& call, const Group& g, Workspace& w) {
  const DF df;
  const std::int64_t n = lanes();
  const std::int64_t panel = panel_stride();
  const std::int64_t D = call.D;
  for (std::size_t pi = 0; pi < g.used; ++pi) {
    Panel& pn = w.panels[pi];
    if (!pn.started) std::fill(pn.acc.begin(), pn.acc.end(), 0.0f);  // it saw no key: O = 0
    // O^T / l in place, a vector of rows at a time (IEEE division: the same quotient as one row at a time).
    for (int c = 0; c < kPanelVectors; ++c) {
      const VF l = hn::LoadU(df, pn.l.data() + c * n);
      const auto none = hn::Eq(l, hn::Zero(df));
      for (std::int64_t d = 0; d < D; ++d) {
        float* const at = pn.acc.data() + d * panel + c * n;
        hn::StoreU(hn::IfThenZeroElse(none, hn::Div(hn::LoadU(df, at), l)), df, at);
      }
    }
    const float* sink = call.mask.sinks.empty() ? nullptr : &call.mask.sinks[static_cast<std::size_t>(g.h)];
    for (std::int64_t r = 0; r < pn.rows.length; ++r) {
      const std::int64_t i = pn.rows.begin + r;
      prefetch_row<true>(call.o, g.b, i + kRowsAhead, g.h);
      const RowEnd end = finish_row(pn.m[r], pn.l[r], sink);
      for (std::int64_t d = 0; d < D; ++d) w.row[d] = pn.acc[d * panel + r];
      store_row(call.o, g.b, i, g.h, w.row.data(), end.o_factor);
      if (call.lse != nullptr) call.lse[(g.b * call.Hq + g.h) * call.Sq + i] = end.lse;
    }
  }
}

// Task `task`: its group of q blocks planned, its panels built, the kv blocks walked, the outputs written and
// its tiles counted. A head's groups are taken last first: under a causal mask the later q blocks see the
// most keys, and the largest tasks first leave the smallest for the end, when threads run out of work
// unevenly.
void forward_group(const ForwardCall& call, std::int64_t task, Workspace& w) {
  Group g;
  g.b = task / (call.Hq * call.groups);
  g.h = (task / call.groups) % call.Hq;
  g.hk = g.h / call.G;
  g.qi0 = (call.groups - 1 - task % call.groups) * kGroupBlocks;
  g.qi1 = std::min(call.q_blocks, g.qi0 + kGroupBlocks);
  const std::int64_t panel = panel_stride();
  w.st.resize(call.Bk * panel);
  w.alpha.resize(panel);
  w.row.resize(static_cast<std::size_t>(std::max(call.D, call.Dp)));
  plan_kv_blocks(call, g, w);
  build_panels(call, g, w);
  walk_kv_blocks(call, g, w);
  write_outputs(call, g, w);
  for (std::int64_t qi = g.qi0; qi < g.qi1; ++qi) {
    call.task_tiles[(g.b * call.Hq + g.h) * call.q_blocks + qi] = g.computed[qi - g.qi0];
    call.full += g.computed_full[qi - g.qi0];
    call.partial += g.computed[qi - g.qi0] - g.computed_full[qi - g.qi0];
  }
}

}  // namespace

// The vector path (Highway): fp32 arithmetic for fp32 and bf16 inputs alike.
void forward_vector(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                    const AttentionMask& mask, double scale, const FlashConfig& config, const BlockGrid& grid,
                    const TensorRef& o, float* lse, std::vector<std::int64_t>& task_tiles,
                    std::atomic<std::int64_t>& full, std::atomic<std::int64_t>& partial) {
  const std::int64_t Bk = config.block_kv;
  const std::int64_t Dp = padded_head_dim(q.shape.d);
  const PackedBlocks kt(k, grid.kv, Bk, Dp, PackLayout::row_tiles, 1.0f, config.threads);
  const PackedBlocks vp(v, grid.kv, Bk, Dp, PackLayout::column_tiles, 1.0f, config.threads);
  const std::int64_t q_blocks = (q.shape.s + config.block_q - 1) / config.block_q;
  const ForwardCall call{.q = q,
                         .mask = mask,
                         .grid = grid,
                         .o = o,
                         .lse = lse,
                         .kt = kt,
                         .vp = vp,
                         .Sq = q.shape.s,
                         .Skv = k.shape.s,
                         .Hq = q.shape.h,
                         .D = q.shape.d,
                         .G = q.shape.h / k.shape.h,
                         .Bq = config.block_q,
                         .Bk = Bk,
                         .Dp = Dp,
                         .q_blocks = q_blocks,
                         .groups = (q_blocks + kGroupBlocks - 1) / kGroupBlocks,
                         .q_factor = static_cast<float>(scale * kLog2eDouble),
                         .softcap_b = static_cast<float>(mask.softcap * kLog2eDouble),
                         .segments = mask.has_segments(),
                         .guard = any_nonfinite(v),
                         .task_tiles = task_tiles,
                         .full = full,
                         .partial = partial};
  std::vector<Workspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));
  parallel_for(q.shape.b * call.Hq * call.groups, config.threads,
               [&](std::int64_t task, int worker) { forward_group(call, task, spaces[worker]); });
}

}  // namespace cpattn::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cpattn {

namespace kernels {
HWY_EXPORT(forward_vector);
}  // namespace kernels

using namespace kernels;

double flash_cpu_seconds() {
  return static_cast<double>(kernels::kernel_cpu_ns()) * 1e-9;
}

void flash_forward(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                   const AttentionMask& mask, double scale, const FlashConfig& config, const TensorRef& o,
                   float* lse, TileCounts* tiles) {
  const KernelClock clock;
  const trace::Scope event("kernel", "flash_forward", trace::enabled() ? trace_args(q, k, mask) : "");
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
  // The bf16 products cannot skip a masked pair, so a non-finite V (0 * Inf = NaN) takes the vector path.
  if (bf16_inputs && flash_bf16_path(config) != Bf16Path::vector && !any_nonfinite(v)) {
    flash_forward_bf16(q, k, v, mask, scale, config, grid, o, lse, task_tiles, full, partial);
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
