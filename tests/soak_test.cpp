// Soak: many forward+backward steps at cp = 4 on the in-process group, each with a random valid shape,
// strategy, mask, packing and dtype, each checked against the single-device kernel; the heap in use (glibc's
// mallinfo2: every arena's allocated bytes plus mmapped chunks, less the kernels' kept scratch, itself
// bounded) must not grow once the first steps have run. Resident memory is reported too but not asserted:
// glibc keeps freed memory in per-thread arenas, and each step starts new rank threads, so RSS rises towards
// a plateau without anything being live. Soak.ShortRun is in the default suite (CI); Soak.LongRun has the
// slow label (scripts/test --slow).
#include <gtest/gtest.h>
#include <malloc.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include "cp_harness.hpp"

namespace cpattn {
namespace {

double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

double heap_in_use_mib() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<double>(info.uordblks + info.hblkhd) / (1024.0 * 1024.0);
}

// A random configuration that validates at cp = 4.
testing::CpCase random_case(std::mt19937& gen) {
  auto pick = [&](std::initializer_list<std::int64_t> options) {
    std::uniform_int_distribution<std::size_t> d(0, options.size() - 1);
    return *(options.begin() + d(gen));
  };
  testing::CpCase c;
  c.cp = 4;
  const int variant = static_cast<int>(pick({0, 1, 2}));
  c.strategy = variant == 0 ? Strategy::ulysses : Strategy::all_gather;
  c.load_balance = variant == 2;
  c.remat = pick({0, 1}) == 1;
  c.hq = pick({4, 8, 16});
  c.hkv = pick({1, 2, 4});
  while (c.hq % c.hkv != 0) c.hkv /= 2;
  c.dim = pick({8, 20, 32, 64});
  c.batch = pick({1, 2});
  c.seq = 8 * pick({1, 3, 8, 17, 32});  // a multiple of 2 * cp for the load balance
  c.causal = pick({0, 1}) == 1;
  c.dtype = pick({0, 0, 1}) == 1 ? DType::bf16 : DType::f32;
  if (c.seq >= 24 && pick({0, 1}) == 1) {
    std::uniform_int_distribution<std::int64_t> cut(1, c.seq - 1);
    const std::int64_t a = cut(gen);
    c.segments = {a, c.seq - a};
  }
  return c;
}

void soak(int steps, std::uint32_t seed) {
  std::mt19937 gen(seed);
  const int warm_up = std::min(20, steps / 2);
  double rss_after_warm_up = 0, rss_max = 0, heap_after_warm_up = 0, heap_max = 0;
  int checked = 0;
  for (int step = 0; step < steps; ++step) {
    const testing::CpCase c = random_case(gen);
    ASSERT_TRUE(validation_errors(c.attention(), c.parallel()).empty()) << c.name();
    {  // the step's tensors live in this scope only
      SCOPED_TRACE("step " + std::to_string(step) + ": " + c.name());
      const auto in = testing::make_whole_inputs(c, seed + static_cast<std::uint32_t>(step));
      const auto got = testing::run_context_parallel(c, in);
      const auto single = testing::run_single_device(c, in);
      ASSERT_EQ(testing::count_bit_differences(got.o, single.o), 0) << "o";
      ASSERT_EQ(testing::count_bit_differences(got.lse, single.lse), 0) << "lse";
      const double tol = c.dtype == DType::f32 ? 1e-6 : 1e-2;
      CPATTN_EXPECT_CLOSE(got.dq, single.dq, tol, "dq");
      CPATTN_EXPECT_CLOSE(got.dk, single.dk, tol, "dk");
      CPATTN_EXPECT_CLOSE(got.dv, single.dv, tol, "dv");
      if (::testing::Test::HasFailure()) return;
      ++checked;
    }
    ASSERT_LE(flash_kept_scratch_bytes(), std::size_t{128} << 20);
    const double rss = resident_mib(), heap = heap_in_use_mib();
    if (step + 1 == warm_up) {
      rss_after_warm_up = rss;
      heap_after_warm_up = heap;
    }
    if (step + 1 > warm_up) {
      rss_max = std::max(rss_max, rss);
      heap_max = std::max(heap_max, heap);
    }
  }
  // Between steps nothing of a step is live: the heap in use may differ only by the allocator's and the
  // test's own bookkeeping (well under 1 MiB), never by a step's tensors (up to 2 MiB each).
  EXPECT_LE(heap_max - heap_after_warm_up, 1.0)
      << "heap in use grew from " << heap_after_warm_up << " MiB after " << warm_up << " steps to "
      << heap_max << " MiB";
  std::printf(
      "soak: %d steps checked at cp=4; heap in use %.2f MiB after %d steps, at most %.2f MiB after; resident "
      "%.1f -> at most %.1f MiB\n",
      checked, heap_after_warm_up, warm_up, heap_max, rss_after_warm_up, rss_max);
}

TEST(Soak, ShortRun) {
  soak(200, 7);
}

TEST(Soak, LongRun) {
  soak(3000, 11);
}

}  // namespace
}  // namespace cpattn
