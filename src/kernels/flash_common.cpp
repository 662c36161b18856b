#include "flash_common.hpp"

#include <sys/mman.h>

#include <bit>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <new>

#include "../core/parallel_for.hpp"

namespace cpattn::kernels {

void check_same_shape(const char* name, const Shape4& got, const Shape4& want) {
  if (!(got == want)) {
    throw Error(ErrorKind::invalid_input, name, to_string(got),
                std::string(name) + " has shape " + to_string(got) + "; expected " + to_string(want));
  }
}

void check_forward_args(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                        const AttentionMask& mask, const FlashConfig& config) {
  const Shape4 qs = q.shape, ks = k.shape;
  auto fail = [](const std::string& field, const std::string& value, const std::string& message) {
    throw Error(ErrorKind::invalid_input, field, value, message);
  };
  check_same_shape("v", v.shape, ks);
  if (ks.b != qs.b)
    fail("k", to_string(ks),
         "k batch (" + std::to_string(ks.b) + ") differs from q's (" + std::to_string(qs.b) + ")");
  if (ks.d != qs.d)
    fail("k", to_string(ks),
         "k head_dim (" + std::to_string(ks.d) + ") differs from q's (" + std::to_string(qs.d) + ")");
  if (qs.d < 1 || qs.d > 512)
    fail("head_dim", std::to_string(qs.d), "head_dim (" + std::to_string(qs.d) + ") must be in 1..512");
  if (ks.h < 1 || qs.h % ks.h != 0) {
    fail("num_kv_heads", std::to_string(ks.h),
         "k's heads (" + std::to_string(ks.h) + ") must divide q's heads (" + std::to_string(qs.h) + ")");
  }
  for (const auto* t : {&q, &k, &v}) {
    if (t->stride[3] != 1)
      fail("stride", std::to_string(t->stride[3]), "the head_dim axis must be contiguous");
  }
  if (static_cast<std::int64_t>(mask.q_positions.size()) != qs.b * qs.s) {
    fail("q_positions", std::to_string(mask.q_positions.size()),
         "q_positions holds " + std::to_string(mask.q_positions.size()) +
             " entries; expected B*Sq = " + std::to_string(qs.b * qs.s));
  }
  if (static_cast<std::int64_t>(mask.kv_positions.size()) != ks.b * ks.s) {
    fail("kv_positions", std::to_string(mask.kv_positions.size()),
         "kv_positions holds " + std::to_string(mask.kv_positions.size()) +
             " entries; expected B*Skv = " + std::to_string(ks.b * ks.s));
  }
  if (mask.has_segments() && (static_cast<std::int64_t>(mask.q_segments.size()) != qs.b * qs.s ||
                              static_cast<std::int64_t>(mask.kv_segments.size()) != ks.b * ks.s)) {
    fail("segment_ids",
         std::to_string(mask.q_segments.size()) + "," + std::to_string(mask.kv_segments.size()),
         "segment ids must hold B*Sq (" + std::to_string(qs.b * qs.s) + ") and B*Skv (" +
             std::to_string(ks.b * ks.s) + ") entries");
  }
  if (config.block_q < kTileRows || config.block_q % kTileRows != 0) {
    fail("block_q", std::to_string(config.block_q), "block_q must be a positive multiple of 4");
  }
  if (config.block_kv < 64 || config.block_kv % 64 != 0) {
    fail("block_kv", std::to_string(config.block_kv), "block_kv must be a positive multiple of 64");
  }
  if (config.threads < 1) fail("threads", std::to_string(config.threads), "threads must be at least 1");
}

namespace {
// Whether any of n values has its exponent bits all ones (Inf or NaN). No early exit inside the row, so the
// compiler vectorizes it (a std::isfinite loop with a return stays scalar; docs/performance.md, decisions).
template <class Bits, class T>
bool row_nonfinite(const T* p, std::int64_t n, Bits exponent) {
  Bits bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    bad |= static_cast<Bits>((std::bit_cast<Bits>(p[i]) & exponent) == exponent);
  }
  return bad != 0;
}
}  // namespace

bool any_nonfinite(const ConstTensorRef& t) {
  for (std::int64_t b = 0; b < t.shape.b; ++b) {
    for (std::int64_t s = 0; s < t.shape.s; ++s) {
      for (std::int64_t h = 0; h < t.shape.h; ++h) {
        const std::int64_t off = t.offset(b, s, h);
        const bool bad =
            t.dtype == DType::f32
                ? row_nonfinite<std::uint32_t>(static_cast<const float*>(t.ptr) + off, t.shape.d, 0x7f800000u)
                : row_nonfinite<std::uint16_t>(static_cast<const bf16*>(t.ptr) + off, t.shape.d,
                                               std::uint16_t{0x7f80});
        if (bad) return true;
      }
    }
  }
  return false;
}

BlockGrid make_block_grid(const AttentionMask& mask, std::int64_t batch, std::int64_t sq, std::int64_t skv,
                          const FlashConfig& config) {
  BlockGrid g;
  for (std::int64_t b = 0; b < batch; ++b) {
    g.q.push_back(block_meta(mask.q_positions, mask.q_segments, b * sq, sq, config.block_q));
    g.kv.push_back(block_meta(mask.kv_positions, mask.kv_segments, b * skv, skv, config.block_kv));
  }
  return g;
}

namespace {
constexpr std::size_t kHuge = std::size_t{2} << 20;

// The freed scratch blocks kept for reuse, the oldest first.
class ScratchPool {
 public:
  ~ScratchPool() { release(); }
  // A kept block of exactly `bytes`, or nullptr.
  void* take(std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      if (it->bytes != bytes) continue;
      void* p = it->p;
      total_ -= bytes;
      kept_.erase(std::next(it).base());
      return p;
    }
    return nullptr;
  }
  // Keeps p, freeing the oldest blocks while more than kKeptScratchBytes are kept.
  void give(void* p, std::size_t bytes) {
    std::vector<Block> drop;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      kept_.push_back({p, bytes});
      total_ += bytes;
      while (total_ > ScratchFloats::kKeptScratchBytes) {
        drop.push_back(kept_.front());
        total_ -= kept_.front().bytes;
        kept_.erase(kept_.begin());
      }
    }
    for (const Block& blk : drop) munmap(blk.p, blk.bytes);
  }
  void release() {
    std::vector<Block> drop;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      drop.swap(kept_);
      total_ = 0;
    }
    for (const Block& blk : drop) munmap(blk.p, blk.bytes);
  }
  std::size_t total() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return total_;
  }

 private:
  struct Block {
    void* p;
    std::size_t bytes;
  };
  std::mutex mutex_;
  std::vector<Block> kept_;
  std::size_t total_ = 0;
};

ScratchPool& scratch_pool() {
  static ScratchPool pool;
  return pool;
}
}  // namespace

namespace {
// bytes (a multiple of kHuge) mapped at a kHuge boundary: a larger anonymous mapping with its unaligned head
// and tail unmapped.
void* map_huge(std::size_t bytes) {
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t tail = start + bytes + kHuge - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
  return p;
}
}  // namespace

ScratchFloats::ScratchFloats(std::size_t n) {
  const std::size_t bytes = std::max<std::size_t>(n * sizeof(float), sizeof(float));
  void* p = nullptr;
  if (bytes >= kHuge) {
    bytes_ = (bytes + kHuge - 1) / kHuge * kHuge;
    p = scratch_pool().take(bytes_);
    if (p == nullptr) p = map_huge(bytes_);
  } else {
    p = std::malloc(bytes);
  }
  if (p == nullptr) throw std::bad_alloc();
  data_ = static_cast<float*>(p);
}

ScratchFloats::~ScratchFloats() {
  if (bytes_ == 0) {
    std::free(data_);
  } else if (bytes_ <= kKeptScratchBytes) {
    scratch_pool().give(data_, bytes_);
  } else {
    munmap(data_, bytes_);
  }
}

void ScratchFloats::release_kept() {
  scratch_pool().release();
}

std::size_t ScratchFloats::kept_bytes() {
  return scratch_pool().total();
}

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

namespace cpattn {
std::size_t flash_kept_scratch_bytes() {
  return kernels::ScratchFloats::kept_bytes();
}
void flash_release_scratch() {
  kernels::ScratchFloats::release_kept();
}
}  // namespace cpattn
