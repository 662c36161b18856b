// The answers of `validate` and `plan`, for every caller: their rules and bounds on top of validation's,
// their JSON document and their text. The program prints them (`cpattn validate|plan [--json]`), the Python
// module returns the document (`cpattn.validate(**keywords)`, `cpattn.plan(**keywords)`): the same answer
// either way.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cpattn/config_file.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

// validate lists every rank's heads: at most this many entries over all ranks (the text and the document).
inline constexpr std::int64_t kMaxListedHeads = std::int64_t{1} << 22;
// plan's bounds: tokens of a row, and blocks per row of the tile grid.
inline constexpr std::int64_t kMaxPlanSeq = std::int64_t{1} << 22;
inline constexpr std::int64_t kMaxPlanBlocks = 8192;
// The ranks plan models: the ring's per-step tile tables hold cp * cp entries (cp 2048 at S = 4M plans in
// 2.6 s and 170 MB on the 2-core EPYC; cp 16384 took 199 s and 8.4 GB).
inline constexpr std::int64_t kMaxPlanRanks = 2048;
// The model's other sizes: far above any model (Qwen3.5-397B-A17B: width 4096, 60 layers), low enough that
// the products the plan forms (bytes per layer, seconds per model) stay finite and exact.
inline constexpr std::int64_t kMaxPlanEmbDim = std::int64_t{1} << 24;
inline constexpr std::int64_t kMaxPlanLayers = 1000000;
inline constexpr double kMaxPlanRate = 1e30;  // FLOP/s or bytes/s

struct DocumentAnswer {
  int exit_code = 0;              // 0, or 2 for a configuration that breaks a rule
  std::string document;           // the JSON document; {"valid": false, "errors": [...]} on exit 2
  std::string text;               // the answer as text (empty on exit 2)
  std::string svg;                // plan: one layer per strategy and rank as an SVG image (empty otherwise)
  std::vector<ErrorItem> errors;  // every broken rule (exit 2)
};

// validate: the values' rules, then the head placement of every rank. Error(invalid_input) for a valid
// configuration with more head entries than it lists (kMaxListedHeads).
DocumentAnswer validate_answer(const ConfigValues& values);

// What plan reads: the problem (a config's strategy and ulysses degree are not read: every strategy and
// factorisation is planned), a preset under it, the model's sizes and the hardware over it.
struct PlanInputs {
  ConfigValues values;
  std::optional<std::int64_t> ulysses_degree;  // given by the caller: refused
  std::optional<std::string> strategy;         // given by the caller: refused (every strategy is planned)
  std::string preset;                          // a model preset's heads and sizes, under `values`
  std::optional<std::string> hardware;         // a compiled-in profile's name; unset: h200
  std::string profile;                         // a profile file (YAML) in place of a named one
  std::string segments;                        // packed document lengths as typed ("61440,4096"), or empty
  std::optional<std::int64_t> emb_dim, layers, attention_every, ranks_per_host;
  // Sliding-window layers (ModelShape): the local layers' window (LEFT) and the global layers' period.
  std::optional<std::int64_t> local_window, global_every;
  std::optional<std::int64_t> block;  // unset: the profile's block, else 512
  bool remat = false;
  bool forward_only = false;                                // prefill: the forward alone
  std::optional<double> flops, bandwidth, inter_bandwidth;  // the hardware's, overridden
};
// plan: every strategy's bytes, balance, memory and time, and the recommended one. Error(invalid_input) for
// an unknown preset.
DocumentAnswer plan_answer(const PlanInputs& inputs);

// The keyword form of both (the Python module's): keywords named as the program's flags without their dashes
// and with underscores (q_heads for --q-heads), each read as the flag reads its text (numbers by the one
// decimal parser, with the flag's range); a switch takes true or false; `config` may repeat (files merged in
// order, as --config). Error(invalid_config) for an unknown command or keyword (naming the valid ones and the
// nearest) or a switch given a value, Error(invalid_input) for a value the keyword cannot take; the rules a
// configuration breaks are in the answer.
using KeywordValue = std::variant<bool, std::int64_t, double, std::string>;
// The keywords of "validate" or "plan", in the table's order (tests hold them against the program's flags).
std::vector<std::string> document_keywords(const std::string& command);
DocumentAnswer keyword_answer(const std::string& command,
                              const std::vector<std::pair<std::string, KeywordValue>>& keywords);

}  // namespace cpattn
