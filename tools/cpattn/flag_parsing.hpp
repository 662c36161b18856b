// Flags whose values are numbers or names, read by the one decimal parser (cpattn/parse.hpp): every command's
// integer and real flags are added through these, so that every flag refuses the same way (exit 2, the flag,
// the value as typed and its range) and the range is stated in --help.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpattn/config.hpp"
#include "cpattn/parse.hpp"

namespace cpattn::cli {

// The in-process group's largest size (one thread per rank): run --cp, bench comm --ranks and bench strategy
// --cp/--cps above it exit 2. Chosen so that every command answers within seconds (docs/errors.md: a ring's
// time grows faster than cp squared in-process, each shift waking every rank); more ranks are MPI's.
inline constexpr std::int64_t kMaxInProcessRanks = 128;

namespace detail {
std::string with_range(const std::string& description, std::int64_t min, std::int64_t max);
std::string with_range(const std::string& description, double min, double max);
}  // namespace detail

// `target` is an integer type or std::optional of one; its value is set as the flag is read.
template <class T>
CLI::Option* add_integer(CLI::App& app, const std::string& name, T& target, std::int64_t min,
                         std::int64_t max, const std::string& description) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, name, min, max](const std::string& text) {
            using V = std::remove_reference_t<decltype(target.value())>;
            target = static_cast<V>(parse_integer(text, name, min, max));
          },
          detail::with_range(description, min, max))
      ->type_name("INT");
}

template <class T>
requires std::is_integral_v<T> CLI::Option* add_integer(CLI::App& app, const std::string& name, T& target,
                                                        std::int64_t min, std::int64_t max,
                                                        const std::string& description) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, name, min, max](const std::string& text) {
            target = static_cast<T>(parse_integer(text, name, min, max));
          },
          detail::with_range(description, min, max))
      ->type_name("INT");
}

// A comma list of integers ("2,4,8"), each in [min, max]; an empty list or an empty item ("2,,4") is refused.
template <class T>
CLI::Option* add_integer_list(CLI::App& app, const std::string& name, std::vector<T>& target,
                              std::int64_t min, std::int64_t max, const std::string& description) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, name, min, max](const std::string& text) {
            if (text.empty()) {
              throw Error(ErrorKind::invalid_input, name, "",
                          name + " is an empty list; give at least one value or leave it out");
            }
            target.clear();
            for (std::size_t begin = 0;;) {
              const std::size_t end = std::min(text.find(',', begin), text.size());
              const std::string item = text.substr(begin, end - begin);
              if (item.empty()) {
                throw Error(
                    ErrorKind::invalid_input, name, text,
                    name + " '" + quoted(text) + "' has an empty item; valid: INT,INT,... with no gaps");
              }
              target.push_back(static_cast<T>(parse_integer(item, name, min, max)));
              if (end == text.size()) break;
              begin = end + 1;
            }
          },
          detail::with_range(description, min, max))
      ->type_name("INT,...");
}

// A real number in [min, max] (decimal notation).
template <class T>
CLI::Option* add_real(CLI::App& app, const std::string& name, T& target, double min, double max,
                      const std::string& description) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, name, min, max](const std::string& text) { target = parse_real(text, name, min, max); },
          detail::with_range(description, min, max))
      ->type_name("NUMBER");
}

// Text that may not be empty (a path, a list, a name read later): `--save ""` is refused, not taken as unset.
// `target` is std::string or std::optional<std::string>.
template <class T>
CLI::Option* add_text(CLI::App& app, const std::string& name, T& target, const std::string& description) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, name](const std::string& text) {
            if (text.empty()) {
              throw Error(ErrorKind::invalid_input, name, text,
                          name + " is empty; give it a value or leave it out");
            }
            target = text;
          },
          description)
      ->type_name("TEXT");
}

// A name from `valid` ("inproc", "mpi"): anything else is refused naming the valid ones.
CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& target,
                        const std::vector<std::string>& valid, const std::string& description);

}  // namespace cpattn::cli
