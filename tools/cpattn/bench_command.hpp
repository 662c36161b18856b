#pragma once

#include <CLI/CLI.hpp>

namespace cpattn::cli {

// `cpattn bench comm` and `cpattn bench strategy`: measured figures with same-run baselines.
void add_bench_command(CLI::App& app, int& exit_code);

}  // namespace cpattn::cli
