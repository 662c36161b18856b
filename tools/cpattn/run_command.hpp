#pragma once

#include <CLI/CLI.hpp>

namespace cpattn::cli {

// `cpattn run`: a real distributed forward + backward on random (or loaded) inputs, with --check against the
// single-device kernel and the float64 reference.
void add_run_command(CLI::App& app, int& exit_code);

}  // namespace cpattn::cli
