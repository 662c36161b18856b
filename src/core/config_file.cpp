#include "cpattn/config_file.hpp"

#include "cpattn/parse.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include <yaml-cpp/eventhandler.h>
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
                            const std::string& wanted) {
  const std::string text = node.IsNull()     ? "no value (null)"
                           : node.IsScalar() ? "'" + quoted(node.Scalar()) + "'"
                                             : (node.IsMap() ? "a mapping" : "a sequence");
  throw Error(ErrorKind::invalid_input, key, node.IsScalar() ? node.Scalar() : text,
              name + ": key '" + quoted(key) + "' has value " + quoted(text) + "; expected " + wanted);
}

std::int64_t as_int(const std::string& name, const std::string& key, const YAML::Node& node) {
  if (!node.IsScalar()) bad_value(name, key, node, "an integer");
  const std::string& text = node.Scalar();
  try {
    // The one decimal reading of every integer (parse.hpp): no octal 010, no hex, no empty value.
    return parse_integer(text, key);
  } catch (const Error&) {
  }
  // The seed's framework writes some sizes as floats (per_device_batch_size: 1.0): accept whole numbers.
  try {
    const double d = parse_real(text, key, -9e18, 9e18);
    if (d == std::trunc(d)) return static_cast<std::int64_t>(d);
  } catch (const Error&) {
  }
  bad_value(name, key, node, "an integer, written in decimal digits");
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

// Every key cpattn reads, and nothing else: a key not here is refused (a misspelt key must not be ignored).
struct KeyReader {
  const char* key;
  void (*read)(ConfigValues&, const std::string& name, const std::string& key, const YAML::Node&);
};

constexpr KeyReader kKeys[] = {
    {"context_parallel_strategy", [](ConfigValues& v, const std::string& n, const std::string& k,
                                     const YAML::Node& x) { v.strategy = as_string(n, k, x); }},
    {"ici_context_parallelism", [](ConfigValues& v, const std::string& n, const std::string& k,
                                   const YAML::Node& x) { v.cp = as_int(n, k, x); }},
    {"ici_tensor_parallelism", [](ConfigValues& v, const std::string& n, const std::string& k,
                                  const YAML::Node& x) { v.tp = as_int(n, k, x); }},
    {"context_parallel_ulysses_degree", [](ConfigValues& v, const std::string& n, const std::string& k,
                                           const YAML::Node& x) { v.ulysses_degree = as_int(n, k, x); }},
    {"num_query_heads", [](ConfigValues& v, const std::string& n, const std::string& k,
                           const YAML::Node& x) { v.num_q_heads = as_int(n, k, x); }},
    {"base_num_query_heads", [](ConfigValues& v, const std::string& n, const std::string& k,
                                const YAML::Node& x) { v.num_q_heads = as_int(n, k, x); }},
    {"num_kv_heads", [](ConfigValues& v, const std::string& n, const std::string& k,
                        const YAML::Node& x) { v.num_kv_heads = as_int(n, k, x); }},
    {"base_num_kv_heads", [](ConfigValues& v, const std::string& n, const std::string& k,
                             const YAML::Node& x) { v.num_kv_heads = as_int(n, k, x); }},
    {"head_dim", [](ConfigValues& v, const std::string& n, const std::string& k,
                    const YAML::Node& x) { v.head_dim = as_int(n, k, x); }},
    {"max_target_length", [](ConfigValues& v, const std::string& n, const std::string& k,
                             const YAML::Node& x) { v.seq_len = as_int(n, k, x); }},
    {"per_device_batch_size", [](ConfigValues& v, const std::string& n, const std::string& k,
                                 const YAML::Node& x) { v.batch = as_int(n, k, x); }},
    {"context_parallel_load_balance", [](ConfigValues& v, const std::string& n, const std::string& k,
                                         const YAML::Node& x) { v.load_balance = as_bool(n, k, x); }},
    {"context_parallel_attention_load_balance",
     [](ConfigValues& v, const std::string& n, const std::string& k, const YAML::Node& x) {
       v.attention_load_balance = as_bool(n, k, x);
     }},
    {"context_parallel_layout", [](ConfigValues& v, const std::string& n, const std::string& k,
                                   const YAML::Node& x) { v.layout = as_string(n, k, x); }},
    {"dtype", [](ConfigValues& v, const std::string& n, const std::string& k,
                 const YAML::Node& x) { v.dtype = as_string(n, k, x); }},
    {"sliding_window_size",
     [](ConfigValues& v, const std::string& n, const std::string& k, const YAML::Node& x) {
       const std::int64_t w = as_int(n, k, x);
       if (w < 0 || w - 1 > kMaxWindowSide) {
         bad_value(n, k, x, "a window of 0 (none) or 1.." + std::to_string(kMaxWindowSide + 1) + " keys");
       }
       if (w > 0) v.sliding_window = w;
     }},
    {"attn_logits_soft_cap",
     [](ConfigValues& v, const std::string& n, const std::string& k, const YAML::Node& x) {
       if (!x.IsScalar()) bad_value(n, k, x, "a number");
       double cap = 0;
       try {
         cap = parse_real(x.Scalar(), k, 0, kMaxSoftcap, "a soft-cap");
       } catch (const Error&) {
         bad_value(n, k, x, "0 (none) or a finite number in 1e-06..1e+30");
       }
       if (cap > 0) v.softcap = cap;
     }},
    {"base_emb_dim", [](ConfigValues& v, const std::string& n, const std::string& k,
                        const YAML::Node& x) { v.emb_dim = as_int(n, k, x); }},
    {"base_num_decoder_layers", [](ConfigValues& v, const std::string& n, const std::string& k,
                                   const YAML::Node& x) { v.num_layers = as_int(n, k, x); }},
    {"inhomogeneous_layer_cycle_interval", [](ConfigValues& v, const std::string& n, const std::string& k,
                                              const YAML::Node& x) { v.attention_every = as_int(n, k, x); }},
};

std::string known_keys_text() {
  std::string out;
  for (const auto& k : kKeys) out += (out.empty() ? "" : ", ") + std::string(k.key);
  return out;
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
  take(layout, o.layout);
  take(causal, o.causal);
  take(dtype, o.dtype);
  take(window_left, o.window_left);
  take(window_right, o.window_right);
  take(sliding_window, o.sliding_window);
  take(softcap, o.softcap);
  sinks = sinks || o.sinks;
  take(emb_dim, o.emb_dim);
  take(num_layers, o.num_layers);
  take(attention_every, o.attention_every);
}

namespace {

// Ignores every event: the parser alone, to count documents.
class IgnoreEvents final : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
  }
  void OnMapEnd() override {}
};

}  // namespace

std::size_t yaml_documents_up_to_two(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  IgnoreEvents ignore;
  std::size_t n = 0;
  while (n < 2 && parser.HandleNextDocument(ignore)) ++n;
  return n;
}

ConfigValues parse_config_yaml(const std::string& text, const std::string& name) {
  YAML::Node root;
  try {
    // A second document (after ---) would otherwise go unread, typos and all: refused. Counted by the
    // parser's events, at most two documents parsed (LoadAll would build every one of thousands of empty
    // ones).
    const std::size_t documents = yaml_documents_up_to_two(text);
    if (documents > 1) {
      throw Error(
          ErrorKind::invalid_input, name, "2 or more documents",
          name + ": holds 2 YAML documents or more (separated by ---); valid: one mapping of keys to values");
    }
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
  std::vector<std::pair<std::string, std::string>> seen;  // (setting, key as written)
  for (const auto& entry : root) {
    if (!entry.first.IsScalar()) {
      throw Error(ErrorKind::invalid_input, name, "",
                  name + ": a key is not a plain word (a sequence or mapping used as a key); valid keys: " +
                      known_keys_text());
    }
    const std::string key = entry.first.Scalar();
    // The seed's two spellings of one setting count as one key: given both, which would win is not the
    // user's to guess.
    const std::string setting = key.starts_with("base_num_") ? key.substr(5) : key;
    const auto earlier =
        std::find_if(seen.begin(), seen.end(),
                     [&](const std::pair<std::string, std::string>& s) { return s.first == setting; });
    if (earlier != seen.end()) {
      throw Error(
          ErrorKind::invalid_input, key, key,
          name + ": key '" + quoted(key) + "' is given twice" +
              (earlier->second == key ? "" : " (as '" + quoted(earlier->second) + "', its other spelling)") +
              "; give each key once");
    }
    seen.emplace_back(setting, key);
    const auto* known =
        std::find_if(std::begin(kKeys), std::end(kKeys), [&](const KeyReader& k) { return key == k.key; });
    if (known == std::end(kKeys)) {
      std::vector<std::string> names;
      for (const auto& k : kKeys) names.emplace_back(k.key);
      const std::string near = nearest(key, names);
      throw Error(ErrorKind::invalid_input, key, key,
                  name + ": unknown key '" + quoted(key) + "'" +
                      (near.empty() ? "" : "; did you mean '" + near + "'?") +
                      "; valid keys: " + known_keys_text());
    }
    known->read(v, name, key, entry.second);
  }
  return v;
}

ConfigValues read_config_file(const std::string& path) {
  std::ifstream in;
  const std::uint64_t size = open_input_file(path, in);
  // A config of the seed framework is a few kilobytes; a larger file is not one (and would take long to
  // parse).
  constexpr std::uint64_t kMaxConfigBytes = 1 << 20;
  if (size > kMaxConfigBytes) {
    throw Error(ErrorKind::invalid_input, path, std::to_string(size),
                quoted(path) + ": config file is " + std::to_string(size) +
                    " bytes; valid: a YAML file of at most 1 MiB");
  }
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
  s.attention.window_left = v.window_left;
  s.attention.window_right = v.window_right;
  if (!v.window_left && !v.window_right && v.sliding_window) {
    s.attention.window_left = *v.sliding_window - 1;
    if (!s.attention.causal) s.attention.window_right = *v.sliding_window - 1;
  }
  s.attention.softcap = v.softcap;
  s.attention.sinks = v.sinks;
  s.parallel.cp = v.cp.value_or(1);
  s.parallel.tp = v.tp.value_or(1);
  s.parallel.ulysses_degree = v.ulysses_degree.value_or(0);
  s.parallel.load_balance = v.attention_balanced();
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
  try {
    if (v.layout) s.parallel.layout = parse_layout(*v.layout, "layout");
    // A layout given by its name decides (--load-balance, or a config's load_balance, is the dual chunk
    // swap's other name): its load balance is whether it is that one.
    if (s.parallel.layout) s.parallel.load_balance = *s.parallel.layout == ShardLayout::dual_chunk_swap;
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
