// The kernels' scratch memory for a call's packed operands, and the pool that keeps freed blocks for the
// next call.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>

namespace cpattn::kernels {

// Scratch of n floats, uninitialized, for a call's packed operands. From 2 MiB on it is its own mapping
// (mmap, apart from malloc's heap), aligned to 2 MiB and advised as transparent huge pages (madvise: under
// THP mode "madvise" 4 KiB pages would cost a page fault per 4 KiB), and when freed it is kept for the next
// call that needs a block of its size (kept_limit() in all, the most recently freed kept first): fresh pages
// cost every call their faults and zeroing (docs/performance.md, decisions), while calls of one shape ask for
// the same sizes each time. The limit is 1 GiB, or an eighth of the memory the process may use (the
// machine's, or its cgroup's limit) where that is less: the ranks of an in-process group (ring: several
// kernel calls a step) each keep their own call's blocks.
class ScratchFloats {
 public:
  static std::size_t kept_limit();
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

// n zeroed values of T in pooled scratch: a call's accumulators and partials, whose pages the next call of
// the same shape reuses instead of faulting in fresh ones.
template <class T>
class PooledArray {
 public:
  explicit PooledArray(std::size_t n)
      : n_(n),
        scratch_(std::make_unique<ScratchFloats>((n * sizeof(T) + sizeof(float) - 1) / sizeof(float))) {
    if (n > 0) std::memset(static_cast<void*>(scratch_->get()), 0, n * sizeof(T));
  }
  T* data() const { return reinterpret_cast<T*>(scratch_->get()); }
  std::size_t size() const { return n_; }
  T* begin() const { return data(); }
  T& operator[](std::size_t i) const { return data()[i]; }

 private:
  std::size_t n_;
  std::unique_ptr<ScratchFloats> scratch_;
};

}  // namespace cpattn::kernels
