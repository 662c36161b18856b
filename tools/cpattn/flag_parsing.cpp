#include "flag_parsing.hpp"

#include <cstdio>

namespace cpattn::cli::detail {

std::string with_range(const std::string& description, std::int64_t min, std::int64_t max) {
  constexpr auto lo = std::numeric_limits<std::int64_t>::min(), hi = std::numeric_limits<std::int64_t>::max();
  if (min == lo && max == hi) return description;
  return description + (max == hi ? " (>= " + std::to_string(min) + ")"
                                  : " (" + std::to_string(min) + ".." + std::to_string(max) + ")");
}

std::string with_range(const std::string& description, double min, double max) {
  char buf[64];
  std::snprintf(buf, sizeof buf, " (%g..%g)", min, max);
  return description + buf;
}

}  // namespace cpattn::cli::detail

namespace cpattn::cli {

CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& target,
                        const std::vector<std::string>& valid, const std::string& description) {
  std::string list;
  for (const auto& v : valid) list += (list.empty() ? "" : ", ") + v;
  return app
      .add_option_function<std::string>(
          name,
          [&target, name, valid, list](const std::string& text) {
            for (const auto& v : valid) {
              if (text == v) {
                target = text;
                return;
              }
            }
            throw Error(ErrorKind::invalid_input, name, text,
                        name + " '" + quoted(text) + "' is not one of the choices; valid: " + list);
          },
          description + " (" + list + ")")
      ->type_name("NAME");
}

}  // namespace cpattn::cli
