// The flash kernels' arguments: the checks every entry point runs first, and whether an input holds a
// non-finite value (the products then guard their masked pairs).
#pragma once

#include <string>

#include "cpattn/flash.hpp"
#include "cpattn/tensor.hpp"
#include "cpattn/trace.hpp"

namespace cpattn::kernels {

// Shapes and sizes agree; throws Error(invalid_input) naming the tensor otherwise.
void check_forward_args(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                        const AttentionMask& mask, const FlashConfig& config);
void check_same_shape(const char* name, const Shape4& got, const Shape4& want);

// Whether any element of t is Inf or NaN (the kernels then guard their products so that a masked pair adds
// exactly nothing: 0 * Inf is NaN).
bool any_nonfinite(const ConstTensorRef& t);

// A kernel call's shape for its trace event: query and key rows, heads, head dim, dtype, causal.
std::string trace_args(const ConstTensorRef& q, const ConstTensorRef& k, const AttentionMask& mask);

}  // namespace cpattn::kernels
