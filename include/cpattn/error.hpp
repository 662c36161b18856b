// Errors: one mechanism for the whole library. Everything that rejects input throws cpattn::Error, which
// carries one or more ErrorItems, each naming the field(s), the offending value and what would be valid.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cpattn {

enum class ErrorKind {
  invalid_config,  // a spec or flag that breaks a rule (validation)
  invalid_input,   // tensors, files or configs whose content is wrong
  communication,   // a collective failed: a peer rank failed, a mismatch, a timeout, an MPI error
  internal,        // an invariant inside cpattn broke (a bug)
  out_of_memory,   // an allocation failed: the bytes and what they were for are named (and the rank, on a
                   // rank)
  resource,        // another resource of the machine ran out: a thread that cannot be made, a file size
                   // limit, a full disk (what ran out and what it was for are named)
  interrupted,     // the caller asked the work to stop (cpattn/interrupt.hpp: Python's Ctrl-C)
};

const char* to_string(ErrorKind kind);

struct ErrorItem {
  std::vector<std::string> fields;  // the offending field(s); first is the main one
  std::string value;                // the offending value(s), as text
  std::string message;              // the whole sentence, with the valid range
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::vector<ErrorItem> items);
  Error(ErrorKind kind, std::string field, std::string value, std::string message);

  ErrorKind kind() const { return kind_; }
  const std::vector<ErrorItem>& items() const { return items_; }

 private:
  ErrorKind kind_;
  std::vector<ErrorItem> items_;
};

// Throws Error(resource): "could not start a thread for <what>: <the system's reason>; ...".
[[noreturn]] void fail_thread(const std::string& what, const std::exception& reason);
// Throws Error(out_of_memory): "out of memory while allocating N bytes for <what>".
[[noreturn]] void fail_allocation(std::size_t bytes, const std::string& what);
// The same error said of one rank: "out of memory on rank r while allocating ..." (other kinds: "rank r:
// ...").
Error on_rank(const Error& e, int rank);

// Errors found one by one and reported at once (every broken rule, not the first): validation's rules, the
// Python module's arguments.
class ErrorList {
 public:
  void add(std::vector<std::string> fields, std::string value, std::string message) {
    items_.push_back({std::move(fields), std::move(value), std::move(message)});
  }
  void append(const std::vector<ErrorItem>& items) {
    items_.insert(items_.end(), items.begin(), items.end());
  }
  bool empty() const { return items_.empty(); }
  const std::vector<ErrorItem>& items() const { return items_; }
  std::vector<ErrorItem> take() { return std::move(items_); }
  // Error(kind) with every item, where there is one.
  void raise(ErrorKind kind) const {
    if (!items_.empty()) throw Error(kind, items_);
  }

 private:
  std::vector<ErrorItem> items_;
};

// Throws Error(internal) with file:line when an internal invariant fails.
[[noreturn]] void fail_invariant(const char* expr, const char* file, int line);

}  // namespace cpattn

#define CPATTN_ASSERT(cond) \
  ((cond) ? static_cast<void>(0) : ::cpattn::fail_invariant(#cond, __FILE__, __LINE__))
