#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "cpattn/comm.hpp"

namespace cpattn::cli {

// `cpattn bench comm`, `cpattn bench strategy` and `cpattn bench kernel`: measured figures with same-run
// baselines.
void add_bench_command(CLI::App& app, int& exit_code);
void add_bench_kernel_command(CLI::App& bench, int& exit_code);     // bench_kernel.cpp
void add_bench_calibrate_command(CLI::App& bench, int& exit_code);  // bench_calibrate.cpp

// One collective's seconds per call on this rank's group (the slowest rank's, best of tries): `kind` is
// all_to_all, all_to_all_strided, all_to_all_v, all_gather or reduce_scatter; `bytes` the per-device size.
double collective_seconds(Communicator& comm, const std::string& kind, std::int64_t bytes);

}  // namespace cpattn::cli
