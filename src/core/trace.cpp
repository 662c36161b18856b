#include "cpattn/trace.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>

namespace cpattn::trace {
namespace {

std::atomic<bool> g_on{false};
std::mutex g_mutex;
std::vector<Event> g_events;
thread_local int t_rank = -1;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

void start() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
  g_on = true;
}

std::vector<Event> stop() {
  g_on = false;
  std::lock_guard<std::mutex> lock(g_mutex);
  return std::move(g_events);
}

bool enabled() {
  return g_on.load(std::memory_order_relaxed);
}

void set_thread_rank(int rank) {
  t_rank = rank;
}

Scope::Scope(const char* category, std::string name, std::string args) {
  if (!enabled()) return;
  on_ = true;
  event_.name = std::move(name);
  event_.category = category;
  event_.rank = t_rank;
  event_.args = std::move(args);
  event_.begin_ns = now_ns();
}

Scope::~Scope() {
  if (!on_) return;
  event_.end_ns = now_ns();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_on) g_events.push_back(std::move(event_));
}

std::string chrome_json(const std::vector<Event>& events) {
  std::int64_t origin = 0;
  bool any = false;
  std::vector<int> ranks;
  for (const Event& e : events) {
    origin = any ? std::min(origin, e.begin_ns) : e.begin_ns;
    any = true;
    if (std::find(ranks.begin(), ranks.end(), e.rank) == ranks.end()) ranks.push_back(e.rank);
  }
  std::sort(ranks.begin(), ranks.end());
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(3);
  o << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  bool first = true;
  for (const int r : ranks) {
    o << (first ? "" : ",") << "\n  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << r
      << ", \"tid\": 0, \"args\": {\"name\": " << json_string(r < 0 ? "no rank" : "rank " + std::to_string(r))
      << "}}";
    o << ",\n  {\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": " << r
      << ", \"tid\": 0, \"args\": {\"sort_index\": " << r << "}}";
    first = false;
  }
  for (const Event& e : events) {
    o << (first ? "" : ",") << "\n  {\"name\": " << json_string(e.name)
      << ", \"cat\": " << json_string(e.category) << ", \"ph\": \"X\", \"pid\": " << e.rank
      << ", \"tid\": 0, \"ts\": " << static_cast<double>(e.begin_ns - origin) / 1e3
      << ", \"dur\": " << static_cast<double>(e.end_ns - e.begin_ns) / 1e3 << ", \"args\": {" << e.args
      << "}}";
    first = false;
  }
  o << "\n]}\n";
  return o.str();
}

std::string to_lines(const std::vector<Event>& events) {
  std::ostringstream o;
  for (const Event& e : events) {
    o << e.rank << '\t' << e.begin_ns << '\t' << e.end_ns << '\t' << e.category << '\t' << e.name << '\t'
      << e.args << '\n';
  }
  return o.str();
}

std::vector<Event> from_lines(const std::string& text) {
  std::vector<Event> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    Event e;
    std::string rank, begin, end;
    if (!std::getline(f, rank, '\t') || !std::getline(f, begin, '\t') || !std::getline(f, end, '\t') ||
        !std::getline(f, e.category, '\t') || !std::getline(f, e.name, '\t')) {
      continue;
    }
    std::getline(f, e.args);
    e.rank = std::stoi(rank);
    e.begin_ns = std::stoll(begin);
    e.end_ns = std::stoll(end);
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace cpattn::trace
