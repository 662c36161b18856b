// The full product of the strategy sweep (label slow; run with scripts/test --slow): every cp, head pair,
// mask, packing, dtype, batch and head dim, with the three strategies. Rejected combinations are asserted
// rejected.
#include <gtest/gtest.h>

#include "cp_harness.hpp"

namespace cpattn {
namespace {

TEST(ContextParallelSlow, FullProductMatchesTheSingleDeviceKernel) {
  const std::pair<std::int64_t, std::int64_t> heads[] = {{32, 2}, {8, 2}, {16, 4}, {8, 8}, {4, 1}, {16, 16}};
  int ran = 0, rejected = 0;
  for (std::int64_t cp : {1, 2, 4, 8}) {
    for (const auto& [hq, hkv] : heads) {
      for (bool causal : {true, false}) {
        for (bool packed : {false, true}) {
          for (DType dtype : {DType::f32, DType::bf16}) {
            for (std::int64_t batch : {1, 2}) {
              for (std::int64_t dim : {64, 80, 128}) {
                for (int variant = 0; variant < 3; ++variant) {
                  testing::CpCase c;
                  c.cp = cp;
                  c.hq = hq;
                  c.hkv = hkv;
                  c.causal = causal;
                  c.dtype = dtype;
                  c.batch = batch;
                  c.dim = dim;
                  c.seq = 32 * cp;
                  if (packed) c.segments = {c.seq / 2 + 3, c.seq / 2 - 3};
                  c.strategy = variant == 0 ? Strategy::ulysses : Strategy::all_gather;
                  c.load_balance = variant == 2;
                  c.remat = (dim == 80);
                  if (!validation_errors(c.attention(), c.parallel()).empty()) {
                    ++rejected;
                    // Only ulysses with fewer q heads than ranks can be refused here.
                    EXPECT_EQ(c.strategy, Strategy::ulysses) << c.name();
                    EXPECT_GT(cp, hq) << c.name();
                    continue;
                  }
                  ++ran;
                  testing::expect_matches_single_device(c);
                }
              }
            }
          }
        }
      }
    }
  }
  std::cout << "full product: " << ran << " runs, " << rejected << " rejected by the validator\n";
  EXPECT_GT(ran, 3000);
}

// Ulysses at any head counts: every shape of kAnyHeadCounts over masks, packing, dtypes, batch and head dims
// (remat with head dim 80).
TEST(ContextParallelSlow, UlyssesAtAnyHeadCountsFullProduct) {
  int ran = 0;
  for (const testing::HeadCounts& h : testing::kAnyHeadCounts) {
    for (bool causal : {true, false}) {
      for (bool packed : {false, true}) {
        for (DType dtype : {DType::f32, DType::bf16}) {
          for (std::int64_t batch : {1, 2}) {
            for (std::int64_t dim : {64, 80}) {
              testing::CpCase c;
              c.hq = h.hq;
              c.hkv = h.hkv;
              c.cp = h.cp;
              c.seq = h.cp * (150 / h.cp + 1);
              c.causal = causal;
              if (packed) c.segments = {c.seq / 2 + 3, c.seq / 2 - 3};
              c.dtype = dtype;
              c.batch = batch;
              c.dim = dim;
              c.remat = dim == 80;
              ++ran;
              testing::expect_matches_single_device(c);
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(ran, 256);
}

}  // namespace
}  // namespace cpattn
