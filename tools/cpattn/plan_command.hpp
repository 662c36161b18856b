#pragma once

#include <CLI/CLI.hpp>

namespace cpattn::cli {

// `cpattn plan`: the planner's answer for a model, per strategy, as a table or JSON.
void add_plan_command(CLI::App& app, int& exit_code);

}  // namespace cpattn::cli
