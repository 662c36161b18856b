// Shared test helpers: token metadata from the layout module, and the harness's comparisons as GoogleTest
// expectations that report max abs/rel error and the first mismatches (llm.c's check_tensor), not just
// pass/fail. Random inputs come from harness::random_problem.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpattn/flash.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/tensor.hpp"
#include "harness/check.hpp"

namespace cpattn::testing {

using ::cpattn::natural_positions;
using ::cpattn::segment_ids_from_lengths;

using harness::Diff;

// harness::compare, after checking that the sizes agree.
template <class A, class B>
Diff compare(const A& got, const B& want, double tolerance_rel = 0) {
  EXPECT_EQ(got.size(), want.size());
  return harness::compare(got, want, tolerance_rel);
}

// Passes when max |got - want| <= tolerance * max |want| and non-finite entries agree.
#define CPATTN_EXPECT_CLOSE(got, want, tolerance, what)                                             \
  do {                                                                                              \
    const auto diff_ = ::cpattn::testing::compare((got), (want), (tolerance));                      \
    EXPECT_LE(diff_.max_rel, (tolerance))                                                           \
        << (what) << ": max abs " << diff_.max_abs << ", max |ref| " << diff_.max_ref << ", rel "   \
        << diff_.max_rel << " at " << diff_.worst << ";" << diff_.first_mismatches;                 \
    EXPECT_EQ(diff_.nonfinite, 0) << (what) << ": non-finite mismatches" << diff_.first_mismatches; \
  } while (0)

// Bit-identical float arrays (NaN compared by bits too).
template <class A, class B>
std::int64_t count_bit_differences(const A& got, const B& want) {
  std::int64_t bad = 0;
  if (got.size() != want.size()) return -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float g = static_cast<float>(got[i]);
    const float w = static_cast<float>(want[i]);
    if (std::memcmp(&g, &w, sizeof(float)) != 0) ++bad;
  }
  return bad;
}

// The bf16 paths this CPU can run, each forced by its config (AMX, AVX512-BF16 dot products, the converting
// vector path); the ones it cannot are named on stdout as skipped.
inline std::vector<std::pair<Bf16Path, FlashConfig>> bf16_paths() {
  std::vector<std::pair<Bf16Path, FlashConfig>> paths;
  for (const auto& [path, amx, dot] :
       {std::tuple{Bf16Path::amx, true, false}, std::tuple{Bf16Path::avx512_bf16, false, true},
        std::tuple{Bf16Path::vector, false, false}}) {
    FlashConfig cfg;
    cfg.allow_amx = amx;
    cfg.allow_avx512_bf16 = dot;
    if (flash_bf16_path(cfg) == path) {
      paths.emplace_back(path, cfg);
    } else {
      std::printf("note: bf16 path %s skipped: this CPU lacks it\n", to_string(path));
    }
  }
  return paths;
}

}  // namespace cpattn::testing
