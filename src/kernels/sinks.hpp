// Attention sinks (gpt-oss): one extra logit per q head in the softmax's denominator, with no value. A row's
// result over its keys, O = acc / l and LSE = m + log2 l in base 2, becomes O * 2^(LSE - LSE') with
// LSE' = log2(2^LSE + 2^(sink log2 e)): the share of the probability the sink takes is taken from every key.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/exp2_poly.hpp"

namespace cpattn::kernels {

struct RowEnd {
  float o_factor;  // what acc / l is multiplied by (1 without a sink; 0 for a row that saw no key)
  float lse;       // the row's natural-log LSE, the sink's included (-inf: no key and no sink)
};

// m, l: the row's running maximum (base 2) and sum over its keys (l = 0: it saw none); sink: the head's sink
// logit (natural units), or nullptr. A sink of -inf is no sink.
inline RowEnd finish_row(float m, float l, const float* sink) {
  constexpr double kLn2 = 0.6931471805599453;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const double keys = l != 0.0f ? static_cast<double>(m) + std::log2(static_cast<double>(l)) : neg_inf;
  if (sink == nullptr || *sink == -std::numeric_limits<float>::infinity()) {
    return {1.0f, static_cast<float>(keys * kLn2)};
  }
  const double s2 = static_cast<double>(*sink) * kLog2eDouble;
  const double hi = std::max(keys, s2);
  const double both = hi + std::log2(std::exp2(keys - hi) + std::exp2(s2 - hi));
  return {l != 0.0f ? static_cast<float>(std::exp2(keys - both)) : 0.0f, static_cast<float>(both * kLn2)};
}

}  // namespace cpattn::kernels
