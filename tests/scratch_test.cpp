// The kernels' internals that the flash tests cannot see from outside: the register-tile partition that the
// forward's packed operands share with its loops, and the kept scratch blocks (kernels/packing.hpp,
// kernels/scratch.hpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/packing.hpp"
#include "kernels/scratch.hpp"

namespace cpattn::kernels {
namespace {

std::vector<std::int64_t> tiles(std::int64_t rows, std::int64_t rmax) {
  std::vector<std::int64_t> sizes;
  for (std::int64_t r = 0, size = 0; r < rows; r += size) {
    size = row_tile_size(rows, r, rmax);
    sizes.push_back(size);
  }
  return sizes;
}

TEST(RowTiles, WholeTilesThenEightFourAndTwo) {
  using V = std::vector<std::int64_t>;
  EXPECT_EQ(tiles(64, 8), (V{8, 8, 8, 8, 8, 8, 8, 8}));  // the forward's Bk = 64
  EXPECT_EQ(tiles(80, 8), (V{8, 8, 8, 8, 8, 8, 8, 8, 8, 8}));
  EXPECT_EQ(tiles(14, 8), (V{8, 4, 2}));
  EXPECT_EQ(tiles(6, 8), (V{4, 2}));
  EXPECT_EQ(tiles(2, 8), (V{2}));
  EXPECT_EQ(tiles(64, 12), (V{12, 12, 12, 12, 12, 4}));
  EXPECT_EQ(tiles(22, 12), (V{12, 8, 2}));
  EXPECT_EQ(tiles(64, 6), (V{6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 4}));  // the backward's
  EXPECT_EQ(tiles(10, 6), (V{6, 4}));
}

TEST(RowTiles, CoverEveryRowOnceForEveryEvenCount) {
  for (const std::int64_t rmax : {6, 8, 12}) {
    for (std::int64_t rows = 2; rows <= 512; rows += 2) {
      std::int64_t sum = 0;
      for (const std::int64_t s : tiles(rows, rmax)) {
        EXPECT_TRUE(s == rmax || s == 8 || s == 4 || s == 2) << rows << " rows: a tile of " << s;
        EXPECT_LE(s, rmax);
        sum += s;
      }
      EXPECT_EQ(sum, rows) << rmax;
    }
  }
}

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(ScratchFloats, AFreedBlockIsReusedBySameSizedScratch) {
  ScratchFloats::release_kept();
  float* first = nullptr;
  {
    const ScratchFloats a(3 * kMiB / sizeof(float));  // rounded up to 4 MiB
    first = a.get();
    first[0] = 1.0f;  // writable
    EXPECT_EQ(ScratchFloats::kept_bytes(), 0u);
  }
  EXPECT_EQ(ScratchFloats::kept_bytes(), 4 * kMiB);
  {
    const ScratchFloats other(8 * kMiB / sizeof(float));  // another size: not that block
    EXPECT_NE(other.get(), first);
    EXPECT_EQ(ScratchFloats::kept_bytes(), 4 * kMiB);
  }
  {
    const ScratchFloats again(4 * kMiB / sizeof(float));
    EXPECT_EQ(again.get(), first);
  }
  ScratchFloats::release_kept();
  EXPECT_EQ(ScratchFloats::kept_bytes(), 0u);
}

TEST(ScratchFloats, SmallScratchIsNotKeptAndTheKeptTotalIsBounded) {
  ScratchFloats::release_kept();
  { const ScratchFloats small(1024); }
  EXPECT_EQ(ScratchFloats::kept_bytes(), 0u);
  // More blocks than the bound holds, all alive at once, then freed: the oldest go.
  const std::size_t block = 16 * kMiB;
  std::vector<std::unique_ptr<ScratchFloats>> live;
  for (std::size_t total = 0; total <= ScratchFloats::kept_limit() + block; total += block)
    live.push_back(std::make_unique<ScratchFloats>(block / sizeof(float)));
  const float* newest = live.back()->get();
  for (auto& s : live) s.reset();  // front to back: the last freed is the newest
  EXPECT_LE(ScratchFloats::kept_bytes(), ScratchFloats::kept_limit());
  EXPECT_GT(ScratchFloats::kept_bytes(), ScratchFloats::kept_limit() - block);
  const ScratchFloats again(block / sizeof(float));
  EXPECT_EQ(again.get(), newest);  // the most recently freed is taken first
  // A block larger than the bound is never kept.
  { const ScratchFloats huge(2 * ScratchFloats::kept_limit() / sizeof(float)); }
  EXPECT_LE(ScratchFloats::kept_bytes(), ScratchFloats::kept_limit());
  ScratchFloats::release_kept();
}

}  // namespace
}  // namespace cpattn::kernels
