#include "plan_command.hpp"

#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cpattn/planner.hpp"
#include "flag_parsing.hpp"
#include "problem_flags.hpp"

namespace cpattn::cli {
namespace {

// plan's bounds: tokens of a row, and blocks per row of the tile grid.
constexpr std::int64_t kMaxPlanSeq = std::int64_t{1} << 22;
constexpr std::int64_t kMaxPlanBlocks = 8192;
// The ranks plan models: the ring's per-step tile tables hold cp * cp entries (cp 2048 at S = 4M plans in
// 2.6 s and 170 MB on the 2-core EPYC; cp 16384 took 199 s and 8.4 GB).
constexpr std::int64_t kMaxPlanRanks = 2048;
// The model's other sizes: far above any model (Qwen3.5-397B-A17B: width 4096, 60 layers), low enough that
// the products the plan forms (bytes per layer, seconds per model) stay finite and exact.
constexpr std::int64_t kMaxPlanEmbDim = std::int64_t{1} << 24;
constexpr std::int64_t kMaxPlanLayers = 1000000;
constexpr double kMaxPlanRate = 1e30;  // FLOP/s or bytes/s

struct PlanOptions {
  ProblemFlags problem;
  std::string preset, hardware = "h200", segments;
  std::optional<std::int64_t> emb_dim, layers, attention_every;
  std::int64_t block = 512;
  bool remat = false, json = false;
  std::optional<double> flops, bandwidth, inter_bandwidth;
  std::optional<std::int64_t> ranks_per_host;
};

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

std::string preset_names() {
  std::string names;
  for (const auto& x : model_presets()) names += (names.empty() ? "" : ", ") + x.model.name;
  return names;
}

// The values plan reads: a preset's, then the problem flags', then plan's own model flags. Every strategy
// and factorisation is planned: a config file's strategy and ulysses degree are not used (and
// --ulysses-degree given as a flag is refused: its value in `ulysses_degree`).
ConfigValues plan_values(const CLI::App& app, const PlanOptions& opt,
                         std::optional<std::int64_t>& ulysses_degree) {
  ConfigValues values;
  if (!opt.preset.empty()) {
    const ModelPreset* p = find_preset(opt.preset);
    if (p == nullptr) {
      throw Error(ErrorKind::invalid_input, "--preset", opt.preset,
                  "--preset '" + quoted(opt.preset) + "' is not a preset; valid: " + preset_names());
    }
    values.num_q_heads = p->num_q_heads;
    values.num_kv_heads = p->num_kv_heads;
    values.head_dim = p->head_dim;
    values.emb_dim = p->model.emb_dim;
    values.num_layers = p->model.num_layers;
    values.attention_every = p->model.attention_every;
  }
  values.merge_from(opt.problem.resolve(app));
  if (opt.emb_dim) values.emb_dim = opt.emb_dim;
  if (opt.layers) values.num_layers = opt.layers;
  if (opt.attention_every) values.attention_every = opt.attention_every;
  values.strategy.reset();
  ulysses_degree = opt.problem.values.ulysses_degree;
  values.ulysses_degree.reset();
  return values;
}

// plan's own rules and bounds on top of validation's: every one broken, all at once.
void plan_bounds(const ConfigValues& values, const PlanOptions& opt, const HardwareProfile* hw,
                 std::optional<std::int64_t> ulysses_degree, std::vector<ErrorItem>& errors) {
  if (hw == nullptr) {
    std::string names;
    for (const auto& h : hardware_profiles()) names += (names.empty() ? "" : ", ") + h.name;
    errors.push_back({{"--hardware"},
                      opt.hardware,
                      "--hardware '" + quoted(opt.hardware) + "' is unknown; valid: " + names});
  }
  auto positive = [&](const std::optional<std::int64_t>& v, const char* field) {
    if (v && *v < 1)
      errors.push_back({{field}, std::to_string(*v), std::string(field) + " must be positive"});
  };
  positive(values.num_layers, "--layers");
  positive(values.attention_every, "--attention-every");
  positive(values.emb_dim, "--emb-dim");
  if (ulysses_degree) {
    errors.push_back({{"ulysses_degree"},
                      std::to_string(*ulysses_degree),
                      "plan plans hybrid at every factorisation of cp; drop --ulysses-degree"});
  }
  // The plan counts tiles on the block grid and keeps the sequence's positions: both bounded, so that any
  // accepted input plans in a few seconds (and a larger one is refused at once, not after minutes).
  if (values.seq_len && *values.seq_len > kMaxPlanSeq) {
    errors.push_back({{"seq_len"},
                      std::to_string(*values.seq_len),
                      "--seq (" + std::to_string(*values.seq_len) + ") is longer than plan models (at most " +
                          std::to_string(kMaxPlanSeq) + " tokens)"});
  } else if (values.seq_len && (*values.seq_len + opt.block - 1) / opt.block > kMaxPlanBlocks) {
    errors.push_back({{"--block"},
                      std::to_string(opt.block),
                      "--block " + std::to_string(opt.block) + " makes " +
                          std::to_string((*values.seq_len + opt.block - 1) / opt.block) +
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
PlanRequest plan_request(const ConfigValues& values, const Specs& specs, const PlanOptions& opt,
                         const HardwareProfile& hw) {
  PlanRequest req;
  req.attention = specs.attention;
  req.parallel = specs.parallel;
  req.model = {opt.preset.empty() ? "custom" : opt.preset, values.emb_dim.value_or(0),
               values.num_layers.value_or(1), values.attention_every.value_or(1)};
  req.block = opt.block;
  if (!opt.segments.empty()) req.segments = parse_document_lengths(opt.segments, "--segments");
  req.remat = opt.remat;
  req.hardware = hw;
  if (opt.flops) req.hardware.flops = *opt.flops;
  if (opt.bandwidth) req.hardware.bandwidth = *opt.bandwidth;
  if (opt.ranks_per_host) req.hardware.ranks_per_host = *opt.ranks_per_host;
  if (opt.inter_bandwidth) req.hardware.inter_bandwidth = *opt.inter_bandwidth;
  if (opt.flops || opt.bandwidth || opt.ranks_per_host || opt.inter_bandwidth) {
    req.hardware.source += " (overridden by --flops / --bandwidth / --ranks-per-host / --inter-bandwidth)";
  }
  return req;
}

nlohmann::ordered_json records_json(const std::vector<CollectiveRecord>& list) {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (const auto& c : list) {
    nlohmann::ordered_json entry = {{"kind", to_string(c.kind)},
                                    {"phase", c.phase},
                                    {"count", c.count},
                                    {"bytes", c.bytes},
                                    {"bytes_sent_per_rank", c.bytes_sent_per_rank}};
    if (!c.group.empty()) entry["group"] = c.group;
    a.push_back(entry);
  }
  return a;
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
                                               {"emb_dim", req.model.emb_dim},
                                               {"layers", req.model.num_layers},
                                               {"attention_layers", req.model.attention_layers()}});
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
    if (strategy_traits(s.strategy).sub_groups) {
      j["ulysses_degree"] = s.ulysses_degree;
      j["ring_degree"] = s.ring_degree;
    }
    j["possible"] = s.possible;
    if (!s.possible) {
      j["why_not"] = nlohmann::ordered_json::parse(errors_to_json(s.why_not));
      doc["strategies"].push_back(j);
      continue;
    }
    j["collectives"] = records_json(s.collectives);
    j["reorder_collectives"] = records_json(s.reorder);
    j["tiles_per_rank_per_q_head"] = s.tiles_per_rank_per_q_head;
    j["tiles_per_rank"] = s.tiles_per_rank;
    j["tiles_skew"] = s.tiles_skew;
    j["memory_bytes_per_rank"] = s.memory_bytes_per_rank;
    j["kv_buffer_bytes_per_rank"] = s.kv_buffer_bytes_per_rank;
    j["estimated_seconds"] = {{"compute_per_rank", s.compute_seconds_per_rank},
                              {"straggler_rank", s.straggler_rank},
                              {"communication", s.communication_seconds},
                              {"exposed", s.exposed_seconds},
                              {"layer", s.layer_seconds},
                              {"model", s.model_seconds}};
    j["model_bytes_sent_per_rank"] = s.model_bytes_sent_per_rank;
    j["inter_host_bytes_sent_per_rank"] = s.inter_host_bytes_sent_per_rank;
    doc["strategies"].push_back(j);
  }
  doc["recommendation"] = plan.recommendation;
  {
    // What to run: a strategy that neither splits heads nor passes a ring (all_gather) has no degrees;
    // ulysses is U = cp, R = 1; ring U = 1, R = cp.
    const StrategyPlan& best = plan.strategies[plan.recommended];
    const StrategyTraits traits = strategy_traits(best.strategy);
    const bool degrees = traits.heads != HeadSplit::none || traits.ring;
    doc["recommended"] = {
        {"name", best.name},
        {"strategy", to_string(best.strategy)},
        {"load_balance", best.load_balance},
        {"ulysses_degree", degrees ? nlohmann::ordered_json(best.ulysses_degree) : nlohmann::ordered_json()},
        {"ring_degree", degrees ? nlohmann::ordered_json(best.ring_degree) : nlohmann::ordered_json()}};
  }
  return doc;
}

// plan's text: a header line, each strategy's table and estimates, the recommendation.
void print_plan(const PlanRequest& req, const Plan& plan, const std::string& segments, std::ostream& out) {
  out << "cpattn plan: " << req.model.name << ", S=" << req.attention.seq_len << " B=" << req.attention.batch
      << " Hq=" << req.attention.num_q_heads << " Hkv=" << req.attention.num_kv_heads
      << " D=" << req.attention.head_dim << " " << to_string(req.attention.dtype)
      << ", cp=" << req.parallel.cp << " tp=" << req.parallel.tp << ", block " << req.block << ", "
      << (req.hardware.ranks_per_host > 0 && req.parallel.cp > req.hardware.ranks_per_host
              ? std::to_string(req.hardware.ranks_per_host) + " ranks per host, "
              : std::string())
      << (req.segments.empty() ? "one document" : "segments " + segments) << (req.remat ? ", remat" : "")
      << "; " << req.model.attention_layers() << " attention layers of " << req.model.num_layers << "; "
      << req.hardware.name << "\n";
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
  }
  out << "\nrecommendation: " << plan.recommendation << "\n";
}

int run_plan(const CLI::App& app, const PlanOptions& opt, std::ostream& out, std::ostream& err) {
  std::optional<std::int64_t> ulysses_degree;
  const ConfigValues values = plan_values(app, opt, ulysses_degree);
  std::vector<ErrorItem> errors;
  const Specs specs = to_specs(values, errors);
  const HardwareProfile* hw = find_hardware(opt.hardware);
  plan_bounds(values, opt, hw, ulysses_degree, errors);
  if (errors.empty()) {
    ParallelSpec general = specs.parallel;
    general.load_balance = false;
    general.layout.reset();
    errors = validation_errors(specs.attention, general);
  }
  if (!errors.empty()) {
    if (opt.json) out << failure_json("valid", errors) << "\n";
    print_errors(errors, err);
    return 2;
  }
  const PlanRequest req = plan_request(values, specs, opt, *hw);
  const Plan plan = make_plan(req);
  if (opt.json) {
    out << json_text(plan_document(req, plan), 2) << "\n";
    return 0;
  }
  print_plan(req, plan, opt.segments, out);
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code, std::ostream& out, std::ostream& err) {
  auto opt = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand("plan", "plan every strategy for a model: bytes, balance, memory, time");
  opt->problem.add_to(*sub);
  sub->add_option("--preset", opt->preset, preset_names());
  add_integer(*sub, "--emb-dim", opt->emb_dim, 1, kMaxPlanEmbDim,
              "model width (the reorder moves [B, S/cp, emb_dim])");
  add_integer(*sub, "--layers", opt->layers, 1, kMaxPlanLayers, "decoder layers");
  add_integer(*sub, "--attention-every", opt->attention_every, 1, kMaxPlanLayers,
              "full attention on every N-th layer");
  add_integer(*sub, "--block", opt->block, 1, kMaxPlanSeq, "square tile size (default 512)");
  add_text(*sub, "--segments", opt->segments, "packed document lengths, e.g. 61440,4096");
  sub->add_flag("--remat", opt->remat, "recompute attention's forward in backward");
  add_text(*sub, "--hardware", opt->hardware, "h100, h200 or tpu-v7x");
  add_real(*sub, "--flops", opt->flops, 1, kMaxPlanRate, "override the FLOP rate (FLOP/s)");
  add_real(*sub, "--bandwidth", opt->bandwidth, 1, kMaxPlanRate,
           "override the bandwidth inside a host (bytes/s each way per device)");
  add_integer(*sub, "--ranks-per-host", opt->ranks_per_host, 0, std::numeric_limits<std::int32_t>::max(),
              "override the devices per host (rank r on host r / this; 0: one host)");
  add_real(*sub, "--inter-bandwidth", opt->inter_bandwidth, 1, kMaxPlanRate,
           "override the bandwidth between hosts (bytes/s each way per device)");
  sub->add_flag("--json", opt->json, "print JSON");
  sub->callback([sub, opt, &exit_code, &out, &err] { exit_code = run_plan(*sub, *opt, out, err); });
}

}  // namespace cpattn::cli
