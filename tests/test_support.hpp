// Shared test helpers: deterministic random tensors, positions, and comparisons that report max abs/rel error
// and the first mismatches (llm.c's check_tensor), not just pass/fail.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpattn/tensor.hpp"

namespace cpattn::testing {

inline Tensor random_tensor(DType dtype, Shape4 shape, std::uint32_t seed, float scale = 1.0f) {
  return random_normal(dtype, shape, seed, scale);
}

// Positions 0..S-1 for each of B rows.
inline std::vector<std::int32_t> natural_positions(std::int64_t batch, std::int64_t seq) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(batch * seq));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t s = 0; s < seq; ++s) p[b * seq + s] = static_cast<std::int32_t>(s);
  }
  return p;
}

// Segment ids for documents of the given lengths (summing to S), the same for each batch row.
inline std::vector<std::int32_t> segments_from_lengths(std::int64_t batch,
                                                       const std::vector<std::int64_t>& lengths) {
  std::vector<std::int32_t> row;
  for (std::size_t i = 0; i < lengths.size(); ++i)
    row.insert(row.end(), lengths[i], static_cast<std::int32_t>(i));
  std::vector<std::int32_t> all;
  for (std::int64_t b = 0; b < batch; ++b) all.insert(all.end(), row.begin(), row.end());
  return all;
}

struct Diff {
  double max_abs = 0;  // max |got - want|
  double max_ref = 0;  // max |want|
  double max_rel = 0;  // max_abs / max_ref
  std::int64_t worst = -1;
  std::int64_t nonfinite = 0;  // entries where exactly one side is non-finite or both differ in kind
  std::string first_mismatches;
};

template <class A, class B>
Diff compare(const A& got, const B& want, double tolerance_rel = 0) {
  Diff d;
  EXPECT_EQ(got.size(), want.size());
  const std::size_t n = std::min<std::size_t>(got.size(), want.size());
  for (std::size_t i = 0; i < n; ++i) {
    const double w = static_cast<double>(want[i]);
    if (std::isfinite(w)) d.max_ref = std::max(d.max_ref, std::abs(w));
  }
  std::ostringstream first;
  int shown = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]);
    const double w = static_cast<double>(want[i]);
    if (!std::isfinite(g) || !std::isfinite(w)) {
      const bool same = (std::isnan(g) && std::isnan(w)) || g == w;
      if (!same) {
        ++d.nonfinite;
        if (shown++ < 5) first << " [" << i << "] got " << g << " want " << w;
      }
      continue;
    }
    const double e = std::abs(g - w);
    if (e > d.max_abs) {
      d.max_abs = e;
      d.worst = static_cast<std::int64_t>(i);
    }
    if (tolerance_rel > 0 && e > tolerance_rel * std::max(d.max_ref, 1e-30) && shown++ < 5) {
      first << " [" << i << "] got " << g << " want " << w;
    }
  }
  d.max_rel = d.max_ref > 0 ? d.max_abs / d.max_ref : d.max_abs;
  d.first_mismatches = first.str();
  return d;
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

}  // namespace cpattn::testing
