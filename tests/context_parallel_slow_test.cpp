// The full product of the strategy sweep (label slow; run with scripts/test --slow): every cp, head pair,
// mask, packing, dtype, batch and head dim, with the three strategies. Rejected combinations are asserted
// rejected.
#include <gtest/gtest.h>

#include <iostream>

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

// Ring: the full product over cp, head pairs, masks, packing, load balance, dtypes, batch and head dims.
TEST(ContextParallelSlow, RingFullProduct) {
  const std::pair<std::int64_t, std::int64_t> heads[] = {{8, 8}, {8, 2}, {32, 2}, {4, 1}};
  int ran = 0;
  for (std::int64_t cp : {2, 3, 4, 8}) {
    for (const auto& [hq, hkv] : heads) {
      for (bool causal : {true, false}) {
        for (bool packed : {false, true}) {
          for (bool load_balance : {false, true}) {
            for (DType dtype : {DType::f32, DType::bf16}) {
              for (std::int64_t batch : {1, 2}) {
                for (std::int64_t dim : {64, 80}) {
                  testing::CpCase c;
                  c.strategy = Strategy::ring;
                  c.cp = cp;
                  c.hq = hq;
                  c.hkv = hkv;
                  c.causal = causal;
                  c.load_balance = load_balance;
                  c.dtype = dtype;
                  c.batch = batch;
                  c.dim = dim;
                  c.seq = 2 * cp * (24 + cp);
                  if (packed) c.segments = {c.seq / 2 + 3, c.seq / 2 - 8, 5};
                  ++ran;
                  testing::expect_ring_matches_single_device(c);
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(ran, 1024);
}

// Hybrid: the product over (cp, U) in {(4,2), (8,2), (8,4), (16,8)} and (Hq, Hkv) in {(32,2), (8,2), (28,4)},
// causal or not, packed or one document, load balance or not, fp32 and bf16; within the ring's bounds.
TEST(ContextParallelSlow, HybridFullProduct) {
  const std::pair<std::int64_t, std::int64_t> degrees[] = {{4, 2}, {8, 2}, {8, 4}, {16, 8}};
  const std::pair<std::int64_t, std::int64_t> heads[] = {{32, 2}, {8, 2}, {28, 4}};
  int ran = 0;
  for (const auto& [cp, u] : degrees) {
    for (const auto& [hq, hkv] : heads) {
      for (bool causal : {true, false}) {
        for (bool packed : {false, true}) {
          for (bool load_balance : {false, true}) {
            for (DType dtype : {DType::f32, DType::bf16}) {
              testing::CpCase c;
              c.strategy = Strategy::hybrid;
              c.cp = cp;
              c.ulysses_degree = u;
              c.hq = hq;
              c.hkv = hkv;
              c.causal = causal;
              c.load_balance = load_balance;
              c.dtype = dtype;
              c.dim = 32;
              c.seq = 2 * cp * (12 + cp);
              if (packed) c.segments = {c.seq / 2 + 3, c.seq / 2 - 8, 5};
              ++ran;
              testing::expect_ring_matches_single_device(c);
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(ran, 192);
}

// How the ring's error against the single-device kernel grows with cp (ring-flash-attention #42 reports it
// growing with ring size): one causal fp32 problem, cp = 1 .. 8, printed; every cp within the bounds.
TEST(ContextParallelSlow, RingErrorAgainstCp) {
  for (std::int64_t cp = 1; cp <= 8; ++cp) {
    testing::CpCase c;
    c.strategy = Strategy::ring;
    c.cp = cp;
    c.hq = 8;
    c.hkv = 2;
    c.dim = 64;
    c.seq = 1680;  // divisible by 1 .. 8
    const auto in = testing::make_whole_inputs(c, 21);
    const auto got = testing::run_context_parallel(c, in);
    const auto single = testing::run_single_device(c, in);
    const auto o = testing::compare(got.o, single.o), lse = testing::compare(got.lse, single.lse);
    const auto dk = testing::compare(got.dk, single.dk);
    std::cout << "ring cp " << cp << ": o max rel " << o.max_rel << ", lse max abs " << lse.max_abs
              << ", dk max rel " << dk.max_rel << "\n";
    EXPECT_LE(o.max_rel, 5e-6);
    EXPECT_LE(lse.max_abs, 1e-5);
    EXPECT_LE(dk.max_rel, 1e-5);
  }
}

}  // namespace
}  // namespace cpattn
