// The flags that describe an attention problem, shared by the subcommands (validate, run, plan, bench).
#pragma once

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "cpattn/config.hpp"
#include "cpattn/config_file.hpp"

namespace cpattn::cli {

struct ProblemFlags {
  ConfigValues values;                    // what the flags set
  std::vector<std::string> config_files;  // --config, in order
  bool load_balance = false;
  bool causal = false;
  bool no_causal = false;

  // Adds --strategy --cp --ulysses-degree --q-heads --kv-heads --head-dim --seq --batch --tp --load-balance
  // --dtype --causal
  // --no-causal --config.
  void add_to(CLI::App& app);
  // Files merged in order, then the flags on top.
  ConfigValues resolve(const CLI::App& app) const;
};

// "6144,2048" -> {6144, 2048}; each a positive integer, else Error(invalid_input) naming `flag`.
std::vector<std::int64_t> parse_document_lengths(const std::string& text, const std::string& flag);

// Refuses, before anything is allocated, a problem whose `tensor_count` tensors of [B, S, max(Hq, Hkv), D]
// alone exceed this machine's physical memory: Error(invalid_input) naming the sizes, with the need and what
// there is. (A lower bound of what a run needs, so it never refuses a problem that would fit.)
void require_memory_for(const AttentionSpec& attention, int tensor_count, const std::string& what);

// The attention problem as the "problem" block of every command's JSON: batch, seq, q_heads, kv_heads,
// head_dim, causal, dtype; commands append their own keys.
nlohmann::ordered_json attention_to_json(const AttentionSpec& attention);

// JSON for a list of errors: [{"field", "fields"?, "value", "message"}].
std::string errors_to_json(const std::vector<ErrorItem>& errors);
// A failed command's one JSON document: {"<key>": false, "errors": [...]} (key "ok" for run and bench,
// "valid" for validate and plan).
std::string failure_json(const std::string& key, const std::vector<ErrorItem>& errors);
// A document as text, always valid UTF-8 (a byte that is not is replaced by U+FFFD), never throwing on it.
std::string json_text(const nlohmann::ordered_json& doc, int indent = -1);
std::string json_text(const nlohmann::json& doc, int indent = -1);
void print_errors(const std::vector<ErrorItem>& errors, std::ostream& err = std::cerr);

}  // namespace cpattn::cli
