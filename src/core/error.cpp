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

}  // namespace cpattn
