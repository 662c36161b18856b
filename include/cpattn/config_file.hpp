// Configuration values as a user gives them: YAML files with the seed framework's key names, then flags.
// Several sources merge, later wins; each value is optional until the specs are built from them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpattn/config.hpp"

namespace cpattn {

struct ConfigValues {
  std::optional<std::string> strategy;         // context_parallel_strategy
  std::optional<std::int64_t> cp;              // ici_context_parallelism
  std::optional<std::int64_t> tp;              // ici_tensor_parallelism
  std::optional<std::int64_t> num_q_heads;     // num_query_heads | base_num_query_heads
  std::optional<std::int64_t> num_kv_heads;    // num_kv_heads | base_num_kv_heads
  std::optional<std::int64_t> head_dim;        // head_dim
  std::optional<std::int64_t> seq_len;         // max_target_length
  std::optional<std::int64_t> batch;           // per_device_batch_size
  std::optional<std::int64_t> ulysses_degree;  // context_parallel_ulysses_degree (hybrid)
  std::optional<bool> load_balance;            // context_parallel_load_balance
  std::optional<bool> attention_load_balance;  // context_parallel_attention_load_balance
  std::optional<std::string> layout;           // context_parallel_layout (--layout): a ShardLayout's name
  std::optional<bool> causal;
  std::optional<std::string> dtype;  // dtype
  // Sliding window: --window LEFT[,RIGHT] sets the sides; sliding_window_size W (W keys back, the query's
  // included; 0: none, as in the seed framework's defaults) where no --window is given: window_left W - 1,
  // and without the causal mask window_right W - 1 too (the seed framework's local-sliding mask bounds both
  // sides).
  std::optional<std::int64_t> window_left, window_right;
  std::optional<std::int64_t> sliding_window;
  std::optional<double> softcap;  // attn_logits_soft_cap (0: none, as in the seed framework's defaults)
  bool sinks = false;             // the run's --sinks (no config key)
  // The model around attention (for the planner).
  std::optional<std::int64_t> emb_dim;          // base_emb_dim
  std::optional<std::int64_t> num_layers;       // base_num_decoder_layers
  std::optional<std::int64_t> attention_every;  // inhomogeneous_layer_cycle_interval

  // Values set in `later` replace ours.
  void merge_from(const ConfigValues& later);
  // Attention's load balance: context_parallel_attention_load_balance where it is given (by any file or
  // flag), else context_parallel_load_balance. Two settings, not one spelled twice: the seed sets them apart
  // on purpose (its GDN layers keep the contiguous layout, load_balance false, while attention balances), so
  // they are neither OR-ed nor refused when they differ, and each follows "later wins" on its own.
  bool attention_balanced() const { return attention_load_balance.value_or(load_balance.value_or(false)); }
};

// Parses YAML text; unknown keys are ignored, a known key with the wrong type is an Error(invalid_input)
// naming the key and the file. `name` is used in messages.
// How many YAML documents `text` holds, counting no further than two (a config or profile holds one).
std::size_t yaml_documents_up_to_two(const std::string& text);

ConfigValues parse_config_yaml(const std::string& text, const std::string& name);
ConfigValues read_config_file(const std::string& path);

// The specs the values describe, with defaults for what is unset (batch 1, cp 1, tp 1, all_gather, causal,
// fp32). Unset required sizes and unparsable strings are added to `errors` (not thrown). `all_config_errors`
// gives these together with every broken validation rule (the rules only when every required size is set).
struct Specs {
  AttentionSpec attention;
  ParallelSpec parallel;
};
Specs to_specs(const ConfigValues& values, std::vector<ErrorItem>& errors);
std::vector<ErrorItem> all_config_errors(const ConfigValues& values, Specs& specs);

}  // namespace cpattn
