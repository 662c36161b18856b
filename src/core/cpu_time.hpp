// CPU time, per thread: what a rank's kernels cost when ranks share cores (the in-process group on fewer
// cores than ranks), where wall time counts the other ranks' turns too.
#pragma once

#include <time.h>

#include <cstdint>

namespace cpattn {

// The calling thread's CPU time in nanoseconds (CLOCK_THREAD_CPUTIME_ID).
inline std::int64_t thread_cpu_ns() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// CPU time that helper threads (parallel_for's workers) spent on the calling thread's behalf, added when
// they finish: a thread's own time plus this is what its calls cost.
inline std::int64_t& helper_cpu_ns() {
  thread_local std::int64_t ns = 0;
  return ns;
}

}  // namespace cpattn
