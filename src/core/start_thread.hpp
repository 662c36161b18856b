// Threads that cannot be made are an Error(resource) naming what they were for, not std::system_error (nor,
// for a caller that already started others, std::terminate from a joinable thread left behind).
#pragma once

#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "cpattn/error.hpp"

namespace cpattn {

template <class... Args>
std::thread start_thread(const std::string& what, Args&&... args) {
  try {
    return std::thread(std::forward<Args>(args)...);
  } catch (const std::system_error& e) {
    fail_thread(what, e);
  } catch (const std::bad_alloc& e) {  // the thread's own state
    fail_thread(what, e);
  }
}

}  // namespace cpattn
