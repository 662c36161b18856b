// Software prefetches: the kernels' rows are strided and their next blocks known ahead, two patterns the
// hardware prefetchers do not cover.
#pragma once

#include <cstdint>
#include <limits>

#include "cpattn/error.hpp"
#include "cpattn/flash.hpp"

namespace cpattn::kernels {

inline constexpr std::int64_t kCacheLine = 64;  // bytes

// Prefetches row (b, s, h) of t into L1, for reading or (kWrite) for writing: the kernels read and write rows
// of [B, S, H, D] tensors H * D elements apart, a stride the hardware prefetchers do not follow, so a row
// fetched only when it is loaded or stored waits on memory.
template <bool kWrite = false, class Ptr>
inline void prefetch_row(const BasicTensorRef<Ptr>& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  if (s >= t.shape.s) return;
  const std::int64_t bytes = t.shape.d * static_cast<std::int64_t>(dtype_size(t.dtype));
  const char* p =
      static_cast<const char*>(t.ptr) + t.offset(b, s, h) * static_cast<std::int64_t>(dtype_size(t.dtype));
  for (std::int64_t at = 0; at < bytes; at += kCacheLine) __builtin_prefetch(p + at, kWrite ? 1 : 0, 3);
}

// Software prefetch into L2 (prefetcht1) of up to eight byte ranges, a few cache lines at a time: the kernels
// fetch the operands of their next block this way between register tiles. Issued in one burst, a block's
// requests fill the line-fill buffers and the burst itself stalls the loop.
class PrefetchQueue {
 public:
  void clear() { count_ = at_ = 0, line_ = 0; }
  void add(const void* p, std::int64_t bytes) {  // an empty or negative range adds nothing
    if (bytes <= 0) return;
    CPATTN_ASSERT(count_ < kRanges);
    ranges_[count_++] = {static_cast<const char*>(p), (bytes + kCacheLine - 1) / kCacheLine};
  }
  // The next `lines` lines, in the order the ranges were added.
  void issue(std::int64_t lines) {
    for (; lines > 0 && at_ < count_; --lines) {
      __builtin_prefetch(ranges_[at_].p + line_ * kCacheLine, 0, 2);
      if (++line_ == ranges_[at_].lines) ++at_, line_ = 0;
    }
  }
  void drain() { issue(std::numeric_limits<std::int64_t>::max()); }

 private:
  static constexpr int kRanges = 8;
  struct Range {
    const char* p = nullptr;
    std::int64_t lines = 0;
  };
  Range ranges_[kRanges];
  int count_ = 0, at_ = 0;
  std::int64_t line_ = 0;
};

}  // namespace cpattn::kernels
