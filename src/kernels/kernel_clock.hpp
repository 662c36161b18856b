// The CPU time of the calling thread's kernel calls (flash_cpu_seconds, flash.hpp): each top-level
// flash_forward / flash_backward adds its thread's CPU time and its workers'.
#pragma once

#include <cstdint>

#include "core/cpu_time.hpp"

namespace cpattn::kernels {

inline std::int64_t& kernel_cpu_ns() {
  thread_local std::int64_t ns = 0;
  return ns;
}

class KernelClock {
 public:
  KernelClock() : top_(depth()++ == 0), t0_(top_ ? now() : 0) {}
  ~KernelClock() {
    --depth();
    if (top_) kernel_cpu_ns() += now() - t0_;
  }
  KernelClock(const KernelClock&) = delete;
  KernelClock& operator=(const KernelClock&) = delete;

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::int64_t now() { return thread_cpu_ns() + helper_cpu_ns(); }
  bool top_;
  std::int64_t t0_;
};

}  // namespace cpattn::kernels
