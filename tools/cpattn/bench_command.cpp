#include "bench_command.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include <unistd.h>

#include "cpattn/inproc.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/planner.hpp"
#include "flag_parsing.hpp"
#include "harness/whole_problem.hpp"
#include "problem_flags.hpp"

#include "cpattn/agreement.hpp"
#include "cpattn/communicators.hpp"

namespace cpattn::cli {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// ---- bench comm ----

struct CommOptions {
  std::string backend = "inproc";
  std::vector<int> ranks{2, 4};
  bool ranks_given = false;  // --ranks on the command line (refused with the MPI backend)
  std::int64_t min_bytes = 64 << 10, max_bytes = 64 << 20;
  bool json = false;
};

constexpr int kTries = 5;

// The largest per-rank size bench comm takes (16 GiB): bytes *= 4 stays far from overflow.
constexpr std::int64_t kMaxCommBytes = std::int64_t{1} << 34;

// Rows of the strided all_to_all case: 1024 fp32 (one token's 8 heads of D = 128 in Ulysses).
constexpr std::int64_t kStridedRow = 1024;

struct Timing {
  double seconds = 0;  // per call, the best try
  int iters = 0;       // calls per try
};

// Times one collective on this rank; `bytes` is the per-device size (HLO convention: all_to_all operand,
// all_gather output, reduce_scatter input). kTries tries of `iters` calls each between barriers, the slowest
// rank's time per call, best try. "all_to_all_strided" is the Ulysses swap's layout: the sender's block p is
// the columns [p*R, (p+1)*R) of a [T][n*R] array, the receiver's block p the rows [p*T, (p+1)*T) of [n*T][R];
// "all_to_all_v" the same blocks as per-rank block lists.
// kTries tries of `iters` calls of fn between barriers: the slowest rank's seconds per call, best try.
template <class Fn>
double best_try_seconds(Communicator& comm, int iters, Fn&& fn) {
  double best = 1e30;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    comm.barrier();
    const auto t0 = clock_type::now();
    for (int i = 0; i < iters; ++i) fn();
    comm.barrier();
    std::int64_t ns = static_cast<std::int64_t>(seconds_since(t0) * 1e9 / iters);
    comm.all_reduce(&ns, 1, ReduceOp::max);
    best = std::min(best, static_cast<double>(ns) * 1e-9);
  }
  return best;
}

// "memcpy" is the baseline: every rank copies `bytes` of its own, timed the same way (iters given).
Timing time_collective(Communicator& comm, const std::string& kind, std::int64_t bytes, bool raw_mpi,
                       int fixed_iters = 0) {
  const int n = comm.size();
  if (kind == "memcpy") {
    std::vector<unsigned char> src(static_cast<std::size_t>(bytes), 1), dst(src.size(), 0);
    auto copy = [&] { std::memcpy(dst.data(), src.data(), src.size()); };
    copy();
    return {best_try_seconds(comm, fixed_iters, copy), fixed_iters};
  }
  const std::int64_t elems = bytes / 4, block = elems / n;
  const std::int64_t row = std::min(block, kStridedRow), rows = row > 0 ? block / row : 0;
  std::vector<float> send(static_cast<std::size_t>(kind == "all_gather" ? block : elems), 1.0f),
      recv(static_cast<std::size_t>(kind == "reduce_scatter" ? block : elems));
  // all_to_all_v: all_to_all_strided's layout given as per-rank block lists (the ulysses swaps' call).
  BlockList from{{}, {}, elems, n * row}, to{{}, {}, elems, row};
  for (int p = 0; p < n; ++p) {
    from.shape.push_back({1, rows, row});
    from.offset.push_back(p * row);
    to.shape.push_back({1, rows, row});
    to.offset.push_back(p * rows * row);
  }
  auto once = [&] {
    if (raw_mpi && native_all_to_all(comm, send.data(), recv.data(), block)) return;
    if (kind == "all_to_all") comm.all_to_all(send.data(), recv.data(), block, CommDType::f32);
    if (kind == "all_to_all_strided") {
      comm.all_to_all_strided(send.data(), {row, 0, n * row}, recv.data(), {rows * row, 0, row},
                              {1, rows, row}, CommDType::f32);
    }
    if (kind == "all_to_all_v") comm.all_to_all_v(send.data(), from, recv.data(), to, CommDType::f32);
    if (kind == "all_gather") comm.all_gather(send.data(), recv.data(), block, CommDType::f32);
    if (kind == "reduce_scatter") comm.reduce_scatter_sum(send.data(), recv.data(), block, CommDType::f32);
  };
  once();
  comm.barrier();
  auto t0 = clock_type::now();
  once();
  comm.barrier();
  std::int64_t warm_ns = static_cast<std::int64_t>(seconds_since(t0) * 1e9);
  comm.all_reduce(&warm_ns, 1, ReduceOp::max);
  const int iters =
      static_cast<int>(std::clamp<std::int64_t>(40'000'000 / std::max<std::int64_t>(warm_ns, 1), 1, 50));
  return {best_try_seconds(comm, iters, once), iters};
}

}  // namespace

double collective_seconds(Communicator& comm, const std::string& kind, std::int64_t bytes) {
  return time_collective(comm, kind, bytes, false).seconds;
}

namespace {

// The sizes must make sense together, and fit: every rank holds about four buffers of the largest size (send,
// receive, and the memcpy baseline's two).
void check_comm_options(const CommOptions& opt) {
  if (opt.backend != "inproc" && opt.ranks_given) {
    throw Error(ErrorKind::invalid_input, "--ranks", "",
                "--ranks sizes the in-process group; under --backend " + opt.backend +
                    " the ranks are mpirun's processes (-np): drop --ranks");
  }
  if (opt.min_bytes > opt.max_bytes) {
    throw Error(ErrorKind::invalid_input, "--min-bytes", std::to_string(opt.min_bytes),
                "--min-bytes (" + std::to_string(opt.min_bytes) + ") is larger than --max-bytes (" +
                    std::to_string(opt.max_bytes) + "); valid: min <= max");
  }
  const int most_ranks = opt.backend == "inproc" && !opt.ranks.empty()
                             ? *std::max_element(opt.ranks.begin(), opt.ranks.end())
                             : 1;
  if (opt.backend == "inproc" && opt.min_bytes < 4 * most_ranks) {
    throw Error(ErrorKind::invalid_input, "--min-bytes", std::to_string(opt.min_bytes),
                "--min-bytes (" + std::to_string(opt.min_bytes) +
                    ") leaves a rank's block empty at --ranks " + std::to_string(most_ranks) +
                    "; valid: at least 4 bytes (one float) per rank, " + std::to_string(4 * most_ranks));
  }
  const double need = 4.0 * static_cast<double>(opt.max_bytes) * most_ranks;
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (need > have / 2) {
    throw Error(ErrorKind::invalid_input, "--max-bytes", std::to_string(opt.max_bytes),
                "--max-bytes (" + std::to_string(opt.max_bytes) + ") at " + std::to_string(most_ranks) +
                    " rank(s) needs about " + std::to_string(static_cast<std::int64_t>(need / 1048576)) +
                    " MiB (four buffers per rank) and this machine has " +
                    std::to_string(static_cast<std::int64_t>(have / 1048576)) +
                    " MiB; valid: at most half of it");
  }
}

int bench_comm(const CommOptions& opt) {
  check_comm_options(opt);
  nlohmann::ordered_json out;
  out["results"] = nlohmann::ordered_json::array();
  const std::vector<std::string> kinds = {"all_to_all", "all_to_all_strided", "all_to_all_v", "all_gather",
                                          "reduce_scatter"};
  bool print = true;
  double memcpy_gbps = 0;
  // On every rank: the collective, then the memcpy baselines with as many calls per try.
  struct Measured {
    double t = 0, mem_t = 0, mem_all_t = 0;
  };
  auto measure = [](Communicator& c, const std::string& kind, std::int64_t bytes, bool raw) {
    const int n = c.size();
    const Timing timing = time_collective(c, kind, bytes, raw);
    const std::int64_t moved = bytes / n * (n - 1);  // per rank, to other ranks
    // Every byte a rank writes, its own block included: an out-of-place all_to_all copies n/(n-1) times what
    // it sends, so fraction_of_memcpy cannot pass (n-1)/n while the copy itself runs at memcpy speed.
    const std::int64_t written = kind.starts_with("all_to_all") ? bytes / n * n : moved;
    Measured m{timing.seconds, time_collective(c, "memcpy", moved, false, timing.iters).seconds, 0};
    m.mem_all_t =
        written == moved ? m.mem_t : time_collective(c, "memcpy", written, false, timing.iters).seconds;
    return m;
  };
  auto record = [&](const char* backend, const std::string& kind, int n, std::int64_t bytes, Measured m) {
    const double t = m.t, mem_t = m.mem_t, mem_all_t = m.mem_all_t;
    const double moved = static_cast<double>(bytes / n * (n - 1));
    memcpy_gbps = std::max(memcpy_gbps, moved * n / mem_t / 1e9);
    const double algbw = static_cast<double>(bytes) / t / 1e9;
    out["results"].push_back({{"backend", backend},
                              {"collective", kind},
                              {"ranks", n},
                              {"bytes_per_rank", bytes},
                              {"seconds", t},
                              {"algbw_gbps", algbw},
                              {"busbw_gbps", algbw * (n - 1) / n},
                              {"fraction_of_memcpy", mem_t / t},
                              {"written_fraction_of_memcpy", mem_all_t / t}});
  };
  if (opt.backend == "inproc") {
    for (int n : opt.ranks) {
      for (const auto& kind : kinds) {
        for (std::int64_t bytes = opt.min_bytes; bytes <= opt.max_bytes; bytes *= 4) {
          InProcessGroup group(n);
          Measured t;
          group.run([&](Communicator& c) {
            const Measured s = measure(c, kind, bytes, false);
            if (c.rank() == 0) t = s;
          });
          record("inproc", kind, n, bytes, t);
        }
      }
    }
  } else {
    CommunicatorOptions options;
    options.thread_multiple = false;  // as MPI's own calls are measured (MPI_Init)
    const std::unique_ptr<Communicator> made =
        make_communicator(parse_backend(opt.backend, "--backend"), options);
    Communicator& comm = *made;
    // Every process must make the same calls with the same sizes: its flags agreed first.
    Agreement agreement;
    agreement.add("--min-bytes", opt.min_bytes).add("--max-bytes", opt.max_bytes).add("--json", opt.json);
    agree(comm, agreement);
    print = comm.rank() == 0;
    for (const std::string kind : {"all_to_all", "raw_MPI_Alltoall", "all_to_all_strided", "all_to_all_v",
                                   "all_gather", "reduce_scatter"}) {
      for (std::int64_t bytes = opt.min_bytes; bytes <= opt.max_bytes; bytes *= 4) {
        const bool raw = kind == "raw_MPI_Alltoall";
        const Measured t = measure(comm, raw ? "all_to_all" : kind, bytes, raw);
        if (print) record(raw ? "mpi_raw" : "mpi", raw ? "all_to_all" : kind, comm.size(), bytes, t);
      }
    }
  }
  if (!print) return 0;
  out["memcpy_gbps"] = memcpy_gbps;
  if (opt.json) {
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }
  std::cout << "memcpy (same threads, same bytes): up to " << std::setprecision(3) << memcpy_gbps
            << " GB/s\n";
  std::cout << std::left << std::setw(9) << "backend" << std::setw(20) << "collective" << std::setw(6)
            << "ranks" << std::setw(12) << "bytes/rank" << std::setw(12) << "seconds" << std::setw(11)
            << "algbw GB/s" << std::setw(11) << "busbw GB/s" << std::setw(11) << "of memcpy"
            << "written/memcpy\n";
  for (const auto& r : out["results"]) {
    std::cout << std::left << std::setw(9) << r["backend"].get<std::string>() << std::setw(20)
              << r["collective"].get<std::string>() << std::setw(6) << r["ranks"].get<int>() << std::setw(12)
              << r["bytes_per_rank"].get<std::int64_t>() << std::setw(12) << std::setprecision(4)
              << r["seconds"].get<double>() << std::setw(11) << std::setprecision(3)
              << r["algbw_gbps"].get<double>() << std::setw(11) << r["busbw_gbps"].get<double>()
              << std::setw(11) << r["fraction_of_memcpy"].get<double>()
              << r["written_fraction_of_memcpy"].get<double>() << "\n";
  }
  return 0;
}

// ---- bench strategy ----

struct StrategyOptions {
  ProblemFlags problem;
  std::vector<int> cps{2, 4};
  // Layers per configuration, each pass's best: the first layer of a configuration pays for memory the
  // process touches for the first time (on some machines several times the compute of a windowed layer),
  // which the configurations run first would pay most.
  int repeat = 2;
  bool json = false;
};

struct StrategyConfig {
  std::string name;
  Strategy strategy;
  bool lb;
  std::int64_t cp;
  std::int64_t ulysses_degree = 0;
};

// The configurations bench strategy runs: the single device, then at each cp every strategy (with and without
// load balance; hybrid at every factorisation U x R, 1 < U < cp, load-balanced), narrowed to what was asked
// (--strategy, --cp, --ulysses-degree, --load-balance). What was asked and breaks a rule is refused (exit 2),
// not skipped.
std::vector<StrategyConfig> strategy_configs(const CLI::App& app, const StrategyOptions& opt,
                                             const ConfigValues& asked, const AttentionSpec& a) {
  std::vector<std::int64_t> cps(opt.cps.begin(), opt.cps.end());
  if (asked.cp) {
    if (app.count("--cps") > 0) {
      throw Error(ErrorKind::invalid_input, "--cp", std::to_string(*asked.cp),
                  "--cp and --cps both give the ranks; give one of them");
    }
    if (*asked.cp < 1 || *asked.cp > kMaxInProcessRanks) {
      throw Error(ErrorKind::invalid_input, "--cp", std::to_string(*asked.cp),
                  "--cp (" + std::to_string(*asked.cp) + ") is out of range; valid: 1.." +
                      std::to_string(kMaxInProcessRanks) + " (in-process ranks)");
    }
    cps = {*asked.cp};
  }
  if (asked.tp && *asked.tp != 1) {
    throw Error(ErrorKind::invalid_input, "--tp", std::to_string(*asked.tp),
                "bench strategy runs one tensor-parallel group; use --tp 1");
  }
  if (asked.layout) {
    throw Error(
        ErrorKind::invalid_input, "--layout", *asked.layout,
        "bench strategy measures the contiguous and dual_chunk_swap layouts (--load-balance); the layouts "
        "cut by documents run with cpattn run --layout NAME --segments ... (bench/layouts.py compares "
        "them); drop --layout");
  }
  // Plain values and flags, not std::optional (GCC 12 warns of them as maybe uninitialised here).
  const bool only = asked.strategy.has_value();
  const Strategy only_strategy = only ? parse_strategy(*asked.strategy, "--strategy") : Strategy::all_gather;
  const bool lb_asked = asked.load_balance.has_value() || asked.attention_load_balance.has_value();
  const bool lb_value = asked.attention_balanced();
  std::vector<StrategyConfig> configs = {{"single_device", Strategy::all_gather, false, 1}};
  for (const std::int64_t cp : cps) {
    for (const Strategy strategy : kStrategies) {
      if (only && strategy != only_strategy) continue;
      const StrategyTraits traits = strategy_traits(strategy);
      if (traits.sub_groups) {
        const bool balanced = !lb_asked || lb_value;
        const std::size_t before = configs.size();
        for (std::int64_t u = 2; u < cp; ++u) {
          if (cp % u == 0 && (!asked.ulysses_degree || *asked.ulysses_degree == u)) {
            configs.push_back({hybrid_name(u, cp / u, balanced), strategy, balanced, cp, u});
          }
        }
        if (asked.ulysses_degree && configs.size() == before) {  // not a factorisation: the rules say why
          configs.push_back({"hybrid", strategy, balanced, cp, *asked.ulysses_degree});
        }
        continue;
      }
      if (asked.ulysses_degree) {  // only hybrid has one: the rules refuse it below
        configs.push_back({traits.name, strategy, (lb_asked && lb_value), cp, *asked.ulysses_degree});
        continue;
      }
      if (!(lb_asked && lb_value)) configs.push_back({traits.name, strategy, false, cp});
      // Load balance where the strategy has it; asked of one that has none, refused by the rules below.
      if ((lb_asked ? lb_value : traits.load_balance) && (traits.load_balance || only)) {
        configs.push_back({std::string(traits.name) + "_load_balanced", strategy, true, cp});
      }
    }
  }
  // Only where something was asked: the asked configurations that break a rule are refused.
  if (only || asked.cp || asked.ulysses_degree || lb_asked) {
    std::vector<ErrorItem> errors;
    for (std::size_t i = 1; i < configs.size(); ++i) {
      ParallelSpec p;
      p.cp = configs[i].cp;
      p.strategy = configs[i].strategy;
      p.load_balance = configs[i].lb;
      p.ulysses_degree = configs[i].ulysses_degree;
      for (ErrorItem& e : validation_errors(a, p)) {
        const bool said = std::any_of(errors.begin(), errors.end(),
                                      [&](const ErrorItem& x) { return x.message == e.message; });
        if (!said) errors.push_back(std::move(e));  // once, whichever cp broke it
      }
    }
    if (configs.size() == 1) {
      errors.push_back({{"--strategy"},
                        asked.strategy.value_or(""),
                        "nothing to run: no configuration is what was asked"});
    }
    if (!errors.empty()) throw Error(ErrorKind::invalid_config, errors);
  }
  return configs;
}

int bench_strategy(const CLI::App& app, const StrategyOptions& opt) {
  const ConfigValues asked = opt.problem.resolve(app);
  ConfigValues values = asked;
  if (!values.seq_len) values.seq_len = 16384;
  if (!values.num_q_heads) values.num_q_heads = 32;
  if (!values.num_kv_heads) values.num_kv_heads = 2;
  if (!values.head_dim) values.head_dim = 128;
  // The problem alone (one device); how it is split is each configuration's.
  values.cp = 1;
  values.tp.reset();
  values.strategy = "all_gather";
  values.ulysses_degree.reset();
  values.load_balance.reset();
  values.attention_load_balance.reset();
  Specs base;
  auto errors = all_config_errors(values, base);
  if (!errors.empty()) {
    throw Error(ErrorKind::invalid_config, errors);  // main answers it: stderr, and --json's document
  }
  const AttentionSpec& a = base.attention;
  const std::vector<StrategyConfig> configs = strategy_configs(app, opt, asked, a);
  const harness::WholeProblem problem = harness::random_problem(a, 1);
  nlohmann::ordered_json out;
  out["problem"] = attention_to_json(a);
  out["problem"]["cores"] = std::thread::hardware_concurrency();
  out["problem"]["repeat"] = opt.repeat;
  out["results"] = nlohmann::ordered_json::array();
  double single = 0;
  for (const StrategyConfig& c : configs) {
    ParallelSpec p;
    p.cp = c.cp;
    p.strategy = c.strategy;
    p.load_balance = c.lb;
    p.ulysses_degree = c.ulysses_degree;
    const auto rule_errors = validation_errors(a, p);
    if (!rule_errors.empty()) {
      out["results"].push_back({{"name", c.name}, {"cp", c.cp}, {"skipped", rule_errors.front().message}});
      continue;
    }
    harness::RunSettings settings;
    settings.repeat = opt.repeat;
    const harness::WholeResult r = harness::run_in_process(a, p, settings, problem);
    double fwd = 0, bwd = 0, wait = 0;
    std::int64_t tmin = INT64_MAX, tmax = 0;
    for (const auto& rank : r.ranks) {
      fwd = std::max(fwd, rank.forward_seconds);
      bwd = std::max(bwd, rank.backward_seconds);
      wait = std::max(wait, rank.comm_wait_seconds);
      tmin = std::min(tmin, rank.tiles);
      tmax = std::max(tmax, rank.tiles);
    }
    if (c.cp == 1) single = fwd + bwd;
    nlohmann::ordered_json result = {
        {"name", c.name},
        {"cp", c.cp},
        // As `cpattn run --json` reports them: the slowest rank's; comm_wait, what it waited on ring shifts.
        {"seconds", {{"forward", fwd}, {"backward", bwd}, {"total", fwd + bwd}, {"comm_wait", wait}}},
        {"ratio_to_single_device", (fwd + bwd) / single},
        {"tiles_skew", static_cast<double>(tmax) / static_cast<double>(std::max<std::int64_t>(tmin, 1))}};
    if (strategy_traits(c.strategy).ring) {
      // What the rank waited on its shifts, against what it computed (its time less the waiting).
      result["comm_wait_fraction_of_compute"] = wait / std::max(fwd + bwd - wait, 1e-12);
    }
    if (strategy_traits(c.strategy).heads == HeadSplit::whole_group) {
      // The slowest rank's share of the work against the mean: n_max / (Hq/cp) (1 when cp divides Hq).
      const UlyssesHeads heads = ulysses_heads(a.num_q_heads, a.num_kv_heads, c.cp);
      result["most_heads_over_mean"] = static_cast<double>(heads.max_q_heads()) * static_cast<double>(c.cp) /
                                       static_cast<double>(a.num_q_heads);
    }
    out["results"].push_back(std::move(result));
  }
  if (opt.json) {
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }
  std::cout << "bench strategy: B=" << a.batch << " S=" << a.seq_len << " Hq=" << a.num_q_heads
            << " Hkv=" << a.num_kv_heads << " D=" << a.head_dim << (a.causal ? " causal " : " ")
            << to_string(a.dtype) << window_text(a) << ", " << std::thread::hardware_concurrency()
            << " cores; each rank max(1, cores/cp) threads; best of " << opt.repeat << " layers\n";
  for (const auto& r : out["results"]) {
    std::cout << std::left << std::setw(31) << r["name"].get<std::string>() << " cp " << std::setw(4)
              << r["cp"].get<int>();
    if (r.contains("skipped")) {
      std::cout << "skipped: " << r["skipped"].get<std::string>() << "\n";
      continue;
    }
    std::cout << std::setprecision(3) << "forward " << std::setw(10) << r["seconds"]["forward"].get<double>()
              << " backward " << std::setw(10) << r["seconds"]["backward"].get<double>() << " x single "
              << std::setw(7) << r["ratio_to_single_device"].get<double>() << " tiles max/min "
              << r["tiles_skew"].get<double>();
    if (r.contains("most_heads_over_mean")) {
      std::cout << " heads max/mean " << r["most_heads_over_mean"].get<double>();
    }
    if (r.contains("comm_wait_fraction_of_compute")) {
      std::cout << " comm wait/compute " << r["comm_wait_fraction_of_compute"].get<double>();
    }
    std::cout << "\n";
  }
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  CLI::App* bench = app.add_subcommand("bench", "benchmarks with same-run baselines");
  bench->require_subcommand(1);
  auto comm_opt = std::make_shared<CommOptions>();
  CLI::App* comm =
      bench->add_subcommand("comm", "collective bandwidth against memcpy (and raw MPI_Alltoall)");
  add_choice(*comm, "--backend", comm_opt->backend, {"inproc", "mpi"}, "the group (mpi: under mpirun)");
  add_integer_list(*comm, "--ranks", comm_opt->ranks, 1, kMaxInProcessRanks, "in-process group sizes");
  add_integer(*comm, "--min-bytes", comm_opt->min_bytes, 4, kMaxCommBytes,
              "smallest per-rank size (at least 4 bytes per rank)");
  add_integer(*comm, "--max-bytes", comm_opt->max_bytes, 4, kMaxCommBytes, "largest per-rank size");
  comm->add_flag("--json", comm_opt->json, "print JSON");
  comm->callback([comm, comm_opt, &exit_code] {
    comm_opt->ranks_given = comm->count("--ranks") > 0;
    exit_code = bench_comm(*comm_opt);
  });

  auto st_opt = std::make_shared<StrategyOptions>();
  CLI::App* st = bench->add_subcommand("strategy", "every strategy against the single-device kernel");
  st_opt->problem.add_to(*st);
  add_integer_list(*st, "--cps", st_opt->cps, 1, kMaxInProcessRanks, "cp values to compare");
  add_integer(
      *st, "--repeat", st_opt->repeat, 1, 1000,
      "layers per configuration; forward and backward each their best (the first touches fresh memory)");
  st->add_flag("--json", st_opt->json, "print JSON");
  st->callback([st, st_opt, &exit_code] { exit_code = bench_strategy(*st, *st_opt); });

  add_bench_kernel_command(*bench, exit_code);
  add_bench_calibrate_command(*bench, exit_code);
}

}  // namespace cpattn::cli
