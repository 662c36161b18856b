#include "cpattn/error.hpp"

#include <utility>

namespace cpattn {
namespace {

std::string join_messages(const std::vector<ErrorItem>& items) {
  std::string text;
  for (const auto& item : items) {
    if (!text.empty()) text += "\n";
    text += item.message;
  }
  return text;
}

}  // namespace

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_config:
      return "invalid_config";
    case ErrorKind::invalid_input:
      return "invalid_input";
    case ErrorKind::communication:
      return "communication";
    case ErrorKind::internal:
      return "internal";
    case ErrorKind::out_of_memory:
      return "out_of_memory";
    case ErrorKind::resource:
      return "resource";
    case ErrorKind::interrupted:
      return "interrupted";
  }
  return "unknown";
}

Error::Error(ErrorKind kind, std::vector<ErrorItem> items)
    : std::runtime_error(join_messages(items)), kind_(kind), items_(std::move(items)) {}

Error::Error(ErrorKind kind, std::string field, std::string value, std::string message)
    : Error(kind, std::vector<ErrorItem>{{{std::move(field)}, std::move(value), std::move(message)}}) {}

void fail_invariant(const char* expr, const char* file, int line) {
  throw Error(
      ErrorKind::internal, "invariant", expr,
      std::string("cpattn internal error: ") + expr + " failed at " + file + ":" + std::to_string(line));
}

void fail_thread(const std::string& what, const std::exception& reason) {
  throw Error(
      ErrorKind::resource, "threads", what,
      "could not start a thread for " + what + ": " + reason.what() +
          " (the process's limits, ulimit -u or -v, or its memory ran out); use fewer ranks or threads");
}

void fail_allocation(std::size_t bytes, const std::string& what) {
  throw Error(ErrorKind::out_of_memory, "memory", std::to_string(bytes),
              "out of memory while allocating " + std::to_string(bytes) + " bytes for " + what);
}

Error on_rank(const Error& e, int rank) {
  const std::string prefix = "out of memory";
  std::vector<ErrorItem> items = e.items();
  for (ErrorItem& item : items) {
    if (e.kind() == ErrorKind::out_of_memory && item.message.rfind(prefix, 0) == 0) {
      item.message.insert(prefix.size(), " on rank " + std::to_string(rank));
    } else {
      item.message = "rank " + std::to_string(rank) + ": " + item.message;
    }
  }
  return Error(e.kind(), std::move(items));
}

}  // namespace cpattn
