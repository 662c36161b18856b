#include "cpattn/config.hpp"
#include "cpattn/parse.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

namespace cpattn {

const char* to_string(Strategy strategy) {
  const char* name = strategy_traits(strategy).name;
  return name != nullptr ? name : "unknown strategy";
}

std::string strategy_names(bool StrategyTraits::*flag) {
  std::vector<const char*> names;
  for (const Strategy s : kStrategies) {
    const StrategyTraits traits = strategy_traits(s);
    if (flag == nullptr || traits.*flag) names.push_back(traits.name);
  }
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

const char* strategy_names() {
  static const std::string names = strategy_names(nullptr);
  return names.c_str();
}

std::int64_t ParallelSpec::head_group_size() const {
  switch (traits().heads) {
    case HeadSplit::none:
      return 1;
    case HeadSplit::whole_group:
      return std::max<std::int64_t>(1, cp);
    case HeadSplit::ulysses_groups:
      return std::max<std::int64_t>(1, ulysses_degree);
  }
  return 1;
}

std::int64_t ParallelSpec::ring_degree() const {
  return traits().ring ? std::max<std::int64_t>(1, cp / head_group_size()) : 1;
}

const char* to_string(ShardLayout layout) {
  switch (layout) {
    case ShardLayout::contiguous:
      return "contiguous";
    case ShardLayout::dual_chunk_swap:
      return "dual_chunk_swap";
    case ShardLayout::per_document:
      return "per_document";
    case ShardLayout::solver:
      return "solver";
  }
  return "?";
}

Strategy parse_strategy(const std::string& text, const std::string& field) {
  for (const Strategy strategy : kStrategies) {
    if (text == strategy_traits(strategy).name) return strategy;
  }
  throw Error(ErrorKind::invalid_config, field, text,
              field + " '" + quoted(text) + "' is not a strategy; valid: " + strategy_names());
}

ShardLayout parse_layout(const std::string& text, const std::string& field) {
  if (text == "contiguous") return ShardLayout::contiguous;
  if (text == "dual_chunk_swap") return ShardLayout::dual_chunk_swap;
  if (text == "per_document") return ShardLayout::per_document;
  if (text == "solver") return ShardLayout::solver;
  throw Error(ErrorKind::invalid_config, field, text,
              field + " '" + quoted(text) +
                  "' is not a layout; valid: contiguous, dual_chunk_swap, per_document or solver");
}

double AttentionSpec::scale() const {
  return softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

AttentionMask AttentionSpec::mask(std::span<const std::int32_t> q_positions,
                                  std::span<const std::int32_t> kv_positions,
                                  std::span<const std::int32_t> q_segments,
                                  std::span<const std::int32_t> kv_segments) const {
  AttentionMask m{q_positions, kv_positions, q_segments, kv_segments, causal};
  m.window_left = window_left.value_or(kUnboundedWindow);
  m.window_right = window_right.value_or(kUnboundedWindow);
  m.softcap = softcap.value_or(0.0);
  return m;
}

PositionBand AttentionSpec::band() const {
  return mask({}, {}, {}, {}).band();
}

namespace {

// Collects broken rules; each names its field(s), the value(s) and what would be valid.
class Rules : public ErrorList {
 public:
  bool positive(const std::string& field, std::int64_t value) {
    if (value > 0) return true;
    add({field}, std::to_string(value),
        field + " (" + std::to_string(value) + ") must be a positive integer");
    return false;
  }
};

std::string str(std::int64_t v) {
  return std::to_string(v);
}

// The strategy itself, the layout against load balance and the strategy (they read no size).
void layout_rules(Rules& rules, const ParallelSpec& p) {
  if (p.traits().name == nullptr) {
    const std::string value = str(static_cast<int>(p.strategy));
    rules.add(
        {"strategy"}, value,
        "strategy " + value + " is not a strategy (an integer cast to Strategy); valid: " + strategy_names());
    return;
  }
  const ShardLayout layout = p.effective_layout();
  if (!p.traits().load_balance && p.load_balance) {
    rules.add({"load_balance", "strategy"}, "true",
              "load_balance (true) is for " + strategy_names(&StrategyTraits::load_balance) + "; " +
                  to_string(p.strategy) +
                  " gives every rank the same work per head, set load_balance to false");
  } else if (layout == ShardLayout::dual_chunk_swap && !p.load_balance) {
    rules.add({"layout", "load_balance"}, "dual_chunk_swap",
              "layout dual_chunk_swap needs " + strategy_names(&StrategyTraits::load_balance) +
                  " with load_balance true; valid layout here: contiguous");
  } else if (layout != ShardLayout::dual_chunk_swap && p.load_balance) {
    rules.add({"layout", "load_balance"}, to_string(layout),
              "load_balance (true) is the layout dual_chunk_swap (chunks r and 2*cp-1-r on rank r), not " +
                  std::string(to_string(layout)) + "; set one of them");
  } else if (layout_reads_documents(layout) && !p.traits().load_balance) {
    rules.add({"layout", "strategy"}, to_string(layout),
              "layout " + std::string(to_string(layout)) + " is for " +
                  strategy_names(&StrategyTraits::load_balance) + "; " + to_string(p.strategy) +
                  " gives every rank the same work per head: valid layout here: contiguous");
  }
}

// The documents the per_document and solver layouts cut the row by: lengths of at least 1 summing to
// seq_len.
void document_rules(Rules& rules, const AttentionSpec& a, const ParallelSpec& p) {
  if (p.documents.empty()) return;
  std::int64_t sum = 0;
  for (std::size_t d = 0; d < p.documents.size(); ++d) {
    const std::int64_t n = p.documents[d];
    if (n < 1) {
      rules.add({"documents"}, str(n),
                "documents[" + str(static_cast<std::int64_t>(d)) + "] (" + str(n) +
                    ") must be at least 1: a document's length in tokens");
      return;
    }
    if (n > a.seq_len - sum) {
      sum = a.seq_len + 1;
      break;
    }
    sum += n;
  }
  if (sum != a.seq_len) {
    rules.add({"documents", "seq_len"}, sum > a.seq_len ? "more than " + str(a.seq_len) : str(sum),
              "documents must sum to seq_len (" + str(a.seq_len) + "): the lengths of the row's documents");
  }
}

// seq_len against cp and the layout: S cut into cp shares (2*cp chunks with load balance), and the solver's
// chunks few enough a rank.
void sequence_rules(Rules& rules, const AttentionSpec& a, const ParallelSpec& p) {
  if (p.load_balance && p.traits().load_balance) {
    if (a.seq_len % layout_chunks(ShardLayout::dual_chunk_swap, p.cp) != 0) {
      rules.add({"seq_len", "cp"}, str(a.seq_len),
                "seq_len (" + str(a.seq_len) + ") must be divisible by 2*cp (" + str(2 * p.cp) + ") for " +
                    to_string(p.strategy) + " with load balance (dual chunk swap cuts it into 2*cp chunks)");
    }
  } else if (a.seq_len % layout_chunks(ShardLayout::contiguous, p.cp) != 0) {
    rules.add({"seq_len", "cp"}, str(a.seq_len),
              "seq_len (" + str(a.seq_len) + ") must be divisible by cp (" + str(p.cp) + ")");
  } else if (p.effective_layout() == ShardLayout::solver &&
             a.seq_len / p.cp / solver_chunk(a.seq_len, p.cp) > kMostSolverChunks) {
    const std::int64_t n = a.seq_len / p.cp, c = solver_chunk(a.seq_len, p.cp);
    rules.add({"seq_len", "cp", "layout"}, str(a.seq_len),
              "layout solver cuts seq_len / cp (" + str(n) + ") tokens into chunks of " + str(c) +
                  " (its largest divisor up to " +
                  str(std::max(std::min<std::int64_t>(512, n / 16), n / 64)) + "): " + str(n / c) +
                  " a rank, more than " + str(kMostSolverChunks) +
                  "; valid: seq_len a multiple of 64 * cp, or per_document");
  }
}

// hybrid: U = ulysses_degree ranks per ulysses group, a divisor of cp, each holding at least one q head;
// ulysses_degree means nothing to the other strategies.
void hybrid_rules(Rules& rules, const AttentionSpec& a, const ParallelSpec& p, bool tp_divides, bool cp_ok) {
  const std::int64_t u = p.ulysses_degree;
  if (!p.traits().sub_groups) {
    if (u != 0) {
      rules.add({"ulysses_degree", "strategy"}, str(u),
                "ulysses_degree (" + str(u) + ") is for the hybrid strategy; strategy is " +
                    to_string(p.strategy) + " (drop ulysses_degree, or set strategy hybrid)");
    }
    return;
  }
  if (!cp_ok) return;  // what follows reads cp, whose own rule said what is wrong with it
  if (u == 0) {
    rules.add({"ulysses_degree", "strategy"}, "0",
              "hybrid needs ulysses_degree (unset or 0), the ranks of each ulysses group: a divisor of cp (" +
                  str(p.cp) + "); give --ulysses-degree or context_parallel_ulysses_degree");
    return;
  }
  if (u < 1 || u > p.cp || p.cp % u != 0) {
    rules.add({"ulysses_degree", "cp"}, str(u),
              "hybrid needs ulysses_degree (" + str(u) + ") to be a divisor of cp (" + str(p.cp) +
                  "): the size of each ulysses group, ring_degree = cp / ulysses_degree");
    if (u < 1) return;
  }
  if (!tp_divides) return;  // the heads or tp are broken: their own rules say so
  const std::int64_t hq = a.num_q_heads / p.tp;
  if (u > hq) {
    rules.add({"ulysses_degree", "num_q_heads"}, str(u),
              "hybrid needs ulysses_degree (" + str(u) + ") <= num_q_heads" +
                  (p.tp > 1 ? " per tp rank" : std::string()) + " (" + str(hq) +
                  "): every rank of a ulysses group holds at least one q head");
  }
}

// The sliding window: each side 0..kMaxWindowSide (0: the query's own position only); causal attention has
// no right side to bound (its keys end at the query).
void window_rules(Rules& rules, const AttentionSpec& a) {
  for (const auto& [field, side] :
       {std::pair<const char*, std::optional<std::int64_t>>{"window_left", a.window_left},
        {"window_right", a.window_right}}) {
    if (!side || (*side >= 0 && *side <= kMaxWindowSide)) continue;
    rules.add({field}, str(*side),
              std::string(field) + " (" + str(*side) + ") is not a window side; valid: 0.." +
                  str(kMaxWindowSide) + " tokens (0: the query's own position only)");
  }
  if (a.softcap && !(*a.softcap >= kMinSoftcap && *a.softcap <= kMaxSoftcap)) {
    std::ostringstream value;
    value << *a.softcap;
    rules.add({"softcap"}, value.str(),
              "softcap (" + value.str() +
                  ") is not a soft-cap; valid: a finite number in 1e-06..1e+30 (logits x "
                  "become softcap * tanh(x / softcap)); leave it unset for none");
  }
  if (a.causal && a.window_right) {
    rules.add(
        {"window_right", "causal"}, str(*a.window_right),
        "window_right (" + str(*a.window_right) +
            ") is for non-causal attention: a causal query sees no key after it; give the window's left "
            "side only (--window LEFT), or causal false");
  }
}

}  // namespace

std::vector<ErrorItem> validation_errors(const AttentionSpec& a, const ParallelSpec& p) {
  Rules rules;
  // Each rule is judged where the sizes it reads are positive, so that one bad size hides no other broken
  // rule.
  const bool batch_ok = rules.positive("batch", a.batch);
  const bool seq_ok = rules.positive("seq_len", a.seq_len);
  const bool hq_ok = rules.positive("num_q_heads", a.num_q_heads);
  const bool hkv_ok = rules.positive("num_kv_heads", a.num_kv_heads);
  const bool dim_ok = rules.positive("head_dim", a.head_dim);
  const bool sizes_ok = batch_ok && seq_ok && hq_ok && hkv_ok && dim_ok;
  // A stated bound on the ranks of a group (kMaxRanks): ranks are ints (Communicator::rank()), 2*cp must not
  // overflow (found by fuzz_validator), and a placement or a plan holds an entry per rank.
  auto group_size_ok = [&](const char* field, std::int64_t value) {
    if (!rules.positive(field, value)) return false;
    if (value <= kMaxRanks) return true;
    rules.add({field}, str(value),
              std::string(field) + " (" + str(value) + ") is more ranks than cpattn supports; valid: 1.." +
                  str(kMaxRanks));
    return false;
  };
  const bool cp_ok = group_size_ok("cp", p.cp);
  const bool tp_ok = group_size_ok("tp", p.tp);

  if (a.seq_len > std::numeric_limits<std::int32_t>::max()) {
    rules.add(
        {"seq_len"}, str(a.seq_len),
        "seq_len (" + str(a.seq_len) + ") is too long; token positions are int32, valid: 1..2147483647");
  }
  window_rules(rules, a);
  if (a.head_dim > kMaxHeadDim) {
    rules.add({"head_dim"}, str(a.head_dim),
              "head_dim (" + str(a.head_dim) + ") is larger than the kernels support; valid: 1.." +
                  str(kMaxHeadDim));
  }
  for (const auto& [field, heads] : {std::pair<const char*, std::int64_t>{"num_q_heads", a.num_q_heads},
                                     {"num_kv_heads", a.num_kv_heads}}) {
    if (heads > kMaxHeads) {
      rules.add({field}, str(heads),
                std::string(field) + " (" + str(heads) + ") is more heads than cpattn supports; valid: 1.." +
                    str(kMaxHeads));
    }
  }
  if (a.softmax_scale && !(*a.softmax_scale >= kMinScale && *a.softmax_scale <= kMaxScale)) {
    std::ostringstream v;
    v << *a.softmax_scale;
    rules.add(
        {"softmax_scale"}, v.str(),
        "softmax_scale (" + v.str() +
            ") must be finite and positive, within 1e-30..1e+30 (the kernels hold it and the scaled scores "
            "in fp32)");
  }
  if (sizes_ok) {
    // The largest tensor, [B, S, max(Hq, Hkv), D], must be addressable (elements and bytes).
    std::int64_t n = 0;
    const std::int64_t bytes_max = std::numeric_limits<std::int64_t>::max() / 8;
    if (__builtin_mul_overflow(a.batch, a.seq_len, &n) || __builtin_mul_overflow(n, a.num_q_heads, &n) ||
        __builtin_mul_overflow(n, a.head_dim, &n) || n > bytes_max) {
      rules.add({"batch", "seq_len", "num_q_heads", "head_dim"},
                str(a.batch) + "x" + str(a.seq_len) + "x" + str(a.num_q_heads) + "x" + str(a.head_dim),
                "batch*seq_len*num_q_heads*head_dim (" + str(a.batch) + "*" + str(a.seq_len) + "*" +
                    str(a.num_q_heads) + "*" + str(a.head_dim) + ") overflows; the product must stay below " +
                    str(bytes_max));
    }
  }
  if (hq_ok && hkv_ok && a.num_q_heads % a.num_kv_heads != 0) {
    rules.add({"num_q_heads", "num_kv_heads"}, str(a.num_q_heads) + "," + str(a.num_kv_heads),
              "num_kv_heads (" + str(a.num_kv_heads) + ") must divide num_q_heads (" + str(a.num_q_heads) +
                  ") for grouped-query attention");
  }

  layout_rules(rules, p);
  if (seq_ok) document_rules(rules, a, p);
  if (seq_ok && cp_ok) sequence_rules(rules, a, p);  // seq_len against cp: judged once both are valid

  // The head rules below read Hq / tp: judged once the heads and tp are valid.
  bool tp_divides = hq_ok && hkv_ok && tp_ok;
  if (hq_ok && tp_ok && a.num_q_heads % p.tp != 0) {
    tp_divides = false;
    rules.add({"tp", "num_q_heads"}, str(p.tp),
              "tp (" + str(p.tp) + ") must divide num_q_heads (" + str(a.num_q_heads) + ")");
  }
  if (hkv_ok && tp_ok && a.num_kv_heads % p.tp != 0) {
    tp_divides = false;
    rules.add({"tp", "num_kv_heads"}, str(p.tp),
              "tp (" + str(p.tp) + ") must divide num_kv_heads (" + str(a.num_kv_heads) + ")");
  }

  if (p.traits().heads == HeadSplit::whole_group && tp_divides && cp_ok) {
    // With tensor parallelism the ulysses rules apply to the heads one tp rank holds.
    const std::int64_t hq = a.num_q_heads / p.tp;
    const std::string local = p.tp > 1 ? " per tp rank (heads / tp, tp=" + str(p.tp) + ")" : "";
    // Any head counts (docs/design.md, "Head placement"): the q heads are split unevenly when
    // cp does not divide them and each rank receives the kv heads its q heads read; a rank needs a q head.
    if (p.cp > hq) {
      rules.add(
          {"cp", "num_q_heads"}, str(p.cp),
          "ulysses needs cp (" + str(p.cp) + ") <= num_q_heads" + local + " (" + str(hq) +
              "): every rank holds at least one q head; more ranks than q heads need the hybrid strategy "
              "(ulysses groups of ulysses_degree <= num_q_heads ranks inside a ring), ring or all_gather");
    }
  }
  hybrid_rules(rules, a, p, tp_divides, cp_ok);
  return rules.take();
}

std::optional<ErrorItem> remat_refusal(Strategy strategy, bool remat) {
  const StrategyTraits traits = strategy_traits(strategy);
  if (!remat || traits.remat || traits.name == nullptr) return std::nullopt;  // an unknown one: validation's
  return ErrorItem{{"remat"},
                   "true",
                   std::string("remat means nothing for ") + to_string(strategy) + " (" + traits.remat_note +
                       "); set remat to false"};
}

void validate(const AttentionSpec& attention, const ParallelSpec& parallel) {
  auto items = validation_errors(attention, parallel);
  if (!items.empty()) throw Error(ErrorKind::invalid_config, std::move(items));
}

}  // namespace cpattn
