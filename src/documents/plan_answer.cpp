// plan's answer: its bounds on top of validation's, the request, its document and its text (docs/cli.md,
// "plan"; docs/planner.md).
#include <iomanip>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cpattn/documents.hpp"
#include "cpattn/parse.hpp"
#include "cpattn/planner.hpp"
#include "documents/json_document.hpp"
#include "documents/plan_svg.hpp"

namespace cpattn {
namespace {

std::string mib(std::int64_t bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(bytes % (1 << 20) == 0 ? 0 : 2)
    << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return o.str();
}

std::string fmt_double(double x) {
  std::ostringstream o;
  o << std::setprecision(3) << x;
  return o.str();
}

// The values plan reads: a preset's, then the problem's, then plan's own model sizes. Every strategy and
// factorisation is planned: a config file's strategy and ulysses degree are not used.
ConfigValues plan_values(const PlanInputs& opt) {
  ConfigValues values;
  if (!opt.preset.empty()) {
    const ModelPreset* p = find_preset(opt.preset);
    if (p == nullptr) {
      throw Error(ErrorKind::invalid_input, "--preset", opt.preset,
                  "--preset '" + quoted(opt.preset) + "' is not a preset; valid: " + model_preset_names());
    }
    values.num_q_heads = p->num_q_heads;
    values.num_kv_heads = p->num_kv_heads;
    values.head_dim = p->head_dim;
    values.emb_dim = p->model.emb_dim;
    values.num_layers = p->model.num_layers;
    values.attention_every = p->model.attention_every;
  }
  values.merge_from(opt.values);
  if (opt.emb_dim) values.emb_dim = opt.emb_dim;
  if (opt.layers) values.num_layers = opt.layers;
  if (opt.attention_every) values.attention_every = opt.attention_every;
  values.strategy.reset();
  values.ulysses_degree.reset();
  return values;
}

// plan's own rules and bounds on top of validation's: every one broken, all at once.
// The tile size: the caller's, else the profile's (the one its kernel rates count in), else 512.
std::int64_t plan_block(const PlanInputs& opt, const HardwareProfile* hw) {
  return opt.block.value_or(hw != nullptr && hw->block > 0 ? hw->block : 512);
}

void plan_bounds(const ConfigValues& values, const PlanInputs& opt, const HardwareProfile* hw,
                 std::vector<ErrorItem>& errors) {
  const std::int64_t block = plan_block(opt, hw);
  if (hw == nullptr) {
    errors.push_back({{"--hardware"},
                      opt.hardware.value_or(""),
                      "--hardware '" + quoted(opt.hardware.value_or("")) +
                          "' is unknown; valid: " + hardware_profile_names()});
  }
  auto positive = [&](const std::optional<std::int64_t>& v, const char* field) {
    if (v && *v < 1)
      errors.push_back({{field}, std::to_string(*v), std::string(field) + " must be positive"});
  };
  positive(values.num_layers, "--layers");
  positive(values.attention_every, "--attention-every");
  positive(values.emb_dim, "--emb-dim");
  positive(opt.global_every, "--global-every");
  if (opt.local_window && (*opt.local_window < 0 || *opt.local_window > kMaxWindowSide)) {
    errors.push_back({{"--local-window"},
                      std::to_string(*opt.local_window),
                      "--local-window (" + std::to_string(*opt.local_window) + ") must be 0.." +
                          std::to_string(kMaxWindowSide)});
  }
  // Local layers need a period of global ones, and a period needs local layers, unless a preset gives the
  // other.
  const ModelPreset* preset = opt.preset.empty() ? nullptr : find_preset(opt.preset);
  const bool window = opt.local_window || (preset != nullptr && preset->model.local_window);
  const std::int64_t every = opt.global_every.value_or(preset != nullptr ? preset->model.global_every : 1);
  if (window && every < 2 && !(opt.global_every && *opt.global_every < 1)) {
    errors.push_back(
        {{"--global-every"},
         std::to_string(every),
         std::string(opt.local_window ? "--local-window" : "the preset's local window") +
             " makes local layers only with --global-every N >= 2 (every N-th attention layer global, the "
             "others local)"});
  }
  if (opt.global_every && !window) {
    errors.push_back({{"--global-every"},
                      std::to_string(*opt.global_every),
                      "--global-every sets the period of global layers among local ones: give --local-window "
                      "(the local layers' window) too"});
  }
  if (opt.forward_only && opt.remat) {
    errors.push_back(
        {{"remat", "forward_only"},
         "true",
         "remat recomputes in a backward, and a forward-only plan (prefill) has none; drop one of them"});
  }
  if (opt.strategy) {
    errors.push_back({{"strategy"},
                      *opt.strategy,
                      "plan plans every strategy (its recommendation says which to run); drop --strategy '" +
                          quoted(*opt.strategy) + "'"});
  }
  if (values.layout) {
    errors.push_back(
        {{"layout"},
         *values.layout,
         "plan plans every layout (contiguous, dual_chunk_swap, and on a packed row per_document and "
         "solver: --segments); drop --layout '" +
             quoted(*values.layout) + "'"});
  }
  if (opt.ulysses_degree) {
    errors.push_back({{"ulysses_degree"},
                      std::to_string(*opt.ulysses_degree),
                      "plan plans hybrid at every factorisation of cp; drop --ulysses-degree"});
  }
  // The plan counts tiles on the block grid and keeps the sequence's positions: both bounded, so that any
  // accepted input plans in a few seconds (and a larger one is refused at once, not after minutes).
  if (values.seq_len && *values.seq_len > kMaxPlanSeq) {
    errors.push_back({{"seq_len"},
                      std::to_string(*values.seq_len),
                      "--seq (" + std::to_string(*values.seq_len) + ") is longer than plan models (at most " +
                          std::to_string(kMaxPlanSeq) + " tokens)"});
  } else if (values.seq_len && (*values.seq_len + block - 1) / block > kMaxPlanBlocks) {
    errors.push_back({{"--block"},
                      std::to_string(block),
                      "--block " + std::to_string(block) + " makes " +
                          std::to_string((*values.seq_len + block - 1) / block) +
                          " blocks per row at --seq " + std::to_string(*values.seq_len) +
                          "; plan takes at most " + std::to_string(kMaxPlanBlocks) + "; valid: --block >= " +
                          std::to_string((*values.seq_len + kMaxPlanBlocks - 1) / kMaxPlanBlocks)});
  }
  if (values.cp && *values.cp > kMaxPlanRanks) {
    errors.push_back({{"cp"},
                      std::to_string(*values.cp),
                      "--cp (" + std::to_string(*values.cp) + ") is more ranks than plan models (at most " +
                          std::to_string(kMaxPlanRanks) + "): its ring tables grow as cp squared"});
  }
}

// The request the planner answers, from values that passed every rule.
PlanRequest plan_request(const ConfigValues& values, const Specs& specs, const PlanInputs& opt,
                         const HardwareProfile& hw) {
  PlanRequest req;
  req.attention = specs.attention;
  req.parallel = specs.parallel;
  const ModelPreset* preset = opt.preset.empty() ? nullptr : find_preset(opt.preset);
  std::optional<std::int64_t> local_window = opt.local_window;
  if (!local_window && preset != nullptr) local_window = preset->model.local_window;
  req.model = {opt.preset.empty() ? "custom" : opt.preset,
               values.emb_dim.value_or(0),
               values.num_layers.value_or(1),
               values.attention_every.value_or(1),
               local_window,
               opt.global_every.value_or(preset != nullptr ? preset->model.global_every : 1)};
  req.block = plan_block(opt, &hw);
  if (!opt.segments.empty()) req.segments = parse_document_lengths(opt.segments, "--segments");
  req.remat = opt.remat;
  req.forward_only = opt.forward_only;
  req.hardware = hw;
  // --flops is the kernel's one rate: the profile's measured rates give way to it; --bandwidth every device's
  // link, the all-to-all's measured rate included (a switch's uplink stays the profile's).
  if (opt.flops) {
    req.hardware.flops = *opt.flops;
    req.hardware.kernel.clear();
  }
  if (opt.bandwidth) {
    req.hardware.bandwidth = *opt.bandwidth;
    req.hardware.all_to_all_bandwidth = 0;
  }
  if (opt.ranks_per_host) req.hardware.ranks_per_host = *opt.ranks_per_host;
  if (opt.inter_bandwidth) req.hardware.inter_bandwidth = *opt.inter_bandwidth;
  if (opt.flops || opt.bandwidth || opt.ranks_per_host || opt.inter_bandwidth) {
    req.hardware.source += " (overridden by --flops / --bandwidth / --ranks-per-host / --inter-bandwidth)";
  }
  return req;
}

// plan --json: the problem, the hardware, every strategy's entry, the recommendation.
nlohmann::ordered_json plan_document(const PlanRequest& req, const Plan& plan) {
  nlohmann::ordered_json doc;
  doc["valid"] = true;
  doc["problem"] = {{"model", req.model.name}};
  doc["problem"].update(attention_to_json(req.attention));
  doc["problem"].update(nlohmann::ordered_json{{"cp", req.parallel.cp},
                                               {"tp", req.parallel.tp},
                                               {"block", req.block},
                                               {"segments", req.segments},
                                               {"remat", req.remat},
                                               {"forward_only", req.forward_only},
                                               {"emb_dim", req.model.emb_dim},
                                               {"layers", req.model.num_layers},
                                               {"attention_layers", req.model.attention_layers()},
                                               {"global_layers", req.model.global_layers()},
                                               {"local_layers", req.model.local_layers()}});
  if (req.model.local_window) {
    doc["problem"]["local_window"] = *req.model.local_window;
    doc["problem"]["global_every"] = req.model.global_every;
  }
  doc["hardware"] = {{"name", req.hardware.name},
                     {"flops", req.hardware.flops},
                     {"bandwidth_bytes_per_second", req.hardware.bandwidth},
                     {"ranks_per_host", req.hardware.ranks_per_host},
                     {"inter_host_bandwidth_bytes_per_second", req.hardware.inter_bandwidth},
                     {"source", req.hardware.source}};
  doc["strategies"] = nlohmann::ordered_json::array();
  for (const auto& s : plan.strategies) {
    nlohmann::ordered_json j;
    j["name"] = s.name;
    j["strategy"] = to_string(s.strategy);
    j["load_balance"] = s.load_balance;
    j["layout"] = to_string(s.layout);
    if (strategy_traits(s.strategy).sub_groups) {
      j["ulysses_degree"] = s.ulysses_degree;
      j["ring_degree"] = s.ring_degree;
    }
    // One layer's entry (a global layer's, or under "local_layers" a local one's).
    auto layer = [](const StrategyPlan& x, nlohmann::ordered_json& into) {
      into["possible"] = x.possible;
      if (!x.possible) {
        into["why_not"] = nlohmann::ordered_json::parse(errors_to_json(x.why_not));
        return;
      }
      into["collectives"] = records_json(x.collectives);
      into["reorder_collectives"] = records_json(x.reorder);
      into["tiles_per_rank_per_q_head"] = x.tiles_per_rank_per_q_head;
      into["tiles_per_rank"] = x.tiles_per_rank;
      into["tiles_skew"] = x.tiles_skew;
      into["memory_bytes_per_rank"] = x.memory_bytes_per_rank;
      into["kv_buffer_bytes_per_rank"] = x.kv_buffer_bytes_per_rank;
      into["estimated_seconds"] = {{"compute_per_rank", x.compute_seconds_per_rank},
                                   {"straggler_rank", x.straggler_rank},
                                   {"communication", x.communication_seconds},
                                   {"exposed", x.exposed_seconds},
                                   {"layer", x.layer_seconds}};
    };
    layer(s, j);
    if (!s.possible) {
      doc["strategies"].push_back(j);
      continue;
    }
    j["estimated_seconds"]["model"] = s.model_seconds;
    j["model_bytes_sent_per_rank"] = s.model_bytes_sent_per_rank;
    j["inter_host_bytes_sent_per_rank"] = s.inter_host_bytes_sent_per_rank;
    if (s.local) {
      j["local_layers"] = nlohmann::ordered_json::object();
      layer(*s.local, j["local_layers"]);
      j["local_layers"]["inter_host_bytes_sent_per_rank"] = s.local->inter_host_bytes_sent_per_rank;
    }
    doc["strategies"].push_back(j);
  }
  doc["recommendation"] = plan.recommendation;
  // What to run: a strategy that neither splits heads nor passes a ring (all_gather) has no degrees;
  // ulysses is U = cp, R = 1; ring U = 1, R = cp. With local layers, "recommended_local" is theirs.
  auto pick = [](const StrategyPlan& best) {
    const StrategyTraits traits = strategy_traits(best.strategy);
    const bool degrees = traits.heads != HeadSplit::none || traits.ring;
    return nlohmann::ordered_json{
        {"name", best.name},
        {"strategy", to_string(best.strategy)},
        {"load_balance", best.load_balance},
        {"layout", to_string(best.layout)},
        {"ulysses_degree", degrees ? nlohmann::ordered_json(best.ulysses_degree) : nlohmann::ordered_json()},
        {"ring_degree", degrees ? nlohmann::ordered_json(best.ring_degree) : nlohmann::ordered_json()}};
  };
  doc["recommended"] = pick(plan.strategies[plan.recommended]);
  if (plan.recommended_local) doc["recommended_local"] = pick(plan.strategies[*plan.recommended_local]);
  return doc;
}

// plan's text: a header line, each strategy's table and estimates, the recommendation.
void print_plan(const PlanRequest& req, const Plan& plan, const std::string& segments, std::ostream& out) {
  out << "cpattn plan: " << req.model.name << ", S=" << req.attention.seq_len << " B=" << req.attention.batch
      << " Hq=" << req.attention.num_q_heads << " Hkv=" << req.attention.num_kv_heads
      << " D=" << req.attention.head_dim << " " << to_string(req.attention.dtype)
      << window_text(req.attention) << ", cp=" << req.parallel.cp << " tp=" << req.parallel.tp << ", block "
      << req.block << ", "
      << (req.hardware.ranks_per_host > 0 && req.parallel.cp > req.hardware.ranks_per_host
              ? std::to_string(req.hardware.ranks_per_host) + " ranks per host, "
              : std::string())
      << (req.segments.empty() ? "one document" : "segments " + segments) << (req.remat ? ", remat" : "")
      << (req.forward_only ? ", forward only (prefill)" : "") << "; " << req.model.attention_layers()
      << " attention layers of " << req.model.num_layers;
  if (req.model.local_layers() > 0) {
    out << " (" << req.model.global_layers() << " global, " << req.model.local_layers()
        << " local with window " << *req.model.local_window << ")";
  }
  out << "; " << req.hardware.name << "\n";
  for (const auto& s : plan.strategies) {
    out << "\n== " << s.name << "\n";
    if (!s.possible) {
      out << "  impossible: " << s.why_not.front().message << "\n";
      continue;
    }
    const bool grouped = strategy_traits(s.strategy).sub_groups;
    out << "  per attention layer:\n  " << std::left << std::setw(20) << "kind" << std::setw(10) << "phase"
        << (grouped ? "group    " : "") << std::setw(7) << "count" << std::setw(16) << "bytes"
        << "sent per rank\n";
    for (const auto* list : {&s.collectives, &s.reorder}) {
      for (const auto& c : *list) {
        out << "  " << std::left << std::setw(20) << to_string(c.kind) << std::setw(10) << c.phase
            << std::setw(grouped ? 9 : 0) << (grouped ? c.group : std::string()) << std::setw(7) << c.count
            << std::setw(16) << mib(c.bytes) << mib(c.bytes_sent_per_rank) << "\n";
      }
    }
    out << "  tiles per rank per q head:";
    for (auto t : s.tiles_per_rank_per_q_head) out << " " << t;
    out << "  (all local heads:";
    for (auto t : s.tiles_per_rank) out << " " << t;
    out << "; max/min " << fmt_double(s.tiles_skew) << ")\n";
    out << "  memory per rank saved for backward " << mib(s.memory_bytes_per_rank) << ", K/V buffers "
        << mib(s.kv_buffer_bytes_per_rank) << "\n";
    out << "  estimate per layer: compute " << fmt_double(s.compute_seconds_per_rank[s.straggler_rank] * 1e3)
        << " ms on the straggler (rank " << s.straggler_rank << "), communication "
        << fmt_double(s.communication_seconds * 1e3) << " ms, exposed " << fmt_double(s.exposed_seconds * 1e3)
        << " ms, layer " << fmt_double(s.layer_seconds * 1e3) << " ms; model "
        << fmt_double(s.model_seconds * 1e3) << " ms\n";
    if (req.hardware.ranks_per_host > 0 && req.parallel.cp > req.hardware.ranks_per_host) {
      out << "  across hosts per rank per layer: " << mib(s.inter_host_bytes_sent_per_rank) << "\n";
    }
    if (s.local && !s.local->possible) {
      out << "  local layer (window " << *req.model.local_window
          << "): impossible: " << s.local->why_not.front().message << "\n";
    } else if (s.local) {
      const StrategyPlan& l = *s.local;
      std::int64_t sent = 0;
      for (const auto* list : {&l.collectives, &l.reorder}) {
        for (const auto& c : *list) sent += c.bytes_sent_per_rank;
      }
      out << "  local layer (window " << *req.model.local_window << "): sent per rank " << mib(sent)
          << ", tiles max/min " << fmt_double(l.tiles_skew) << ", compute "
          << fmt_double(l.compute_seconds_per_rank[l.straggler_rank] * 1e3) << " ms, communication "
          << fmt_double(l.communication_seconds * 1e3) << " ms, layer " << fmt_double(l.layer_seconds * 1e3)
          << " ms\n  model: " << req.model.global_layers() << " x " << fmt_double(s.layer_seconds * 1e3)
          << " + " << req.model.local_layers() << " x " << fmt_double(l.layer_seconds * 1e3)
          << " ms = " << fmt_double(s.model_seconds * 1e3) << " ms\n";
    }
  }
  out << "\nrecommendation: " << plan.recommendation << "\n";
}

}  // namespace

DocumentAnswer plan_answer(const PlanInputs& inputs) {
  DocumentAnswer answer;
  const ConfigValues values = plan_values(inputs);
  Specs specs = to_specs(values, answer.errors);
  std::optional<HardwareProfile> from_file;
  if (!inputs.profile.empty()) {
    if (inputs.hardware) {
      answer.errors.push_back({{"--profile", "--hardware"},
                               inputs.profile,
                               "--profile and --hardware both name the hardware; give one of them"});
    }
    try {
      from_file = read_hardware_profile(inputs.profile);
    } catch (const Error& e) {  // in the document with the other errors
      answer.errors.insert(answer.errors.end(), e.items().begin(), e.items().end());
      from_file = HardwareProfile{};
      from_file->name = "(unread)";
      from_file->flops = from_file->bandwidth = 1;
    }
  }
  const HardwareProfile* hw = from_file ? &*from_file : find_hardware(inputs.hardware.value_or("h200"));
  plan_bounds(values, inputs, hw, answer.errors);
  if (answer.errors.empty()) {
    ParallelSpec general = specs.parallel;
    general.load_balance = false;
    general.layout.reset();
    answer.errors = validation_errors(specs.attention, general);
  }
  if (!answer.errors.empty()) {
    answer.exit_code = 2;
    answer.document = failure_json("valid", answer.errors);
    return answer;
  }
  const PlanRequest req = plan_request(values, specs, inputs, *hw);
  const Plan plan = make_plan(req);
  answer.document = json_text(plan_document(req, plan), 2);
  answer.svg = plan_svg(req, plan);
  std::ostringstream text;
  print_plan(req, plan, inputs.segments, text);
  answer.text = text.str();
  return answer;
}

}  // namespace cpattn
