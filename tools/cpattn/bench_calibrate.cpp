// `cpattn bench calibrate`: this machine measured as a planner profile (cpattn/planner.hpp, HardwareProfile):
// the flash kernel's rate over call shapes on one core, and the collectives' latency and bandwidth on the
// group it runs on (the in-process group, or under mpirun the MPI backend), written as a profile file that
// `cpattn plan --profile FILE` reads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <thread>

#include "bench_command.hpp"
#include "cpattn/agreement.hpp"
#include "cpattn/communicators.hpp"
#include "cpattn/flash.hpp"
#include "cpattn/inproc.hpp"
#include "cpattn/planner.hpp"
#include "cpattn/sequence_layout.hpp"
#include "flag_parsing.hpp"
#include "output_dir.hpp"

namespace cpattn::cli {
namespace {

struct CalibrateOptions {
  std::string backend = "inproc";
  std::string output;  // the profile file; empty: printed
  std::string name = "this-machine";
  bool quick = false;       // a small grid (tests): head dim 64, extents 256 and 1024, fp32
  std::string kernel_from;  // a profile whose kernel rates are taken instead of measured
};

// The kernel grid: head dims, query and key extents (each call's q x kv x D at most kMaxCell, so the largest
// cell takes about a second forward on one core), causal where q <= kv (the queries at the keys' end, as a
// diagonal call has them), both dtypes.
constexpr std::int64_t kMaxCell = std::int64_t{1} << 32;

// A measured figure to 4 significant digits: what the machine's noise leaves of it.
double four_digits(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", x);
  return std::strtod(text, nullptr);
}

double calibrate_seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Best of calls until `budget` seconds have passed (at least two), after a warm-up call; a call longer than
// half a second is timed once.
double best_of(const std::function<void()>& fn, double budget = 0.2) {
  const double first = calibrate_seconds(fn);
  if (first > 0.5) return first;
  double best = 1e30, spent = 0;
  for (int i = 0; i < 2 || spent < budget; ++i) {
    const double t = calibrate_seconds(fn);
    best = std::min(best, t);
    spent += t;
  }
  return best;
}

// One cell: the kernel's forward and backward rates in the planner's units (tiles the kernel computed x
// 4·Bq·Bk·D, the backward's 2.5x that, over the seconds), one thread per core on every core at once, each on
// inputs of its own: the rate one core keeps while the others compute too (they share the caches and the
// memory), as ranks sharing the cores do. The slowest core's time.
KernelRate measure_cell(DType dtype, std::int64_t d, std::int64_t q, std::int64_t kv, bool causal, int cores,
                        double softcap = 0) {
  FlashConfig cfg;
  cfg.threads = 1;
  struct Inputs {
    Tensor q, k, v, d_out, o, dq, dk, dv;
    std::vector<float> lse;
  };
  std::vector<Inputs> in;
  for (int c = 0; c < cores; ++c) {
    const std::uint32_t seed = static_cast<std::uint32_t>(4 * c);
    in.push_back({random_normal(dtype, {1, q, 1, d}, seed + 1), random_normal(dtype, {1, kv, 1, d}, seed + 2),
                  random_normal(dtype, {1, kv, 1, d}, seed + 3), random_normal(dtype, {1, q, 1, d}, seed + 4),
                  Tensor(dtype, {1, q, 1, d}), Tensor(dtype, {1, q, 1, d}), Tensor(dtype, {1, kv, 1, d}),
                  Tensor(dtype, {1, kv, 1, d}), std::vector<float>(static_cast<std::size_t>(q))});
  }
  std::vector<std::int32_t> q_pos(static_cast<std::size_t>(q)), kv_pos = natural_positions(1, kv);
  for (std::int64_t i = 0; i < q; ++i) q_pos[i] = static_cast<std::int32_t>(kv - q + i);
  AttentionMask mask{q_pos, kv_pos, {}, {}, causal};
  mask.softcap = softcap;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  TileCounts tiles;
  // Every core's call at once; the time until the last one ends.
  auto on_every_core = [&](auto&& call) {
    std::vector<std::thread> threads;
    for (int c = 1; c < cores; ++c) threads.emplace_back([&, c] { call(in[c], nullptr); });
    call(in[0], &tiles);
    for (auto& t : threads) t.join();
  };
  const double fwd = best_of([&] {
    tiles = {};
    on_every_core([&](Inputs& x, TileCounts* counts) {
      flash_forward(cref(x.q), cref(x.k), cref(x.v), mask, scale, cfg, ref(x.o), x.lse.data(), counts);
    });
  });
  const double bwd = best_of([&] {
    on_every_core([&](Inputs& x, TileCounts*) {
      flash_backward(cref(x.q), cref(x.k), cref(x.v), cref(x.o), x.lse.data(), cref(x.d_out), mask, scale,
                     cfg, ref(x.dq), ref(x.dk), ref(x.dv));
    });
  });
  const double flops =
      static_cast<double>(tiles.total()) * 4.0 * static_cast<double>(cfg.block_q * cfg.block_kv * d);
  return {
      dtype, d, q, kv, causal, four_digits(flops / fwd), four_digits(flops * kBackwardFlopsPerForward / bwd)};
}

// Memory bytes/s per core with every core at once, for the work a ring step does outside its kernel calls:
// the fold of a call's fp32 output into the running one and the gradients' fp32 sums, 12 bytes per element
// (read both, write one), over arrays of 16 MiB per core (beyond this machine's caches, as a long row's are).
double measure_memory(int cores) {
  constexpr std::size_t kElements = std::size_t{1} << 22;
  std::vector<std::vector<float>> dst(static_cast<std::size_t>(cores)), src(dst.size());
  for (int c = 0; c < cores; ++c) {
    dst[c].assign(kElements, 1.0f);
    src[c].assign(kElements, 0.5f);
  }
  auto pass = [&](int c) {
    float* a = dst[c].data();
    const float* b = src[c].data();
    for (std::size_t i = 0; i < kElements; ++i) a[i] = a[i] * 0.75f + b[i] * 0.25f;
  };
  const double seconds = best_of([&] {
    std::vector<std::thread> threads;
    for (int c = 1; c < cores; ++c) threads.emplace_back(pass, c);
    pass(0);
    for (auto& t : threads) t.join();
  });
  return four_digits(12.0 * static_cast<double>(kElements) / seconds);
}

std::vector<KernelRate> measure_kernel(bool quick, int cores) {
  const std::vector<std::int64_t> dims =
      quick ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{64, 128, 256};
  const std::vector<std::int64_t> extents =
      quick ? std::vector<std::int64_t>{256, 1024} : std::vector<std::int64_t>{256, 1024, 4096, 16384};
  const std::vector<DType> dtypes =
      quick ? std::vector<DType>{DType::f32} : std::vector<DType>{DType::f32, DType::bf16};
  std::vector<KernelRate> out;
  std::cout << "kernel (per core, " << cores
            << " cores computing at once; GFLOP/s as the planner counts them)\n"
            << "dtype  D    q      kv     causal  forward  backward\n";
  for (const DType dtype : dtypes) {
    for (const std::int64_t d : dims) {
      for (const std::int64_t q : extents) {
        for (const std::int64_t kv : extents) {
          if (q * kv * d > kMaxCell) continue;
          for (const bool causal : {false, true}) {
            if (causal && q > kv) continue;
            out.push_back(measure_cell(dtype, d, q, kv, causal, cores));
            const KernelRate& k = out.back();
            std::cout << std::left << std::setw(7) << to_string(dtype) << std::setw(5) << d << std::setw(7)
                      << q << std::setw(7) << kv << std::setw(8) << (causal ? "yes" : "no") << std::setw(9)
                      << std::setprecision(4) << k.forward / 1e9 << k.backward / 1e9 << "\n"
                      << std::flush;
          }
        }
      }
    }
  }
  return out;
}

// Latency and bandwidth fitted to all_to_all and all_gather at sizes 4 KiB to 4 MiB per rank: seconds =
// (n - 1) x latency + bytes sent / bandwidth, least squares on the relative error. Every rank calls it.
struct LinkFit {
  double latency = 0, bandwidth = 0, worst_error = 0;
  int ranks = 0;
};

LinkFit fit_links(Communicator& comm) {
  const int n = comm.size();
  if (n < 2) {
    throw Error(
        ErrorKind::invalid_input, "--backend", "mpi",
        "bench calibrate --backend mpi fits the links between ranks: run it under mpirun -np 2 (or more)");
  }
  struct Point {
    double messages, bytes, seconds;
  };
  std::vector<Point> points;
  for (const char* kind : {"all_to_all", "all_gather"}) {
    for (std::int64_t bytes = 4096 * n; bytes <= (std::int64_t{4} << 20) * n; bytes *= 4) {
      const double t = collective_seconds(comm, kind, bytes);
      points.push_back({static_cast<double>(n - 1), static_cast<double>(bytes / n * (n - 1)), t});
    }
  }
  // Minimise sum ((m a + b g - t) / t)^2 over a (latency) and g (1 / bandwidth): the 2x2 normal equations.
  double smm = 0, smb = 0, sbb = 0, smt = 0, sbt = 0;
  for (const Point& p : points) {
    const double m = p.messages / p.seconds, b = p.bytes / p.seconds;
    smm += m * m;
    smb += m * b;
    sbb += b * b;
    smt += m;
    sbt += b;
  }
  const double det = smm * sbb - smb * smb;
  LinkFit fit;
  fit.ranks = n;
  double a = (smt * sbb - sbt * smb) / det, g = (smm * sbt - smb * smt) / det;
  if (!(det > 0) || !(a >= 0)) {  // no latency term: the bytes alone
    a = 0;
    g = sbt / sbb;
  } else if (!(g > 0)) {  // no bandwidth term cannot be: the fit failed
    g = 0;
  }
  if (!(g > 0) || !std::isfinite(g)) {
    throw Error(ErrorKind::internal, "links", std::to_string(n),
                "the collectives' timings gave no bandwidth (" + std::to_string(points.size()) + " sizes)");
  }
  fit.latency = a;
  fit.bandwidth = 1 / g;
  for (const Point& p : points) {
    fit.worst_error =
        std::max(fit.worst_error, std::abs(p.messages * a + p.bytes * g - p.seconds) / p.seconds);
  }
  return fit;
}

int bench_calibrate(const CalibrateOptions& opt) {
  // The name checked before the minute of measuring, as plan will read it.
  if (opt.name.empty() ||
      opt.name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
    throw Error(ErrorKind::invalid_input, "--name", opt.name,
                "--name '" + quoted(opt.name) +
                    "' is not a profile name; valid: lower-case letters, digits, '.', '-'");
  }
  if (!opt.output.empty()) check_writable_file(opt.output, "--output");  // before the minute of measuring
  if (!opt.kernel_from.empty() && read_hardware_profile(opt.kernel_from).kernel.empty()) {
    throw Error(ErrorKind::invalid_input, "--kernel-from", opt.kernel_from,
                "--kernel-from '" + quoted(opt.kernel_from) + "' has no kernel rates (key kernel)");
  }
  LinkFit links;
  bool print = true;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (opt.backend == "inproc") {
    InProcessGroup group(2);
    group.run([&](Communicator& c) {
      const LinkFit f = fit_links(c);
      if (c.rank() == 0) links = f;
    });
  } else {
    CommunicatorOptions options;
    options.thread_multiple = false;
    const std::unique_ptr<Communicator> made =
        make_communicator(parse_backend(opt.backend, "--backend"), options);
    Agreement agreement;
    agreement.add("--quick", opt.quick)
        .add_text("--name", opt.name)
        .add_text("--output", opt.output)
        .add_text("--kernel-from", opt.kernel_from);
    agree(*made, agreement);
    links = fit_links(*made);
    print = made->rank() == 0;
  }
  if (!print) return 0;
  std::cout << std::setprecision(4) << "links (" << opt.backend << ", " << links.ranks << " ranks): latency "
            << links.latency * 1e6 << " us per message, bandwidth " << links.bandwidth / 1e9
            << " GB/s per rank; the fit's worst error " << 100 * links.worst_error << " %\n";
  HardwareProfile p;
  p.name = opt.name;
  if (opt.kernel_from.empty()) {
    p.kernel = measure_kernel(opt.quick, cores);
  } else {
    p.kernel = read_hardware_profile(opt.kernel_from).kernel;
  }
  if (opt.kernel_from.empty()) {
    // A soft-cap's cost: one fp32 cell with a cap of 50 against the same without (the planner multiplies a
    // capped call's time by it).
    const std::int64_t d = opt.quick ? 64 : 128;
    const KernelRate plain = measure_cell(DType::f32, d, 1024, 1024, false, cores),
                     capped = measure_cell(DType::f32, d, 1024, 1024, false, cores, 50.0);
    p.softcap_forward = std::max(1.0, four_digits(plain.forward / capped.forward));
    p.softcap_backward = std::max(1.0, four_digits(plain.backward / capped.backward));
    std::cout << std::setprecision(4) << "soft-cap (fp32, D " << d << ", 1024 x 1024, cap 50): forward x"
              << p.softcap_forward << ", backward x" << p.softcap_backward << "\n";
  }
  p.memory_bandwidth = measure_memory(cores);
  std::cout << std::setprecision(4) << "memory (per core, " << cores
            << " cores at once): " << p.memory_bandwidth / 1e9
            << " GB/s folding fp32 arrays (12 bytes per element)\n";
  double best = 0;
  for (const KernelRate& k : p.kernel) best = std::max(best, k.forward);
  p.flops = best;
  p.bandwidth = four_digits(links.bandwidth);
  p.latency = four_digits(links.latency);
  p.cores = cores;
  p.block = FlashConfig{}.block_q;
  p.source =
      "cpattn bench calibrate --backend " + opt.backend + (opt.quick ? " --quick" : "") +
      " on this machine (" + std::to_string(cores) +
      " cores): kernel rates per core with every core computing, " +
      (opt.kernel_from.empty() ? std::string("measured") : "from " + opt.kernel_from) +
      ", square tiles of 64 counted as the kernel computed them; latency and bandwidth fitted to "
      "all_to_all and all_gather on " +
      std::to_string(links.ranks) +
      " ranks, 4 KiB to 4 MiB per rank; memory: per core with every core folding fp32 arrays of 16 MiB; "
      "merge and accumulate bytes: cpattn's own ring (12 per element); flops: the best forward rate" +
      (opt.kernel_from.empty() ? "; soft-cap factors: fp32, 1024 x 1024, cap 50 against none" : "");
  const std::string yaml = profile_yaml(p);
  parse_hardware_profile(yaml, "the calibrated profile");  // what plan will read, read back
  if (opt.output.empty()) {
    std::cout << yaml;
  } else {
    std::ofstream out(opt.output);
    out << yaml;
    out.close();
    if (!out)
      throw Error(ErrorKind::resource, "--output", opt.output, "cannot write --output '" + opt.output + "'");
    std::cout << "profile written to " << opt.output << "\n";
  }
  return 0;
}

}  // namespace

void add_bench_calibrate_command(CLI::App& bench, int& exit_code) {
  auto opt = std::make_shared<CalibrateOptions>();
  CLI::App* sub = bench.add_subcommand(
      "calibrate",
      "this machine as a planner profile: kernel rates by call shape, collectives' latency and bandwidth");
  add_choice(*sub, "--backend", opt->backend, {"inproc", "mpi"},
             "the group whose collectives are fitted (mpi: under mpirun)");
  add_text(*sub, "--output", opt->output, "write the profile (YAML) to this file (default: print it)");
  add_text(*sub, "--name", opt->name, "the profile's name (default this-machine)");
  add_text(*sub, "--kernel-from", opt->kernel_from,
           "take the kernel rates from this profile instead of measuring them (a second backend's links)");
  sub->add_flag("--quick", opt->quick, "a small kernel grid (head dim 64, extents 256 and 1024, fp32)");
  sub->callback([opt, &exit_code] { exit_code = bench_calibrate(*opt); });
}

}  // namespace cpattn::cli
