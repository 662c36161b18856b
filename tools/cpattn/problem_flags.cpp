#include "problem_flags.hpp"

#include "flag_parsing.hpp"

#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace cpattn::cli {

void ProblemFlags::add_to(CLI::App& app, bool parallel) {
  app.add_option("--config", config_files, "YAML config file(s) with the seed framework's keys; later wins")
      ->check(CLI::ExistingFile);
  // Sizes are read as decimal int64 here; their rules (cp >= 1, heads dividing, ...) are validation's, which
  // reports every broken rule at once.
  constexpr std::int64_t any_lo = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t any_hi = std::numeric_limits<std::int64_t>::max();
  if (parallel) {
    add_text(app, "--strategy", values.strategy, strategy_names());
    add_integer(app, "--cp", values.cp, any_lo, any_hi, "context-parallel ranks");
    add_integer(app, "--ulysses-degree", values.ulysses_degree, any_lo, any_hi,
                "hybrid: ranks per ulysses group (a divisor of cp, <= q heads); the ring has cp / this");
    add_integer(app, "--tp", values.tp, any_lo, any_hi, "tensor-parallel degree over heads");
  }
  add_integer(app, "--q-heads", values.num_q_heads, any_lo, any_hi, "query heads");
  add_integer(app, "--kv-heads", values.num_kv_heads, any_lo, any_hi, "key/value heads");
  add_integer(app, "--head-dim", values.head_dim, any_lo, any_hi, "head dimension");
  add_integer(app, "--seq", values.seq_len, any_lo, any_hi, "sequence length (tokens of one packed row)");
  add_integer(app, "--batch", values.batch, any_lo, any_hi, "batch size");
  add_text(app, "--dtype", values.dtype, "fp32 or bf16");
  if (parallel) {
    app.add_flag("--load-balance", load_balance,
                 strategy_names(&StrategyTraits::load_balance) + " with dual-chunk-swap load balance");
    add_text(
        app, "--layout", values.layout,
        "the shards' layout: contiguous, dual_chunk_swap (= --load-balance), per_document (each "
        "document's dual chunk swap) or solver (chunks dealt by their cost); the last two cut the row by "
        "its documents (--segments)");
  }
  // --window LEFT or LEFT,RIGHT: read as decimal int64 here, the sides' rules are validation's.
  app.add_option_function<std::string>(
         "--window",
         [this](const std::string& text) {
           const WindowText w = parse_window(text, "--window");
           values.window_left = w.left;
           values.window_right = w.right;
         },
         "sliding window: a query at p sees keys p-LEFT..p (causal) or p-LEFT..p+RIGHT (--no-causal), "
         "within its document; 0.." +
             std::to_string(kMaxWindowSide) + " each")
      ->type_name("LEFT[,RIGHT]");
  // --softcap C: read as a decimal number here; its range is validation's (softcap).
  app.add_option_function<std::string>(
         "--softcap",
         [this](const std::string& text) {
           values.softcap = parse_real(text, "--softcap", -std::numeric_limits<double>::max(),
                                       std::numeric_limits<double>::max(), "a soft-cap");
         },
         "logit soft-capping (Gemma 2): logits x become C*tanh(x/C) before the softmax; 1e-06..1e+30")
      ->type_name("C");
  CLI::Option* yes = app.add_flag("--causal", causal, "causal mask (the default)");
  CLI::Option* no = app.add_flag("--no-causal", no_causal, "no causal mask");
  yes->excludes(no);
  no->excludes(yes);
}

ConfigValues ProblemFlags::resolve(const CLI::App& app) const {
  ConfigValues merged;
  for (const auto& path : config_files) merged.merge_from(read_config_file(path));
  ConfigValues flags = values;
  const auto given = [&](const char* flag) {
    const CLI::Option* o = app.get_option_no_throw(flag);
    return o != nullptr && o->count() > 0;
  };
  if (given("--load-balance")) {
    flags.load_balance = load_balance;
    flags.attention_load_balance = load_balance;
  }
  if (given("--causal")) flags.causal = true;
  if (given("--no-causal")) flags.causal = false;
  merged.merge_from(flags);
  return merged;
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
  for (const auto& e : errors) err << "error (invalid_config): " << utf8_safe(e.message) << "\n";
}

int print_answer(const DocumentAnswer& answer, bool json, std::ostream& out, std::ostream& err) {
  if (json) out << answer.document << "\n";
  if (answer.exit_code != 0) {
    print_errors(answer.errors, err);
  } else if (!json) {
    out << answer.text;
  }
  return answer.exit_code;
}

}  // namespace cpattn::cli
