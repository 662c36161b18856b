#pragma once

#include <CLI/CLI.hpp>

#include <iostream>

namespace cpattn::cli {

// `cpattn validate`: checks a configuration and prints the head placement. Exit 0 valid, 2 invalid.
// Its answer goes to `out`, its errors to `err` (the program: std::cout, std::cerr; the Python module:
// strings).
void add_validate_command(CLI::App& app, int& exit_code, std::ostream& out = std::cout,
                          std::ostream& err = std::cerr);

}  // namespace cpattn::cli
