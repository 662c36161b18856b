// A request to stop the work in progress, from a signal handler (the Python module's Ctrl-C): the kernels
// check it before each of their tasks (a block of rows of one head) and throw Error(interrupted), so that a
// long call ends within a task's time instead of running to its end.
#pragma once

namespace cpattn {

// Async-signal-safe: sets a lock-free flag.
void request_interrupt();
bool interrupt_requested();
void clear_interrupt();
// Throws Error(interrupted) when one was requested (and clears the request).
void throw_if_interrupted();

}  // namespace cpattn
