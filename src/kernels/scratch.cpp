#include "kernels/scratch.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <new>

#include <vector>
#include "cpattn/error.hpp"

#include "cpattn/flash.hpp"

namespace cpattn::kernels {

namespace {
constexpr std::size_t kHuge = std::size_t{2} << 20;

// The freed scratch blocks kept for reuse, the oldest first.
class ScratchPool {
 public:
  ~ScratchPool() { release(); }
  // A kept block of exactly `bytes`, or nullptr.
  void* take(std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      if (it->bytes != bytes) continue;
      void* p = it->p;
      total_ -= bytes;
      kept_.erase(std::next(it).base());
      return p;
    }
    return nullptr;
  }
  // Keeps p, freeing the oldest blocks while more than kept_limit() bytes are kept.
  void give(void* p, std::size_t bytes) {
    std::vector<Block> drop;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      kept_.push_back({p, bytes});
      total_ += bytes;
      while (total_ > ScratchFloats::kept_limit()) {
        drop.push_back(kept_.front());
        total_ -= kept_.front().bytes;
        kept_.erase(kept_.begin());
      }
    }
    for (const Block& blk : drop) munmap(blk.p, blk.bytes);
  }
  void release() {
    std::vector<Block> drop;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      drop.swap(kept_);
      total_ = 0;
    }
    for (const Block& blk : drop) munmap(blk.p, blk.bytes);
  }
  std::size_t total() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return total_;
  }

 private:
  struct Block {
    void* p;
    std::size_t bytes;
  };
  std::mutex mutex_;
  std::vector<Block> kept_;
  std::size_t total_ = 0;
};

ScratchPool& scratch_pool() {
  static ScratchPool pool;
  return pool;
}
}  // namespace

namespace {
// bytes (a multiple of kHuge) mapped at a kHuge boundary: a larger anonymous mapping with its unaligned head
// and tail unmapped.
void* map_huge(std::size_t bytes) {
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t tail = start + bytes + kHuge - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
  return p;
}
}  // namespace

ScratchFloats::ScratchFloats(std::size_t n) {
  const std::size_t bytes = std::max<std::size_t>(n * sizeof(float), sizeof(float));
  void* p = nullptr;
  if (bytes >= kHuge) {
    bytes_ = (bytes + kHuge - 1) / kHuge * kHuge;
    p = scratch_pool().take(bytes_);
    if (p == nullptr) p = map_huge(bytes_);
  } else {
    p = std::malloc(bytes);
  }
  if (p == nullptr) fail_allocation(bytes_ > 0 ? bytes_ : bytes, "the kernels' scratch");
  data_ = static_cast<float*>(p);
}

ScratchFloats::~ScratchFloats() {
  if (bytes_ == 0) {
    std::free(data_);
  } else if (bytes_ <= kept_limit()) {
    scratch_pool().give(data_, bytes_);
  } else {
    munmap(data_, bytes_);
  }
}

namespace {
// The memory this process may use: the machine's, or its cgroup's limit (v2 memory.max, v1
// memory.limit_in_bytes) where that is less; 0 when unknown.
std::size_t usable_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  std::size_t bytes =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    unsigned long long limit = 0;
    if (f >> limit && limit > 0 && (bytes == 0 || limit < bytes)) bytes = static_cast<std::size_t>(limit);
  }
  return bytes;
}
}  // namespace

std::size_t ScratchFloats::kept_limit() {
  static const std::size_t limit = [] {
    const std::size_t gib = std::size_t{1} << 30, memory = usable_memory();
    return memory == 0 ? gib / 8 : std::min(gib, memory / 8);
  }();
  return limit;
}

void ScratchFloats::release_kept() {
  scratch_pool().release();
}

std::size_t ScratchFloats::kept_bytes() {
  return scratch_pool().total();
}

}  // namespace cpattn::kernels

namespace cpattn {
std::size_t flash_kept_scratch_bytes() {
  return kernels::ScratchFloats::kept_bytes();
}
void flash_release_scratch() {
  kernels::ScratchFloats::release_kept();
}
}  // namespace cpattn
