// The program as a user runs it: exit codes, messages on stderr, and the JSON that scripts read.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "cpattn/documents.hpp"
#include "cpattn/npy.hpp"
#include "cpattn/planner.hpp"

namespace {

struct Result {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

Result run(const std::string& args) {
  const auto err_path =
      std::filesystem::temp_directory_path() / ("cpattn_cli_err_" + std::to_string(::getpid()));
  const std::string cmd = std::string(CPATTN_EXE) + " " + args + " 2>" + err_path.string();
  Result r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream err(err_path);
  r.err.assign(std::istreambuf_iterator<char>(err), {});
  std::filesystem::remove(err_path);
  return r;
}

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

// Each (arguments, phrase): exit 2 and the phrase on stderr.
template <std::size_t N>
void expect_bad_input(const std::pair<std::string, std::string> (&cases)[N]) {
  for (const auto& [args, phrase] : cases) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(phrase), std::string::npos) << args << "\nstderr: " << r.err;
  }
}

const char* kSeed = "--q-heads 32 --kv-heads 2 --head-dim 256 --seq 65536";

// The keyword form (cpattn/documents.hpp, the Python module's) takes exactly the program's flags of validate
// and plan, each integer one with the flag's range: read off --help, so a flag added to one and not the other
// fails here.
TEST(CliDocuments, KeywordsAreTheFlagsWithTheirRanges) {
  for (const std::string command : {"validate", "plan"}) {
    const Result help = run(command + " --help");
    ASSERT_EQ(help.exit_code, 0) << help.err;
    std::set<std::string> flags;
    std::vector<std::pair<std::string, std::int64_t>> ranged;  // keyword, the flag's largest value
    std::istringstream lines(help.out);
    for (std::string line; std::getline(lines, line);) {
      // "  --name ARG   description (lo..hi)": a flag's line; "(lo..hi)" where it has a range.
      const std::size_t at = line.find_first_not_of(' ');
      if (at == std::string::npos || at == 0 || line.compare(at, 2, "--") != 0) continue;
      std::string name =
          line.substr(at + 2, line.find_first_not_of("abcdefghijklmnopqrstuvwxyz-", at + 2) - at - 2);
      // The program's own outputs (--json, plan --svg FILE) are not keywords: Python gets the document.
      if (name == "json" || name == "svg" || name.rfind("no-", 0) == 0) continue;
      std::replace(name.begin(), name.end(), '-', '_');
      flags.insert(name);
      const std::size_t dots = line.rfind("..");
      if (!line.empty() && line.back() == ')' && dots != std::string::npos &&
          line.find_first_not_of("0123456789", dots + 2) == line.size() - 1) {
        ranged.emplace_back(name, std::stoll(line.substr(dots + 2, line.size() - 1 - dots - 2)));
      }
    }
    const std::vector<std::string> listed = cpattn::document_keywords(command);
    EXPECT_EQ(flags, std::set<std::string>(listed.begin(), listed.end())) << command;
    if (command == "plan") {
      EXPECT_EQ(ranged.size(), 7u)
          << "--emb-dim --layers --attention-every --local-window --global-every --block --ranks-per-host";
    }
    for (const auto& [name, max] : ranged) {
      EXPECT_NO_THROW(cpattn::keyword_answer(command, {{name, std::to_string(max)}}))
          << command << " " << name;
      try {
        cpattn::keyword_answer(command, {{name, std::to_string(max) + "0"}});
        ADD_FAILURE() << command << " " << name << " took a value past its range";
      } catch (const cpattn::Error& e) {
        EXPECT_EQ(e.items().front().fields.front(), name) << e.what();
      }
    }
  }
}

TEST(CliValidate, SeedUlyssesCp4PrintsThePlacement) {
  const Result r = run(std::string("validate --strategy ulysses --cp 4 ") + kSeed);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("replication: 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[kv0, kv0, kv1, kv1]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 -> q heads 8..15, kv head 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 3 -> q heads 24..31, kv head 1"), std::string::npos) << r.out;
}

TEST(CliValidate, SeedUlyssesCp8Json) {
  const Result r = run(std::string("validate --json --strategy ulysses --cp 8 ") + kSeed);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["valid"].get<bool>());
  EXPECT_EQ(j["replication"], 4);
  ASSERT_EQ(j["ranks"].size(), 8u);
  for (int rank = 0; rank < 8; ++rank) {
    const auto& entry = j["ranks"][rank];
    EXPECT_EQ(entry["rank"], rank);
    EXPECT_EQ(entry["q_heads"], (std::vector<int>{4 * rank, 4 * rank + 1, 4 * rank + 2, 4 * rank + 3}));
    EXPECT_EQ(entry["kv_heads"], (std::vector<int>{rank / 4}));
  }
}

// Any head counts: 24 q heads on 3 kv heads over 4 ranks share kv heads between ranks; 28 q heads over 8
// split 4,4,4,4,3,3,3,3.
TEST(CliValidate, UnevenHeadsGiveThePlacementTheReplicationAndTheSkew) {
  Result r =
      run("validate --json --strategy ulysses --cp 4 --q-heads 24 --kv-heads 3 --head-dim 64 --seq 1024");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kv_head_order"], (std::vector<int>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(j["replication"], 2);
  EXPECT_EQ(j["work_skew"].get<double>(), 1.0);
  EXPECT_EQ(j["ranks"][1]["q_heads"], (std::vector<int>{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(j["ranks"][1]["kv_heads"], (std::vector<int>{0, 1}));
  r = run("validate --json --strategy ulysses --cp 8 --q-heads 28 --kv-heads 4 --head-dim 128 --seq 1024");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_DOUBLE_EQ(j["work_skew"].get<double>(), 4.0 / 3.0);
  EXPECT_EQ(j["ranks"][4]["q_heads"], (std::vector<int>{16, 17, 18}));
  EXPECT_EQ(j["ranks"][4]["kv_heads"], (std::vector<int>{2}));
  EXPECT_EQ(j["ranks"][5]["kv_heads"], (std::vector<int>{2, 3}));
  r = run("validate --strategy ulysses --cp 8 --q-heads 28 --kv-heads 4 --head-dim 128 --seq 1024");
  EXPECT_NE(r.out.find("rank 5 -> q heads 19..21, kv heads 2,3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("work skew: 1.33"), std::string::npos) << r.out;
  r = run("validate --strategy ulysses --cp 8 --q-heads 4 --kv-heads 4 --head-dim 64 --seq 1024");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("hybrid"), std::string::npos) << r.err;
}

TEST(CliValidate, InvalidConfigListsEveryErrorAsJsonAndExits2) {
  const Result r =
      run("validate --json --strategy ulysses --cp 4 --q-heads 2 --kv-heads 3 --head-dim 64 --seq 1001");
  EXPECT_EQ(r.exit_code, 2);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["valid"].get<bool>());
  ASSERT_EQ(j["errors"].size(), 3u) << r.out;
  std::map<std::string, nlohmann::json> by_field;
  for (const auto& e : j["errors"]) by_field[e["field"].get<std::string>()] = e;
  EXPECT_EQ(by_field["seq_len"]["value"], 1001);
  EXPECT_EQ(by_field["num_q_heads"]["fields"], (std::vector<std::string>{"num_q_heads", "num_kv_heads"}))
      << r.out;
  EXPECT_EQ(by_field["cp"]["fields"], (std::vector<std::string>{"cp", "num_q_heads"}));
  EXPECT_NE(r.err.find("ulysses needs cp (4) <= num_q_heads (2)"), std::string::npos) << r.err;
}

TEST(CliValidate, ReadsSeedYamlAndFlagsWin) {
  const std::string model = write_temp("cpattn_model.yml",
                                       "base_num_query_heads: 32\nbase_num_kv_heads: 2\nhead_dim: 256\n"
                                       "base_emb_dim: 4096\nbase_num_decoder_layers: 60\n");
  const std::string run_cfg =
      write_temp("cpattn_run.yml",
                 "context_parallel_strategy: \"ulysses\"\nici_context_parallelism: 4\n"
                 "max_target_length: 65536\ncontext_parallel_load_balance: false\n");
  Result r = run("validate --json --config " + model + " --config " + run_cfg);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["replication"], 2);
  r = run("validate --json --config " + model + " --config " + run_cfg + " --cp 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["replication"], 4);
}

TEST(CliValidate, BadInputExits2WithAMessage) {
  const std::string bad_type = write_temp("cpattn_bad_type.yml", "ici_context_parallelism: four\n");
  const std::string not_yaml = write_temp("cpattn_not_yaml.yml", "a: [unclosed\n");
  const std::pair<std::string, std::string> cases[] = {
      {"validate --cp abc --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "--cp"},
      {"validate --no-such-flag", "no-such-flag"},
      {"validate --strategy rings --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8",
       "'rings' is not a strategy"},
      {"validate --config " + bad_type + " --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8",
       "ici_context_parallelism"},
      {"validate --config " + not_yaml, "not valid YAML"},
      {"validate --config /nonexistent.yml", "nonexistent.yml"},
      {"validate --q-heads 8", "seq_len is not set"},
      {"validate --dtype fp16 --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "fp16"},
      {"validate --window 1,2,3 --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "more than two sides"},
      {"validate --window x --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "--window 'x'"},
      {"validate --window -1 --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "window_left (-1)"},
      {"validate --window 4,4 --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8",
       "window_right (4) is for non-causal"},
      {"validate --window 4,2147483648 --no-causal --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8",
       "window_right (2147483648)"},
      {"validate --softcap 0 --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "softcap (0) is not a soft-cap"},
      {"validate --softcap fifty --q-heads 8 --kv-heads 8 --head-dim 8 --seq 8", "--softcap"},
      {"no-such-command", "no-such-command"},
      {"", "subcommand"},
  };
  expect_bad_input(cases);
}

// --window LEFT (causal) and LEFT,RIGHT (--no-causal), --softcap C: named in validate's text and JSON, and
// run
// --check on every strategy passes against the single-device kernel and the reference with the same options.
TEST(CliValidate, WindowsSoftCapsAndSinksAreNamedAndRunChecksThemOnEveryStrategy) {
  const Result text =
      run("validate --strategy ring --cp 4 --q-heads 8 --kv-heads 2 --head-dim 64 --seq 4096 "
          "--window 1023 --softcap 50");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("fp32, window 1023 back, softcap 50\n"), std::string::npos) << text.out;
  const Result json =
      run("validate --json --strategy ring --cp 4 --q-heads 8 --kv-heads 2 --head-dim 64 "
          "--seq 4096 --window 64,32 --no-causal");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["window"]["left"], 64);
  EXPECT_EQ(j["window"]["right"], 32);
  EXPECT_TRUE(j["softcap"].is_null());
  for (const std::string strategy :
       {"ulysses", "all_gather --load-balance", "ring --load-balance", "hybrid --ulysses-degree 2"}) {
    const Result r = run("run --json --strategy " + strategy +
                         " --cp 4 --q-heads 8 --kv-heads 2 --head-dim 32 --seq 512 --segments 400,112 "
                         "--window 50 --softcap 0.5 --check --threads 1");
    ASSERT_EQ(r.exit_code, 0) << strategy << r.err;
    const auto doc = nlohmann::json::parse(r.out);
    EXPECT_TRUE(doc["check"]["pass"].get<bool>()) << strategy;
    EXPECT_EQ(doc["problem"]["window"]["left"], 50) << strategy;
    EXPECT_EQ(doc["problem"]["window"]["right"], 0) << strategy;
    EXPECT_EQ(doc["problem"]["softcap"], 0.5) << strategy;
  }
  // --sinks FILE.npy: checked (dsinks too) on every strategy, dsinks.npy saved; a file of the wrong shape or
  // a NaN sink exits 2 naming --sinks; a run without --sinks refuses a directory holding an earlier
  // dsinks.npy.
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "cpattn_cli_sinks";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::vector<float> sinks = {0.5f, 4.0f, -3.0f, 1.0f, 0.0f, 2.5f, -1.0f, 6.0f};
  cpattn::write_npy((dir / "sinks.npy").string(), {8}, sinks.data());
  cpattn::write_npy((dir / "seven.npy").string(), {7}, sinks.data());
  std::vector<float> nan = sinks;
  nan[3] = std::nanf("");
  cpattn::write_npy((dir / "nan.npy").string(), {8}, nan.data());
  for (const std::string strategy : {"ulysses", "ring --load-balance", "hybrid --ulysses-degree 2"}) {
    const Result r =
        run("run --json --strategy " + strategy +
            " --cp 4 --q-heads 8 --kv-heads 2 --head-dim 32 --seq 256 --window 40 --check --threads 1 "
            "--sinks " +
            (dir / "sinks.npy").string() + " --save " + (dir / "out").string());
    ASSERT_EQ(r.exit_code, 0) << strategy << r.err;
    const auto doc = nlohmann::json::parse(r.out);
    EXPECT_TRUE(doc["check"]["pass"].get<bool>()) << strategy;
    EXPECT_TRUE(doc["problem"]["sinks"].get<bool>()) << strategy;
    EXPECT_LE(doc["check"]["reference"]["max_rel_diff"]["dsinks"].get<double>(), 2e-5) << strategy;
    EXPECT_EQ(cpattn::read_npy((dir / "out" / "dsinks.npy").string()).shape, (std::vector<std::int64_t>{8}));
  }
  const std::string base = "run --strategy ring --cp 2 --q-heads 8 --kv-heads 2 --head-dim 16 --seq 64 ";
  const std::pair<std::string, std::string> bad[] = {
      {base + "--sinks " + (dir / "seven.npy").string(), "expected float32 [8]"},
      {base + "--sinks " + (dir / "nan.npy").string(), "head 3's sink is NaN"},
      {base + "--save " + (dir / "out").string(), "dsinks.npy"},
  };
  expect_bad_input(bad);
  std::filesystem::remove_all(dir);
}

TEST(CliValidate, HelpExits0) {
  EXPECT_EQ(run("validate --help").exit_code, 0);
}

// Issue "reliability": every kind of bad input, each a row asserting exit 2, the error class printed and the
// field or file the message names. Sizes are refused before anything is allocated (these rows run in
// milliseconds), .npy files are damaged copies of a good one.
TEST(CliRun, BadInputTableNamesTheClassAndTheFieldOrFile) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("cpattn_cli_bad_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const fs::path good = CPATTN_TEST_DATA "/attention/gqa4_noncausal";
  std::ifstream q_in(good / "q.npy", std::ios::binary);
  const std::string q_bytes((std::istreambuf_iterator<char>(q_in)), {});
  ASSERT_GT(q_bytes.size(), 200u);
  // A copy of the good inputs with `file` replaced by `bytes`; returns the folder.
  auto inputs_with = [&](const std::string& name, const std::string& file, const std::string& bytes) {
    const fs::path d = dir / name;
    fs::create_directories(d);
    for (const char* f : {"q.npy", "k.npy", "v.npy", "do.npy"}) fs::copy_file(good / f, d / f);
    std::ofstream(d / file, std::ios::binary | std::ios::trunc) << bytes;
    return d.string();
  };
  auto replaced = [&](std::string text, const std::string& from, const std::string& to) {
    const auto at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) text.replace(at, from.size(), to);
    return text;
  };
  std::ifstream lse_in(good / "lse.npy", std::ios::binary), k_in(good / "k.npy", std::ios::binary);
  const std::string lse_bytes((std::istreambuf_iterator<char>(lse_in)), {});
  const std::string k_bytes((std::istreambuf_iterator<char>(k_in)), {});
  const std::string run_load = "run --strategy all_gather --cp 2 --threads 1 --load ";
  const std::string deep =
      write_temp("cpattn_deep.yaml", "num_query_heads: " + std::string(5000, '[') + "\n");
  const std::string typed = write_temp("cpattn_typed.yaml", "max_target_length: [1, 2]\n");
  const std::string sizes = " --q-heads 8 --kv-heads 2 --head-dim 8";
  struct Row {
    std::string args, error_class, names;
  };
  const Row rows[] = {
      {"run --cp 4 --seq 0" + sizes, "invalid_config", "seq_len (0)"},
      {"run --cp 4 --seq 64 --q-heads 8 --kv-heads 2 --head-dim -8", "invalid_config", "head_dim (-8)"},
      {"run --cp 4 --seq 64 --batch 0" + sizes, "invalid_config", "batch (0)"},
      {"run --cp 1 --batch 1048576 --seq 1073741824 --q-heads 1024 --kv-heads 1024 --head-dim 512",
       "invalid_config", "overflows"},
      {"run --cp 4 --batch 64 --seq 1073741824 --q-heads 8 --kv-heads 2 --head-dim 512", "invalid_input",
       "GiB of memory"},
      {"run --cp 4 --batch 99999999999999 --seq 64" + sizes, "invalid_input", "batch*seq_len*heads*head_dim"},
      {"run --cp 4 --seq 64 --q-heads 6 --kv-heads 4 --head-dim 8", "invalid_config", "num_kv_heads (4)"},
      {"run --cp 4 --seq 66" + sizes, "invalid_config", "seq_len (66) must be divisible by cp (4)"},
      {"run --strategy ulysses --cp 4 --seq 64 --q-heads 12 --kv-heads 5 --head-dim 8", "invalid_config",
       "num_kv_heads (5)"},
      {"run --strategy ulysses --cp 8 --seq 64 --q-heads 6 --kv-heads 3 --head-dim 8", "invalid_config",
       "cp (8) <= num_q_heads (6)"},
      {"validate --tp 3 --cp 2 --seq 64" + sizes, "invalid_config", "tp (3)"},
      {"run --strategy ulysses --load-balance --cp 4 --seq 64" + sizes, "invalid_config", "load_balance"},
      {"run --strategy rings --cp 4 --seq 64" + sizes, "invalid_config", "'rings' is not a strategy"},
      {"run --cp 4 --seq 64 --no-such-flag" + sizes, "", "no-such-flag"},
      {"run --cp 2 --q-heads 4 --load " + inputs_with("flag", "q.npy", q_bytes), "invalid_input",
       "--q-heads (4) disagrees"},
      {run_load + inputs_with("truncated", "q.npy", q_bytes.substr(0, q_bytes.size() - 100)), "invalid_input",
       "q.npy"},
      {run_load + inputs_with("int_dtype", "q.npy", replaced(q_bytes, "<f4", "<i4")), "invalid_input",
       "q.npy"},
      {run_load + inputs_with("big_endian", "q.npy", replaced(q_bytes, "<f4", ">f4")), "invalid_input",
       "q.npy"},
      {run_load + inputs_with("fortran", "q.npy", replaced(q_bytes, "False,", "True, ")), "invalid_input",
       "q.npy"},
      {run_load + inputs_with("three_axes", "q.npy", lse_bytes), "invalid_input", "q.npy"},
      {run_load + inputs_with("garbage", "q.npy", "this is not a .npy file"), "invalid_input", "q.npy"},
      {run_load + inputs_with("do_shape", "do.npy", k_bytes), "invalid_input", "do.npy"},
      {run_load + inputs_with("kv_shape", "k.npy", q_bytes), "invalid_input", "k.npy"},
      {run_load + inputs_with("segments_dtype", "segment_ids.npy", q_bytes), "invalid_input",
       "segment_ids.npy"},
      {"validate --config " + deep + " --cp 2 --seq 64" + sizes, "invalid_input", "cpattn_deep.yaml"},
      {"validate --config " + typed + " --cp 2 --seq 64" + sizes, "invalid_input", "max_target_length"},
  };
  for (const Row& row : rows) {
    const Result r = run(row.args);
    EXPECT_EQ(r.exit_code, 2) << row.args << "\n" << r.err;
    if (!row.error_class.empty()) {
      EXPECT_NE(r.err.find("error (" + row.error_class + ")"), std::string::npos) << row.args << "\n"
                                                                                  << r.err;
    }
    EXPECT_NE(r.err.find(row.names), std::string::npos) << row.args << "\nstderr: " << r.err;
  }
  fs::remove_all(dir);
}

}  // namespace

namespace {

TEST(CliRun, UlyssesCheckPassesAndPrintsTheJsonScriptsRead) {
  const Result r =
      run("run --json --strategy ulysses --cp 4 --q-heads 8 --kv-heads 2 --head-dim 32 --seq 256 "
          "--segments 200,56 --check --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const auto& sd = j["check"]["single_device"];
  for (const char* k : {"o", "lse"}) EXPECT_EQ(sd["max_abs_diff"][k].get<double>(), 0.0) << k;
  for (const char* k : {"dq", "dk", "dv"}) EXPECT_LE(sd["max_rel_diff"][k].get<double>(), 1e-6) << k;
  for (const char* k : {"o", "dq", "dk", "dv"})
    EXPECT_LE(j["check"]["reference"]["max_rel_diff"][k].get<double>(), 1e-5);
  EXPECT_TRUE(j["check"]["pass"].get<bool>());
  EXPECT_EQ(j["tiles_per_rank"].size(), 4u);
  EXPECT_GT(j["seconds"]["forward"].get<double>(), 0.0);
  bool saw_forward_a2a = false;
  for (const auto& c : j["collectives"]) {
    if (c["kind"] == "all_to_all" && c["phase"] == "forward") {
      saw_forward_a2a = true;
      EXPECT_EQ(c["count"], 5);
    }
  }
  EXPECT_TRUE(saw_forward_a2a);
}

// --trace FILE: every rank's kernel calls, collectives and waits as Chrome trace events, which a JSON parser
// reads: per rank the layer's forward and backward enclose their kernel calls; the collectives are the ones
// the report counted; --repeat runs the layer again (twice the events, the best iteration's seconds).
TEST(CliRun, TraceHoldsEveryRanksKernelCallsCollectivesAndWaits) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("cpattn_trace_" + std::to_string(::getpid()) + ".json"))
          .string();
  const Result r =
      run("run --json --strategy ring --load-balance --cp 2 --q-heads 2 --kv-heads 2 --head-dim 32 "
          "--seq 512 --threads 1 --repeat 2 --trace " +
          path);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto report = nlohmann::json::parse(r.out);
  EXPECT_EQ(report["problem"]["repeat"], 2);
  std::ifstream in(path);
  const auto trace = nlohmann::json::parse(in);
  std::filesystem::remove(path);
  std::map<int, std::map<std::string, int>> count;  // rank -> category -> events
  std::map<int, std::vector<std::pair<double, double>>> layers, kernels;
  std::set<std::string> names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M") {
      EXPECT_TRUE((e["args"].contains("name") && e["args"]["name"].is_string()) ||
                  e["args"].contains("sort_index"));
      continue;
    }
    ASSERT_EQ(e["ph"], "X");
    const int rank = e["pid"].get<int>();
    count[rank][e["cat"].get<std::string>()]++;
    names.insert(e["name"].get<std::string>());
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    if (e["cat"] == "layer") layers[rank].push_back({e["ts"].get<double>(), e["dur"].get<double>()});
    if (e["cat"] == "kernel") {
      EXPECT_EQ(e["args"]["head_dim"], 32);
      EXPECT_EQ(e["args"]["dtype"], "fp32");
      kernels[rank].push_back({e["ts"].get<double>(), e["dur"].get<double>()});
    }
  }
  // Every kernel call lies inside one of its rank's layer events (microseconds, printed to 0.001).
  for (const auto& [rank, calls] : kernels) {
    for (const auto& [ts, dur] : calls) {
      const bool inside = std::any_of(layers[rank].begin(), layers[rank].end(), [&](const auto& l) {
        return ts >= l.first - 0.002 && ts + dur <= l.first + l.second + 0.002;
      });
      EXPECT_TRUE(inside) << "rank " << rank << " kernel at " << ts;
    }
  }
  ASSERT_EQ(count.size(), 2u);
  std::int64_t collective_calls = 0;
  for (const auto& c : report["collectives"]) collective_calls += c["count"].get<std::int64_t>();
  for (int rank : {0, 1}) {
    EXPECT_EQ(count[rank]["layer"], 4) << rank;  // forward and backward, twice
    // Each iteration: 2 forward steps and 2 backward steps, each chunk pair a call (some skipped by the
    // mask).
    EXPECT_GE(count[rank]["kernel"], 8) << rank;
    EXPECT_EQ(count[rank]["collective"], 2 * collective_calls) << rank;
    EXPECT_GE(count[rank]["wait"], 2) << rank;
  }
  EXPECT_TRUE(names.count("flash_forward") && names.count("flash_backward"));
  EXPECT_TRUE(names.count("collective_permute kv (forward) start"));
  EXPECT_TRUE(names.count("shift wait"));
  EXPECT_TRUE(names.count("attention forward") && names.count("attention backward"));
  // An unwritable file is named before the run (exit 2), and nothing is printed or left behind.
  const Result bad =
      run("run --strategy ulysses --cp 2 --q-heads 2 --kv-heads 2 --head-dim 32 --seq 256 "
          "--threads 1 --trace /nonexistent-dir/t.json");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--trace '/nonexistent-dir/t.json' cannot be written"), std::string::npos)
      << bad.err;
  EXPECT_EQ(bad.out, "");
}

// bench calibrate writes a profile that plan reads: rates for the measured shapes, this machine's cores.
TEST(CliBench, CalibrateWritesAProfilePlanReads) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("cpattn_profile_" + std::to_string(::getpid()) + ".yaml"))
          .string();
  const Result r = run("bench calibrate --quick --name here --output " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("latency"), std::string::npos) << r.out;
  const cpattn::HardwareProfile p = cpattn::read_hardware_profile(path);
  EXPECT_EQ(p.name, "here");
  EXPECT_EQ(p.block, 64);
  EXPECT_GE(p.cores, 1);
  EXPECT_GT(p.bandwidth, 0);
  EXPECT_GE(p.latency, 0);
  ASSERT_EQ(p.kernel.size(), 7u);  // 256 and 1024 squared, non-causal; causal where q <= kv
  for (const auto& k : p.kernel) {
    EXPECT_EQ(k.head_dim, 64);
    EXPECT_GT(k.forward, 0);
    EXPECT_GT(k.backward, 0);
  }
  const Result plan = run("plan --json --profile " + path +
                          " --q-heads 4 --kv-heads 4 --head-dim 64 --seq 4096 "
                          "--cp 2 --dtype fp32");
  std::filesystem::remove(path);
  ASSERT_EQ(plan.exit_code, 0) << plan.out;
  const auto j = nlohmann::json::parse(plan.out);
  EXPECT_EQ(j["problem"]["block"], 64);  // the profile's tile size
  EXPECT_EQ(j["hardware"]["name"], "here");
  expect_bad_input({{"bench calibrate --quick --name 'Bad Name'", "not a profile name"},
                    {"bench calibrate --quick --kernel-from /nonexistent.yaml", "nonexistent.yaml"}});
}

TEST(CliBench, CommJsonHasEveryCollectiveWithItsKeys) {
  const Result r = run("bench comm --json --ranks 2,3 --min-bytes 65536 --max-bytes 262144");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["memcpy_gbps"].get<double>(), 0.0);
  // 2 group sizes x 5 collectives x 2 sizes (64 KiB, 256 KiB).
  ASSERT_EQ(j["results"].size(), 20u);
  for (const auto& row : j["results"]) {
    EXPECT_EQ(row["backend"], "inproc");
    for (const char* k :
         {"seconds", "algbw_gbps", "busbw_gbps", "fraction_of_memcpy", "written_fraction_of_memcpy"})
      EXPECT_GT(row[k].get<double>(), 0.0) << k << " " << row.dump();
    const double n = row["ranks"].get<double>();
    EXPECT_NEAR(row["busbw_gbps"].get<double>(), row["algbw_gbps"].get<double>() * (n - 1) / n, 1e-9);
  }
  EXPECT_EQ(j["results"][2]["collective"], "all_to_all_strided");
  EXPECT_EQ(j["results"][4]["collective"], "all_to_all_v");
}

// bf16: the path is the best this CPU has unless --bf16-path forces one; the fp32 baseline of the same run
// and the fractions of the bf16 peak are reported; a path that is not one, or that the CPU lacks, is exit 2.
TEST(CliBench, KernelBf16PathIsForcedAndComparedWithFp32) {
  const std::string base =
      "bench kernel --json --dtype bf16 --seq 64 --q-heads 2 --kv-heads 1 --head-dim 32 --min-seconds 0 ";
  Result r = run(base + "--bf16-path vector");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["forward_path"], "vector");
  for (const char* k : {"fp32_forward_seconds", "fp32_backward_seconds", "forward_speedup_over_fp32",
                        "backward_speedup_over_fp32"}) {
    EXPECT_GT(j[k].get<double>(), 0.0) << k;
  }
  EXPECT_TRUE(j.contains("forward_fraction_of_bf16_peak"));
  r = run(base);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string best = nlohmann::json::parse(r.out)["forward_path"];
  EXPECT_TRUE(best == "amx" || best == "avx512_bf16" || best == "vector") << best;
  r = run(base + "--bf16-path " + best);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["forward_path"], best);
  r = run(base + "--bf16-path tpu");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--bf16-path 'tpu' is not a path this CPU can run (available: "), std::string::npos)
      << r.err;
  r = run(base + "--bf16-path amx --no-amx");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--bf16-path"), std::string::npos) << r.err;
}

TEST(CliBench, KernelJsonNamesItsPathAndTarget) {
  const Result r = run("bench kernel --json --seq 64 --q-heads 2 --kv-heads 1 --head-dim 32 --min-seconds 0");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* k :
       {"fma_peak_gflops", "tile_peak_gflops", "forward_gflops", "backward_gflops",
        "forward_fraction_of_peak", "backward_fraction_of_peak", "forward_fraction_of_tile_peak",
        "backward_fraction_of_tile_peak", "reference_seconds"}) {
    EXPECT_GT(j[k].get<double>(), 0.0) << k;
  }
  EXPECT_EQ(j["forward_path"], "vector");
  EXPECT_FALSE(j["vector_target"].get<std::string>().empty());
  // The drift of each baseline is its readings' change over their mean, and "steady" says both stayed within
  // 5 %.
  bool steady = true;
  for (const char* name : {"fma_peak", "tile_peak"}) {
    const auto& readings = j[std::string(name) + "_before_after_gflops"];
    const double before = readings[0].get<double>(), after = readings[1].get<double>();
    const double drift = j[std::string(name) + "_drift"].get<double>();
    EXPECT_NEAR(drift, (after - before) / ((before + after) / 2), 1e-12) << name;
    steady = steady && std::abs(drift) <= 0.05;
  }
  EXPECT_EQ(j["steady"].get<bool>(), steady);
  const Result bad = run("bench kernel --seq 64 --q-heads 2 --kv-heads 1 --head-dim 32 --simd-target AVX9");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("SIMD target 'AVX9' is not compiled in"), std::string::npos) << bad.err;
}

TEST(CliRun, SavesOutputsAndLoadsInputsWhoseShapesWin) {
  const auto dir = std::filesystem::temp_directory_path() / "cpattn_cli_run";
  std::filesystem::remove_all(dir);
  const std::string base = "run --strategy all_gather --load-balance --cp 2 --no-causal --threads 1 ";
  Result r = run(base + "--q-heads 4 --kv-heads 1 --head-dim 16 --seq 64 --save " + (dir / "a").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* f : {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"}) {
    EXPECT_TRUE(std::filesystem::exists(dir / "a" / f)) << f;
  }
  // Inputs from files: shapes come from them; a flag that disagrees is refused.
  std::filesystem::create_directories(dir / "in");
  std::filesystem::copy_file(CPATTN_TEST_DATA "/attention/gqa4_noncausal/q.npy", dir / "in" / "q.npy");
  std::filesystem::copy_file(CPATTN_TEST_DATA "/attention/gqa4_noncausal/k.npy", dir / "in" / "k.npy");
  std::filesystem::copy_file(CPATTN_TEST_DATA "/attention/gqa4_noncausal/v.npy", dir / "in" / "v.npy");
  std::filesystem::copy_file(CPATTN_TEST_DATA "/attention/gqa4_noncausal/do.npy", dir / "in" / "do.npy");
  r = run("run --json --strategy ulysses --cp 2 --no-causal --check --threads 1 --load " +
          (dir / "in").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["problem"]["q_heads"], 8);
  r = run("run --strategy ulysses --cp 2 --q-heads 4 --load " + (dir / "in").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--q-heads (4) disagrees"), std::string::npos) << r.err;
  std::filesystem::remove_all(dir);
}

// Uneven heads (14 q heads on 2 kv heads over 3 ranks: 5, 5, 4, kv 0 on ranks 0 and 1) pass the check, and
// the saved O and LSE, whole tensors in natural token order, are the same bytes as all_gather's.
TEST(CliRun, UlyssesAtUnevenHeadsChecksAndSavesWhatAllGatherSaves) {
  const auto dir = std::filesystem::temp_directory_path() / "cpattn_cli_uneven";
  std::filesystem::remove_all(dir);
  const std::string shape =
      "--cp 3 --q-heads 14 --kv-heads 2 --head-dim 32 --seq 192 --segments 150,42 --threads 1";
  Result r = run("run --json --strategy ulysses --check --save " + (dir / "u").string() + " " + shape);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["check"]["pass"].get<bool>());
  for (const char* k : {"o", "lse"}) {
    EXPECT_EQ(j["check"]["single_device"]["max_abs_diff"][k].get<double>(), 0.0) << k;
  }
  r = run("run --strategy all_gather --save " + (dir / "a").string() + " " + shape);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run("run --strategy ulysses --forward-only --check " + shape);
  EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("check: PASS"), std::string::npos) << r.out;
  auto bytes = [](const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  for (const char* f : {"o.npy", "lse.npy"}) {
    EXPECT_FALSE(bytes(dir / "u" / f).empty()) << f;
    EXPECT_EQ(bytes(dir / "u" / f), bytes(dir / "a" / f)) << f;
  }
  std::filesystem::remove_all(dir);
}

// ring: the check within its bounds (stated in check.tolerances), O's relative error reported for every
// strategy; collective_permute and the segment ids' all_gather only; --remat refused with exit 2.
TEST(CliRun, RingChecksWithinItsBoundsAndRefusesRemat) {
  const std::string shape =
      " --cp 3 --q-heads 8 --kv-heads 2 --head-dim 32 --seq 192 --segments 150,37,5 --threads 1";
  Result r = run("run --json --check --strategy ring --load-balance" + shape);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["check"]["pass"].get<bool>());
  EXPECT_EQ(j["check"]["tolerances"]["forward"], "within bounds");
  EXPECT_EQ(j["check"]["tolerances"]["o_rel_vs_single_device"].get<double>(), 5e-6);
  EXPECT_EQ(j["check"]["tolerances"]["lse_abs_vs_single_device"].get<double>(), 1e-5);
  EXPECT_LE(j["check"]["single_device"]["max_rel_diff"]["o"].get<double>(), 5e-6);
  for (const auto& c : j["collectives"]) {
    EXPECT_TRUE(c["kind"] == "collective_permute" || c["kind"] == "all_gather") << c.dump();
  }
  r = run("run --json --check --strategy ulysses" + shape);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["check"]["single_device"]["max_rel_diff"]["o"].get<double>(), 0.0);
  EXPECT_EQ(j["check"]["tolerances"]["forward"], "bit-identical");
  r = run("run --strategy ring --remat" + shape);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("remat means nothing for ring"), std::string::npos) << r.err;
}

// hybrid: --ulysses-degree or its YAML key; the check within the ring's bounds; each collective with its
// group; the degrees in the problem block; whole tensors saved in natural order equal the ring's within its
// bounds; cp > q heads (8 x 2 over 4 q heads) runs; U that does not divide cp exits 2 naming it.
TEST(CliRun, HybridChecksAndReportsEachGroup) {
  const auto dir = std::filesystem::temp_directory_path() / "cpattn_cli_hybrid";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream yaml(dir / "hybrid.yml");
    yaml << "context_parallel_strategy: hybrid\ncontext_parallel_ulysses_degree: 2\n";
  }
  const std::string shape =
      " --cp 4 --q-heads 6 --kv-heads 2 --head-dim 16 --seq 192 --segments 150,42 --threads 1 --load-balance";
  Result r = run("run --json --check --config " + (dir / "hybrid.yml").string() + shape + " --save " +
                 (dir / "hybrid").string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["check"]["pass"].get<bool>());
  EXPECT_EQ(j["check"]["tolerances"]["forward"], "within bounds");
  EXPECT_EQ(j["problem"]["strategy"], "hybrid");
  EXPECT_EQ(j["problem"]["ulysses_degree"], 2);
  EXPECT_EQ(j["problem"]["ring_degree"], 2);
  // The packed row's segment ids move first over all four ranks (no group), the rest in the groups.
  std::set<std::string> groups;
  for (const auto& c : j["collectives"]) {
    groups.insert(c.value("group", ""));
    if (c["kind"] == "collective_permute" || c["kind"] == "all_to_all") {
      EXPECT_EQ(c["group"], c["kind"] == "all_to_all" ? "ulysses" : "ring") << c.dump();
    } else {
      EXPECT_EQ(c.value("group", ""), "") << c.dump();
    }
  }
  EXPECT_EQ(groups, (std::set<std::string>{"", "ulysses", "ring"}));
  r = run("run --strategy ring" + shape + " --save " + (dir / "ring").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* f : {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"}) {
    const std::vector<double> h = cpattn::read_npy((dir / "hybrid" / f).string()).as_doubles(),
                              g = cpattn::read_npy((dir / "ring" / f).string()).as_doubles();
    ASSERT_EQ(h.size(), g.size()) << f;
    double max_ref = 0, max_diff = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      max_ref = std::max(max_ref, std::abs(g[i]));
      max_diff = std::max(max_diff, std::abs(h[i] - g[i]));
    }
    EXPECT_LE(max_diff, 2e-5 * max_ref) << f;
  }
  r = run(
      "run --json --check --strategy hybrid --ulysses-degree 4 --cp 8 --q-heads 4 --kv-heads 1 --head-dim 16 "
      "--seq 128 --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(nlohmann::json::parse(r.out)["check"]["pass"].get<bool>());
  r = run("run --strategy hybrid --ulysses-degree 3" + shape);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("hybrid needs ulysses_degree (3) to be a divisor of cp (4)"), std::string::npos)
      << r.err;
  std::filesystem::remove_all(dir);
}

// ring --load / --save: whole tensors in natural token order whatever the layout, against the float64
// reference stored with the inputs (within 2e-5 of max |reference|, the ring's bound against the reference).
TEST(CliRun, RingLoadsAndSavesWholeTensorsInNaturalOrder) {
  const auto dir = std::filesystem::temp_directory_path() / "cpattn_cli_ring_io";
  std::filesystem::remove_all(dir);
  const std::pair<const char*, const char*> cases[] = {
      {"gqa16_causal", "--causal --load-balance --cp 4"},  // zigzag layout, one document, MQA
      {"gqa4_noncausal", "--no-causal --cp 3"},            // contiguous shards, batch 2, odd cp
  };
  for (const auto& [name, flags] : cases) {
    const std::filesystem::path in = std::filesystem::path(CPATTN_TEST_DATA) / "attention" / name,
                                out = dir / name;
    const Result r = run(std::string("run --strategy ring --threads 1 ") + flags + " --load " + in.string() +
                         " --save " + out.string());
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.err;
    for (const char* f : {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"}) {
      const cpattn::NpyArray got = cpattn::read_npy((out / f).string()),
                             want = cpattn::read_npy((in / f).string());
      ASSERT_EQ(got.shape, want.shape) << name << " " << f;
      const std::vector<double> g = got.as_doubles(), w = want.as_doubles();
      double max_ref = 0, max_diff = 0;
      for (std::size_t i = 0; i < w.size(); ++i) {
        max_ref = std::max(max_ref, std::abs(w[i]));
        max_diff = std::max(max_diff, std::abs(g[i] - w[i]));
      }
      EXPECT_LE(max_diff, 2e-5 * max_ref) << name << " " << f;
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(CliRun, BadInputExits2) {
  const std::pair<std::string, std::string> cases[] = {
      {"run --cp 4 --q-heads 8 --kv-heads 2 --head-dim 8 --seq 64 --segments 10,20", "--segments"},
      {"run --cp 4 --q-heads 8 --kv-heads 2 --head-dim 8 --seq 64 --segments 32,x", "not a positive"},
      {"run --cp 4 --q-heads 8 --kv-heads 2 --head-dim 8 --seq 64 --backend nccl", "--backend"},
      {"run --strategy ulysses --cp 8 --q-heads 6 --kv-heads 2 --head-dim 8 --seq 64", "num_q_heads"},
      {"run --cp 2 --q-heads 2 --kv-heads 2 --head-dim 8 --seq 64 --comm-timeout 0", "--comm-timeout '0'"},
      {"run --cp 2 --q-heads 2 --kv-heads 2 --head-dim 8 --seq 64 --comm-timeout -3", "--comm-timeout '-3'"},
      {"run --cp 2 --load /nonexistent/dir", "/nonexistent/dir/q.npy"},
  };
  expect_bad_input(cases);
}

}  // namespace

namespace {

TEST(CliPlan, SeedPresetJsonHasEveryStrategy) {
  const Result r =
      run("plan --json --preset qwen3.5-397b-a17b --seq 65536 --dtype bf16 --cp 4 --segments 61440,4096");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  // all_gather, ring and hybrid 2 x 2 in the four layouts (the packed row: per_document and solver too), and
  // ulysses
  ASSERT_EQ(j["strategies"].size(), 13u);
  EXPECT_EQ(j["strategies"][9]["name"], "hybrid_u2_r2");
  EXPECT_EQ(j["strategies"][9]["ulysses_degree"], 2);
  EXPECT_EQ(j["strategies"][9]["ring_degree"], 2);
  EXPECT_EQ(j["strategies"][12]["name"], "hybrid_u2_r2_solver");
  EXPECT_EQ(j["strategies"][12]["layout"], "solver");
  // The seed's packed rows: the ring on the per-document layout, balanced with its hops hidden behind its
  // steps, just ahead of ulysses (docs/planner.md, "Layouts on packed rows"), as the recommendation says.
  EXPECT_EQ(j["recommended"], (nlohmann::json{{"name", "ring_per_document"},
                                              {"strategy", "ring"},
                                              {"load_balance", false},
                                              {"layout", "per_document"},
                                              {"ulysses_degree", 1},
                                              {"ring_degree", 4}}));
  for (const auto& s : j["strategies"]) {
    EXPECT_TRUE(s["possible"].get<bool>());
    for (const char* key :
         {"collectives", "tiles_per_rank_per_q_head", "memory_bytes_per_rank", "estimated_seconds"}) {
      EXPECT_TRUE(s.contains(key)) << s["name"] << " " << key;
    }
  }
  // The all_gathers: the packed segment ids (S int32) whole, then each rank the key blocks of its documents
  // its queries reach (all_to_all_v), K and V: 64 MiB each (the seed's figure) for the rank that reaches them
  // all (an all_to_all_v's bytes: its largest operand).
  for (const auto& s : j["strategies"]) {
    if (!s["name"].get<std::string>().starts_with("all_gather")) continue;
    EXPECT_EQ(s["collectives"][0]["kind"], "all_gather") << s["name"];
    EXPECT_EQ(s["collectives"][0]["bytes"], 65536 * 4) << s["name"];
    EXPECT_EQ(s["collectives"][1]["kind"], "all_to_all") << s["name"];
    EXPECT_EQ(s["collectives"][1]["bytes"], 2 * 64 * (1 << 20)) << s["name"];
  }
  EXPECT_TRUE(j["recommendation"].is_string());
}

// The presets whose head counts cp does not divide: ulysses is possible, its skew the heads' (most over
// fewest), and its largest q-head operand is what the extra head costs.
TEST(CliPlan, UnevenHeadPresetsPlanUlyssesWithItsSkew) {
  const struct {
    const char* preset;
    int cp, q_heads, kv_heads, layers;
    double skew;
  } cases[] = {{"qwen2.5-7b", 8, 28, 4, 28, 4.0 / 3.0},
               {"qwen2.5-32b", 16, 40, 8, 64, 3.0 / 2.0},
               {"phi-3-medium", 4, 40, 10, 40, 1.0},
               {"phi-3-medium", 16, 40, 10, 40, 3.0 / 2.0},
               {"llama3-8b", 16, 32, 8, 32, 1.0}};
  for (const auto& c : cases) {
    const Result r = run(std::string("plan --json --preset ") + c.preset + " --seq 65536 --dtype bf16 --cp " +
                         std::to_string(c.cp));
    ASSERT_EQ(r.exit_code, 0) << c.preset << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["problem"]["q_heads"], c.q_heads) << c.preset;
    EXPECT_EQ(j["problem"]["kv_heads"], c.kv_heads) << c.preset;
    EXPECT_EQ(j["problem"]["layers"], c.layers) << c.preset;
    EXPECT_EQ(j["problem"]["head_dim"], 128) << c.preset;
    const auto& u = j["strategies"][2];
    ASSERT_EQ(u["name"], "ulysses");
    EXPECT_TRUE(u["possible"].get<bool>()) << c.preset << " cp " << c.cp;
    EXPECT_DOUBLE_EQ(u["tiles_skew"].get<double>(), c.skew) << c.preset << " cp " << c.cp;
  }
}

// A profile file in place of a named one: its figures and source in the document; the same figures as a
// named profile's give the same estimates. A prefill plan says so and has the forward's calls alone.
TEST(CliPlan, AProfileFileAndAPrefillAreWhatTheDocumentSays) {
  const std::string path =
      ::testing::TempDir() + "/cpattn_cli_profile_" + std::to_string(::getpid()) + ".yaml";
  {
    std::ofstream f(path);
    f << "name: mine\nflops: 989e12\nbandwidth: 450e9\nranks_per_host: 8\ninter_bandwidth: 50e9\n"
         "source: the h200 figures, copied\n";
  }
  const std::string problem = "plan --json --preset qwen3.5-397b-a17b --seq 65536 --dtype bf16 --cp 8";
  const Result named = run(problem), file = run(problem + " --profile " + path);
  std::remove(path.c_str());
  ASSERT_EQ(named.exit_code, 0) << named.err;
  ASSERT_EQ(file.exit_code, 0) << file.err;
  const auto a = nlohmann::json::parse(named.out), b = nlohmann::json::parse(file.out);
  EXPECT_EQ(b["hardware"]["name"], "mine");
  EXPECT_EQ(b["hardware"]["source"], "the h200 figures, copied");
  EXPECT_EQ(a["recommended"], b["recommended"]);
  for (std::size_t i = 0; i < a["strategies"].size(); ++i) {
    EXPECT_EQ(a["strategies"][i]["estimated_seconds"], b["strategies"][i]["estimated_seconds"]);
  }
  const Result prefill = run(problem + " --forward-only");
  ASSERT_EQ(prefill.exit_code, 0) << prefill.err;
  const auto p = nlohmann::json::parse(prefill.out);
  EXPECT_EQ(p["problem"]["forward_only"], true);
  EXPECT_EQ(a["problem"]["forward_only"], false);
  for (const auto& s : p["strategies"]) {
    for (const auto& c : s["collectives"]) EXPECT_EQ(c["phase"], "forward") << s["name"];
  }
  ASSERT_EQ(p["strategies"].size(), a["strategies"].size());
  for (std::size_t i = 0; i < a["strategies"].size(); ++i) {
    EXPECT_LT(p["strategies"][i]["estimated_seconds"]["layer"].get<double>(),
              a["strategies"][i]["estimated_seconds"]["layer"].get<double>())
        << a["strategies"][i]["name"];
  }
}

TEST(CliPlan, BadInputExits2) {
  const std::pair<std::string, std::string> cases[] = {
      {"plan --preset gpt5 --seq 1024", "--preset 'gpt5'"},
      {"plan --preset llama3-70b --seq 1001 --cp 4", "seq_len (1001) must be divisible by cp (4)"},
      {"plan --preset llama3-70b --seq 1024 --hardware tpu-v1", "--hardware 'tpu-v1'"},
      {"plan --preset llama3-70b --seq 1024 --segments 1000,20", "segments"},
      {"plan --preset llama3-70b --seq 1024 --segments 1000,24 --layout solver", "plan plans every layout"},
  };
  expect_bad_input(cases);
}

}  // namespace

namespace {

// What `cpattn plan` predicts for an attention layer is what `cpattn run` counted.
// And the memory each rank keeps for its backward equals what the forwards kept.
TEST(CliPlan, PredictedCollectivesEqualWhatRunCounted) {
  const std::string shape =
      " --q-heads 8 --kv-heads 2 --head-dim 16 --seq 256 --cp 4 --dtype bf16 --segments 200,56";
  for (const std::string strategy : {"ulysses", "all_gather", "all_gather_load_balanced", "all_gather_solver",
                                     "ring", "ring_load_balanced", "ring_per_document", "hybrid_u2_r2",
                                     "hybrid_u2_r2_load_balanced", "hybrid_u2_r2_solver"}) {
    for (const std::string remat : {"", " --remat"}) {
      // refused (CliRun.RingChecksWithinItsBoundsAndRefusesRemat)
      if ((strategy.starts_with("ring") || strategy.starts_with("hybrid")) && !remat.empty()) continue;
      std::string base = strategy, layout;
      for (const std::string suffix : {"_load_balanced", "_per_document", "_solver"}) {
        if (!strategy.ends_with(suffix)) continue;
        base = strategy.substr(0, strategy.size() - suffix.size());
        layout = suffix == "_load_balanced" ? " --load-balance" : " --layout " + suffix.substr(1);
      }
      if (base.starts_with("hybrid")) base = "hybrid --ulysses-degree 2";
      const std::string flags = " --strategy " + base + layout;
      const Result ran = run("run --json --threads 1" + flags + shape + remat);
      ASSERT_EQ(ran.exit_code, 0) << ran.err;
      const Result planned = run("plan --json --block 64" + shape + remat);
      ASSERT_EQ(planned.exit_code, 0) << planned.err;
      nlohmann::json predicted, memory;
      const auto plan = nlohmann::json::parse(planned.out);
      for (const auto& s : plan["strategies"]) {
        if (s["name"] == strategy) {
          predicted = s["collectives"];
          memory = s["memory_bytes_per_rank"];
        }
      }
      // The memory the plan predicts is what the forwards kept (their largest), byte for byte.
      const auto saved = nlohmann::json::parse(ran.out)["saved_bytes_per_rank"];
      std::int64_t largest = 0;
      for (const auto& b : saved) largest = std::max(largest, b.get<std::int64_t>());
      EXPECT_EQ(memory.get<std::int64_t>(), largest) << strategy << remat;
      auto key = [](const nlohmann::json& list) {
        std::vector<std::string> rows;
        for (const auto& c : list) rows.push_back(c.dump());
        std::sort(rows.begin(), rows.end());
        return rows;
      };
      EXPECT_EQ(key(nlohmann::json::parse(ran.out)["collectives"]), key(predicted)) << strategy << remat;
    }
  }
}

}  // namespace
