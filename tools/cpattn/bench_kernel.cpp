// `cpattn bench kernel`: the flash kernels' GFLOP/s on one problem, as fractions of this machine's FMA peak
// measured in the same run, and the naive reference's time for the same problem where it is affordable.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <tuple>

#include "bench_command.hpp"
#include "cpattn/context_parallel.hpp"
#include "cpattn/flash.hpp"
#include "cpattn/reference.hpp"
#include "cpattn/sequence_layout.hpp"
#include "flag_parsing.hpp"
#include "harness/whole_problem.hpp"
#include "kernels/machine_peak.hpp"
#include "problem_flags.hpp"

namespace cpattn::cli {
namespace {

using clock_type = std::chrono::steady_clock;

struct KernelOptions {
  ProblemFlags problem;
  int threads = 1;
  double min_seconds = 1.0;  // per kernel: repeat until this much time has passed (at least 2 timed runs)
  std::int64_t reference_max_seq = 4096;
  bool json = false;
  bool no_amx = false;
  std::string bf16_path;    // empty: the best this CPU has
  std::string simd_target;  // empty: the best the CPU has
  bool single_run = false;  // time one call each, no warm-up (for problems that take minutes)
};

// Best of repeated calls (the least disturbed by the machine's other tenants), after one warm-up call.
template <class Fn>
double best_seconds(double min_seconds, Fn&& fn) {
  fn();
  double best = 1e30, spent = 0;
  for (int i = 0; i < 2 || spent < min_seconds; ++i) {
    const auto t0 = clock_type::now();
    fn();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    best = std::min(best, s);
    spent += s;
  }
  return best;
}

// How far a baseline moved while the kernels ran: (after - before) over their mean.
double drift(double before, double after) {
  const double mean = (before + after) / 2;
  return mean > 0 ? (after - before) / mean : 0.0;
}

// A run's fractions are read against the mean of two baseline readings; when either baseline moved more than
// this between them, the machine changed pace during the run (other tenants, clock) and the fractions say
// more about that than about the kernels.
constexpr double kSteadyDrift = 0.05;

// One forward and one backward timing of a problem (best of repeats after a warm-up, or one call each).
struct KernelTimes {
  double forward_s = 0, backward_s = 0;
  FlashForwardResult fwd;
  FlashBackwardResult grads;
};

KernelTimes time_kernels(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_out,
                         const AttentionMask& mask, double scale, const FlashConfig& cfg,
                         const KernelOptions& opt) {
  auto seconds_of = [](auto&& fn) {
    const auto t0 = clock_type::now();
    fn();
    return std::chrono::duration<double>(clock_type::now() - t0).count();
  };
  KernelTimes t;
  t.forward_s = seconds_of([&] { t.fwd = flash_attention_forward(q, k, v, mask, scale, cfg); });
  if (!opt.single_run) {
    t.forward_s = best_seconds(opt.min_seconds, [&] {
      flash_forward(cref(q), cref(k), cref(v), mask, scale, cfg, ref(t.fwd.o), t.fwd.lse.data());
    });
  }
  t.backward_s = seconds_of([&] {
    t.grads = flash_attention_backward(q, k, v, t.fwd.o, t.fwd.lse, d_out, mask, scale, cfg, q.dtype());
  });
  if (!opt.single_run) {
    t.backward_s = best_seconds(opt.min_seconds, [&] {
      flash_backward(cref(q), cref(k), cref(v), cref(t.fwd.o), t.fwd.lse.data(), cref(d_out), mask, scale,
                     cfg, ref(t.grads.dq), ref(t.grads.dk), ref(t.grads.dv));
    });
  }
  return t;
}

// --bf16-path and --no-amx as a config; an unknown or unavailable path is an error naming the available ones.
std::optional<ErrorItem> apply_bf16_path(const KernelOptions& opt, FlashConfig& cfg) {
  cfg.allow_amx = !opt.no_amx;
  if (opt.bf16_path.empty()) return std::nullopt;
  FlashConfig probe;
  std::string available;
  for (const auto& [name, amx, dot] : {std::tuple{"amx", true, false}, std::tuple{"avx512_bf16", false, true},
                                       std::tuple{"vector", false, false}}) {
    probe.allow_amx = amx;
    probe.allow_avx512_bf16 = dot;
    if (std::string(to_string(flash_bf16_path(probe))) != name) continue;
    available += (available.empty() ? "" : ", ") + std::string(name);
    if (opt.bf16_path == name) {
      if (opt.no_amx && amx) break;
      cfg.allow_amx = amx;
      cfg.allow_avx512_bf16 = dot;
      return std::nullopt;
    }
  }
  if (opt.no_amx && opt.bf16_path == "amx") {
    return ErrorItem{{"bf16_path"}, opt.bf16_path, "--bf16-path amx contradicts --no-amx"};
  }
  return ErrorItem{
      {"bf16_path"},
      opt.bf16_path,
      "--bf16-path '" + opt.bf16_path + "' is not a path this CPU can run (available: " + available + ")"};
}

double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;  // Linux reports KiB
}

// bench kernel's text, from its document.
void print_kernel_report(const nlohmann::ordered_json& out, const AttentionSpec& a,
                         const KernelOptions& opt) {
  const auto num = [&](const char* key) { return out[key].get<double>(); };
  const double fma_peak = num("fma_peak_gflops"), tile_peak = num("tile_peak_gflops");
  const double peak_before = out["fma_peak_before_after_gflops"][0].get<double>();
  const double peak_after = out["fma_peak_before_after_gflops"][1].get<double>();
  const double tile_before = out["tile_peak_before_after_gflops"][0].get<double>();
  const double tile_after = out["tile_peak_before_after_gflops"][1].get<double>();
  const double bf16_peak = num("bf16_peak_gflops"), forward_s = num("forward_seconds");
  const double backward_s = num("backward_seconds"), forward_gflops = num("forward_gflops");
  const double backward_gflops = num("backward_gflops"), rss = num("peak_rss_bytes");
  const double tensor_bytes = num("tensor_bytes"), fma_drift = num("fma_peak_drift");
  const double tile_drift = num("tile_peak_drift");
  const bool steady = out["steady"].get<bool>();
  struct Fp32 {
    double forward_s, backward_s;
  };
  std::optional<Fp32> fp32;
  if (out.contains("fp32_forward_seconds"))
    fp32 = Fp32{num("fp32_forward_seconds"), num("fp32_backward_seconds")};
  std::cout << std::setprecision(4) << "bench kernel: B=" << a.batch << " S=" << a.seq_len
            << " Hq=" << a.num_q_heads << " Hkv=" << a.num_kv_heads << " D=" << a.head_dim
            << (a.causal ? " causal " : " non-causal ") << to_string(a.dtype) << window_text(a) << ", "
            << opt.threads << " thread(s)\n"
            << "fp32 FMA peak   " << fma_peak << " GFLOP/s (before " << peak_before << ", after "
            << peak_after << ")\ntile ceiling    " << tile_peak
            << " GFLOP/s (the forward's 8 x 3 register tile on L1 data; before " << tile_before << ", after "
            << tile_after << ")\nbf16 dot peak   " << bf16_peak << " GFLOP/s"
            << (bf16_peak == 0 ? " (no AVX512_BF16)" : "") << "\nforward path    "
            << out["forward_path"].get<std::string>() << " (vector target "
            << out["vector_target"].get<std::string>() << ")\nforward         " << forward_s << " s  "
            << forward_gflops << " GFLOP/s  " << forward_gflops / fma_peak << " of the FMA peak, "
            << forward_gflops / tile_peak << " of the tile ceiling\n"
            << "backward        " << backward_s << " s  " << backward_gflops << " GFLOP/s  "
            << backward_gflops / fma_peak << " of the FMA peak, " << backward_gflops / tile_peak
            << " of the tile ceiling\n"
            << (fp32
                    ? "fp32 baseline   forward " + std::to_string(fp32->forward_s) + " s, backward " +
                          std::to_string(fp32->backward_s) + " s (the same values in fp32, this run): bf16 " +
                          std::to_string(fp32->forward_s / forward_s) + "x / " +
                          std::to_string(fp32->backward_s / backward_s) + "x faster; " +
                          std::to_string(forward_gflops / std::max(bf16_peak, 1e-9)) + " / " +
                          std::to_string(backward_gflops / std::max(bf16_peak, 1e-9)) + " of the bf16 peak\n"
                    : std::string())
            << "peak RSS        " << rss / 1048576.0 << " MiB = " << rss / tensor_bytes
            << "x the inputs, outputs and gradients (" << tensor_bytes / 1048576.0 << " MiB)\n";
  if (!steady) {
    std::cout << "unsteady        the FMA peak moved " << std::setprecision(2) << 100 * fma_drift
              << " % and the tile ceiling " << 100 * tile_drift
              << " % between their readings before and after the kernels (steady: within "
              << 100 * kSteadyDrift
              << " %): the machine changed pace, so the fractions above are unreliable; run again\n"
              << std::setprecision(4);
  }
  if (out["reference_seconds"].is_null()) {
    std::cout << "reference       skipped (S > " << opt.reference_max_seq << ")\n";
  } else {
    std::cout << "reference       " << out["reference_seconds"].get<double>()
              << " s forward (float64, naive): the flash forward is "
              << out["forward_speedup_over_reference"].get<double>() << "x faster\n";
  }
}

int bench_kernel(const CLI::App& app, const KernelOptions& opt) {
  ConfigValues values = opt.problem.resolve(app);
  if (!values.seq_len) values.seq_len = 4096;
  if (!values.num_q_heads) values.num_q_heads = 8;
  if (!values.num_kv_heads) values.num_kv_heads = values.num_q_heads;
  if (!values.head_dim) values.head_dim = 128;
  values.cp = 1;
  values.strategy = "all_gather";
  Specs specs;
  auto errors = all_config_errors(values, specs);
  if (opt.threads < 1) {
    errors.push_back({{"threads"}, std::to_string(opt.threads), "--threads must be at least 1"});
  }
  FlashConfig cfg;
  cfg.threads = opt.threads;
  if (auto e = apply_bf16_path(opt, cfg)) errors.push_back(*e);
  if (!errors.empty()) {
    throw Error(ErrorKind::invalid_config, errors);  // main answers it: stderr, and --json's document
  }
  const AttentionSpec& a = specs.attention;
  require_memory_for(a, 8, "cpattn bench kernel");  // Q, K, V, dO, O, dQ, dK, dV
  const harness::WholeProblem problem = harness::random_problem(a, 1);
  const Tensor &q = problem.q, &k = problem.k, &v = problem.v, &d_out = problem.d_out;
  const Shape4 q_shape = q.shape(), kv_shape = k.shape();
  const std::vector<std::int32_t> positions = natural_positions(a.batch, a.seq_len);
  const AttentionMask mask = a.mask(positions, positions, {}, {});
  const double scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  if (!opt.simd_target.empty()) flash_force_vector_target(opt.simd_target);

  // The peak first and again after the kernels; their mean is the baseline (the machine's clock drifts).
  // The peak of the cores the threads run on: more threads than the machine has cores add no FMA units (and
  // would only make the measurement take as many times longer).
  const int peak_threads = std::min(opt.threads, threads_per_rank(0, 1));
  const double peak_before = measure_fma_peak_gflops(peak_threads);
  const double tile_before = measure_tile_peak_gflops(peak_threads);
  const KernelTimes times = time_kernels(q, k, v, d_out, mask, scale, cfg, opt);
  const double forward_s = times.forward_s, backward_s = times.backward_s;
  const FlashForwardResult& fwd = times.fwd;
  const double rss = peak_rss_bytes();
  // bf16: the fp32 kernels on the same values (the bf16 inputs widened), in the same run, as the baseline.
  std::optional<KernelTimes> fp32;
  if (a.dtype == DType::bf16) {
    fp32 = time_kernels(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), d_out.to(DType::f32), mask,
                        scale, cfg, opt);
  }
  const double peak_after = measure_fma_peak_gflops(peak_threads);
  const double tile_after = measure_tile_peak_gflops(peak_threads);
  const double fma_peak = (peak_before + peak_after) / 2;
  // The second baseline: the forward's own register tile on L1-resident data (the ceiling of the vector
  // kernels' loops), measured the same way; its mean before and after.
  const double tile_peak = (tile_before + tile_after) / 2;
  const double bf16_peak = measure_bf16_dot_peak_gflops(peak_threads);

  const double forward_flops =
      attention_forward_flops(a.batch, a.seq_len, a.num_q_heads, a.head_dim, a.band());
  const double backward_flops = kBackwardFlopsPerForward * forward_flops;
  const double forward_gflops = forward_flops / forward_s * 1e-9;
  const double backward_gflops = backward_flops / backward_s * 1e-9;
  // Q, K, V, dO in; O, LSE, dQ, dK, dV out: what a caller must hold anyway.
  const double tensor_bytes = static_cast<double>(dtype_size(a.dtype)) *
                                  static_cast<double>(4 * q_shape.numel() + 4 * kv_shape.numel()) +
                              4.0 * static_cast<double>(fwd.lse.size());

  nlohmann::ordered_json out;
  out["problem"] = attention_to_json(a);
  out["problem"]["threads"] = opt.threads;
  out["forward_path"] = a.dtype == DType::bf16 ? to_string(flash_bf16_path(cfg)) : "vector";
  out["vector_target"] = flash_vector_target();
  out["fma_peak_gflops"] = fma_peak;
  out["fma_peak_before_after_gflops"] = {peak_before, peak_after};
  out["tile_peak_gflops"] = tile_peak;
  out["tile_peak_before_after_gflops"] = {tile_before, tile_after};
  out["bf16_peak_gflops"] = bf16_peak;
  const double fma_drift = drift(peak_before, peak_after), tile_drift = drift(tile_before, tile_after);
  const bool steady = std::abs(fma_drift) <= kSteadyDrift && std::abs(tile_drift) <= kSteadyDrift;
  out["fma_peak_drift"] = fma_drift;
  out["tile_peak_drift"] = tile_drift;
  out["steady"] = steady;
  out["forward_seconds"] = forward_s;
  out["backward_seconds"] = backward_s;
  out["forward_gflops"] = forward_gflops;
  out["backward_gflops"] = backward_gflops;
  out["forward_fraction_of_peak"] = forward_gflops / fma_peak;
  out["backward_fraction_of_peak"] = backward_gflops / fma_peak;
  out["forward_fraction_of_tile_peak"] = forward_gflops / tile_peak;
  out["backward_fraction_of_tile_peak"] = backward_gflops / tile_peak;
  if (fp32) {
    out["forward_fraction_of_bf16_peak"] = bf16_peak > 0 ? forward_gflops / bf16_peak : 0.0;
    out["backward_fraction_of_bf16_peak"] = bf16_peak > 0 ? backward_gflops / bf16_peak : 0.0;
    out["fp32_forward_seconds"] = fp32->forward_s;
    out["fp32_backward_seconds"] = fp32->backward_s;
    out["forward_speedup_over_fp32"] = fp32->forward_s / forward_s;
    out["backward_speedup_over_fp32"] = fp32->backward_s / backward_s;
  }
  out["peak_rss_bytes"] = rss;
  out["tensor_bytes"] = tensor_bytes;
  out["rss_over_tensors"] = rss / tensor_bytes;
  if (a.seq_len <= opt.reference_max_seq) {
    const auto t0 = clock_type::now();
    const ReferenceResult r = reference_attention(q, k, v, nullptr, mask, scale);
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    out["reference_seconds"] = s;
    out["forward_speedup_over_reference"] = s / forward_s;
    (void)r;
  } else {
    out["reference_seconds"] = nullptr;
  }
  if (opt.json) {
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }
  print_kernel_report(out, a, opt);
  return 0;
}

}  // namespace

void add_bench_kernel_command(CLI::App& bench, int& exit_code) {
  auto opt = std::make_shared<KernelOptions>();
  CLI::App* sub =
      bench.add_subcommand("kernel", "flash forward/backward GFLOP/s against the measured FMA peak");
  opt->problem.add_to(*sub, false);  // one kernel: no strategy, ranks or load balance
  add_integer(*sub, "--threads", opt->threads, 1, kMaxThreads, "kernel threads (default 1)");
  add_real(*sub, "--min-seconds", opt->min_seconds, 0.0, 600.0,
           "time each kernel at least this long (best run counts)");
  add_integer(*sub, "--reference-max-seq", opt->reference_max_seq, 0, std::int64_t{1} << 20,
              "time the float64 reference forward only up to this S (default 4096)");
  sub->add_flag("--no-amx", opt->no_amx, "bf16: not the AMX path, even where AMX is available");
  add_text(*sub, "--bf16-path", opt->bf16_path,
           "bf16: the path to run (amx, avx512_bf16 or vector; default: the best this CPU has)");
  sub->add_flag("--single-run", opt->single_run,
                "time one forward and one backward call, allocation and first touch included (no warm-up, no "
                "repeats): for problems that take minutes");
  add_text(*sub, "--simd-target", opt->simd_target,
           "the vector kernels' SIMD target (Highway's name, e.g. AVX2; default: the best this CPU has; a "
           "-march=native build has only its own)");
  sub->add_flag("--json", opt->json, "print JSON");
  sub->callback([sub, opt, &exit_code] { exit_code = bench_kernel(*sub, *opt); });
}

}  // namespace cpattn::cli
