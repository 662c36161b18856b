#include "kernels/packing.hpp"

#include <algorithm>

#include "core/parallel_for.hpp"

namespace cpattn::kernels {

PackedBlocks::PackedBlocks(const ConstTensorRef& t, const std::vector<std::vector<BlockMeta>>& blocks,
                           std::int64_t block, std::int64_t width, PackLayout layout, float factor,
                           int threads) {
  const std::int64_t B = t.shape.b, D = t.shape.d;
  heads_ = t.shape.h;
  per_row_ = blocks.empty() ? 0 : static_cast<std::int64_t>(blocks[0].size());
  block_floats_ = width * block;
  data_ = std::make_unique<ScratchFloats>(static_cast<std::size_t>(B * heads_ * per_row_ * block_floats_));
  parallel_for(B * heads_ * per_row_, threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / (heads_ * per_row_), h = (task / per_row_) % heads_,
                       index = task % per_row_;
    float* out = data_->get() + task * block_floats_;
    const BlockMeta& blk = blocks[b][index];
    switch (layout) {
      case PackLayout::rows:
        pack_rows(t, b, h, blk, block, width, factor, out);
        break;
      case PackLayout::transposed:
      case PackLayout::row_tiles: {
        // A chunk of rows at a time (kChunk, or one register tile), then each of their D columns as one
        // contiguous run of out: every line of out is written once, whole (one row at a time scattered
        // single floats 4 * block bytes apart over a block zeroed first: two writes of every byte).
        constexpr std::int64_t kChunk = 16;
        std::vector<float> rows(static_cast<std::size_t>(std::max(kChunk, kForwardRowTile) * D));
        auto chunk = [&](std::int64_t j0, std::int64_t cols, float* dst0, std::int64_t stride) {
          const std::int64_t filled = std::clamp<std::int64_t>(blk.length - j0, 0, cols);
          for (std::int64_t jj = 0; jj < filled; ++jj) {
            prefetch_row(t, b, blk.begin + j0 + jj + kPackRowsAhead, h);
            load_row(t, b, blk.begin + j0 + jj, h, factor, D, rows.data() + jj * D);
          }
          for (std::int64_t i = 0; i < D; ++i) {
            float* dst = dst0 + i * stride;
            for (std::int64_t jj = 0; jj < filled; ++jj) dst[jj] = rows[jj * D + i];
            for (std::int64_t jj = filled; jj < cols; ++jj) dst[jj] = 0.0f;
          }
          for (std::int64_t i = D; i < width; ++i) std::fill_n(dst0 + i * stride, cols, 0.0f);
        };
        if (layout == PackLayout::transposed) {
          for (std::int64_t j0 = 0; j0 < block; j0 += kChunk)
            chunk(j0, std::min(kChunk, block - j0), out + j0, block);
        } else {
          for (std::int64_t r = 0, size = 0; r < block; r += size) {
            size = row_tile_size(block, r, kForwardRowTile);
            chunk(r, size, out + r * width, size);
          }
        }
        break;
      }
      case PackLayout::column_tiles: {
        // A row at a time, its columns copied into every tile.
        std::vector<float> row(static_cast<std::size_t>(width));
        for (std::int64_t j = 0; j < block; ++j) {
          if (j < blk.length) {
            prefetch_row(t, b, blk.begin + j + kPackRowsAhead, h);
            load_row(t, b, blk.begin + j, h, factor, width, row.data());
          } else {
            std::fill(row.begin(), row.end(), 0.0f);
          }
          for (std::int64_t c = 0, size = 0; c < width; c += size) {
            size = row_tile_size(width, c, kForwardRowTile);
            std::copy_n(row.data() + c, size, out + c * block + j * size);
          }
        }
        break;
      }
    }
  });
}

}  // namespace cpattn::kernels
