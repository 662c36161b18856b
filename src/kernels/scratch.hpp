// The kernels' scratch memory for a call's packed operands, and the pool that keeps freed blocks for the
// next call.
#pragma once

#include <cstddef>

namespace cpattn::kernels {

// Scratch of n floats, uninitialized, for a call's packed operands. From 2 MiB on it is its own mapping
// (mmap, apart from malloc's heap), aligned to 2 MiB and advised as transparent huge pages (madvise: under
// THP mode "madvise" 4 KiB pages would cost a page fault per 4 KiB), and when freed it is kept for the next
// call that needs a block of its size (kKeptScratchBytes in all, the most recently freed kept first): fresh
// pages cost every call their faults and zeroing (docs/performance.md, decisions), while calls of one shape
// ask for the same sizes each time.
class ScratchFloats {
 public:
  static constexpr std::size_t kKeptScratchBytes = std::size_t{128} << 20;
  explicit ScratchFloats(std::size_t n);
  ~ScratchFloats();
  ScratchFloats(const ScratchFloats&) = delete;
  ScratchFloats& operator=(const ScratchFloats&) = delete;
  float* get() const { return data_; }
  // Frees every kept block (tests; a caller that wants the memory back).
  static void release_kept();
  static std::size_t kept_bytes();

 private:
  float* data_ = nullptr;
  std::size_t bytes_ = 0;  // what was allocated (0: malloc'd, not kept)
};

}  // namespace cpattn::kernels
