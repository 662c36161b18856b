#include "problem_flags.hpp"

#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace cpattn::cli {

void ProblemFlags::add_to(CLI::App& app) {
  app.add_option("--config", config_files, "YAML config file(s) with the seed framework's keys; later wins")
      ->check(CLI::ExistingFile);
  app.add_option("--strategy", values.strategy, "all_gather, ulysses, ring or hybrid");
  app.add_option("--cp", values.cp, "context-parallel ranks");
  app.add_option("--ulysses-degree", values.ulysses_degree,
                 "hybrid: ranks per ulysses group (a divisor of cp, <= q heads); the ring has cp / this");
  app.add_option("--tp", values.tp, "tensor-parallel degree over heads");
  app.add_option("--q-heads", values.num_q_heads, "query heads");
  app.add_option("--kv-heads", values.num_kv_heads, "key/value heads");
  app.add_option("--head-dim", values.head_dim, "head dimension");
  app.add_option("--seq", values.seq_len, "sequence length (tokens of one packed row)");
  app.add_option("--batch", values.batch, "batch size");
  app.add_option("--dtype", values.dtype, "fp32 or bf16");
  app.add_flag("--load-balance", load_balance,
               "all_gather, ring or hybrid with dual-chunk-swap load balance");
  app.add_flag("--causal", causal, "causal mask (the default)");
  app.add_flag("--no-causal", no_causal, "no causal mask");
}

ConfigValues ProblemFlags::resolve(const CLI::App& app) const {
  ConfigValues merged;
  for (const auto& path : config_files) merged.merge_from(read_config_file(path));
  ConfigValues flags = values;
  if (app.count("--load-balance") > 0) {
    flags.load_balance = load_balance;
    flags.attention_load_balance = load_balance;
  }
  if (app.count("--causal") > 0) flags.causal = true;
  if (app.count("--no-causal") > 0) flags.causal = false;
  merged.merge_from(flags);
  return merged;
}

namespace {

nlohmann::json value_json(const std::string& v) {
  if (!v.empty() && v.size() < 19 && v.find_first_not_of("-0123456789") == std::string::npos &&
      v.find('-', 1) == std::string::npos && v != "-") {
    return std::stoll(v);
  }
  if (v == "true") return true;
  if (v == "false") return false;
  return v;
}

}  // namespace

std::vector<std::int64_t> parse_document_lengths(const std::string& text, const std::string& flag) {
  std::vector<std::int64_t> lengths;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    std::size_t used = 0;
    std::int64_t n = -1;
    try {
      n = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != part.size() || n <= 0) {
      throw Error(ErrorKind::invalid_input, flag, text,
                  flag + " '" + text + "': '" + part + "' is not a positive document length");
    }
    lengths.push_back(n);
  }
  if (lengths.empty())
    throw Error(ErrorKind::invalid_input, flag, text, flag + " is empty; give lengths like 6144,2048");
  return lengths;
}

nlohmann::ordered_json attention_to_json(const AttentionSpec& a) {
  return {{"batch", a.batch},           {"seq", a.seq_len},       {"q_heads", a.num_q_heads},
          {"kv_heads", a.num_kv_heads}, {"head_dim", a.head_dim}, {"causal", a.causal},
          {"dtype", to_string(a.dtype)}};
}

std::string errors_to_json(const std::vector<ErrorItem>& errors) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& e : errors) {
    nlohmann::json item;
    item["field"] = e.fields.empty() ? "" : e.fields.front();
    if (e.fields.size() > 1) item["fields"] = e.fields;
    item["value"] = value_json(e.value);
    item["message"] = e.message;
    list.push_back(item);
  }
  return list.dump();
}

void require_memory_for(const AttentionSpec& a, int tensor_count, const std::string& what) {
  const double elements = static_cast<double>(a.batch) * static_cast<double>(a.seq_len) *
                          static_cast<double>(std::max(a.num_q_heads, a.num_kv_heads)) *
                          static_cast<double>(a.head_dim);
  const double need = elements * static_cast<double>(dtype_size(a.dtype)) * tensor_count;
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (need <= have) return;
  std::ostringstream msg;
  msg.precision(3);
  msg << what << " needs at least " << need / 1073741824.0 << " GiB (" << tensor_count
      << " tensors of batch*seq_len*"
      << "heads*head_dim = " << a.batch << "*" << a.seq_len << "*" << std::max(a.num_q_heads, a.num_kv_heads)
      << "*" << a.head_dim << " " << to_string(a.dtype) << " values) but this machine has "
      << have / 1073741824.0 << " GiB of memory; reduce --batch, --seq, --q-heads or --head-dim";
  const std::string value = std::to_string(a.batch) + "x" + std::to_string(a.seq_len) + "x" +
                            std::to_string(std::max(a.num_q_heads, a.num_kv_heads)) + "x" +
                            std::to_string(a.head_dim);
  throw Error(ErrorKind::invalid_input,
              {ErrorItem{{"batch", "seq_len", "num_q_heads", "head_dim"}, value, msg.str()}});
}

void print_errors(const std::vector<ErrorItem>& errors, std::ostream& err) {
  for (const auto& e : errors) err << "error (invalid_config): " << e.message << "\n";
}

}  // namespace cpattn::cli
