// validate and plan by keyword (the Python module's form): one table of keywords, each read as the program
// reads its flag (the same parser, the same range), into the same inputs as the program's.
#include <charconv>
#include <functional>
#include <limits>
#include <type_traits>

#include "cpattn/documents.hpp"
#include "cpattn/parse.hpp"
#include "cpattn/planner.hpp"

namespace cpattn {
namespace {

using Int = std::int64_t;
constexpr Int kAnyLo = std::numeric_limits<Int>::min();
constexpr Int kAnyHi = std::numeric_limits<Int>::max();

// What the keywords set: the problem's values (over a config file's), plan's own inputs.
struct Request {
  ConfigValues values;
  std::vector<std::string> configs;  // config=: YAML files (in order) under the keywords' values
  PlanInputs plan;
};

enum class Kind { integer, real, text, flag };

struct Keyword {
  const char* name;
  Kind kind;
  Int min = kAnyLo, max = kAnyHi;  // integer
  double real_min = 0, real_max = 0;
  std::function<void(Request&, const KeywordValue&)> set;  // the value already read as `kind`
  bool empty_ok = false;                                   // text: "" taken (as the flag takes it)
};

Keyword integer(const char* name, Int min, Int max, std::function<void(Request&, Int)> set) {
  return {name,
          Kind::integer,
          min,
          max,
          0,
          0,
          [set](Request& r, const KeywordValue& v) { set(r, std::get<Int>(v)); }};
}
Keyword real(const char* name, double min, double max, std::function<void(Request&, double)> set) {
  return {name,
          Kind::real,
          0,
          0,
          min,
          max,
          [set](Request& r, const KeywordValue& v) { set(r, std::get<double>(v)); }};
}
Keyword text(const char* name, std::function<void(Request&, const std::string&)> set, bool empty_ok = false) {
  return {name,
          Kind::text,
          0,
          0,
          0,
          0,
          [set](Request& r, const KeywordValue& v) { set(r, std::get<std::string>(v)); },
          empty_ok};
}
Keyword flag(const char* name, std::function<void(Request&, bool)> set) {
  return {
      name, Kind::flag, 0, 0, 0, 0, [set](Request& r, const KeywordValue& v) { set(r, std::get<bool>(v)); }};
}

// The problem's keywords (validate's and plan's): the program's --strategy --cp ... --config.
std::vector<Keyword> problem_keywords() {
  return {
      text("config", [](Request& r, const std::string& v) { r.configs.push_back(v); }),  // may repeat
      text("strategy", [](Request& r, const std::string& v) { r.values.strategy = v; }),
      integer("cp", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.cp = v; }),
      integer("ulysses_degree", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.ulysses_degree = v; }),
      integer("tp", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.tp = v; }),
      integer("q_heads", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.num_q_heads = v; }),
      integer("kv_heads", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.num_kv_heads = v; }),
      integer("head_dim", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.head_dim = v; }),
      integer("seq", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.seq_len = v; }),
      integer("batch", kAnyLo, kAnyHi, [](Request& r, Int v) { r.values.batch = v; }),
      text("dtype", [](Request& r, const std::string& v) { r.values.dtype = v; }),
      // A switch without a false form: false sets nothing (as leaving the flag out).
      flag("load_balance",
           [](Request& r, bool v) {
             if (v) r.values.load_balance = r.values.attention_load_balance = true;
           }),
      text("layout", [](Request& r, const std::string& v) { r.values.layout = v; }),
      flag("causal", [](Request& r, bool v) { r.values.causal = v; }),  // false: --no-causal
      real("softcap", -std::numeric_limits<double>::max(), std::numeric_limits<double>::max(),
           [](Request& r, double v) { r.values.softcap = v; }),
      text("window",
           [](Request& r, const std::string& v) {
             const WindowText w = parse_window(v, "window");
             r.values.window_left = w.left;
             r.values.window_right = w.right;
           }),
  };
}

// plan's own: the program's --preset --emb-dim ... --inter-bandwidth.
std::vector<Keyword> plan_keywords() {
  std::vector<Keyword> k = problem_keywords();
  const std::vector<Keyword> own = {
      text(
          "preset", [](Request& r, const std::string& v) { r.plan.preset = v; }, true),  // "": none
      integer("emb_dim", 1, kMaxPlanEmbDim, [](Request& r, Int v) { r.plan.emb_dim = v; }),
      integer("layers", 1, kMaxPlanLayers, [](Request& r, Int v) { r.plan.layers = v; }),
      integer("attention_every", 1, kMaxPlanLayers, [](Request& r, Int v) { r.plan.attention_every = v; }),
      integer("local_window", 0, kMaxWindowSide, [](Request& r, Int v) { r.plan.local_window = v; }),
      integer("global_every", 1, kMaxPlanLayers, [](Request& r, Int v) { r.plan.global_every = v; }),
      integer("block", 1, kMaxPlanSeq, [](Request& r, Int v) { r.plan.block = v; }),
      text("segments", [](Request& r, const std::string& v) { r.plan.segments = v; }),
      flag("remat", [](Request& r, bool v) { r.plan.remat = v; }),
      flag("forward_only", [](Request& r, bool v) { r.plan.forward_only = v; }),
      text("hardware", [](Request& r, const std::string& v) { r.plan.hardware = v; }),
      text("profile", [](Request& r, const std::string& v) { r.plan.profile = v; }),
      real("flops", 1, kMaxPlanRate, [](Request& r, double v) { r.plan.flops = v; }),
      real("bandwidth", 1, kMaxPlanRate, [](Request& r, double v) { r.plan.bandwidth = v; }),
      integer("ranks_per_host", 0, std::numeric_limits<std::int32_t>::max(),
              [](Request& r, Int v) { r.plan.ranks_per_host = v; }),
      real("inter_bandwidth", 1, kMaxPlanRate, [](Request& r, double v) { r.plan.inter_bandwidth = v; }),
  };
  k.insert(k.end(), own.begin(), own.end());
  return k;
}

// A number's text as a user would type it: what the parser then reads.
std::string number_text(const KeywordValue& v) {
  if (const auto* i = std::get_if<Int>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) {
    char buf[64];
    const auto end = std::to_chars(buf, buf + sizeof buf, *d).ptr;
    return std::string(buf, end);
  }
  return std::get<std::string>(v);
}

// The value read as the keyword's kind, as the program reads its flag's text.
KeywordValue read_value(const Keyword& k, const KeywordValue& v) {
  const std::string name = k.name;
  const bool is_bool = std::holds_alternative<bool>(v);
  if (k.kind == Kind::flag) {
    if (!is_bool)
      throw Error(ErrorKind::invalid_config, name, number_text(v),
                  "'" + name + "' is a switch: True or False");
    return v;
  }
  if (is_bool) {
    throw Error(ErrorKind::invalid_config, name, std::get<bool>(v) ? "True" : "False",
                "'" + name + "' takes a value, not True or False");
  }
  const std::string text = number_text(v);
  switch (k.kind) {
    case Kind::integer:
      return parse_integer(text, name, k.min, k.max);
    case Kind::real:
      return parse_real(text, name, k.real_min, k.real_max);
    case Kind::text:
      if (text.empty() && !k.empty_ok) {
        throw Error(ErrorKind::invalid_input, name, text,
                    name + " is empty; give it a value or leave it out");
      }
      return text;
    case Kind::flag:
      break;
  }
  return v;
}

std::string names_of(const std::vector<Keyword>& keywords) {
  std::string names;
  for (const Keyword& k : keywords) names += (names.empty() ? "" : ", ") + std::string(k.name);
  return names;
}

}  // namespace

std::vector<std::string> document_keywords(const std::string& command) {
  std::vector<std::string> names;
  for (const Keyword& k : command == "plan" ? plan_keywords() : problem_keywords()) names.push_back(k.name);
  return names;
}

DocumentAnswer keyword_answer(const std::string& command,
                              const std::vector<std::pair<std::string, KeywordValue>>& keywords) {
  if (command != "validate" && command != "plan") {
    throw Error(ErrorKind::invalid_config, "command", command,
                "command '" + quoted(command) + "' has no JSON document; valid: validate, plan");
  }
  const bool plan = command == "plan";
  const std::vector<Keyword> table = plan ? plan_keywords() : problem_keywords();
  std::vector<std::string> known;
  for (const Keyword& k : table) known.push_back(k.name);
  Request r;
  for (const auto& [name, value] : keywords) {
    const Keyword* k = nullptr;
    for (const Keyword& candidate : table) {
      if (name == candidate.name) k = &candidate;
    }
    if (k == nullptr) {
      const std::string near = nearest(name, known);
      throw Error(ErrorKind::invalid_config, name, "",
                  "'" + quoted(name) + "' is not a keyword of " + command +
                      (near.empty() ? "" : " (did you mean " + near + "?)") + "; valid: " + names_of(table));
    }
    k->set(r, read_value(*k, value));
  }
  ConfigValues values;
  for (const std::string& path : r.configs) values.merge_from(read_config_file(path));
  values.merge_from(r.values);
  if (!plan) return validate_answer(values);
  r.plan.values = values;
  r.plan.ulysses_degree = r.values.ulysses_degree;  // given: refused (a config file's is not read)
  r.plan.strategy = r.values.strategy;              // likewise
  return plan_answer(r.plan);
}

}  // namespace cpattn
