// Comparisons of results against the single-device kernel and the float64 reference, with the tolerances
// cpattn promises (docs/design.md, "Invariants"). What `cpattn run --check` and the tests share.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "harness/whole_problem.hpp"

namespace cpattn::harness {

// The bounds a strategy's run is checked against. Relative errors are max |got - want| / max |want|.
// all_gather and ulysses: the forward bit-identical to the single-device kernel, gradients within 1e-6 (fp32)
// / 1e-2 (bf16) of it, everything within 1e-5 / 2e-2 of the float64 reference. ring merges its steps in
// another order than the kernel's keys: O within 5e-6 / 1e-2 and LSE within 1e-5 / 1e-2 (absolute) of the
// single-device kernel, gradients within 1e-5 / 1e-2, everything within 2e-5 / 2e-2 of the reference.
struct Tolerances {
  bool forward_exact = true;
  double o_rel = 0, lse_abs = 0;  // 0 when forward_exact
  double grad_rel = 0, reference_rel = 0;
};
Tolerances tolerances(Strategy strategy, DType dtype);

struct Diff {
  double max_abs = 0;          // max |got - want| over entries where both are finite
  double max_ref = 0;          // max |want| over finite entries
  double max_rel = 0;          // max_abs / max_ref
  std::int64_t worst = -1;     // the index of max_abs
  std::int64_t nonfinite = 0;  // entries where exactly one side is non-finite, or both differ in kind
  std::string first_mismatches;
  // max_abs and max_rel, or infinity when a non-finite entry disagrees.
  double abs_or_inf() const { return nonfinite > 0 ? INFINITY : max_abs; }
  double rel_or_inf() const { return nonfinite > 0 ? INFINITY : max_rel; }
};

// got and want: indexable sequences of the same length. With tolerance_rel > 0, the first five entries off by
// more than tolerance_rel * max |want| are listed in first_mismatches (as are non-finite disagreements).
template <class A, class B>
Diff compare(const A& got, const B& want, double tolerance_rel = 0) {
  Diff d;
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

// A whole run checked: O and LSE against the single-device kernel (absolute: must be 0), dQ/dK/dV against it
// (relative), and against the float64 reference on the whole problem when it is small (B*Hq*S^2*D <= 1.5e9),
// else on sampled rows (O, dQ; dK/dV need every row, so they are not compared).
struct WholeCheck {
  std::vector<std::pair<std::string, double>> single_device_abs;  // o, lse, then dq, dk, dv (dsinks)
  std::vector<std::pair<std::string, double>> single_device_rel;  // o, then dq, dk, dv (dsinks)
  std::vector<std::pair<std::string, std::optional<double>>>
      reference_rel;            // o, dq, dk, dv (dsinks; none: not compared)
  std::string reference_scope;  // "whole problem" or "sampled N rows (...)"
  Tolerances tolerances;
  bool pass = false;
};
WholeCheck check_whole_result(const AttentionSpec& attention, Strategy strategy, const WholeProblem& problem,
                              const WholeResult& result, bool forward_only, int threads);

}  // namespace cpattn::harness
