#include "kernels/kernel_args.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "cpattn/config.hpp"
#include "cpattn/error.hpp"
#include "kernels/block_grid.hpp"

namespace cpattn::kernels {

void check_same_shape(const char* name, const Shape4& got, const Shape4& want) {
  if (!(got == want)) {
    throw Error(ErrorKind::invalid_input, name, to_string(got),
                std::string(name) + " has shape " + to_string(got) + "; expected " + to_string(want));
  }
}

void check_forward_args(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                        const AttentionMask& mask, const FlashConfig& config) {
  const Shape4 qs = q.shape, ks = k.shape;
  auto fail = [](const std::string& field, const std::string& value, const std::string& message) {
    throw Error(ErrorKind::invalid_input, field, value, message);
  };
  check_same_shape("v", v.shape, ks);
  if (ks.b != qs.b)
    fail("k", to_string(ks),
         "k batch (" + std::to_string(ks.b) + ") differs from q's (" + std::to_string(qs.b) + ")");
  if (ks.d != qs.d)
    fail("k", to_string(ks),
         "k head_dim (" + std::to_string(ks.d) + ") differs from q's (" + std::to_string(qs.d) + ")");
  if (qs.d < 1 || qs.d > kMaxHeadDim)
    fail("head_dim", std::to_string(qs.d),
         "head_dim (" + std::to_string(qs.d) + ") must be in 1.." + std::to_string(kMaxHeadDim));
  if (ks.h < 1 || qs.h % ks.h != 0) {
    fail("num_kv_heads", std::to_string(ks.h),
         "k's heads (" + std::to_string(ks.h) + ") must divide q's heads (" + std::to_string(qs.h) + ")");
  }
  for (const auto* t : {&q, &k, &v}) {
    if (t->stride[3] != 1)
      fail("stride", std::to_string(t->stride[3]), "the head_dim axis must be contiguous");
  }
  if (static_cast<std::int64_t>(mask.q_positions.size()) != qs.b * qs.s) {
    fail("q_positions", std::to_string(mask.q_positions.size()),
         "q_positions holds " + std::to_string(mask.q_positions.size()) +
             " entries; expected B*Sq = " + std::to_string(qs.b * qs.s));
  }
  if (static_cast<std::int64_t>(mask.kv_positions.size()) != ks.b * ks.s) {
    fail("kv_positions", std::to_string(mask.kv_positions.size()),
         "kv_positions holds " + std::to_string(mask.kv_positions.size()) +
             " entries; expected B*Skv = " + std::to_string(ks.b * ks.s));
  }
  if (mask.has_segments() && (static_cast<std::int64_t>(mask.q_segments.size()) != qs.b * qs.s ||
                              static_cast<std::int64_t>(mask.kv_segments.size()) != ks.b * ks.s)) {
    fail("segment_ids",
         std::to_string(mask.q_segments.size()) + "," + std::to_string(mask.kv_segments.size()),
         "segment ids must hold B*Sq (" + std::to_string(qs.b * qs.s) + ") and B*Skv (" +
             std::to_string(ks.b * ks.s) + ") entries");
  }
  if (!mask.sinks.empty() && static_cast<std::int64_t>(mask.sinks.size()) != qs.h) {
    fail("sinks", std::to_string(mask.sinks.size()),
         "sinks holds " + std::to_string(mask.sinks.size()) + " values; expected one per q head (" +
             std::to_string(qs.h) + ")");
  }
  for (std::size_t h = 0; h < mask.sinks.size(); ++h) {
    if (std::isnan(mask.sinks[h]) || mask.sinks[h] == std::numeric_limits<float>::infinity()) {
      fail("sinks", std::to_string(mask.sinks[h]),
           "sinks[" + std::to_string(h) + "] is " + (std::isnan(mask.sinks[h]) ? "NaN" : "+inf") +
               "; valid: a finite logit, or -inf for no sink");
    }
  }
  for (const auto& [field, side] :
       {std::pair{"window_left", mask.window_left}, {"window_right", mask.window_right}}) {
    if (side < 0 || side > kUnboundedWindow) {
      fail(field, std::to_string(side),
           std::string(field) + " (" + std::to_string(side) + ") is not a window side; valid: 0.." +
               std::to_string(kUnboundedWindow) + " (kUnboundedWindow: no bound)");
    }
  }
  if (!(mask.softcap == 0 || (mask.softcap >= kMinSoftcap && mask.softcap <= kMaxSoftcap))) {
    fail("softcap", std::to_string(mask.softcap),
         "softcap must be 0 (none) or a finite number in 1e-06..1e+30");
  }
  if (config.block_q < kTileRows || config.block_q % kTileRows != 0) {
    fail("block_q", std::to_string(config.block_q), "block_q must be a positive multiple of 4");
  }
  if (config.block_kv < 64 || config.block_kv % 64 != 0) {
    fail("block_kv", std::to_string(config.block_kv), "block_kv must be a positive multiple of 64");
  }
  if (config.threads < 1) fail("threads", std::to_string(config.threads), "threads must be at least 1");
}

namespace {
// Whether any of n values has its exponent bits all ones (Inf or NaN). No early exit inside the row, so the
// compiler vectorizes it (a std::isfinite loop with a return stays scalar; docs/performance.md, decisions).
template <class Bits, class T>
bool row_nonfinite(const T* p, std::int64_t n, Bits exponent) {
  Bits bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    bad |= static_cast<Bits>((std::bit_cast<Bits>(p[i]) & exponent) == exponent);
  }
  return bad != 0;
}
}  // namespace

bool any_nonfinite(const ConstTensorRef& t) {
  for (std::int64_t b = 0; b < t.shape.b; ++b) {
    for (std::int64_t s = 0; s < t.shape.s; ++s) {
      for (std::int64_t h = 0; h < t.shape.h; ++h) {
        const std::int64_t off = t.offset(b, s, h);
        const bool bad =
            t.dtype == DType::f32
                ? row_nonfinite<std::uint32_t>(static_cast<const float*>(t.ptr) + off, t.shape.d, 0x7f800000u)
                : row_nonfinite<std::uint16_t>(static_cast<const bf16*>(t.ptr) + off, t.shape.d,
                                               std::uint16_t{0x7f80});
        if (bad) return true;
      }
    }
  }
  return false;
}

}  // namespace cpattn::kernels

namespace cpattn::kernels {

std::string trace_args(const ConstTensorRef& q, const ConstTensorRef& k, const AttentionMask& mask) {
  return "\"q\": " + std::to_string(q.shape.s) + ", \"kv\": " + std::to_string(k.shape.s) +
         ", \"batch\": " + std::to_string(q.shape.b) + ", \"q_heads\": " + std::to_string(q.shape.h) +
         ", \"head_dim\": " + std::to_string(q.shape.d) + ", \"dtype\": \"" + to_string(q.dtype) +
         "\", \"causal\": " + (mask.causal ? "true" : "false");
}

}  // namespace cpattn::kernels
