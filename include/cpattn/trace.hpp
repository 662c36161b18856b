// What each rank did, as events with a start and a duration: kernel calls, collectives, waits for a ring's
// shift, each layer's forward and backward. Off unless started (one atomic read per would-be event); the
// events are written in the Chrome trace-event format (Perfetto, chrome://tracing), one process row per rank,
// as PyTorch's profiler writes its traces. Used by `cpattn run --trace FILE.json`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cpattn::trace {

struct Event {
  std::string name, category;             // category: layer, kernel, collective, wait
  int rank = -1;                          // the rank whose thread recorded it
  std::int64_t begin_ns = 0, end_ns = 0;  // the monotonic clock (one clock for every process of a machine)
  std::string args;                       // a JSON object's members ("\"q\": 4096, \"kv\": 8192"), or empty
};

// Recording from now on (the events so far dropped); stop() ends it and returns what was recorded. One
// recording at a time per process: two traced runs at once would share (and clear) one another's events.
void start();
std::vector<Event> stop();
bool enabled();
// The rank this thread records for (each in-process rank's thread, each MPI process); -1 until set.
void set_thread_rank(int rank);

// An event from construction to destruction on this thread, recorded where tracing is on.
class Scope {
 public:
  Scope(const char* category, std::string name, std::string args = "");
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool on_ = false;
  Event event_;
};

// The events as one Chrome trace-event JSON document: complete events ("ph": "X", microseconds from the
// earliest event), a process per rank named "rank N".
std::string chrome_json(const std::vector<Event>& events);

// Events as text lines and back (one event per line, fields tab-separated): how an MPI rank sends its events
// to rank 0.
std::string to_lines(const std::vector<Event>& events);
std::vector<Event> from_lines(const std::string& text);

}  // namespace cpattn::trace
