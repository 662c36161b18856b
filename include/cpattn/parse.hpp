// Numbers as users type them (flags, config keys): one decimal reading for every integer and one for every
// real number, so that no flag takes 010 for octal 8, 0x10 for 16, "" for a default or 2^64 for a wrapped
// value. Each refuses with Error(invalid_input) naming the field, the text as typed and what is valid.
#pragma once

#include <cstdint>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpattn/error.hpp"

namespace cpattn {

// An optional sign, then decimal digits only (leading zeros are decimal: "010" is 10); nothing else, not even
// spaces. Refused: empty text, any other character, a value outside [min, max] (the message states the range
// and, past int64, that the text is too large). `valid` says what the field takes ("a count of ranks").
std::int64_t parse_integer(const std::string& text, const std::string& field,
                           std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                           std::int64_t max = std::numeric_limits<std::int64_t>::max(),
                           const std::string& valid = "an integer");

// A finite decimal number ("1.5", "2e-3", "600"), in [min, max]; no hex floats, inf, nan or spaces.
double parse_real(const std::string& text, const std::string& field, double min, double max,
                  const std::string& valid = "a number");

// "6144,2048" -> {6144, 2048}: packed document lengths, each a positive integer, their sum at most 2^63 - 1;
// else Error(invalid_input) naming `field`.
std::vector<std::int64_t> parse_document_lengths(const std::string& text, const std::string& field);

// "LEFT" or "LEFT,RIGHT" (--window): one or two decimal integers, the second absent for "LEFT"; their ranges
// are validation's (window_left, window_right). Else Error(invalid_input) naming `field`.
struct WindowText {
  std::int64_t left = 0;
  std::optional<std::int64_t> right;
};
WindowText parse_window(const std::string& text, const std::string& field);

// "a, b" -> the text made safe to quote in a message: control characters and bytes that are not UTF-8 as
// \xNN escapes, at most 200 characters (the rest as "...").
std::string quoted(const std::string& text);

// The whole text with the bytes that are not UTF-8 and the control characters but newline and tab escaped
// (\xNN): what a message or a JSON document may carry whatever path or value went into it (a NUL byte from a
// file's header, an escape sequence, are shown, not sent to the terminal).
std::string utf8_safe(const std::string& text);

// The nearest of `known` to `word` by edit distance, or "" where none is close (more than a third of the
// word's length away).
std::string nearest(const std::string& word, const std::vector<std::string>& known);

// Opens `path` for binary reading when it is a regular file, and returns its size in bytes. Anything else is
// refused before it is opened (a FIFO would block the open, /dev/zero or a terminal would never end): Error
// (invalid_input) "PATH: is a directory|FIFO|device|socket; valid: a regular file", or "PATH: cannot open
// for reading (REASON)".
std::uint64_t open_input_file(const std::string& path, std::ifstream& in);

}  // namespace cpattn
