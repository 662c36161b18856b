#include "cpattn/config_file.hpp"

#include <cmath>

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

namespace cpattn {
namespace {

template <class T>
void take(std::optional<T>& into, const std::optional<T>& from) {
  if (from) into = from;
}

[[noreturn]] void bad_value(const std::string& name, const std::string& key, const YAML::Node& node,
                            const char* wanted) {
  std::string text = node.IsScalar() ? node.Scalar() : (node.IsMap() ? "a mapping" : "a sequence");
  throw Error(ErrorKind::invalid_input, key, text,
              name + ": key '" + key + "' has value '" + text + "'; expected " + wanted);
}

std::int64_t as_int(const std::string& name, const std::string& key, const YAML::Node& node) {
  if (!node.IsScalar()) bad_value(name, key, node, "an integer");
  try {
    return node.as<std::int64_t>();
  } catch (const YAML::Exception&) {
    // The seed's framework writes some sizes as floats (per_device_batch_size: 1.0): accept whole numbers.
    try {
      const double d = node.as<double>();
      // Range first: converting a double outside int64's range is undefined (found by fuzz_config_yaml).
      if (d >= -9e18 && d <= 9e18 && d == std::trunc(d)) {
        return static_cast<std::int64_t>(d);
      }
    } catch (const YAML::Exception&) {
    }
    bad_value(name, key, node, "an integer");
  }
}

bool as_bool(const std::string& name, const std::string& key, const YAML::Node& node) {
  if (!node.IsScalar()) bad_value(name, key, node, "true or false");
  try {
    return node.as<bool>();
  } catch (const YAML::Exception&) {
    bad_value(name, key, node, "true or false");
  }
}

std::string as_string(const std::string& name, const std::string& key, const YAML::Node& node) {
  if (!node.IsScalar()) bad_value(name, key, node, "a string");
  return node.Scalar();
}

}  // namespace

void ConfigValues::merge_from(const ConfigValues& o) {
  take(strategy, o.strategy);
  take(cp, o.cp);
  take(tp, o.tp);
  take(ulysses_degree, o.ulysses_degree);
  take(num_q_heads, o.num_q_heads);
  take(num_kv_heads, o.num_kv_heads);
  take(head_dim, o.head_dim);
  take(seq_len, o.seq_len);
  take(batch, o.batch);
  take(load_balance, o.load_balance);
  take(attention_load_balance, o.attention_load_balance);
  take(causal, o.causal);
  take(dtype, o.dtype);
  take(emb_dim, o.emb_dim);
  take(num_layers, o.num_layers);
  take(attention_every, o.attention_every);
}

ConfigValues parse_config_yaml(const std::string& text, const std::string& name) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(ErrorKind::invalid_input, name, "", name + ": not valid YAML: " + e.what());
  }
  ConfigValues v;
  if (root.IsNull()) return v;
  if (!root.IsMap()) {
    throw Error(ErrorKind::invalid_input, name, "",
                name + ": the top level must be a mapping of keys to values");
  }
  for (const auto& entry : root) {
    if (!entry.first.IsScalar()) continue;
    const std::string key = entry.first.Scalar();
    const YAML::Node& node = entry.second;
    if (key == "context_parallel_strategy") {
      v.strategy = as_string(name, key, node);
    } else if (key == "ici_context_parallelism") {
      v.cp = as_int(name, key, node);
    } else if (key == "ici_tensor_parallelism") {
      v.tp = as_int(name, key, node);
    } else if (key == "context_parallel_ulysses_degree") {
      v.ulysses_degree = as_int(name, key, node);
    } else if (key == "num_query_heads" || key == "base_num_query_heads") {
      v.num_q_heads = as_int(name, key, node);
    } else if (key == "num_kv_heads" || key == "base_num_kv_heads") {
      v.num_kv_heads = as_int(name, key, node);
    } else if (key == "head_dim") {
      v.head_dim = as_int(name, key, node);
    } else if (key == "max_target_length") {
      v.seq_len = as_int(name, key, node);
    } else if (key == "per_device_batch_size") {
      v.batch = as_int(name, key, node);
    } else if (key == "context_parallel_load_balance") {
      v.load_balance = as_bool(name, key, node);
    } else if (key == "context_parallel_attention_load_balance") {
      v.attention_load_balance = as_bool(name, key, node);
    } else if (key == "dtype") {
      v.dtype = as_string(name, key, node);
    } else if (key == "base_emb_dim") {
      v.emb_dim = as_int(name, key, node);
    } else if (key == "base_num_decoder_layers") {
      v.num_layers = as_int(name, key, node);
    } else if (key == "inhomogeneous_layer_cycle_interval") {
      v.attention_every = as_int(name, key, node);
    }
  }
  return v;
}

ConfigValues read_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(ErrorKind::invalid_input, path, "", path + ": cannot open config file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_config_yaml(ss.str(), path);
}

Specs to_specs(const ConfigValues& v, std::vector<ErrorItem>& errors) {
  Specs s;
  auto required = [&](const std::optional<std::int64_t>& value, const char* field, const char* flag,
                      std::int64_t& out) {
    if (value) {
      out = *value;
    } else {
      errors.push_back(
          {{field}, "unset", std::string(field) + " is not set; give " + flag + " or its config key"});
      out = 0;  // the caller reports this before checking any rule that involves it
    }
  };
  required(v.seq_len, "seq_len", "--seq", s.attention.seq_len);
  required(v.num_q_heads, "num_q_heads", "--q-heads", s.attention.num_q_heads);
  required(v.num_kv_heads, "num_kv_heads", "--kv-heads", s.attention.num_kv_heads);
  required(v.head_dim, "head_dim", "--head-dim", s.attention.head_dim);
  s.attention.batch = v.batch.value_or(1);
  s.attention.causal = v.causal.value_or(true);
  s.parallel.cp = v.cp.value_or(1);
  s.parallel.tp = v.tp.value_or(1);
  s.parallel.ulysses_degree = v.ulysses_degree.value_or(0);
  s.parallel.load_balance = v.any_load_balance();
  try {
    if (v.dtype) s.attention.dtype = parse_dtype(*v.dtype);
  } catch (const Error& e) {
    errors.insert(errors.end(), e.items().begin(), e.items().end());
  }
  try {
    if (v.strategy) s.parallel.strategy = parse_strategy(*v.strategy);
  } catch (const Error& e) {
    errors.insert(errors.end(), e.items().begin(), e.items().end());
  }
  return s;
}

std::vector<ErrorItem> all_config_errors(const ConfigValues& values, Specs& specs) {
  std::vector<ErrorItem> errors;
  specs = to_specs(values, errors);
  const bool sizes_set = values.seq_len && values.num_q_heads && values.num_kv_heads && values.head_dim;
  if (sizes_set) {
    auto rules = validation_errors(specs.attention, specs.parallel);
    errors.insert(errors.end(), rules.begin(), rules.end());
  }
  return errors;
}

}  // namespace cpattn
