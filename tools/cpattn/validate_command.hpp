#pragma once

#include <CLI/CLI.hpp>

namespace cpattn::cli {

// `cpattn validate`: checks a configuration and prints the head placement. Exit 0 valid, 2 invalid.
void add_validate_command(CLI::App& app, int& exit_code);

}  // namespace cpattn::cli
