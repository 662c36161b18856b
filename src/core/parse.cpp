#include "cpattn/parse.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <sys/stat.h>

namespace cpattn {
namespace {

std::string range_text(std::int64_t min, std::int64_t max) {
  constexpr auto lo = std::numeric_limits<std::int64_t>::min(), hi = std::numeric_limits<std::int64_t>::max();
  if (min == lo && max == hi) return "";
  if (max == hi) return " >= " + std::to_string(min);
  if (min == lo) return " <= " + std::to_string(max);
  return " in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

std::string real_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

}  // namespace

std::int64_t parse_integer(const std::string& text, const std::string& field, std::int64_t min,
                           std::int64_t max, const std::string& valid) {
  const std::string want = valid + range_text(min, max);
  auto refuse = [&](const std::string& why) -> std::int64_t {
    throw Error(
        ErrorKind::invalid_input, field, text,
        field + " '" + quoted(text) + "' " + why + "; valid: " + want + ", written in decimal digits");
  };
  std::size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  if (i == text.size()) return refuse(text.empty() ? "is empty" : "has no digits");
  // Accumulated as a negative number: int64's range is one larger below zero.
  std::int64_t value = 0;
  bool overflow = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c < '0' || c > '9') return refuse("is not a decimal integer");
    const int digit = c - '0';
    if (value < (std::numeric_limits<std::int64_t>::min() + digit) / 10) overflow = true;
    if (!overflow) value = value * 10 - digit;
  }
  if (!overflow && !negative && value == std::numeric_limits<std::int64_t>::min()) overflow = true;
  if (overflow) return refuse("is too large (beyond a 64-bit integer)");
  if (!negative) value = -value;
  if (value < min || value > max) return refuse("is out of range");
  return value;
}

double parse_real(const std::string& text, const std::string& field, double min, double max,
                  const std::string& valid) {
  const std::string want = valid + " in [" + real_text(min) + ", " + real_text(max) + "]";
  auto refuse = [&](const std::string& why) -> double {
    throw Error(ErrorKind::invalid_input, field, text,
                field + " '" + quoted(text) + "' " + why + "; valid: " + want);
  };
  if (text.empty()) return refuse("is empty");
  // Decimal notation only: digits, one point, an exponent; strtod alone would take hex, inf, nan and spaces.
  if (text.find_first_not_of("0123456789+-.eE") != std::string::npos)
    return refuse("is not a decimal number");
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return refuse("is not a decimal number");
  // ERANGE also marks an underflow to a tiny or zero value, which the range check below judges.
  if ((errno == ERANGE && std::fabs(x) == HUGE_VAL) || !std::isfinite(x)) return refuse("is out of range");
  if (!(x >= min && x <= max)) return refuse("is out of range");
  return x;
}

namespace {

// Escapes bytes that are not UTF-8 (and, where `controls`, control characters) as \xNN; at most `limit`
// characters, the rest as "...".
std::string escaped(const std::string& text, bool controls, std::size_t limit) {
  std::string out;
  std::size_t i = 0, shown = 0;
  auto escape = [&](unsigned char c) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02X", c);
    out += buf;
  };
  while (i < text.size()) {
    if (shown == limit) return out + "...";
    const auto c = static_cast<unsigned char>(text[i]);
    std::size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= text.size();
    for (std::size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(text[i + k]) >> 6) == 0x2;
    if (ok && len == 2) ok = c >= 0xC2;  // no overlong forms
    if (ok && len == 3) {
      const auto c1 = static_cast<unsigned char>(text[i + 1]);
      ok = !(c == 0xE0 && c1 < 0xA0) && !(c == 0xED && c1 >= 0xA0);  // no overlong forms, no surrogates
    }
    if (ok && len == 4) {
      const auto c1 = static_cast<unsigned char>(text[i + 1]);
      ok = c <= 0xF4 && !(c == 0xF0 && c1 < 0x90) && !(c == 0xF4 && c1 >= 0x90);
    }
    if (!ok) {
      escape(c);
      ++i;
    } else if (len == 1 && (c < 0x20 || c == 0x7F) && (controls || (c != '\n' && c != '\t'))) {
      escape(c);
      ++i;
    } else {
      out.append(text, i, len);
      i += len;
    }
    ++shown;
  }
  return out;
}

}  // namespace

std::string quoted(const std::string& text) {
  return escaped(text, true, 200);
}

std::string utf8_safe(const std::string& text) {
  return escaped(text, false, std::string::npos);
}

std::string nearest(const std::string& word, const std::vector<std::string>& known) {
  std::string best;
  std::size_t best_distance = word.size() / 3 + 1;
  for (const std::string& k : known) {
    // Levenshtein distance, one row at a time.
    std::vector<std::size_t> row(k.size() + 1);
    for (std::size_t j = 0; j <= k.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= word.size(); ++i) {
      std::size_t diagonal = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= k.size(); ++j) {
        const std::size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (word[i - 1] == k[j - 1] ? 0 : 1)});
        diagonal = up;
      }
    }
    if (row[k.size()] < best_distance) {
      best_distance = row[k.size()];
      best = k;
    }
  }
  return best;
}

std::uint64_t open_input_file(const std::string& path, std::ifstream& in) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw Error(ErrorKind::invalid_input, path, "",
                quoted(path) + ": cannot open for reading (" + std::strerror(err) + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a device";
    throw Error(ErrorKind::invalid_input, path, "",
                quoted(path) + ": is " + what + "; valid: a regular file");
  }
  in.open(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    throw Error(ErrorKind::invalid_input, path, "",
                quoted(path) + ": cannot open for reading (" + std::strerror(err) + ")");
  }
  return static_cast<std::uint64_t>(st.st_size);
}

WindowText parse_window(const std::string& text, const std::string& field) {
  const std::size_t comma = text.find(',');
  if (comma != std::string::npos && text.find(',', comma + 1) != std::string::npos) {
    throw Error(ErrorKind::invalid_input, field, text,
                field + " '" + quoted(text) +
                    "' has more than two sides; valid: LEFT (causal) or LEFT,RIGHT (non-causal)");
  }
  WindowText w;
  w.left = parse_integer(text.substr(0, comma), field, std::numeric_limits<std::int64_t>::min(),
                         std::numeric_limits<std::int64_t>::max(), "a window side");
  if (comma != std::string::npos) {
    w.right = parse_integer(text.substr(comma + 1), field, std::numeric_limits<std::int64_t>::min(),
                            std::numeric_limits<std::int64_t>::max(), "a window side");
  }
  return w;
}

std::vector<std::int64_t> parse_document_lengths(const std::string& text, const std::string& flag) {
  if (text.empty())
    throw Error(ErrorKind::invalid_input, flag, text, flag + " is empty; give lengths like 6144,2048");
  std::vector<std::int64_t> lengths;
  std::int64_t total = 0;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string part =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    try {
      lengths.push_back(parse_integer(part, flag, 1, std::numeric_limits<std::int64_t>::max(),
                                      "a positive document length"));
    } catch (const Error&) {
      throw Error(ErrorKind::invalid_input, flag, text,
                  flag + " '" + quoted(text) + "': '" + quoted(part) +
                      "' is not a positive document length (decimal digits, at most 2^63 - 1)");
    }
    if (__builtin_add_overflow(total, lengths.back(), &total)) {
      throw Error(ErrorKind::invalid_input, flag, text,
                  flag + " '" + quoted(text) + "': the lengths add up to more than 2^63 - 1 tokens");
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return lengths;
}

}  // namespace cpattn
