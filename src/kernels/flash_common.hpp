// What the forward and backward flash kernels share: argument checks, row loads/stores with dtype
// conversion, block packing and the mask applied by selection.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cpattn/error.hpp"
#include "cpattn/flash.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn::kernels {

inline constexpr int kTileRows = 4;  // q rows of a backward tile are padded to a multiple of it
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr std::int64_t kCacheLine = 64;  // bytes, for software prefetches
// 2^f for f in [-0.5, 0.5]: the degree-6 minimax polynomial of the kernels' exp2 (relative error 1.9e-9
// before float rounding; Remez exchange on the relative error), coefficients of f^6 down to f^0, for Horner.
inline constexpr float kExp2Poly[7] = {1.5345812004000534e-04f,
                                       1.3399931219124377e-03f,
                                       9.618488957102513e-03f,
                                       5.5503287769656406e-02f,
                                       2.4022646890634405e-01f,
                                       6.931472057372673e-01f,
                                       1.0f};

inline std::int64_t round_up(std::int64_t x, std::int64_t m) {
  return (x + m - 1) / m * m;
}

// D values of row (b, s, h) as floats times `factor` into out[0, width), zero-padded past D.
inline void load_row(const ConstTensorRef& t, std::int64_t b, std::int64_t s, std::int64_t h, float factor,
                     std::int64_t width, float* out) {
  const std::int64_t d = t.shape.d;
  const std::int64_t off = t.offset(b, s, h);
  if (t.dtype == DType::f32) {
    const float* src = static_cast<const float*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) out[i] = src[i] * factor;
  } else {
    const bf16* src = static_cast<const bf16*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) out[i] = bf16_to_float(src[i]) * factor;
  }
  for (std::int64_t i = d; i < width; ++i) out[i] = 0.0f;
}

inline void store_row(const TensorRef& t, std::int64_t b, std::int64_t s, std::int64_t h, const float* in,
                      float factor) {
  const std::int64_t d = t.shape.d;
  const std::int64_t off = t.offset(b, s, h);
  if (t.dtype == DType::f32) {
    float* dst = static_cast<float*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) dst[i] = in[i] * factor;
  } else {
    bf16* dst = static_cast<bf16*>(t.ptr) + off;
    for (std::int64_t i = 0; i < d; ++i) dst[i] = float_to_bf16(in[i] * factor);
  }
}

// Prefetches row (b, s, h) of t into L1, for reading or (kWrite) for writing: the kernels read and write rows
// of [B, S, H, D] tensors H * D elements apart, a stride the hardware prefetchers do not follow, so a row
// fetched only when it is loaded or stored waits on memory.
template <bool kWrite = false, class Ptr>
inline void prefetch_row(const BasicTensorRef<Ptr>& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  if (s >= t.shape.s) return;
  const std::int64_t bytes = t.shape.d * static_cast<std::int64_t>(dtype_size(t.dtype));
  const char* p =
      static_cast<const char*>(t.ptr) + t.offset(b, s, h) * static_cast<std::int64_t>(dtype_size(t.dtype));
  for (std::int64_t at = 0; at < bytes; at += kCacheLine) __builtin_prefetch(p + at, kWrite ? 1 : 0, 3);
}

// Packing prefetches a block's rows this many rows ahead of their loads (prefetch_row): without it the
// strided loads of K and V rows are most of packing's time (docs/performance.md, decisions).
inline constexpr std::int64_t kPackRowsAhead = 8;

// Software prefetch into L2 (prefetcht1) of up to eight byte ranges, a few cache lines at a time: the kernels
// fetch the operands of their next block this way between register tiles. Issued in one burst, a block's
// requests fill the line-fill buffers and the burst itself stalls the loop.
class PrefetchQueue {
 public:
  void clear() { count_ = at_ = 0, line_ = 0; }
  void add(const void* p, std::int64_t bytes) {  // an empty or negative range adds nothing
    if (bytes <= 0) return;
    CPATTN_ASSERT(count_ < kRanges);
    ranges_[count_++] = {static_cast<const char*>(p), (bytes + kCacheLine - 1) / kCacheLine};
  }
  // The next `lines` lines, in the order the ranges were added.
  void issue(std::int64_t lines) {
    for (; lines > 0 && at_ < count_; --lines) {
      __builtin_prefetch(ranges_[at_].p + line_ * kCacheLine, 0, 2);
      if (++line_ == ranges_[at_].lines) ++at_, line_ = 0;
    }
  }
  void drain() { issue(std::numeric_limits<std::int64_t>::max()); }

 private:
  static constexpr int kRanges = 8;
  struct Range {
    const char* p = nullptr;
    std::int64_t lines = 0;
  };
  Range ranges_[kRanges];
  int count_ = 0, at_ = 0;
  std::int64_t line_ = 0;
};

// Block rows as [rows_padded][width] (row-major), zeros past `length` rows.
inline void pack_rows(const ConstTensorRef& t, std::int64_t b, std::int64_t h, const BlockMeta& blk,
                      std::int64_t rows_padded, std::int64_t width, float factor, float* out) {
  for (std::int64_t r = 0; r < rows_padded; ++r) {
    if (r < blk.length) {
      prefetch_row(t, b, blk.begin + r + kPackRowsAhead, h);
      load_row(t, b, blk.begin + r, h, factor, width, out + r * width);
    } else {
      std::memset(out + r * width, 0, static_cast<std::size_t>(width) * sizeof(float));
    }
  }
}

namespace mask_detail {
// One visible run: x[i * step] for i < n keeps its score when the pair is visible, else `fill`. `other` is
// the fixed side (a key's position and segment against n query rows, or a query row's against n keys).
template <bool kCausal, bool kSegments, bool kKeysVary>
inline void select_run(float* x, std::int64_t step, std::int64_t n, const std::int32_t* pos,
                       const std::int32_t* seg, std::int32_t other_pos, std::int32_t other_seg, float fill) {
  for (std::int64_t i = 0; i < n; ++i) {
    bool seen = true;
    if constexpr (kSegments) seen = seen && seg[i] == other_seg;
    if constexpr (kCausal) seen = seen && (kKeysVary ? pos[i] <= other_pos : other_pos <= pos[i]);
    x[i * step] = seen ? x[i * step] : fill;
  }
}

template <bool kCausal, bool kSegments>
inline void apply_mask_as(float* s, std::int64_t q_rows, std::int64_t keys, std::int64_t q_stride,
                          std::int64_t key_stride, const BlockMeta& qb, const BlockMeta& kb, std::int64_t b,
                          const AttentionMask& mask, std::int64_t sq, std::int64_t skv, float fill) {
  const std::int32_t* qpos = mask.q_positions.data() + b * sq + qb.begin;
  const std::int32_t* kpos = mask.kv_positions.data() + b * skv + kb.begin;
  const std::int32_t* qseg = kSegments ? mask.q_segments.data() + b * sq + qb.begin : nullptr;
  const std::int32_t* kseg = kSegments ? mask.kv_segments.data() + b * skv + kb.begin : nullptr;
  const std::int64_t qn = std::min(q_rows, qb.length), kn = std::min(keys, kb.length);
  if (key_stride == 1) {  // S: a query row's keys are contiguous
    for (std::int64_t r = 0; r < q_rows; ++r) {
      float* row = s + r * q_stride;
      const std::int64_t valid = r < qn ? kn : 0;
      select_run<kCausal, kSegments, true>(row, 1, valid, kpos, kseg, qpos[r < qn ? r : 0],
                                           kSegments ? qseg[r < qn ? r : 0] : 0, fill);
      std::fill(row + valid, row + keys, fill);
    }
    return;
  }
  // S^T: a key's query rows are contiguous (q_stride == 1)
  for (std::int64_t j = 0; j < keys; ++j) {
    float* col = s + j * key_stride;
    const std::int64_t valid = j < kn ? qn : 0;
    select_run<kCausal, kSegments, false>(col, q_stride, valid, qpos, qseg, kpos[j < kn ? j : 0],
                                          kSegments ? kseg[j < kn ? j : 0] : 0, fill);
    for (std::int64_t r = valid; r < q_rows; ++r) col[r * q_stride] = fill;
  }
}
}  // namespace mask_detail

// Scores of keys a row may not see become `fill`; padded rows and keys too. The score of query row r and key
// j is s[r * q_stride + j * key_stride] (a row-major S tile with key_stride 1, or a transposed S^T tile with
// q_stride 1). Selection only, so a visible score keeps its bits; the loops run over the block's positions
// and segments in place (branch-free, vectorized by the compiler).
inline void apply_mask(float* s, std::int64_t q_rows, std::int64_t keys, std::int64_t q_stride,
                       std::int64_t key_stride, const BlockMeta& qb, const BlockMeta& kb, std::int64_t b,
                       const AttentionMask& mask, std::int64_t sq, std::int64_t skv, float fill) {
  CPATTN_ASSERT(key_stride == 1 || q_stride == 1);
  if (qb.length == 0 || kb.length == 0) {
    for (std::int64_t r = 0; r < q_rows; ++r)
      for (std::int64_t j = 0; j < keys; ++j) s[r * q_stride + j * key_stride] = fill;
    return;
  }
  const bool segments = mask.has_segments();
  if (mask.causal && segments) {
    mask_detail::apply_mask_as<true, true>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                           fill);
  } else if (mask.causal) {
    mask_detail::apply_mask_as<true, false>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                            fill);
  } else if (segments) {
    mask_detail::apply_mask_as<false, true>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                            fill);
  } else {
    mask_detail::apply_mask_as<false, false>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                             fill);
  }
}

// Whether any element of t is Inf or NaN (the kernels then guard their products so that a masked pair adds
// exactly nothing: 0 * Inf is NaN).
bool any_nonfinite(const ConstTensorRef& t);

// The backward's stripe: how many kv blocks of per-q-head fp64 dK and dV partials
// ([B][Hq][stripe][Bk][width], two of them) fit in config.backward_partial_bytes (at least 1, at most
// kv_blocks); every kv block when a kv head serves one q head (group == 1: no partials).
inline std::int64_t backward_stripe_blocks(const FlashConfig& config, std::int64_t batch,
                                           std::int64_t q_heads, std::int64_t group, std::int64_t width,
                                           std::int64_t kv_blocks) {
  if (group == 1) return kv_blocks;
  const double bytes_per_block = 2.0 * 8.0 * static_cast<double>(batch * q_heads * config.block_kv * width);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(config.backward_partial_bytes / bytes_per_block),
                                  1, kv_blocks);
}

// Applies CPATTN_SIMD_TARGET (a name from flash_vector_targets()) once per process, before the first kernel;
// an invalid name throws Error(invalid_config) naming the valid ones, on every call.
void apply_simd_target_env();

// Shapes and sizes agree; throws Error(invalid_input) naming the tensor otherwise.
void check_forward_args(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                        const AttentionMask& mask, const FlashConfig& config);
void check_same_shape(const char* name, const Shape4& got, const Shape4& want);

// Per batch row, the q and kv block metadata.
struct BlockGrid {
  std::vector<std::vector<BlockMeta>> q, kv;  // [B][blocks]
};
BlockGrid make_block_grid(const AttentionMask& mask, std::int64_t batch, std::int64_t sq, std::int64_t skv,
                          const FlashConfig& config);

// Scratch of n floats, uninitialized, for a call's packed operands. From 2 MiB on it is its own mapping
// (mmap, apart from malloc's heap), aligned to 2 MiB and advised as transparent huge pages (madvise: under
// THP mode "madvise" 4 KiB pages would cost a page fault per 4 KiB), and when freed it is kept for the next
// call that needs a block of its size (kKeptScratchBytes in all, the most recently freed kept first): fresh
// pages cost every call their faults and zeroing (docs/performance.md, decisions), while calls of one shape
// ask for the same sizes each time.
class ScratchFloats {
 public:
  static constexpr std::size_t kKeptScratchBytes = std::size_t{128} << 20;
  explicit ScratchFloats(std::size_t n);
  ~ScratchFloats();
  ScratchFloats(const ScratchFloats&) = delete;
  ScratchFloats& operator=(const ScratchFloats&) = delete;
  float* get() const { return data_; }
  // Frees every kept block (tests; a caller that wants the memory back).
  static void release_kept();
  static std::size_t kept_bytes();

 private:
  float* data_ = nullptr;
  std::size_t bytes_ = 0;  // what was allocated (0: malloc'd, not kept)
};

// The register tiles of `rows` rows (a multiple of 2), as for_row_tiles<rmax> (flash_simd.hpp) walks them and
// the forward's packed operands are laid out: rmax rows while they fit, then 8, 4 and 2 (those below rmax)
// for the rest. The size of the tile that starts at row r:
inline std::int64_t row_tile_size(std::int64_t rows, std::int64_t r, std::int64_t rmax) {
  const std::int64_t left = rows - r;
  if (left >= rmax) return rmax;
  if (rmax > 8 && left >= 8) return 8;
  if (rmax > 4 && left >= 4) return 4;
  return 2;
}

// How PackedBlocks lays out a block of `block` rows of t (each `width` wide: D values, zeros past them).
enum class PackLayout {
  rows,        // [block][width], row-major
  transposed,  // [width][block]
  // The block's rows in register tiles (row_tile_size(block, r, kForwardRowTile)), each tile of R rows
  // starting at row r stored at r * width as [width][R]: a tile's R values of one column are adjacent and its
  // columns follow one another, so a register tile reads its operand as one sequential run (the forward's
  // K^T).
  row_tiles,
  // The width's columns in register tiles (row_tile_size(width, c, kForwardRowTile)), each tile of R columns
  // starting at column c stored at c * block as [block][R] (the forward's V, whose O^T tiles run over d).
  column_tiles,
};

// Rows of the forward's register tiles (8 x 3 vectors: 24 accumulators), and so of PackLayout's tiles.
inline constexpr std::int64_t kForwardRowTile = 8;

// Every block of t ([B, S, H, D]) on a grid, packed once per call and shared by all the tiles that read it,
// zero-padded, times `factor`, laid out as `layout` says.
class PackedBlocks {
 public:
  PackedBlocks(const ConstTensorRef& t, const std::vector<std::vector<BlockMeta>>& blocks, std::int64_t block,
               std::int64_t width, PackLayout layout, float factor, int threads);
  const float* at(std::int64_t b, std::int64_t h, std::int64_t index) const {
    return data_->get() + ((b * heads_ + h) * per_row_ + index) * block_floats_;
  }

 private:
  std::int64_t heads_ = 0, per_row_ = 0, block_floats_ = 0;
  // Not value-initialized: every block is written whole by its packing task (a zeroing pass first was a
  // second write of every byte).
  std::unique_ptr<ScratchFloats> data_;
};

}  // namespace cpattn::kernels
