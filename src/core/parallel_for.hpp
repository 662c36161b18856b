// Runs fn(task, worker) for task in [0, n) on `threads` workers (the calling thread is worker 0). Tasks are
// taken in order from a shared counter; results must not depend on which worker ran a task (nor on how many
// workers there are). An interrupt requested meanwhile (cpattn/interrupt.hpp) stops it before the next task
// with Error(interrupted). The workers' CPU time is added to the caller's helper_cpu_ns (cpu_time.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/cpu_time.hpp"
#include "cpattn/interrupt.hpp"

namespace cpattn {

template <class Fn>
void parallel_for(std::int64_t n, int threads, Fn&& fn) {
  const int workers = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, n)));
  if (workers <= 1) {
    for (std::int64_t t = 0; t < n; ++t) {
      if (interrupt_requested()) throw_if_interrupted();
      fn(t, 0);
    }
    return;
  }
  std::atomic<std::int64_t> next{0}, helpers_ns{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&](int worker) {
    struct Clock {  // a helper's CPU time, on every way out
      std::atomic<std::int64_t>* sum;
      std::int64_t t0 = thread_cpu_ns();
      ~Clock() {
        if (sum != nullptr) *sum += thread_cpu_ns() - t0;
      }
    } clock{worker > 0 ? &helpers_ns : nullptr};
    try {
      for (std::int64_t t = next++; t < n; t = next++) {
        if (interrupt_requested()) throw_if_interrupted();  // the first worker to see it throws
        fn(t, worker);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  // A worker the system cannot start (its thread limit, its address space) leaves its tasks to the others:
  // the results are the same, only slower.
  try {
    for (int w = 1; w < workers; ++w) pool.emplace_back(work, w);
  } catch (...) {  // std::system_error, or std::bad_alloc for a thread's state
  }
  work(0);
  for (auto& t : pool) t.join();
  helper_cpu_ns() += helpers_ns;
  if (error) std::rethrow_exception(error);
}

}  // namespace cpattn
