// The naive single-device attention, accumulating in float64: the oracle every other path is tested against.
// It materializes each row's scores (O(Skv) memory per row, O(B*H*Sq*Skv*D) time); use it on small problems.
#pragma once

#include <vector>

#include "cpattn/mask.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn {

struct ReferenceResult {
  std::vector<double> o;       // [B, Sq, Hq, D]
  std::vector<double> lse;     // [B, Hq, Sq], natural log; -inf for a row that sees no key (and no sink)
  std::vector<double> dq;      // [B, Sq, Hq, D]   (empty unless d_out was given)
  std::vector<double> dk;      // [B, Skv, Hkv, D]
  std::vector<double> dv;      // [B, Skv, Hkv, D]
  std::vector<double> dsinks;  // [Hq] with the mask's sinks and d_out, else empty
};

// q: [B, Sq, Hq, D]; k, v: [B, Skv, Hkv, D]; d_out: [B, Sq, Hq, D] or nullptr for forward only.
// Tensors are read as the values they hold (a bf16 tensor gives its bf16-rounded values).
// Query head h reads kv head h / (Hq / Hkv).
ReferenceResult reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* d_out,
                                    const AttentionMask& mask, double scale);

}  // namespace cpattn

namespace cpattn {

// The reference for chosen query rows only (each row's softmax needs only its own scores): O, LSE and, with
// d_out, dQ of row (b, h, i). Cost O(Skv * D) per row, for checking problems too big for the whole reference.
struct ReferenceRow {
  std::int64_t b = 0, h = 0, i = 0;
};
struct ReferenceRowsResult {
  std::vector<double> o, dq;  // [rows][D]
  std::vector<double> lse;    // [rows]
};
ReferenceRowsResult reference_attention_rows(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor* d_out, const AttentionMask& mask, double scale,
                                             const std::vector<ReferenceRow>& rows);

}  // namespace cpattn
