// The flags that describe an attention problem, shared by the subcommands (validate, run, plan, bench).
#pragma once

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "cpattn/config.hpp"
#include "cpattn/config_file.hpp"
#include "cpattn/documents.hpp"
#include "cpattn/parse.hpp"
#include "documents/json_document.hpp"

namespace cpattn::cli {

struct ProblemFlags {
  ConfigValues values;                    // what the flags set
  std::vector<std::string> config_files;  // --config, in order
  bool load_balance = false;
  bool causal = false;
  bool no_causal = false;

  // Adds --q-heads --kv-heads --head-dim --seq --batch --dtype --causal --no-causal --config and, with
  // `parallel`, how the problem is split: --strategy --cp --ulysses-degree --tp --load-balance (a command
  // that runs one kernel has none of them: given, they are unknown flags, not ignored ones).
  void add_to(CLI::App& app, bool parallel = true);
  // Files merged in order, then the flags on top.
  ConfigValues resolve(const CLI::App& app) const;
};

// Refuses, before anything is allocated, a problem whose `tensor_count` tensors of [B, S, max(Hq, Hkv), D]
// alone exceed this machine's physical memory: Error(invalid_input) naming the sizes, with the need and what
// there is. (A lower bound of what a run needs, so it never refuses a problem that would fit.)
void require_memory_for(const AttentionSpec& attention, int tensor_count, const std::string& what);

void print_errors(const std::vector<ErrorItem>& errors, std::ostream& err = std::cerr);

// Prints an answer of validate or plan (cpattn/documents.hpp): its document (`json`) or its text to `out`; on
// exit 2 every error to `err` (and the document with `json`). Returns its exit code.
int print_answer(const DocumentAnswer& answer, bool json, std::ostream& out, std::ostream& err);

}  // namespace cpattn::cli
