// The attention mask, described by token metadata rather than an S x S matrix: a query sees a key when their
// segment ids are equal (when segments are given) and the key's global position lies in the query's band:
// with `causal`, at or before the query's; with a sliding window, within window_left before and window_right
// after it. Positions are global token indices, so a shard or a reordered sequence masks correctly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

namespace cpattn {

// A side of a sliding window with no bound: beyond any distance between two int32 positions.
inline constexpr std::int64_t kUnboundedWindow = std::int64_t{1} << 40;

// The keys a query at position p may see by position: p - left .. p + right (either may be kUnboundedWindow).
// Causal attention's band has right <= 0 (p itself at most), whatever window_right says.
struct PositionBand {
  std::int64_t left = kUnboundedWindow, right = kUnboundedWindow;

  bool bounded() const { return left < kUnboundedWindow || right < kUnboundedWindow; }
  bool windowed() const { return left < kUnboundedWindow; }  // a left bound: keys far behind are hidden
  bool sees(std::int64_t q_pos, std::int64_t kv_pos) const {
    return kv_pos >= q_pos - left && kv_pos <= q_pos + right;
  }
  // Whether some query position in [q_lo, q_hi] sees some key position in [kv_lo, kv_hi] (bounds inclusive),
  // and whether every one sees every one.
  bool sees_any(std::int64_t q_lo, std::int64_t q_hi, std::int64_t kv_lo, std::int64_t kv_hi) const {
    return kv_lo <= q_hi + right && kv_hi >= q_lo - left;
  }
  bool sees_all(std::int64_t q_lo, std::int64_t q_hi, std::int64_t kv_lo, std::int64_t kv_hi) const {
    return kv_hi <= q_lo + right && kv_lo >= q_hi - left;
  }
};

// The band of plain attention: causal (keys at or before the query) or none.
inline PositionBand causal_band(bool causal) {
  return causal ? PositionBand{kUnboundedWindow, 0} : PositionBand{};
}

struct AttentionMask {
  std::span<const std::int32_t> q_positions;   // [B, Sq]
  std::span<const std::int32_t> kv_positions;  // [B, Skv]
  std::span<const std::int32_t> q_segments;    // [B, Sq], or empty: one segment
  std::span<const std::int32_t> kv_segments;   // [B, Skv], or empty
  bool causal = true;
  // Sliding window (flash-attention's window_size): keys window_left before and window_right after the query
  // (LEFT + RIGHT + 1 positions); kUnboundedWindow: no bound on that side. Causal attention ignores
  // window_right (its right side is 0).
  std::int64_t window_left = kUnboundedWindow, window_right = kUnboundedWindow;
  // Logit soft-capping (Gemma 2's attn_logit_softcapping), a score modifier besides the mask: a visible
  // pair's logit x = scale * q.k becomes softcap * tanh(x / softcap) before the softmax; 0: none.
  double softcap = 0;
  // Attention sinks (gpt-oss): one logit per q head of the call ([Hq], natural units) in the softmax's
  // denominator, with no value: P = e^y / (sum e^y + e^sink). Empty: none.
  std::span<const float> sinks = {};

  bool has_segments() const { return !q_segments.empty(); }
  PositionBand band() const {
    return {window_left, causal ? std::min<std::int64_t>(window_right, 0) : window_right};
  }
  // Query i and key j of batch row b; sq, skv are the per-row lengths.
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j, std::int64_t sq, std::int64_t skv) const {
    if (has_segments() && q_segments[b * sq + i] != kv_segments[b * skv + j]) return false;
    return band().sees(q_positions[b * sq + i], kv_positions[b * skv + j]);
  }
};

}  // namespace cpattn
