#include "run_command.hpp"

#include <pthread.h>

#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "cpattn/agreement.hpp"
#include "cpattn/npy.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/trace.hpp"
#include "flag_parsing.hpp"
#include "harness/check.hpp"
#include "harness/whole_problem.hpp"
#include "output_dir.hpp"
#include "problem_flags.hpp"

#include "cpattn/communicators.hpp"

namespace cpattn::cli {
namespace {

using harness::WholeProblem;
using harness::WholeResult;

struct RunOptions {
  ProblemFlags problem;
  std::string segments;  // "6144,2048"
  bool remat = false, forward_only = false, check = false, json = false;
  std::string backend = "inproc";
  int threads = 0;
  int repeat = 1;             // iterations; the best one's seconds
  double comm_timeout = 600;  // seconds
  std::uint32_t seed = 1;
  std::string load_dir, save_dir;
  std::string sinks_file;  // --sinks: [Hq] float32 .npy
  std::string trace_file;  // --trace: the Chrome trace-event JSON of every rank's events
};

[[noreturn]] void bad_input(const std::string& field, const std::string& value, const std::string& message) {
  throw Error(ErrorKind::invalid_input, field, value, message);
}

// A process that mpirun (or another MPI launcher) started with siblings, asked for the in-process group:
// every process would run its own whole job, unrelated to the others. Refused, naming --backend mpi.
void refuse_inproc_under_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    const std::string text = value;
    if (text.find_first_not_of("0123456789") == std::string::npos && !text.empty() && text != "1" &&
        text.size() < 10 && std::stoi(text) > 1) {
      bad_input("--backend", "inproc",
                "this process was started by an MPI launcher with " + text + " processes (" + name + "=" +
                    text +
                    ") but --backend is inproc: each would run its own unrelated job; add --backend mpi");
    }
  }
}

// Whether two segment-id arrays [B, S] put the same tokens of each row together, whatever the labels:
// [0, 0, 1] and [5, 5, 7] do; [0, 0, 1] and [0, 1, 1] do not. The labels map one to one within each row.
bool same_documents(const std::vector<std::int32_t>& x, const std::vector<std::int32_t>& y,
                    std::int64_t batch) {
  if (x.size() != y.size() || batch <= 0) return false;
  const std::size_t seq = x.size() / static_cast<std::size_t>(batch);
  for (std::size_t row = 0; row < static_cast<std::size_t>(batch); ++row) {
    std::unordered_map<std::int32_t, std::int32_t> x_to_y, y_to_x;
    for (std::size_t i = row * seq; i < (row + 1) * seq; ++i) {
      const auto xy = x_to_y.try_emplace(x[i], y[i]).first;
      const auto yx = y_to_x.try_emplace(y[i], x[i]).first;
      if (xy->second != y[i] || yx->second != x[i]) return false;
    }
  }
  return true;
}

std::vector<std::int64_t> parse_segments(const std::string& text, std::int64_t seq) {
  const std::vector<std::int64_t> lengths = parse_document_lengths(text, "--segments");
  std::int64_t total = 0;
  for (auto n : lengths) total += n;
  if (total != seq) {
    bad_input("--segments", text,
              "--segments '" + quoted(text) + "' sums to " + std::to_string(total) +
                  "; the document lengths must add up to --seq (" + std::to_string(seq) + ")");
  }
  return lengths;
}

// --load DIR: the headers of DIR/{q,k,v,do}.npy (+ segment_ids.npy), read and checked before any data.
struct LoadDir {
  std::string dir;
  NpyHeader q, k, v, d_out;
  bool has_segments = false;
};

// Reads the headers and sets the sizes they imply, refusing disagreements with flags; reads no data, so a
// huge array is refused by validation and the memory check before anything is allocated for it.
LoadDir inspect_load_dir(const std::string& dir, ConfigValues& values) {
  namespace fs = std::filesystem;
  LoadDir d{dir, {}, {}, {}, {}, false};
  auto header4 = [&](const char* name) {
    const std::string path = (fs::path(dir) / name).string();
    NpyHeader h = read_npy_header(path);
    if (h.shape.size() != 4 || h.dtype != NpyDType::f32) {
      bad_input(
          path, npy_type_text(h.dtype, h.shape),
          path + ": holds " + npy_type_text(h.dtype, h.shape) +
              "; valid: float32 ('<f4') with 4 dimensions [B, S, H, D] (float32 whatever --dtype: a bf16 "
              "run rounds the values)");
    }
    static const char* const kDims[] = {"B", "S", "H", "D"};
    for (std::size_t i = 0; i < 4; ++i) {
      if (h.shape[i] < 1) {
        bad_input(path, npy_type_text(h.dtype, h.shape),
                  path + ": holds " + npy_type_text(h.dtype, h.shape) + "; its " + kDims[i] + " is " +
                      std::to_string(h.shape[i]) + ", valid: every dimension >= 1");
      }
    }
    return h;
  };
  d.q = header4("q.npy");
  d.k = header4("k.npy");
  d.v = header4("v.npy");
  d.d_out = header4("do.npy");
  const auto& q = d.q.shape;
  const auto& k = d.k.shape;
  auto agree = [&](std::optional<std::int64_t>& flag, std::int64_t file_value, const char* what) {
    if (flag && *flag != file_value) {
      bad_input(what, std::to_string(*flag),
                std::string(what) + " (" + std::to_string(*flag) + ") disagrees with " + dir +
                    "/q.npy and k.npy (" + std::to_string(file_value) + ")");
    }
    flag = file_value;
  };
  agree(values.batch, q[0], "--batch");
  agree(values.seq_len, q[1], "--seq");
  agree(values.num_q_heads, q[2], "--q-heads");
  agree(values.head_dim, q[3], "--head-dim");
  agree(values.num_kv_heads, k[2], "--kv-heads");
  if (k != d.v.shape || k[0] != q[0] || k[1] != q[1] || k[3] != q[3]) {
    bad_input(dir + "/k.npy", npy_type_text(d.k.dtype, k),
              dir + ": k.npy holds " + npy_type_text(d.k.dtype, k) + " and v.npy " +
                  npy_type_text(d.v.dtype, d.v.shape) +
                  "; valid: both [B, S, Hkv, D] with q.npy's B, S and D (" + npy_type_text(d.q.dtype, q) +
                  ")");
  }
  if (d.d_out.shape != q) {
    bad_input(dir + "/do.npy", npy_type_text(d.d_out.dtype, d.d_out.shape),
              dir + "/do.npy holds " + npy_type_text(d.d_out.dtype, d.d_out.shape) +
                  "; valid: q.npy's shape (" + npy_type_text(d.q.dtype, q) + ")");
  }
  const fs::path seg_path = fs::path(dir) / "segment_ids.npy";
  d.has_segments = fs::exists(fs::symlink_status(seg_path));
  if (d.has_segments) {
    const NpyHeader s = read_npy_header(seg_path.string());
    if (s.dtype != NpyDType::i32 || s.shape != std::vector<std::int64_t>{q[0], q[1]}) {
      bad_input(seg_path.string(), npy_type_text(s.dtype, s.shape),
                seg_path.string() + ": holds " + npy_type_text(s.dtype, s.shape) +
                    "; valid: int32 ('<i4') [B, S] = (" + std::to_string(q[0]) + ", " + std::to_string(q[1]) +
                    ")");
    }
  }
  return d;
}

// The data of the files inspect_load_dir checked (read_npy checks each header again: a file changed since is
// refused, not trusted).
WholeProblem read_load_dir(const LoadDir& d, DType dtype) {
  namespace fs = std::filesystem;
  auto tensor = [&](const char* name, const NpyHeader& h) {
    const std::string path = (fs::path(d.dir) / name).string();
    const NpyArray a = read_npy(path);
    if (a.shape != h.shape || a.dtype != h.dtype) bad_input(path, "", path + ": changed while it was read");
    return Tensor::from_floats(dtype, {a.shape[0], a.shape[1], a.shape[2], a.shape[3]}, a.as_floats());
  };
  WholeProblem p{
      tensor("q.npy", d.q), tensor("k.npy", d.k), tensor("v.npy", d.v), tensor("do.npy", d.d_out), {}};
  if (d.has_segments) {
    const std::string path = (fs::path(d.dir) / "segment_ids.npy").string();
    const NpyArray s = read_npy(path);
    if (s.dtype != NpyDType::i32 || s.shape != std::vector<std::int64_t>{d.q.shape[0], d.q.shape[1]}) {
      bad_input(path, "", path + ": changed while it was read");
    }
    p.segment_ids = s.as_int32();
  }
  return p;
}

// --sinks FILE: a float32 .npy of one finite logit per q head (or -inf: no sink for that head).
std::vector<float> read_sinks(const std::string& path, std::int64_t q_heads) {
  const NpyArray s = read_npy(path);
  if (s.dtype != NpyDType::f32 || s.shape != std::vector<std::int64_t>{q_heads}) {
    std::string shape;
    for (const std::int64_t n : s.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(n);
    bad_input("--sinks", path,
              "--sinks " + cpattn::quoted(path) + " holds " +
                  (s.dtype == NpyDType::f32 ? "float32" : "not float32") + " [" + shape +
                  "]; expected float32 [" + std::to_string(q_heads) + "] (one logit per q head)");
  }
  std::vector<float> values = s.as_floats();
  for (std::size_t h = 0; h < values.size(); ++h) {
    if (std::isnan(values[h]) || values[h] == std::numeric_limits<float>::infinity()) {
      bad_input("--sinks", path,
                "--sinks " + cpattn::quoted(path) + ": head " + std::to_string(h) + "'s sink is " +
                    (std::isnan(values[h]) ? "NaN" : "+inf") +
                    "; valid: a finite logit, or -inf for no sink");
    }
  }
  return values;
}

std::string fmt(double x) {
  std::ostringstream s;
  s << std::setprecision(3) << x;
  return s.str();
}

// The whole run on the chosen backend. Under MPI every process runs one rank and then holds the whole result.
// Everything of the run every process must hold alike: the specs, every flag, the inputs it made or read.
// Under mpirun each process parses its own command line and reads its own files; a flag given to one rank
// alone (--no-causal, --save DIR) or another file under the same path is refused on every rank.
Agreement run_agreement(const RunOptions& opt, const AttentionSpec& a, const ParallelSpec& p,
                        const WholeProblem& problem) {
  Agreement agreement;
  add_specs(agreement, a, p);
  agreement.add_text("--segments", opt.segments)
      .add("--remat", opt.remat)
      .add("--forward-only", opt.forward_only)
      .add("--check", opt.check)
      .add("--json", opt.json)
      .add_text("--backend", opt.backend)
      .add("--threads", static_cast<std::int64_t>(opt.threads))
      .add("--repeat", static_cast<std::int64_t>(opt.repeat))
      .add("--comm-timeout", opt.comm_timeout)
      .add("--seed", static_cast<std::int64_t>(opt.seed))
      .add_text("--load", opt.load_dir)
      .add_text("--save", opt.save_dir)
      .add_text("--sinks", opt.sinks_file)
      .add_text("--trace", opt.trace_file);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"inputs: q", &problem.q},
                                {"inputs: k", &problem.k},
                                {"inputs: v", &problem.v},
                                {"inputs: do", &problem.d_out}}) {
    agreement.add_bytes(name, t->raw(), t->nbytes());
  }
  agreement.add_bytes("inputs: segment_ids", problem.segment_ids.data(),
                      problem.segment_ids.size() * sizeof(std::int32_t));
  agreement.add_bytes("inputs: sinks", problem.sinks.data(), problem.sinks.size() * sizeof(float));
  return agreement;
}

WholeResult execute(const std::string& backend, const AttentionSpec& a, const ParallelSpec& p,
                    const harness::RunSettings& settings, const WholeProblem& problem,
                    const Agreement& agreement, int& my_rank) {
  my_rank = 0;
  if (backend == "inproc") return harness::run_in_process(a, p, settings, problem);
  CommunicatorOptions options;
  options.timeout = settings.comm_timeout;
  options.timeout_name = "--comm-timeout";
  const std::unique_ptr<Communicator> made = make_communicator(parse_backend(backend), options);
  Communicator& comm = *made;
  my_rank = comm.rank();
  // Alike on every rank, agreed or not: an error here reaches main on every rank, which prints one document
  // and ends MPI normally.
  agree(comm, agreement);
  if (comm.size() != p.cp) {
    bad_input("--cp", std::to_string(p.cp),
              "--cp (" + std::to_string(p.cp) + ") must equal the number of MPI processes (" +
                  std::to_string(comm.size()) + "): run under mpirun -np " + std::to_string(p.cp));
  }
  WholeResult result;
  try {
    result = harness::make_whole_result(a, p, settings.forward_only);  // memory can fail on one rank alone
    if (settings.trace) trace::start();
    harness::run_rank(comm, a, p, settings, problem, result);
    if (settings.trace) result.trace = harness::gather_trace(comm, trace::stop());
    harness::share_whole_result(comm, a, p, settings.forward_only, result);
    result.hosts = comm.hosts();
  } catch (const std::exception& e) {
    // No fault-tolerant MPI: end the whole job, naming this rank, instead of leaving peers waiting. Bad input
    // ends it with exit 2, as the in-process group's run does.
    const auto* error = dynamic_cast<const Error*>(&e);
    const bool bad = error != nullptr && (error->kind() == ErrorKind::invalid_config ||
                                          error->kind() == ErrorKind::invalid_input);
    // Named by rank once: an error that already says which rank it is (the strategies' own) keeps its words.
    const std::string me = "rank " + std::to_string(comm.rank()) + ": ";
    const std::string what = e.what();
    std::cerr << "error (" << (error != nullptr ? to_string(error->kind()) : "internal")
              << "): " << (what.rfind(me, 0) == 0 ? what : me + what) << "\n";
    end_job(bad ? 2 : 1);
  }
  return result;
}

// "1e-6" for 1e-6, "2e-2" for 2e-2: a tolerance as it is written in the docs.
std::string tolerance_text(double x) {
  const int exponent = static_cast<int>(std::floor(std::log10(x) + 1e-9));
  const long mantissa = std::lround(x / std::pow(10.0, exponent));
  return std::to_string(mantissa) + "e" + std::to_string(exponent);
}

// --trace FILE: the events as one Chrome trace-event document; a file that cannot be written is named.
void write_trace(const std::string& path, const std::vector<trace::Event>& events) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << trace::chrome_json(events);
  out.close();
  if (!out) {
    throw Error(ErrorKind::resource, "--trace", path,
                "--trace '" + cpattn::quoted(path) + "' could not be written (" + std::strerror(errno) + ")");
  }
}

// The run's figures: the problem, the slowest rank's seconds, what each rank counted, the tiles per rank.
nlohmann::ordered_json run_report(const RunOptions& opt, const AttentionSpec& a, const ParallelSpec& p,
                                  int threads_per_rank, const WholeResult& result) {
  nlohmann::ordered_json out;
  out["ok"] = true;
  out["problem"] = {{"strategy", to_string(p.strategy)}, {"cp", p.cp}};
  if (p.traits().sub_groups) {
    out["problem"]["ulysses_degree"] = p.ulysses_degree;
    out["problem"]["ring_degree"] = p.ring_degree();
  }
  out["problem"].update(attention_to_json(a));
  out["problem"].update(nlohmann::ordered_json{{"load_balance", p.load_balance},
                                               {"layout", to_string(p.effective_layout())},
                                               {"remat", opt.remat},
                                               {"forward_only", opt.forward_only},
                                               {"backend", opt.backend},
                                               {"threads_per_rank", threads_per_rank},
                                               {"repeat", opt.repeat},
                                               {"segments", opt.segments}});
  double fwd_s = 0, bwd_s = 0, wait_s = 0;
  std::vector<std::int64_t> tiles;
  std::vector<double> kernel_cpu;  // each rank's kernels' CPU seconds, forward and backward
  for (const auto& r : result.ranks) {
    fwd_s = std::max(fwd_s, r.forward_seconds);
    bwd_s = std::max(bwd_s, r.backward_seconds);
    wait_s = std::max(wait_s, r.comm_wait_seconds);
    tiles.push_back(r.tiles);
    kernel_cpu.push_back(r.forward_kernel_cpu_seconds + r.backward_kernel_cpu_seconds);
  }
  out["seconds"] = {{"forward", fwd_s},
                    {"backward", opt.forward_only ? nlohmann::ordered_json() : nlohmann::ordered_json(bwd_s)},
                    {"comm_wait", wait_s}};
  // Hosts as the backend tells them apart; bytes across hosts are rank 0's, each call's bytes the largest
  // over the ranks (what the planner predicts: a direct ring's messages carry each rank's own rows).
  const bool hosts = !result.hosts.empty();
  out["hosts"] = {{"count", hosts ? *std::max_element(result.hosts.begin(), result.hosts.end()) + 1 : 1},
                  {"of_rank", hosts ? result.hosts : std::vector<int>(static_cast<std::size_t>(p.cp), 0)}};
  out["collectives"] = nlohmann::ordered_json::array();
  for (const auto& c : harness::largest_over_ranks(result.ranks))
    out["collectives"].push_back(record_json(c, hosts));
  out["tiles_per_rank"] = tiles;
  // The CPU time of each rank's kernel calls (its threads' and their workers'), forward and backward: what
  // the layout balances, measurable where ranks share cores and wall time is not.
  out["kernel_cpu_seconds_per_rank"] = kernel_cpu;
  std::vector<std::int64_t> saved;
  for (const auto& r : result.ranks) saved.push_back(r.saved_bytes);
  out["saved_bytes_per_rank"] = saved;  // what each rank's forward kept for its backward
  const auto [tmin, tmax] = std::minmax_element(tiles.begin(), tiles.end());
  out["tiles_skew"] = *tmin > 0 ? static_cast<double>(*tmax) / static_cast<double>(*tmin) : 0.0;
  return out;
}

nlohmann::ordered_json tolerances_json(const harness::Tolerances& tol) {
  nlohmann::ordered_json j;
  if (tol.forward_exact) {
    j["forward"] = "bit-identical";
  } else {
    j["forward"] = "within bounds";
    j["o_rel_vs_single_device"] = tol.o_rel;
    j["lse_abs_vs_single_device"] = tol.lse_abs;
  }
  j["grad_vs_single_device"] = tol.grad_rel;
  j["vs_reference"] = tol.reference_rel;
  return j;
}

// --check: adds out["check"] and returns the lines it prints.
std::string check_report(const harness::WholeCheck& c, bool forward_only, nlohmann::ordered_json& out) {
  nlohmann::ordered_json sd_abs, sd_rel, ref_rel;
  for (const auto& [name, value] : c.single_device_abs) sd_abs[name] = value;
  for (const auto& [name, value] : c.single_device_rel) sd_rel[name] = value;
  for (const auto& [name, value] : c.reference_rel)
    ref_rel[name] = value ? nlohmann::ordered_json(*value) : nullptr;
  out["check"] = {{"single_device", {{"max_abs_diff", sd_abs}, {"max_rel_diff", sd_rel}}},
                  {"reference", {{"max_rel_diff", ref_rel}, {"scope", c.reference_scope}}},
                  {"tolerances", tolerances_json(c.tolerances)},
                  {"pass", c.pass}};
  std::ostringstream t;
  t << "check vs the single-device kernel: max abs diff o " << fmt(sd_abs["o"]) << ", lse "
    << fmt(sd_abs["lse"]);
  if (!forward_only) {
    t << "; max rel diff dq " << fmt(sd_rel["dq"]) << ", dk " << fmt(sd_rel["dk"]) << ", dv "
      << fmt(sd_rel["dv"]);
    if (sd_rel.contains("dsinks")) t << ", dsinks " << fmt(sd_rel["dsinks"]);
  }
  t << "\ncheck vs the float64 reference (" << c.reference_scope << "): max rel diff";
  for (const auto& [name, value] : ref_rel.items())
    t << " " << name << " " << (value.is_null() ? "-" : fmt(value));
  const harness::Tolerances& tol = c.tolerances;
  t << "\ncheck: " << (c.pass ? "PASS" : "FAIL") << " (forward "
    << (tol.forward_exact ? std::string("bit-identical")
                          : "O within " + tolerance_text(tol.o_rel) + " of max |O|, LSE within " +
                                tolerance_text(tol.lse_abs))
    << "; gradients within " << tolerance_text(tol.grad_rel) << " of the single-device kernel; within "
    << fmt(tol.reference_rel) << " of the reference)\n";
  return t.str();
}

// --save DIR: o, lse and (unless forward-only) dq, dk, dv as float32 .npy in natural token order, and dsinks
// [Hq] with --sinks, all or none (output_dir.hpp).
void save_outputs(const std::string& dir, const AttentionSpec& a, const WholeResult& result,
                  bool forward_only) {
  std::vector<std::vector<float>> floats;
  std::vector<OutputFile> files;
  floats.reserve(5);
  auto add = [&](const char* name, const Tensor& t) {
    floats.push_back(t.to_floats());
    const Shape4 s = t.shape();
    files.push_back({name, {s.b, s.s, s.h, s.d}, floats.back().data()});
  };
  add("o.npy", result.o);
  files.push_back({"lse.npy", {a.batch, a.num_q_heads, a.seq_len}, result.lse.data()});
  if (!forward_only) {
    add("dq.npy", result.dq);
    add("dk.npy", result.dk);
    add("dv.npy", result.dv);
    if (a.sinks) {
      CPATTN_ASSERT(static_cast<std::int64_t>(result.dsinks.size()) == a.num_q_heads);
      files.push_back({"dsinks.npy", {a.num_q_heads}, result.dsinks.data()});
    }
  }
  write_outputs(dir, files);
}

void print_text(const RunOptions& opt, const AttentionSpec& a, const ParallelSpec& p,
                const nlohmann::ordered_json& out) {
  const bool named_layout = p.layout.has_value() && layout_reads_documents(*p.layout);
  std::cout << "cpattn run: " << to_string(p.strategy) << (p.load_balance ? " (load balance)" : "")
            << (named_layout ? std::string(" (layout ") + to_string(*p.layout) + ")" : std::string())
            << (opt.remat ? " remat" : "") << ", cp=" << p.cp
            << (p.traits().sub_groups ? " (ulysses " + std::to_string(p.ulysses_degree) + " x ring " +
                                            std::to_string(p.ring_degree()) + ")"
                                      : std::string())
            << (opt.backend == "mpi" ? " over MPI (" : " on the in-process group (")
            << out["problem"]["threads_per_rank"].get<int>() << " thread(s) per rank); B=" << a.batch
            << " S=" << a.seq_len << " Hq=" << a.num_q_heads << " Hkv=" << a.num_kv_heads
            << " D=" << a.head_dim << (a.causal ? " causal" : " non-causal") << " " << to_string(a.dtype)
            << (opt.segments.empty() ? "" : " segments " + opt.segments) << window_text(a) << "\n";
  if (p.traits().heads != HeadSplit::none) {
    const UlyssesHeads u = ulysses_heads(a.num_q_heads / p.tp, a.num_kv_heads / p.tp, p.head_group_size());
    std::cout << "placement: replication " << u.replication() << ";";
    for (const auto& r : head_placement(a, p)) {
      std::cout << " rank " << r.rank << " -> q " << r.q_heads.begin << ".." << r.q_heads.end - 1 << " kv "
                << r.kv_heads.front()
                << (r.kv_heads.size() > 1 ? ".." + std::to_string(r.kv_heads.back()) : std::string()) << ";";
    }
    std::cout << "\n";
  }
  std::cout << "seconds: forward " << fmt(out["seconds"]["forward"].get<double>());
  if (!opt.forward_only) std::cout << ", backward " << fmt(out["seconds"]["backward"].get<double>());
  std::cout << "\ncollectives (per rank):\n";
  const bool grouped = p.traits().sub_groups;
  const int hosts = out["hosts"]["count"].get<int>();
  if (hosts > 1) {
    std::cout << "hosts: " << hosts << " (rank -> host:";
    for (const auto& h : out["hosts"]["of_rank"]) std::cout << " " << h.get<int>();
    std::cout << ")\n";
  }
  std::cout << "  " << std::left << std::setw(20) << "kind" << std::setw(10) << "phase"
            << (grouped ? "group    " : "") << std::setw(7) << "count" << std::setw(14) << "bytes"
            << (hosts > 1 ? "bytes sent per rank  across hosts (rank 0)\n" : "bytes sent per rank\n");
  for (const auto& c : out["collectives"]) {
    std::cout << "  " << std::left << std::setw(20) << c["kind"].get<std::string>() << std::setw(10)
              << c["phase"].get<std::string>() << std::setw(grouped ? 9 : 0)
              << (grouped ? c.value("group", std::string()) : std::string()) << std::setw(7)
              << c["count"].get<std::int64_t>() << std::setw(14) << c["bytes"].get<std::int64_t>()
              << std::setw(hosts > 1 ? 21 : 0) << c["bytes_sent_per_rank"].get<std::int64_t>();
    if (hosts > 1) std::cout << c["bytes_sent_across_hosts"].get<std::int64_t>();
    std::cout << "\n";
  }
  std::cout << "tiles per rank (forward):";
  for (const auto& t : out["tiles_per_rank"]) std::cout << " " << t.get<std::int64_t>();
  std::cout << "  (max/min " << fmt(out["tiles_skew"].get<double>()) << ")\n";
}

int run(const CLI::App& app, RunOptions& opt) {
  ConfigValues values = opt.problem.resolve(app);
  LoadDir loaded;
  if (!opt.load_dir.empty()) loaded = inspect_load_dir(opt.load_dir, values);
  Specs specs;
  if (!opt.sinks_file.empty()) values.sinks = true;
  const auto errors = all_config_errors(values, specs);
  if (!errors.empty()) {
    if (opt.json) std::cout << failure_json("ok", errors) << "\n";
    print_errors(errors);
    return 2;
  }
  parse_backend(opt.backend, "--backend");  // one this build has
  const AttentionSpec& a = specs.attention;
  const ParallelSpec& p = specs.parallel;
  if (opt.backend == "inproc") refuse_inproc_under_launcher();
  if (opt.backend == "inproc" && p.cp > kMaxInProcessRanks) {
    bad_input("--cp", std::to_string(p.cp),
              "--cp (" + std::to_string(p.cp) + ") is more ranks than the in-process group runs (at most " +
                  std::to_string(kMaxInProcessRanks) + ", one thread each); use --backend mpi under mpirun");
  }
  if (p.tp != 1)
    bad_input("--tp", std::to_string(p.tp), "cpattn run simulates one tensor-parallel group; use --tp 1");
  // Inputs Q, K, V, dO and outputs O, dQ, dK, dV, before the ranks' own copies and the check's.
  require_memory_for(a, 8, "cpattn run");
  if (!opt.save_dir.empty()) check_output_dir(opt.save_dir, opt.forward_only, a.sinks);
  WholeProblem problem =
      opt.load_dir.empty() ? harness::random_problem(a, opt.seed) : read_load_dir(loaded, a.dtype);
  if (!opt.segments.empty()) {
    std::vector<std::int32_t> ids =
        segment_ids_from_lengths(a.batch, parse_segments(opt.segments, a.seq_len));
    if (!problem.segment_ids.empty() && !same_documents(ids, problem.segment_ids, a.batch)) {
      bad_input("--segments", opt.segments,
                "--segments '" + cpattn::quoted(opt.segments) + "' disagrees with " +
                    cpattn::quoted(opt.load_dir) +
                    "/segment_ids.npy (the documents differ); give one of them, or both alike");
    }
    problem.segment_ids = std::move(ids);
  }
  if (!opt.sinks_file.empty()) problem.sinks = read_sinks(opt.sinks_file, a.num_q_heads);
  // The per_document and solver layouts cut the row by its documents: the first batch row's (--segments, or
  // the loaded segment ids; none: one document).
  if (layout_reads_documents(p.effective_layout()) && !problem.segment_ids.empty()) {
    specs.parallel.documents = document_lengths(std::vector<std::int32_t>(
        problem.segment_ids.begin(), problem.segment_ids.begin() + static_cast<std::ptrdiff_t>(a.seq_len)));
  }
  harness::RunSettings settings;
  settings.options.remat = opt.remat;
  settings.options.threads = opt.threads;
  settings.forward_only = opt.forward_only;
  settings.repeat = opt.repeat;
  settings.trace = !opt.trace_file.empty();
  if (settings.trace) check_writable_file(opt.trace_file, "--trace");  // named before the run, not after
  settings.comm_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(opt.comm_timeout * 1000));
  const int rank_threads = threads_per_rank(opt.threads, p.cp);

  int my_rank = 0;
  const WholeResult result =
      execute(opt.backend, a, p, settings, problem,
              opt.backend == "inproc" ? Agreement() : run_agreement(opt, a, p, problem), my_rank);
  if (my_rank != 0) return 0;  // under mpirun rank 0 alone checks and reports

  nlohmann::ordered_json out = run_report(opt, a, p, rank_threads, result);
  bool pass = true;
  std::string check_text;
  if (opt.check) {
    const harness::WholeCheck c =
        harness::check_whole_result(a, p.strategy, problem, result, opt.forward_only, threads_per_rank(0, 1));
    pass = c.pass;
    check_text = check_report(c, opt.forward_only, out);
  }
  if (!opt.save_dir.empty()) save_outputs(opt.save_dir, a, result, opt.forward_only);
  if (!opt.trace_file.empty()) write_trace(opt.trace_file, result.trace);
  if (opt.json) {
    std::cout << json_text(out, 2) << "\n";
  } else {
    print_text(opt, a, p, out);
    std::cout << check_text;
  }
  return pass ? 0 : 1;
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto opt = std::make_shared<RunOptions>();
  CLI::App* sub =
      app.add_subcommand("run", "run distributed attention (forward + backward) on the in-process group");
  opt->problem.add_to(*sub);
  add_text(*sub, "--segments", opt->segments, "packed document lengths, e.g. 6144,2048 (sum = --seq)");
  CLI::Option* remat = sub->add_flag("--remat", opt->remat,
                                     "recompute (re-gather / re-exchange) in backward instead of keeping");
  CLI::Option* forward_only =
      sub->add_flag("--forward-only", opt->forward_only, "prefill: forward only, no state kept");
  remat->excludes(forward_only);  // nothing to recompute without a backward
  forward_only->excludes(remat);
  add_choice(*sub, "--backend", opt->backend, {"inproc", "mpi"},
             "the in-process group, or one process per rank under mpirun");
  add_integer(*sub, "--threads", opt->threads, 1, kMaxThreads,
              "kernel threads per rank (default max(1, cores / cp))");
  add_integer(*sub, "--repeat", opt->repeat, 1, 1000,
              "run the layer this many times and report the best iteration's seconds (default 1)");
  add_integer(*sub, "--seed", opt->seed, 0, 4294967295, "seed of the random inputs");
  add_real(*sub, "--comm-timeout", opt->comm_timeout, 0.001, 86400,
           "seconds a rank waits on its peers before it fails naming them (default 600)");
  sub->add_flag("--check", opt->check, "compare with the single-device kernel and the float64 reference");
  sub->add_flag("--json", opt->json, "print one JSON document");
  add_text(*sub, "--load", opt->load_dir, "read q.npy k.npy v.npy do.npy [segment_ids.npy] from DIR");
  add_text(*sub, "--save", opt->save_dir,
           "write o.npy lse.npy dq.npy dk.npy dv.npy (dsinks.npy with --sinks) to DIR");
  add_text(*sub, "--sinks", opt->sinks_file,
           "attention sinks (gpt-oss): a float32 .npy [q heads], one logit per q head in the softmax's "
           "denominator with no value");
  add_text(*sub, "--trace", opt->trace_file,
           "write what each rank did (kernel calls, collectives, waits) to FILE, Chrome trace-event JSON "
           "(Perfetto, chrome://tracing)");
  sub->callback([sub, opt, &exit_code] { exit_code = run(*sub, *opt); });
}

}  // namespace cpattn::cli
