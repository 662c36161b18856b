// Operand packing: a call's K, V, Q and dO blocks converted to fp32 once, zero-padded and laid out as the
// register tiles read them, then shared by every tile that needs them.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpattn/flash.hpp"
#include "kernels/prefetch.hpp"
#include "kernels/row_io.hpp"
#include "kernels/scratch.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn::kernels {

// Packing prefetches a block's rows this many rows ahead of their loads (prefetch_row): without it the
// strided loads of K and V rows are most of packing's time (docs/performance.md, decisions).
inline constexpr std::int64_t kPackRowsAhead = 8;

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
