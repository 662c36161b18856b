#pragma once

#include <CLI/CLI.hpp>

namespace cpattn::cli {

// `cpattn bench comm`, `cpattn bench strategy` and `cpattn bench kernel`: measured figures with same-run
// baselines.
void add_bench_command(CLI::App& app, int& exit_code);
void add_bench_kernel_command(CLI::App& bench, int& exit_code);  // bench_kernel.cpp

}  // namespace cpattn::cli
