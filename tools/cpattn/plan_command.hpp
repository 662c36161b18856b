#pragma once

#include <CLI/CLI.hpp>

#include <iostream>

namespace cpattn::cli {

// `cpattn plan`: the planner's answer for a model, per strategy, as a table or JSON.
// Its answer goes to `out`, its errors to `err` (the program: std::cout, std::cerr; the Python module:
// strings).
void add_plan_command(CLI::App& app, int& exit_code, std::ostream& out = std::cout,
                      std::ostream& err = std::cerr);

}  // namespace cpattn::cli
