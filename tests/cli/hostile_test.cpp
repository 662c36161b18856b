// Hostile and careless input, as a table (docs/errors.md, "Bad input at the edges"): each case runs the
// program as a user would, without a shell (fork + exec, stdin from /dev/null), and must end within 10 s with
// the exit code it names, a message naming the field or file and the value, no file in the fixture tree
// created, changed or removed, and under --json exactly one JSON document on stdout ("ok"/"valid" false, the
// errors listed) even when the value holds bytes that are not UTF-8. The fixtures hold the files a careless
// user points at: lying .npy headers, FIFOs, /dev/zero, sparse 16 GiB arrays, YAML with typos, the outputs
// of an earlier run.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpattn/error.hpp"
#include "cpattn/npy.hpp"
#include "output_dir.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr double kBoundSeconds = 10;

struct Outcome {
  int exit_code = -1;
  std::string out, err;
  double seconds = 0;
  bool timed_out = false;
};

// Runs CPATTN_EXE with `args` in `cwd`, the environment plus `env` (which replaces inherited entries of the
// same name; an MPI launcher's own variables are dropped); kills it at the bound.
Outcome spawn(const std::vector<std::string>& args, const fs::path& cwd, const std::vector<std::string>& env,
              const std::vector<std::pair<int, rlim_t>>& limits = {}) {
  Outcome o;
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return o;
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return o;
  }
  auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e, name = name_of(entry);
    bool replaced = name.rfind("OMPI_", 0) == 0 || name.rfind("PMI", 0) == 0 || name == "MPI_LOCALNRANKS";
    for (const auto& mine : env) replaced = replaced || name_of(mine) == name;
    if (!replaced) envs.push_back(entry);
  }
  for (const auto& e : env) envs.push_back(e);
  std::vector<char*> argv{const_cast<char*>(CPATTN_EXE)}, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ::dup2(null, 0);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    if (::chdir(cwd.c_str()) != 0) ::_exit(126);
    for (const auto& [resource, value] : limits) {
      const rlimit limit{value, value};
      if (::setrlimit(resource, &limit) != 0) ::_exit(125);
    }
    ::execve(CPATTN_EXE, argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    return o;
  }
  std::array<pollfd, 2> fds{{{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}}};
  std::string* sinks[2] = {&o.out, &o.err};
  int open_pipes = 2;
  while (open_pipes > 0) {
    const double left = kBoundSeconds - std::chrono::duration<double>(Clock::now() - start).count();
    if (left <= 0) {
      o.timed_out = true;
      break;
    }
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(left * 1000) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        sinks[i]->append(buf, static_cast<std::size_t>(n));
      } else {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_pipes;
      }
    }
  }
  if (open_pipes > 0) ::kill(pid, SIGKILL);  // past the bound, or poll failed: never wait unbounded
  for (auto& f : fds)
    if (f.fd >= 0) ::close(f.fd);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return o;
}

// What a tree holds, entry by entry: the kind, the size, the modification time and (below 1 MiB) the bytes.
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> entries;
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0) continue;
    std::string what = std::to_string(st.st_mode) + " " + std::to_string(st.st_size) + " " +
                       std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
    if (S_ISREG(st.st_mode) && st.st_size < (1 << 20)) {
      std::ifstream f(it->path(), std::ios::binary);
      what += " " + std::string(std::istreambuf_iterator<char>(f), {});
    }
    entries[fs::relative(it->path(), root).string()] = what;
  }
  return entries;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// An .npy file from its header dict and `data_bytes` zero bytes (a lie where they disagree).
void write_raw_npy(const fs::path& path, const std::string& dict, std::int64_t data_bytes,
                   const std::string& magic = "\x93NUMPY") {
  std::string header = dict;
  while ((magic.size() + 4 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string bytes = magic + std::string("\x01\x00", 2);
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  bytes += header;
  write_text(path, bytes + std::string(static_cast<std::size_t>(data_bytes), '\0'));
}

std::string dict(const std::string& descr, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + shape + "), }";
}

// The problem the good inputs hold: B=1, S=64, Hq=4, Hkv=2, D=8.
constexpr std::int64_t kS = 64, kHq = 4, kHkv = 2, kD = 8;

void write_good_inputs(const fs::path& dir) {
  fs::create_directories(dir);
  // Values that vary (constant ones would make the true dq and dk zero, and their relative check
  // meaningless).
  auto values = [](std::int64_t n, double phase) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + phase));
    return v;
  };
  cpattn::write_npy((dir / "q.npy").string(), {1, kS, kHq, kD}, values(kS * kHq * kD, 0).data());
  cpattn::write_npy((dir / "k.npy").string(), {1, kS, kHkv, kD}, values(kS * kHkv * kD, 1).data());
  cpattn::write_npy((dir / "v.npy").string(), {1, kS, kHkv, kD}, values(kS * kHkv * kD, 2).data());
  cpattn::write_npy((dir / "do.npy").string(), {1, kS, kHq, kD}, values(kS * kHq * kD, 3).data());
}

// The fixture tree, made once for every case.
class Fixtures {
 public:
  Fixtures() {
    root_ = fs::temp_directory_path() / ("cpattn_hostile_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "cwd");
    const fs::path good = root_ / "good";
    write_good_inputs(good);
    auto inputs_with = [&](const std::string& name, const std::string& file) {
      const fs::path d = root_ / name;
      fs::create_directories(d);
      for (const char* f : {"q.npy", "k.npy", "v.npy", "do.npy"})
        if (f != file) fs::copy_file(good / f, d / f);
      return d / file;
    };
    const std::string q_shape = "1, 64, 4, 8";
    write_raw_npy(inputs_with("lie_shape", "q.npy"), dict("<f4", "1, 64, 4, 64"), kS * kHq * kD * 4);
    write_raw_npy(inputs_with("short_data", "q.npy"), dict("<f4", q_shape), kS * kHq * kD * 4 - 12);
    write_raw_npy(inputs_with("long_data", "q.npy"), dict("<f4", q_shape), kS * kHq * kD * 4 + 4);
    write_raw_npy(inputs_with("no_brace", "q.npy"),
                  "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 64, 4, 8), ", kS * kHq * kD * 4);
    write_raw_npy(inputs_with("bad_magic", "q.npy"), dict("<f4", q_shape), kS * kHq * kD * 4, "\x93NUMPZ");
    write_raw_npy(inputs_with("f64", "v.npy"), dict("<f8", "1, 64, 2, 8"), kS * kHkv * kD * 8);
    write_raw_npy(inputs_with("big_endian", "k.npy"), dict(">f4", "1, 64, 2, 8"), kS * kHkv * kD * 4);
    write_raw_npy(inputs_with("fortran", "q.npy"),
                  "{'descr': '<f4', 'fortran_order': True, 'shape': (1, 64, 4, 8), }", kS * kHq * kD * 4);
    write_raw_npy(inputs_with("rank3", "q.npy"), dict("<f4", "64, 4, 8"), kS * kHq * kD * 4);
    write_raw_npy(inputs_with("q_batch0", "q.npy"), dict("<f4", "0, 64, 4, 8"), 0);
    write_raw_npy(inputs_with("negative_dim", "q.npy"), dict("<f4", "1, -64, 4, 8"), 0);
    write_raw_npy(inputs_with("do_shape", "do.npy"), dict("<f4", "1, 64, 2, 8"), kS * kHkv * kD * 4);
    write_raw_npy(inputs_with("k_dim16", "k.npy"), dict("<f4", "1, 64, 2, 16"), kS * kHkv * 16 * 4);
    write_raw_npy(inputs_with("overflow_shape", "q.npy"), dict("<f4", "1, 9223372036854775807, 4, 8"), 16);
    inputs_with("missing_do", "do.npy");
    ::mkfifo(inputs_with("fifo", "q.npy").c_str(), 0600);
    fs::create_symlink("/dev/zero", inputs_with("dev_zero", "q.npy"));
    fs::create_directories(inputs_with("dir_q", "q.npy"));
    write_text(inputs_with("empty_q", "q.npy"), "");
    {
      // Four arrays of 16 GiB each, sparse: valid headers whose data would not fit this machine's memory.
      const fs::path d = root_ / "huge";
      fs::create_directories(d);
      const std::int64_t s = std::int64_t{1} << 22, h = 32, dim = 32;
      for (const char* f : {"q.npy", "k.npy", "v.npy", "do.npy"}) {
        write_raw_npy(d / f, dict("<f4", "1, " + std::to_string(s) + ", 32, 32"), 0);
        fs::resize_file(d / f, fs::file_size(d / f) + s * h * dim * 4);
      }
    }
    {
      const fs::path d = root_ / "segments";
      write_good_inputs(d);
      std::vector<std::int32_t> ids(kS, 5);
      for (std::int64_t i = 40; i < kS; ++i) ids[i] = 9;  // documents of 40 and 24 tokens, labelled 5 and 9
      cpattn::write_npy((d / "segment_ids.npy").string(), {1, kS}, ids.data());
    }
    {
      // An earlier run's outputs, forward and backward.
      const fs::path d = root_ / "earlier_run";
      fs::create_directories(d);
      for (const char* f : {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"}) write_text(d / f, "earlier");
    }
    fs::create_directories(root_ / "o_is_a_dir" / "o.npy");
    write_text(root_ / "a_file", "not a directory");
    ::mkfifo((root_ / "fifo.yml").c_str(), 0600);
    fs::create_symlink("/dev/zero", root_ / "zero.yml");
    fs::create_directories(root_ / "dir.yml");
    const std::string seed =
        "ici_context_parallelism: 4\nbase_num_query_heads: 32\nbase_num_kv_heads: 2\nhead_dim: 256\n"
        "max_target_length: 65536\n";
    yaml("typo", "ici_context_paralelism: 4\nbase_num_query_heads: 32\n");
    yaml("repeated", seed + "ici_context_parallelism: 8\n");
    yaml("null", "ici_context_parallelism:\nbase_num_query_heads: 32\n");
    yaml("list", "ici_context_parallelism: [4, 8]\n");
    yaml("hex", "ici_context_parallelism: 0x10\n");
    yaml("fraction", "ici_context_parallelism: 2.5\n");
    yaml("negative", "ici_context_parallelism: -4\n");
    yaml("overflow", "ici_context_parallelism: 99999999999999999999\n");
    yaml("text", "ici_context_parallelism: four\n");
    yaml("not_yaml", "ici_context_parallelism: [4\n");
    yaml("not_a_map", "- 4\n- 8\n");
    yaml("binary_key", "ici_context_parallelism\xff: 4\n");
    yaml("strategy", "context_parallel_strategy: rings\n");
    yaml("huge", "# " + std::string(1 << 20, 'x') + "\nici_context_parallelism: 4\n");
    yaml("deep", std::string(5000, '[') + std::string(5000, ']') + "\n");
    // More than one YAML document: the second would otherwise go unread, typos and all.
    yaml("two_docs", seed + "---\nici_context_paralelism: 8\n");
    yaml("three_docs", seed + "---\nhead_dim: 64\n---\nhead_dim: 128\n");
    yaml("empty_second", seed + "---\n");
    yaml("marked_docs", "---\n" + seed + "...\n---\nmax_target_length: 1024\n");
    // Hardware profiles (plan --profile): one good, two that break a key.
    yaml("profile_good", "name: mine\nflops: 1e15\nbandwidth: 4e11\nsource: a test\n");
    yaml("profile_typo", "name: mine\nflop: 1e15\nbandwidth: 4e11\nsource: a test\n");
    yaml("profile_fast", "name: mine\nflops: fast\nbandwidth: 4e11\nsource: a test\n");
    // .npy headers that give a key twice (numpy reads the last: a reader of the first would read other data),
    // or hold a NUL or an escape in their text.
    const std::string tail = "'shape': (1, 64, 4, 8), }";
    write_raw_npy(inputs_with("fortran_twice", "q.npy"),
                  "{'descr': '<f4', 'fortran_order': False, 'fortran_order': True, " + tail,
                  kS * kHq * kD * 4);
    write_raw_npy(inputs_with("fortran_twice_false", "q.npy"),
                  "{'descr': '<f4', 'fortran_order': True, 'fortran_order': False, " + tail,
                  kS * kHq * kD * 4);
    write_raw_npy(inputs_with("descr_twice", "q.npy"),
                  "{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, " + tail, kS * kHq * kD * 4);
    write_raw_npy(
        inputs_with("shape_twice", "q.npy"),
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 64, 4, 8), 'shape': (1, 32, 4, 16), }",
        kS * kHq * kD * 4);
    write_raw_npy(inputs_with("nul_descr", "q.npy"),
                  std::string("{'descr': '<f") + '\0' + "4', 'fortran_order': False, " + tail,
                  kS * kHq * kD * 4);
    write_raw_npy(inputs_with("escape_descr", "q.npy"),
                  "{'descr': '<f\x1b[2J', 'fortran_order': False, " + tail, kS * kHq * kD * 4);
  }
  ~Fixtures() { fs::remove_all(root_); }
  const fs::path& root() const { return root_; }

 private:
  void yaml(const std::string& name, const std::string& text) { write_text(root_ / (name + ".yml"), text); }
  fs::path root_;
};

struct Case {
  std::string args;                  // split at spaces; {R} is the fixture tree
  int exit_code;                     // 2 bad input, 1 a failed run
  std::vector<std::string> phrases;  // each on stderr: the field or file, and the value
  std::vector<std::string> env = {};
  std::vector<std::string> extra_args = {};  // appended unsplit (values with spaces or odd bytes)
};

const std::string kSizes = " --q-heads 4 --kv-heads 2 --head-dim 8 --seq 64";

// The cases of the third hardening pass: flags that were accepted and ignored, the in-process group's bounds,
// several YAML documents, .npy headers that repeat a key or hold control bytes.
const std::vector<Case>& hardening_cases() {
  static const std::vector<Case> table = [] {
    std::vector<Case> t;
    const std::string small = " --seq 256 --q-heads 4 --kv-heads 2 --head-dim 16";
    // bench kernel runs one kernel: how a problem is split is no flag of it (refused, not ignored).
    for (const char* flag : {"--cp 0", "--cp 2", "--strategy ring", "--strategy hybrid", "--ulysses-degree 0",
                             "--ulysses-degree 2", "--tp 2", "--load-balance"}) {
      const std::string name = std::string(flag).substr(0, std::string(flag).find(' '));
      t.push_back({"bench kernel " + std::string(flag) + small, 2, {"unknown flag '" + name + "'"}});
    }
    // bench strategy runs what it is asked; what it cannot run is refused, naming the flag.
    for (const char* strategy : {"rings", "bogus", "ULYSSES", "all-gather"}) {
      t.push_back(
          {"bench strategy --strategy " + std::string(strategy) + small, 2, {"--strategy", strategy}});
    }
    for (const char* tp : {"2", "0", "-1", "4"}) {
      t.push_back({"bench strategy --tp " + std::string(tp) + small, 2, {"--tp", "use --tp 1"}});
    }
    for (const char* cp : {"0", "-1", "129", "1024"}) {
      t.push_back({"bench strategy --cp " + std::string(cp) + small, 2, {"--cp", cp}});
    }
    t.push_back({"bench strategy --cp 2 --cps 2,4" + small, 2, {"--cp and --cps"}});
    t.push_back({"bench strategy --layout solver" + small, 2, {"--layout", "cpattn run --layout"}});
    t.push_back({"bench strategy --strategy ulysses --load-balance" + small, 2, {"load_balance (true)"}});
    t.push_back({"bench strategy --strategy hybrid --cp 2" + small, 2, {"nothing to run"}});
    t.push_back(
        {"bench strategy --strategy hybrid --cp 4 --ulysses-degree 3" + small, 2, {"ulysses_degree (3)"}});
    t.push_back({"bench strategy --strategy ring --ulysses-degree 2" + small, 2, {"ulysses_degree (2)"}});
    t.push_back({"bench strategy --ulysses-degree 2" + small, 2, {"ulysses_degree (2)"}});
    t.push_back({"bench strategy --strategy all_gather --cp 3" + small, 2, {"seq_len (256)", "cp (3)"}});
    t.push_back({"bench strategy --strategy ulysses --cp 8" + small, 2, {"cp (8)", "num_q_heads (4)"}});
    for (const char* cps : {"129", "2,200", "1024"}) {
      t.push_back({"bench strategy --cps " + std::string(cps) + small, 2, {"--cps", "128"}});
    }
    // plan plans every strategy: asking it for one is refused, naming it.
    for (const char* strategy : {"all_gather", "ulysses", "ring", "hybrid", "bogus"}) {
      t.push_back({"plan --preset llama3-70b --seq 4096 --cp 4 --strategy " + std::string(strategy),
                   2,
                   {"drop --strategy '" + std::string(strategy) + "'"}});
    }
    // A prefill plan recomputes nothing: --remat with --forward-only is refused (either order).
    t.push_back({"plan --preset llama3-70b --seq 4096 --cp 4 --forward-only --remat",
                 2,
                 {"--remat", "--forward-only"}});
    t.push_back({"plan --preset llama3-70b --seq 4096 --cp 4 --remat --forward-only",
                 2,
                 {"--forward-only", "--remat"}});
    // A hardware profile file: its keys checked, its path a regular file, not given with --hardware.
    const std::string plan4 = "plan --preset llama3-70b --seq 4096 --cp 4 --profile {R}/";
    t.push_back({plan4 + "profile_typo.yml", 2, {"profile_typo.yml", "did you mean 'flops'?"}});
    t.push_back({plan4 + "profile_fast.yml", 2, {"profile_fast.yml: flops", "fast"}});
    t.push_back({plan4 + "no_such.yml", 2, {"no_such.yml"}});
    t.push_back({plan4 + "fifo.yml", 2, {"fifo.yml", "FIFO"}});
    t.push_back({plan4 + "dir.yml", 2, {"dir.yml", "directory"}});
    t.push_back({plan4 + "profile_good.yml --hardware h100", 2, {"--profile", "--hardware"}});
    t.push_back({plan4 + "profile_good.yml --hardware h200", 2, {"--profile", "--hardware"}});
    // plan --svg into a folder that does not exist: the file named, nothing written.
    t.push_back({"plan --preset llama3-70b --seq 4096 --cp 4 --svg {R}/no_such_dir/plan.svg",
                 2,
                 {"--svg", "no_such_dir/plan.svg", "cannot be written"}});
    // Hosts that do not divide cp: a ulysses group of a host's size would span hosts.
    for (const char* per_host : {"3", "5", "6", "7"}) {
      t.push_back({"plan --preset llama3-70b --seq 4096 --cp 16 --ranks-per-host " + std::string(per_host),
                   2,
                   {"ranks_per_host (" + std::string(per_host) + ") must divide cp (16)"}});
    }
    // The in-process group's bounds (each answers within seconds up to them).
    for (const int cp : {129, 256, 1024}) {
      t.push_back({"run --cp " + std::to_string(cp) + " --seq " + std::to_string(8 * cp) +
                       " --q-heads 2 --kv-heads 1 --head-dim 8",
                   2,
                   {"--cp (" + std::to_string(cp) + ")", "at most 128"}});
    }
    for (const char* ranks : {"129", "2,256"}) {
      t.push_back({"bench comm --ranks " + std::string(ranks), 2, {"--ranks", "128"}});
    }
    // A YAML file of several documents, in every command that reads one.
    const std::vector<std::pair<std::string, std::string>> documents = {
        {"two_docs", "holds 2 YAML documents"},
        {"three_docs", "holds 2 YAML documents or more"},
        {"empty_second", "holds 2 YAML documents"},
        {"marked_docs", "holds 2 YAML documents"}};
    for (const auto& [file, phrase] : documents) {
      for (const char* command :
           {"validate", "run", "plan --preset llama3-70b", "bench strategy", "bench kernel"}) {
        t.push_back({std::string(command) + " --config {R}/" + file + ".yml", 2, {file + ".yml", phrase}});
      }
    }
    // .npy headers that repeat a key, or carry a NUL or an escape sequence (shown escaped, never raw).
    for (const char* dir : {"fortran_twice", "fortran_twice_false", "descr_twice", "shape_twice"}) {
      t.push_back({"run --cp 2 --load {R}/" + std::string(dir), 2, {std::string(dir) + "/q.npy", "twice"}});
    }
    t.push_back({"run --cp 2 --load {R}/nul_descr", 2, {"nul_descr/q.npy", "\\x00"}});
    t.push_back({"run --cp 2 --load {R}/escape_descr", 2, {"escape_descr/q.npy", "\\x1B[2J"}});
    return t;
  }();
  return table;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      // run: numbers as typed.
      {"run --cp 010 --seq 1004 --q-heads 4 --kv-heads 2 --head-dim 8",
       2,
       {"seq_len (1004) must be divisible by cp (10)"}},
      {"run --cp 0x4" + kSizes, 2, {"--cp", "0x4"}},
      {"run --cp 4e0" + kSizes, 2, {"--cp", "4e0"}},
      {"run --cp 99999999999999999999" + kSizes, 2, {"--cp", "99999999999999999999"}},
      {"run --cp -1" + kSizes, 2, {"cp (-1)"}},
      {"run --cp 0" + kSizes, 2, {"cp (0)"}},
      {"run --cp 2048 --seq 4096 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"--cp", "2048", "128"}},
      {"run --cp 3 --seq 0200 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"seq_len (200)", "cp (3)"}},
      {"run --cp 2 --seq 64 --batch 1.5 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"--batch", "1.5"}},
      {"run --cp 2 --seq 64 --q-heads 4 --kv-heads 2 --head-dim 513", 2, {"head_dim (513)", "1..512"}},
      {"run --cp 2 --seq 64 --q-heads 70000 --kv-heads 2 --head-dim 8", 2, {"num_q_heads (70000)"}},
      {"run --cp 2 --seq 64 --q-heads 6 --kv-heads 4 --head-dim 8", 2, {"num_kv_heads (4)"}},
      {"run --cp 2 --seq -64 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"seq_len (-64)"}},
      {"run --cp 2 --seq 3000000000 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"seq_len (3000000000)"}},
      {"run --cp 4 --batch 99999999999999" + kSizes, 2, {"99999999999999"}},
      {"run --cp 4 --batch 64 --seq 1073741824 --q-heads 8 --kv-heads 2 --head-dim 512", 2, {"GiB", "--seq"}},
      {"run --cp 2" + kSizes + " --segments 32,-32", 2, {"--segments", "-32"}},
      {"run --cp 2" + kSizes + " --segments 032,032,x", 2, {"--segments", "x"}},
      {"run --cp 2" + kSizes + " --segments 10,20", 2, {"--segments", "10,20", "64"}},
      {"run --cp 2" + kSizes + " --segments 9223372036854775807,9223372036854775807",
       2,
       {"--segments", "9223372036854775807"}},
      {"run --cp 2" + kSizes + " --threads 0", 2, {"--threads", "0"}},
      {"run --cp 2" + kSizes + " --threads -2", 2, {"--threads", "-2"}},
      {"run --cp 2" + kSizes + " --threads 5000", 2, {"--threads", "5000", "1024"}},
      {"run --cp 2" + kSizes + " --seed -1", 2, {"--seed", "-1"}},
      {"run --cp 2" + kSizes + " --comm-timeout 0", 2, {"--comm-timeout", "'0'"}},
      {"run --cp 2" + kSizes + " --comm-timeout nan", 2, {"--comm-timeout", "nan"}},
      {"run --cp 2" + kSizes + " --comm-timeout inf", 2, {"--comm-timeout", "inf"}},
      {"run --cp 2" + kSizes + " --comm-timeout 1e308", 2, {"--comm-timeout", "1e308"}},
      {"run --cp 2" + kSizes + " --comm-timeout 1e-400", 2, {"--comm-timeout", "1e-400"}},
      {"run --cp 2" + kSizes + " --comm-timeout 0x10", 2, {"--comm-timeout", "0x10"}},
      {"run" + kSizes, 2, {"--cp", "empty"}, {}, {"--cp", ""}},
      {"run" + kSizes, 2, {"--cp", "\\xFF\\xFE"}, {}, {"--cp", "\xff\xfe"}},
      // run: intent that contradicts itself.
      {"run --cp 2 --causal --no-causal" + kSizes, 2, {"--causal", "--no-causal"}},
      {"run --cp 2 --remat --forward-only" + kSizes, 2, {"--remat", "--forward-only"}},
      {"run --cp 2 --strategy rings" + kSizes, 2, {"'rings' is not a strategy"}},
      {"run --cp 2" + kSizes, 2, {"strategy", "ring\\xFF"}, {}, {"--strategy", "ring\xff"}},
      {"run --cp 2 --backend nccl" + kSizes, 2, {"--backend", "nccl", "inproc, mpi"}},
      {"run --cp 2 --dtype fp16" + kSizes, 2, {"fp16"}},
      {"run --cp 2 --layout zigzag" + kSizes,
       2,
       {"layout 'zigzag' is not a layout", "per_document or solver"}},
      {"run --cp 2 --strategy ulysses --layout solver" + kSizes,
       2,
       {"layout solver is for all_gather, ring or hybrid"}},
      {"run --cp 4 --strategy ring --layout solver --q-heads 4 --kv-heads 2 --head-dim 8 --seq 4036",
       2,
       {"layout solver cuts seq_len / cp (1009)", "a multiple of 64 * cp"}},
      {"run --cp 2 --strategy ulysses --load-balance" + kSizes, 2, {"load_balance"}},
      {"run --cp 4 --strategy hybrid --ulysses-degree 3" + kSizes, 2, {"ulysses_degree (3)", "cp (4)"}},
      {"run --cp 4 --strategy hybrid" + kSizes, 2, {"ulysses_degree"}},
      {"run --cp 4 --strategy ring --ulysses-degree 2" + kSizes, 2, {"ulysses_degree (2)", "ring"}},
      {"run --cp 2 --tp 3" + kSizes, 2, {"tp (3)"}},
      {"run --cp 8 --strategy ulysses" + kSizes, 2, {"cp (8)", "num_q_heads", "hybrid"}},
      {"run --cp 2 --strategy ring --remat" + kSizes, 2, {"remat"}},
      {"run --cp 2" + kSizes, 2, {"--backend mpi", "OMPI_COMM_WORLD_SIZE"}, {"OMPI_COMM_WORLD_SIZE=2"}},
      {"run --cp 2" + kSizes, 2, {"--backend mpi", "PMI_SIZE"}, {"PMI_SIZE=2"}},
      {"run --cp 2" + kSizes, 2, {"--backend mpi", "PMIX_SIZE"}, {"PMIX_SIZE=2"}},
      {"run --cp 2 --no-such-flag" + kSizes, 2, {"no-such-flag"}},
      {"run --cp 2 --q-heads 4 --kv-heads 2 --head-dim 8 --seq", 2, {"--seq"}},
      // run --load: files that lie, that never end, that are not files.
      {"run --cp 2 --load {R}/nowhere", 2, {"{R}/nowhere/q.npy"}},
      {"run --cp 2 --load", 2, {"nowhere\\xFF/q.npy"}, {}, {"nowhere\xff"}},
      {"run --cp 2 --load {R}/a_file", 2, {"{R}/a_file"}},
      {"run --cp 2 --load {R}/lie_shape", 2, {"q.npy", "float32 (1, 64, 4, 64)", "65536"}},
      {"run --cp 2 --load {R}/short_data", 2, {"q.npy", "bytes"}},
      {"run --cp 2 --load {R}/long_data", 2, {"q.npy", "bytes"}},
      {"run --cp 2 --load {R}/no_brace", 2, {"q.npy", "}"}},
      {"run --cp 2 --load {R}/bad_magic", 2, {"q.npy"}},
      {"run --cp 2 --load {R}/f64", 2, {"v.npy", "float64 (1, 64, 2, 8)", "valid: float32"}},
      {"run --cp 2 --load {R}/big_endian", 2, {"k.npy", ">f4"}},
      {"run --cp 2 --load {R}/fortran", 2, {"q.npy", "fortran"}},
      {"run --cp 2 --load {R}/rank3", 2, {"q.npy", "float32 (64, 4, 8)", "4 dimensions"}},
      {"run --cp 2 --load {R}/q_batch0", 2, {"q.npy", "float32 (0, 64, 4, 8)", "its B is 0"}},
      {"run --cp 2 --load {R}/negative_dim", 2, {"q.npy", "-64"}},
      {"run --cp 2 --load {R}/k_dim16",
       2,
       {"k.npy holds float32 (1, 64, 2, 16)", "v.npy float32 (1, 64, 2, 8)"}},
      {"run --cp 2 --load {R}/overflow_shape", 2, {"q.npy", "9223372036854775807"}},
      {"run --cp 2 --load {R}/missing_do", 2, {"do.npy"}},
      {"run --cp 2 --load {R}/do_shape", 2, {"do.npy holds float32 (1, 64, 2, 8)", "q.npy's shape"}},
      {"run --cp 2 --load {R}/fifo", 2, {"q.npy", "regular"}},
      {"run --cp 2 --load {R}/dev_zero", 2, {"q.npy", "regular"}},
      {"run --cp 2 --load {R}/dir_q", 2, {"q.npy", "regular"}},
      {"run --cp 2 --load {R}/empty_q", 2, {"q.npy"}},
      {"run --cp 2 --load {R}/huge", 2, {"GiB"}},
      {"run --cp 3 --load {R}/good", 2, {"seq_len (64)", "cp (3)"}},
      {"run --cp 2 --load {R}/segments --segments 32,32", 2, {"--segments", "segment_ids.npy"}},
      {"run --cp 2 --load {R}/good --head-dim 16", 2, {"--head-dim (16)", "q.npy"}},
      // run --save: nothing half-written, nothing of an earlier run left beside new outputs.
      {"run --cp 2" + kSizes + " --save {R}/a_file", 2, {"--save", "{R}/a_file"}},
      {"run --cp 2" + kSizes + " --save {R}/a_file/sub", 2, {"--save", "{R}/a_file/sub"}},
      {"run --cp 2" + kSizes + " --save {R}/o_is_a_dir", 2, {"--save", "o.npy"}},
      {"run --cp 2" + kSizes + " --forward-only --save {R}/earlier_run", 2, {"--save", "dq.npy"}},
      {"run --cp 2" + kSizes + " --save {R}/fifo.yml", 2, {"--save", "{R}/fifo.yml"}},
      {"run --cp 2" + kSizes + " --save /proc/version/out", 2, {"--save", "/proc/version/out"}},
      {"run --cp 4 --seq 66 --q-heads 4 --kv-heads 2 --head-dim 8 --save {R}/new_dir", 2, {"seq_len (66)"}},
      {"run --cp 2 --load {R}/lie_shape --save {R}/earlier_run", 2, {"q.npy"}},
      {"run --cp 2" + kSizes + " --save", 2, {"--save"}, {}, {""}},
      // validate: config files.
      {"validate --config {R}/typo.yml",
       2,
       {"ici_context_paralelism", "did you mean 'ici_context_parallelism'"}},
      {"validate --config {R}/repeated.yml", 2, {"ici_context_parallelism", "repeated.yml"}},
      {"validate --config {R}/null.yml", 2, {"ici_context_parallelism", "null.yml"}},
      {"validate --config {R}/list.yml", 2, {"ici_context_parallelism", "list.yml"}},
      {"validate --config {R}/hex.yml", 2, {"ici_context_parallelism", "0x10"}},
      {"validate --config {R}/fraction.yml", 2, {"ici_context_parallelism", "2.5"}},
      {"validate --config {R}/negative.yml" + kSizes, 2, {"cp (-4)"}},
      {"validate --config {R}/overflow.yml", 2, {"ici_context_parallelism", "99999999999999999999"}},
      {"validate --config {R}/text.yml", 2, {"ici_context_parallelism", "four"}},
      {"validate --config {R}/not_yaml.yml", 2, {"not_yaml.yml", "YAML"}},
      {"validate --config {R}/not_a_map.yml", 2, {"not_a_map.yml"}},
      {"validate --config {R}/binary_key.yml", 2, {"binary_key.yml", "\\xFF"}},
      {"validate --config {R}/strategy.yml --seq 64 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"rings"}},
      {"validate --config {R}/huge.yml", 2, {"huge.yml", "1 MiB"}},
      {"validate --config {R}/deep.yml", 2, {"deep.yml"}},
      {"validate --config {R}/fifo.yml", 2, {"fifo.yml", "regular"}},
      {"validate --config {R}/zero.yml", 2, {"zero.yml", "regular"}},
      {"validate --config {R}/dir.yml", 2, {"dir.yml", "directory"}},
      {"validate --config {R}/nowhere.yml", 2, {"nowhere.yml"}},
      // validate: every broken rule at once, and the single ones.
      {"validate --strategy ulysses --cp 4 --q-heads 2 --kv-heads 3 --head-dim 600 --seq 1001 --batch 0",
       2,
       {"batch (0)", "head_dim (600)", "num_kv_heads (3)", "seq_len (1001)", "cp (4)"}},
      {"validate --cp 2 --seq 64 --q-heads 4 --kv-heads 2", 2, {"head_dim is not set"}},
      {"validate", 2, {"is not set"}},
      {"validate --cp 2 --softmax-scale 0.5" + kSizes, 2, {"unknown flag '--softmax-scale'"}},
      {"validate --cp 2 --q-head 4 --kv-heads 2 --head-dim 8 --seq 64",
       2,
       {"unknown flag '--q-head'", "did you mean '--q-heads'?"}},
      {"bench kernel --thread 2", 2, {"unknown flag '--thread'", "did you mean '--threads'?"}},
      {"validate --cp 2 --tp 0" + kSizes, 2, {"tp (0)"}},
      {"validate --cp 2 --tp 3000000000" + kSizes, 2, {"tp (3000000000)"}},
      {"validate --cp 65537 --seq 65537 --q-heads 4 --kv-heads 2 --head-dim 8",
       2,
       {"cp (65537)", "1..65536"}},
      {"validate --strategy all_gather --cp 65536 --seq 65536 --q-heads 65536 --kv-heads 65536 --head-dim 1",
       2,
       {"validate lists every rank's heads", "cp (65536)", "passes every rule"}},
      {"plan --cp 65537 --seq 65537 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"cp (65537)"}},
      {"plan --preset qwen3.5-397b-a17b --cp 4096 --seq 4194304", 2, {"--cp (4096)", "at most 2048"}},
      {"validate --cp 2 --seq 64 --q-heads 3345830087427 --kv-heads 1 --head-dim 8",
       2,
       {"num_q_heads (3345830087427)", "65536"}},
      {"validate --cp 2 --load-balance --seq 66 --q-heads 4 --kv-heads 2 --head-dim 8", 2, {"seq_len (66)"}},
      {"validate --cp 2 --dtype fp16" + kSizes, 2, {"fp16", "fp32", "bf16"}},
      {"validate --cp 2" + kSizes, 2, {"dtype", "\\xC3("}, {}, {"--dtype", "\xc3\x28"}},
      {"validate" + kSizes, 2, {"--cp", "1\\xFF"}, {}, {"--cp", "1\xff"}},
      {"validate --json --no-such-flag", 2, {"no-such-flag"}},
      {"no-such-command", 2, {"no-such-command"}},
      {"", 2, {"subcommand"}},
      {"", 2, {"command", "\\xFF"}, {}, {"\xff"}},
      // plan: bounded, and every number read the same way.
      {"plan --preset gpt5 --seq 1024", 2, {"--preset", "gpt5"}},
      {"plan --seq 1024", 2, {"--preset"}, {}, {"--preset", "llama\xff"}},
      {"plan --preset llama3-70b --seq 1001 --cp 4", 2, {"seq_len (1001)"}},
      {"plan --preset llama3-70b --seq 1024 --hardware tpu-v1", 2, {"--hardware", "tpu-v1"}},
      {"plan --preset llama3-70b --seq 1024 --segments 1000,20", 2, {"segments"}},
      {"plan --preset llama3-70b --seq 1024 --segments 0x400", 2, {"--segments", "0x400"}},
      {"plan --preset llama3-70b --seq 8388608", 2, {"seq", "8388608", "4194304"}},
      {"plan --preset llama3-70b --seq 1048576 --block 1", 2, {"--block", "8192"}},
      {"plan --preset llama3-70b --seq 1024 --block 0", 2, {"--block", "0"}},
      {"plan --preset llama3-70b --seq 1024 --cp 0", 2, {"cp (0)"}},
      {"plan --preset llama3-70b --seq 1024 --emb-dim 0x10", 2, {"--emb-dim", "0x10"}},
      {"plan --preset llama3-70b --seq 1024 --emb-dim -1", 2, {"--emb-dim", "-1"}},
      {"plan --preset llama3-70b --seq 1024 --layers 0", 2, {"--layers", "0"}},
      {"plan --preset llama3-70b --seq 1024 --layers 010e9", 2, {"--layers", "010e9"}},
      {"plan --preset llama3-70b --seq 1024 --attention-every 0", 2, {"--attention-every", "0"}},
      {"plan --preset llama3-70b --seq 1024 --local-window -1", 2, {"--local-window", "-1"}},
      {"plan --preset llama3-70b --seq 1024 --local-window 1023", 2, {"--global-every", "N >= 2"}},
      {"plan --preset llama3-70b --seq 1024 --global-every 6", 2, {"--global-every", "--local-window"}},
      {"plan --preset gemma3-27b --seq 1024 --global-every 1", 2, {"--global-every", "N >= 2"}},
      {"plan --preset gemma3-27b --seq 1024 --global-every 0", 2, {"--global-every", "0"}},
      {"plan --preset llama3-70b --seq 1024 --flops 0", 2, {"--flops", "0"}},
      {"plan --preset llama3-70b --seq 1024 --flops inf", 2, {"--flops", "inf"}},
      {"plan --preset llama3-70b --seq 1024 --bandwidth nan", 2, {"--bandwidth", "nan"}},
      {"plan --preset llama3-70b --seq 1024 --inter-bandwidth -5", 2, {"--inter-bandwidth", "-5"}},
      {"plan --preset llama3-70b --seq 1024 --ranks-per-host -1", 2, {"--ranks-per-host", "-1"}},
      {"plan --preset llama3-70b --seq 1024 --ulysses-degree 2", 2, {"--ulysses-degree"}},
      {"plan --preset llama3-70b --seq 1024 --cp 4 --q-heads 3", 2, {"num_q_heads"}},
      {"plan --preset llama3-70b --seq 1024 --causal --no-causal", 2, {"--causal", "--no-causal"}},
      {"plan --preset llama3-70b --seq 1024 --config {R}/typo.yml", 2, {"ici_context_paralelism"}},
      // bench: the same flags, the same rules.
      {"bench comm --ranks 100000", 2, {"--ranks", "100000", "128"}},
      {"bench comm --ranks 0", 2, {"--ranks", "0"}},
      {"bench comm --ranks 2,,4", 2, {"--ranks"}},
      {"bench comm --ranks", 2, {"--ranks"}, {}, {""}},
      {"bench comm --min-bytes 0", 2, {"--min-bytes", "0"}},
      {"bench comm --min-bytes -5", 2, {"--min-bytes", "-5"}},
      {"bench comm --min-bytes 1000 --max-bytes 10", 2, {"--min-bytes", "--max-bytes"}},
      {"bench comm --max-bytes 99999999999999999", 2, {"--max-bytes", "99999999999999999"}},
      {"bench comm --max-bytes 1e9", 2, {"--max-bytes", "1e9"}},
      {"bench comm --ranks 128 --min-bytes 17179869184 --max-bytes 17179869184",
       2,
       {"--max-bytes (17179869184)", "MiB"}},
      {"bench comm --backend mpi2", 2, {"--backend", "mpi2"}},
      {"bench kernel --threads 0", 2, {"--threads", "0"}},
      {"bench kernel --threads 99999", 2, {"--threads", "99999"}},
      {"bench kernel --min-seconds 1e308", 2, {"--min-seconds", "1e308"}},
      {"bench kernel --min-seconds nan", 2, {"--min-seconds", "nan"}},
      {"bench kernel --min-seconds -1", 2, {"--min-seconds", "-1"}},
      {"bench kernel --head-dim 513 --seq 64", 2, {"head_dim (513)"}},
      {"bench kernel --seq 0", 2, {"seq_len (0)"}},
      {"bench kernel --dtype f16", 2, {"f16"}},
      {"bench kernel", 2, {"--bf16-path", "x\\xFFy"}, {}, {"--bf16-path", "x\xffy"}},
      {"bench strategy --cps 0", 2, {"--cps", "0"}},
      {"bench strategy --cps 2000", 2, {"--cps", "2000", "128"}},
      {"bench strategy --cps 2,x", 2, {"--cps", "x"}},
      {"bench strategy --cps", 2, {"--cps"}, {}, {""}},
      {"bench nosuch", 2, {"nosuch"}},
      {"bench", 2, {"subcommand"}},
  };
  static const std::vector<Case> all = [] {
    std::vector<Case> joined = table;
    for (const Case& c : hardening_cases()) joined.push_back(c);
    return joined;
  }();
  return all;
}

std::string with_root(std::string text, const std::string& root) {
  for (std::size_t at; (at = text.find("{R}")) != std::string::npos;) text.replace(at, 3, root);
  return text;
}

// The table's arguments split at spaces, {R} replaced by the fixture tree.
std::vector<std::string> split(const std::string& text, const std::string& root) {
  std::vector<std::string> out;
  std::istringstream words(text);
  for (std::string word; words >> word;) out.push_back(with_root(word, root));
  return out;
}

// One command's cases: a command's name as the table's first word ("" for the cases with none).
void run_cases(const std::vector<std::string>& commands) {
  Fixtures fixtures;
  const std::string root = fixtures.root().string();
  int ran = 0;
  for (const Case& c : cases()) {
    const std::string first = c.args.substr(0, c.args.find(' '));
    bool mine = false;
    for (const auto& command : commands) mine = mine || first == command;
    if (!mine) continue;
    ++ran;
    for (const bool json : {false, true}) {
      std::vector<std::string> args = split(c.args, root);
      for (const auto& a : c.extra_args) args.push_back(a);
      if (json) args.push_back("--json");
      const std::string shown = c.args + (c.extra_args.empty() ? "" : " + extra") + (json ? " --json" : "");
      const auto before = snapshot(fixtures.root());
      const Outcome o = spawn(args, fixtures.root() / "cwd", c.env);
      EXPECT_FALSE(o.timed_out) << shown << ": no answer within " << kBoundSeconds << " s";
      EXPECT_LE(o.seconds, kBoundSeconds) << shown;
      EXPECT_EQ(o.exit_code, c.exit_code) << shown << "\nstderr: " << o.err;
      if (!json) {
        for (const auto& phrase : c.phrases) {
          EXPECT_NE(o.err.find(with_root(phrase, root)), std::string::npos)
              << shown << "\nmissing: " << phrase << "\nstderr: " << o.err;
        }
      } else {
        nlohmann::json doc;
        try {
          doc = nlohmann::json::parse(o.out);  // one document: anything after it fails the parse
        } catch (const std::exception& e) {
          ADD_FAILURE() << shown << ": stdout is not one JSON document (" << e.what() << "):\n" << o.out;
          continue;
        }
        const char* key = doc.contains("valid") ? "valid" : "ok";
        EXPECT_EQ(doc.value(key, true), false) << shown << "\n" << o.out;
        ASSERT_TRUE(doc.contains("errors") && doc["errors"].is_array() && !doc["errors"].empty())
            << shown << "\n"
            << o.out;
        for (const auto& e : doc["errors"]) {
          EXPECT_TRUE(e.contains("message") && !e["message"].get<std::string>().empty()) << shown;
        }
      }
      const auto after = snapshot(fixtures.root());
      if (after != before) {
        std::string changed;
        for (const auto& [path, what] : after)
          if (!before.count(path) || before.at(path) != what) changed += " " + path;
        for (const auto& [path, what] : before)
          if (!after.count(path)) changed += " -" + path;
        ADD_FAILURE() << shown << ": the fixture tree changed:" << changed;
      }
    }
  }
  EXPECT_GT(ran, 0);
}

// A failure after some earlier outputs were given their second names (here: dk.npy became a directory after
// the check) puts everything back: the directory holds what it held, and says nothing was replaced.
TEST(OutputDir, AFailureBetweenFilesPutsTheEarlierOutputsBack) {
  const fs::path dir = fs::temp_directory_path() / ("cpattn_output_dir_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const char* names[] = {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"};
  for (const char* f : names) write_text(dir / f, f);
  fs::remove(dir / "dk.npy");
  fs::create_directories(dir / "dk.npy" / "taken");
  const auto before = snapshot(dir);
  const std::vector<float> values(8, 1.0f);
  std::vector<cpattn::cli::OutputFile> files;
  for (const char* f : names) files.push_back({f, {8}, values.data()});
  try {
    cpattn::cli::write_outputs(dir.string(), files);
    ADD_FAILURE() << "write_outputs succeeded";
  } catch (const cpattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing was replaced"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("dk.npy"), std::string::npos) << e.what();
  }
  EXPECT_EQ(snapshot(dir), before);
  // With the way clear every output is replaced, and nothing else is left beside them.
  fs::remove_all(dir / "dk.npy");
  cpattn::cli::write_outputs(dir.string(), files);
  std::size_t outputs = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_NE(e.path().filename().string()[0], '.') << e.path() << " left beside the outputs";
    ++outputs;
    EXPECT_EQ(cpattn::read_npy(e.path().string()).shape, (std::vector<std::int64_t>{8})) << e.path();
  }
  EXPECT_EQ(outputs, 5u);
  fs::remove_all(dir);
}

// --segments and a segment_ids.npy that mark the same documents agree, whatever the file's labels; documents
// that differ are refused (the table's case above).
TEST(Hostile, SegmentsAgreeWithAFileThatMarksTheSameDocuments) {
  Fixtures fixtures;
  const fs::path dir = fixtures.root() / "segments";
  Outcome o = spawn({"run", "--cp", "2", "--load", dir.string(), "--segments", "40,24", "--check"},
                    fixtures.root() / "cwd", {});
  EXPECT_EQ(o.exit_code, 0) << o.err;
  o = spawn({"run", "--cp", "2", "--load", dir.string(), "--segments", "24,40"}, fixtures.root() / "cwd", {});
  EXPECT_EQ(o.exit_code, 2) << o.err;
  EXPECT_NE(o.err.find("disagrees with"), std::string::npos) << o.err;
}

// --json gives each refused value as it was typed: "0099999" stays that text (not the number 99999), bytes
// that are not UTF-8 become \xNN escapes (not a replacement character).
TEST(Hostile, JsonValuesAreAsTyped) {
  Fixtures fixtures;
  auto value_of = [&](const std::vector<std::string>& args) {
    const Outcome o = spawn(args, fixtures.root() / "cwd", {});
    EXPECT_EQ(o.exit_code, 2) << o.err;
    try {
      return nlohmann::json::parse(o.out)["errors"][0]["value"];
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what() << "\n" << o.out;
      return nlohmann::json();
    }
  };
  EXPECT_EQ(value_of({"run", "--cp", "2", "--threads", "0099999", "--json"}), "0099999");
  EXPECT_EQ(value_of({"validate", "--cp", "1\xff", "--json"}), "1\\xFF");
  EXPECT_EQ(value_of({"validate", "--seq", "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8",
                      "--cp", "-3", "--json"}),
            -3);
}

// ---- Resources that run out, files of runs that were killed or ran side by side. ----

// The outputs of one run, by name: each file's bytes.
std::map<std::string, std::string> outputs_in(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    out[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(f), {});
  }
  return out;
}

const std::vector<std::string> kRun = {"run", "--cp",       "2", "--q-heads", "4", "--kv-heads",
                                       "2",   "--head-dim", "8", "--seq",     "64"};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// A file size limit: the write fails (EFBIG, not SIGXFSZ), exit 1 as the machine's limit (not bad input),
// nothing left in the directory (made by the run, so removed), the error naming the file and the reason.
TEST(Hostile, AFileSizeLimitIsAResourceErrorThatLeavesNothing) {
  Fixtures fixtures;
  const fs::path dir = fixtures.root() / "fsize_out";
  for (const bool json : {false, true}) {
    const Outcome o = spawn(with(kRun, {"--save", dir.string(), json ? "--json" : "--check"}),
                            fixtures.root() / "cwd", {}, {{RLIMIT_FSIZE, 8192}});
    EXPECT_EQ(o.exit_code, 1) << o.err;
    EXPECT_NE(o.err.find("error (resource)"), std::string::npos) << o.err;
    EXPECT_NE(o.err.find("File too large"), std::string::npos) << o.err;
    EXPECT_FALSE(fs::exists(dir)) << "the run left " << dir;
    if (json) {
      EXPECT_NO_THROW(nlohmann::json::parse(o.out)) << o.out;
    }
  }
}

// Threads the process may not make (its address space too small for their stacks): an error naming the rank
// whose thread could not start, exit 1, never std::terminate (exit 134).
TEST(Hostile, AThreadThatCannotBeMadeIsAResourceError) {
  Fixtures fixtures;
  for (const char* strategy : {"all_gather", "ulysses", "ring"}) {
    const Outcome o = spawn({"run", "--cp", "16", "--strategy", strategy, "--q-heads", "16", "--kv-heads",
                             "16", "--head-dim", "8", "--seq", "256", "--threads", "1", "--json"},
                            fixtures.root() / "cwd", {}, {{RLIMIT_AS, 100'000'000}});
    EXPECT_EQ(o.exit_code, 1) << strategy << ": " << o.err;
    EXPECT_NE(o.err.find("could not start a thread for rank"), std::string::npos) << o.err;
    EXPECT_NO_THROW(nlohmann::json::parse(o.out)) << o.out;
  }
}

// Two runs saving into one directory at once: one writer at a time, so the directory holds one run's five
// outputs, never o and lse of one beside dq, dk, dv of the other; nothing else is left.
TEST(Hostile, RunsSavingIntoOneDirectoryLeaveOneWholeSet) {
  Fixtures fixtures;
  std::map<std::string, std::string> alone[2];
  for (int seed = 0; seed < 2; ++seed) {
    const fs::path d = fixtures.root() / ("alone" + std::to_string(seed));
    ASSERT_EQ(spawn(with(kRun, {"--seed", std::to_string(seed + 1), "--save", d.string()}),
                    fixtures.root() / "cwd", {})
                  .exit_code,
              0);
    alone[seed] = outputs_in(d);
  }
  ASSERT_NE(alone[0].at("o.npy"), alone[1].at("o.npy"));
  const fs::path shared = fixtures.root() / "shared_out";
  for (int round = 0; round < 4; ++round) {
    Outcome outcomes[2];
    std::thread side([&] {
      outcomes[1] =
          spawn(with(kRun, {"--seed", "2", "--save", shared.string()}), fixtures.root() / "cwd", {});
    });
    outcomes[0] = spawn(with(kRun, {"--seed", "1", "--save", shared.string()}), fixtures.root() / "cwd", {});
    side.join();
    EXPECT_EQ(outcomes[0].exit_code, 0) << outcomes[0].err;
    EXPECT_EQ(outcomes[1].exit_code, 0) << outcomes[1].err;
    const auto got = outputs_in(shared);
    EXPECT_TRUE(got == alone[0] || got == alone[1])
        << "round " << round << ": a mixed or partial set of " << got.size() << " files";
  }
}

// What a run killed while saving leaves: with its journal (killed among the renames), the next run puts the
// earlier outputs back before writing its own and says so; without one (killed while writing), its
// temporaries are removed. Either way the directory then holds the new run's outputs alone.
TEST(Hostile, TheNextRunCleansUpAfterARunKilledWhileSaving) {
  Fixtures fixtures;
  const fs::path dir = fixtures.root() / "killed_out";
  ASSERT_EQ(spawn(with(kRun, {"--save", dir.string()}), fixtures.root() / "cwd", {}).exit_code, 0);
  const auto earlier = outputs_in(dir);
  // Killed mid-rename (pid 999999): o.npy replaced (the earlier one kept aside), the rest not yet.
  fs::create_hard_link(dir / "o.npy", dir / ".o.npy.old.999999");
  write_text(dir / ".o.npy.tmp.999999", "new, of the killed run");
  fs::rename(dir / ".o.npy.tmp.999999", dir / "o.npy");
  write_text(dir / ".dq.npy.tmp.999999", "new, of the killed run");
  write_text(dir / ".cpattn.journal",
             "cpattn save journal 999999\no.npy\t.o.npy.tmp.999999\t.o.npy.old.999999\n"
             "dq.npy\t.dq.npy.tmp.999999\t-\n");
  // dq.npy is journalled as new ("-": it did not exist before that run), so putting back removes it; keep a
  // copy of the earlier one to compare with.
  const auto earlier_dq = earlier.at("dq.npy");
  // The next run's own writing fails (a file size limit): what is left is the put-back state alone, the
  // earlier outputs but dq.npy.
  Outcome o = spawn(with(kRun, {"--save", dir.string(), "--seed", "3"}), fixtures.root() / "cwd", {},
                    {{RLIMIT_FSIZE, 8192}});
  EXPECT_EQ(o.exit_code, 1) << o.err;
  EXPECT_NE(o.err.find("put back the outputs that a run killed while renaming its own (pid 999999)"),
            std::string::npos)
      << o.err;
  auto put_back = earlier;
  put_back.erase("dq.npy");
  EXPECT_EQ(outputs_in(dir), put_back) << "not the earlier outputs";
  // A journal cpattn did not write (a name outside the outputs) is refused and kept, nothing removed.
  write_text(dir / ".cpattn.journal", "cpattn save journal 5\nREADME\t.README.tmp.5\t-\n");
  write_text(dir / "README", "mine");
  o = spawn(with(kRun, {"--save", dir.string()}), fixtures.root() / "cwd", {});
  EXPECT_EQ(o.exit_code, 1) << o.err;
  EXPECT_NE(o.err.find("holds a line cpattn did not write"), std::string::npos) << o.err;
  EXPECT_TRUE(fs::exists(dir / "README"));
  fs::remove(dir / ".cpattn.journal");
  fs::remove(dir / "README");
  o = spawn(with(kRun, {"--save", dir.string(), "--seed", "3"}), fixtures.root() / "cwd", {});
  EXPECT_EQ(o.exit_code, 0) << o.err;
  auto now = outputs_in(dir);
  EXPECT_EQ(now.size(), 5u);
  EXPECT_NE(now.at("dq.npy"), earlier_dq);  // seed 3's
  for (const auto& [name, bytes] : now) EXPECT_NE(name[0], '.') << name << " left behind";
  // Killed while writing: temporaries only, no journal.
  write_text(dir / ".lse.npy.tmp.999998", "partial");
  write_text(dir / ".dv.npy.old.999998", "kept");
  o = spawn(with(kRun, {"--save", dir.string()}), fixtures.root() / "cwd", {});
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.err.find("removed 2 temporary or kept file(s)"), std::string::npos) << o.err;
  EXPECT_EQ(outputs_in(dir), earlier);  // seed 1 again: the same outputs as the first run's
}

TEST(Hostile, TheTableHasAtLeast120Cases) {
  EXPECT_GE(cases().size(), 120u);
  EXPECT_GE(hardening_cases().size(), 81u);
}
TEST(Hostile, Run) {
  run_cases({"run"});
}
TEST(Hostile, Validate) {
  run_cases({"validate", "no-such-command", ""});
}
TEST(Hostile, Plan) {
  run_cases({"plan"});
}
TEST(Hostile, Bench) {
  run_cases({"bench"});
}

}  // namespace
