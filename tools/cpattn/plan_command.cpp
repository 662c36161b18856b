#include "plan_command.hpp"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>

#include "cpattn/documents.hpp"
#include "cpattn/planner.hpp"
#include "flag_parsing.hpp"
#include "problem_flags.hpp"

namespace cpattn::cli {
namespace {

struct PlanOptions {
  ProblemFlags problem;
  PlanInputs inputs;
  bool json = false;
  std::string svg;  // --svg FILE
};

// --svg FILE: the plan drawn (a file written whole, or an error naming it).
void write_svg(const std::string& path, const std::string& svg) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << svg;
  out.close();
  if (!out) {
    throw Error(ErrorKind::invalid_input, "--svg", path,
                "--svg: '" + quoted(path) + "' cannot be written (" + std::strerror(errno) + ")");
  }
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code, std::ostream& out, std::ostream& err) {
  auto opt = std::make_shared<PlanOptions>();
  PlanInputs& in = opt->inputs;
  CLI::App* sub = app.add_subcommand("plan", "plan every strategy for a model: bytes, balance, memory, time");
  opt->problem.add_to(*sub);
  sub->add_option("--preset", in.preset, model_preset_names());
  add_integer(*sub, "--emb-dim", in.emb_dim, 1, kMaxPlanEmbDim,
              "model width (the reorder moves [B, S/cp, emb_dim])");
  add_integer(*sub, "--layers", in.layers, 1, kMaxPlanLayers, "decoder layers");
  add_integer(*sub, "--attention-every", in.attention_every, 1, kMaxPlanLayers,
              "full attention on every N-th layer");
  add_integer(*sub, "--local-window", in.local_window, 0, kMaxWindowSide,
              "sliding-window layers: their window (LEFT, as --window), every attention layer but each "
              "--global-every-th");
  add_integer(*sub, "--global-every", in.global_every, 1, kMaxPlanLayers,
              "with --local-window: every N-th attention layer global, the others local");
  add_integer(*sub, "--block", in.block, 1, kMaxPlanSeq,
              "square tile size (default: the profile's block, else 512)");
  add_text(*sub, "--segments", in.segments, "packed document lengths, e.g. 61440,4096");
  CLI::Option* remat = sub->add_flag("--remat", in.remat, "recompute attention's forward in backward");
  CLI::Option* forward_only =
      sub->add_flag("--forward-only", in.forward_only, "prefill: the forward alone (collectives, compute)");
  remat->excludes(forward_only);  // nothing to recompute without a backward
  forward_only->excludes(remat);
  CLI::Option* hardware =
      add_text(*sub, "--hardware", in.hardware, hardware_profile_names() + " (default h200)");
  CLI::Option* profile = add_text(
      *sub, "--profile", in.profile,
      "a hardware profile file (YAML; docs/planner.md lists its keys; cpattn bench calibrate writes one)");
  hardware->excludes(profile);
  profile->excludes(hardware);
  add_real(*sub, "--flops", in.flops, 1, kMaxPlanRate, "override the FLOP rate (FLOP/s)");
  add_real(*sub, "--bandwidth", in.bandwidth, 1, kMaxPlanRate,
           "override the bandwidth inside a host (bytes/s each way per device)");
  add_integer(*sub, "--ranks-per-host", in.ranks_per_host, 0, std::numeric_limits<std::int32_t>::max(),
              "override the devices per host (rank r on host r / this; 0: one host)");
  add_real(*sub, "--inter-bandwidth", in.inter_bandwidth, 1, kMaxPlanRate,
           "override the bandwidth between hosts (bytes/s each way per device)");
  add_text(*sub, "--svg", opt->svg, "also draw one layer per strategy and rank into FILE (SVG)");
  sub->add_flag("--json", opt->json, "print JSON");
  sub->callback([sub, opt, &exit_code, &out, &err] {
    // The problem from the config files and flags; --ulysses-degree as a flag is refused (plan plans every
    // factorisation), a config file's is not read.
    opt->inputs.values = opt->problem.resolve(*sub);
    opt->inputs.ulysses_degree = opt->problem.values.ulysses_degree;
    opt->inputs.strategy = opt->problem.values.strategy;
    const DocumentAnswer answer = plan_answer(opt->inputs);
    if (answer.exit_code == 0 && !opt->svg.empty()) write_svg(opt->svg, answer.svg);
    exit_code = print_answer(answer, opt->json, out, err);
  });
}

}  // namespace cpattn::cli
