#include "cpattn/interrupt.hpp"

#include <atomic>

#include "cpattn/error.hpp"

namespace cpattn {
namespace {

std::atomic<bool> requested{false};
static_assert(std::atomic<bool>::is_always_lock_free, "set from a signal handler");

}  // namespace

void request_interrupt() {
  requested.store(true, std::memory_order_relaxed);
}

bool interrupt_requested() {
  return requested.load(std::memory_order_relaxed);
}

void clear_interrupt() {
  requested.store(false, std::memory_order_relaxed);
}

void throw_if_interrupted() {
  if (requested.exchange(false, std::memory_order_relaxed)) {
    throw Error(ErrorKind::interrupted, "interrupt", "SIGINT",
                "interrupted (Ctrl-C) between kernel tasks; the call's results were dropped");
  }
}

}  // namespace cpattn
