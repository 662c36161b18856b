// cpattn: the command-line program. It only wires the library's parts together, and answers every failure the
// same way: the errors on stderr, exit 2 for bad input (1 for a failed run, a communication failure, memory),
// and with --json one document on stdout ({"ok": false, ...} for run and bench, {"valid": false, ...} for
// validate and plan) whatever failed.
#include <CLI/CLI.hpp>

#include <malloc.h>
#include <algorithm>
#include <csignal>
#include <exception>
#include <filesystem>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "cpattn/communicators.hpp"
#include "cpattn/error.hpp"
#include "cpattn/parse.hpp"

#include "bench_command.hpp"
#include "plan_command.hpp"
#include "problem_flags.hpp"
#include "run_command.hpp"
#include "validate_command.hpp"

namespace {

using cpattn::Error;
using cpattn::ErrorItem;
using cpattn::ErrorKind;

// What the arguments ask for, read before parsing, so that a failure of the parse itself is answered in kind.
struct Invocation {
  std::string command;  // "run", "validate", "plan", "bench" or "" where none is named
  bool json = false;
};

// Under mpirun only world rank 0 prints the document (the ranks agree; one document for the job).
bool prints_documents() {
  return cpattn::world_rank() == 0;
}

// Ends MPI where the run began it. Every error after MPI_Init that main sees is one every rank sees alike
// (--cp against the world's size) or rank 0's alone after the others finished (checking, saving): the ranks
// all reach MPI_Finalize, so the job ends with this process's exit code rather than mpirun's "exited without
// finalize". Errors mid-run end the whole job in execute (cpattn::end_job).
void finish_mpi() {
  cpattn::finish_backends();
}

int fail(const Invocation& inv, ErrorKind kind, const std::vector<ErrorItem>& items,
         const std::string& hint = "") {
  // Every message and field made UTF-8 here, once: a path or value with bytes that are not UTF-8 shows them
  // as \xNN on stderr and in the JSON document alike, whichever message carried it.
  std::vector<ErrorItem> safe = items;
  for (ErrorItem& item : safe) {
    item.message = cpattn::utf8_safe(item.message);
    for (std::string& f : item.fields) f = cpattn::utf8_safe(f);
  }
  for (const ErrorItem& item : safe)
    std::cerr << "error (" << cpattn::to_string(kind) << "): " << item.message << "\n";
  if (!hint.empty()) std::cerr << cpattn::utf8_safe(hint) << "\n";
  if (inv.json && prints_documents()) {
    const bool document = inv.command == "validate" || inv.command == "plan";
    std::cout << cpattn::failure_json(document ? "valid" : "ok", safe) << std::endl;
  }
  finish_mpi();
  return kind == ErrorKind::invalid_config || kind == ErrorKind::invalid_input ? 2 : 1;
}

// The flag a CLI11 message is about ("--causal excludes --no-causal": --causal), else "arguments".
std::string flag_in(const std::string& message) {
  const auto at = message.find("--");
  if (at == std::string::npos) return "arguments";
  const auto end = message.find_first_of(" :,'\"", at);
  return message.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

}  // namespace

int main(int argc, char** argv) {
  // A file size limit (ulimit -f) makes a write fail with EFBIG, which --save reports and cleans up after,
  // instead of killing the process with SIGXFSZ half-way through its files.
  std::signal(SIGXFSZ, SIG_IGN);
  // Freed memory kept for the next layer, as a training process's caching allocator keeps it: no tensor in a
  // mapping of its own, no heap trimmed, one heap for every rank thread (glibc shrinks per-thread arenas, and
  // each layer would fault its memory in again, zeroed; docs/performance.md).
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
  mallopt(M_ARENA_MAX, 1);
  CLI::App app{
      "cpattn: context-parallel attention (all_gather, ulysses with KV-head replication, ring, hybrid)"};
  app.require_subcommand(1);
  int exit_code = 0;
  cpattn::cli::add_validate_command(app, exit_code);
  cpattn::cli::add_run_command(app, exit_code);
  cpattn::cli::add_bench_command(app, exit_code);
  cpattn::cli::add_plan_command(app, exit_code);
  Invocation inv;
  std::string names;
  bool known = false;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    if (argc > 1 && sub->get_name() == argv[1]) {
      known = true;
      inv.command = argv[1];
    }
  }
  for (int i = 1; i < argc; ++i) inv.json = inv.json || std::string(argv[i]) == "--json";
  if (argc > 1 && argv[1][0] != '-' && !known) {
    return fail(
        inv, ErrorKind::invalid_input,
        {{{"command"}, argv[1], "unknown command '" + cpattn::quoted(argv[1]) + "'; valid: " + names}});
  }
  // A command's own commands (bench comm, kernel, strategy): an unknown one is named, not "a subcommand is
  // required".
  if (known && argc > 2 && argv[2][0] != '-') {
    const CLI::App* command = app.get_subcommand(argv[1]);
    const auto subs = command->get_subcommands([](const CLI::App*) { return true; });
    std::string sub_names;
    bool sub_known = subs.empty();
    for (const CLI::App* sub : subs) {
      sub_names += (sub_names.empty() ? "" : ", ") + sub->get_name();
      sub_known = sub_known || sub->get_name() == argv[2];
    }
    if (!sub_known) {
      return fail(
          inv, ErrorKind::invalid_input,
          {{{"command"},
            argv[2],
            "unknown " + inv.command + " command '" + cpattn::quoted(argv[2]) + "'; valid: " + sub_names}});
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    // An argument no flag took: name the first unknown flag with the nearest known one, not CLI11's list of
    // leftovers (which it gives last first).
    const CLI::App* command = inv.command.empty() ? nullptr : app.get_subcommand(inv.command);
    // The flags' owner: the command, or its own command (bench kernel) where one is named.
    const CLI::App* owner = command;
    std::vector<std::string> flags;
    if (command != nullptr) {
      for (const CLI::App* sub : command->get_subcommands([](const CLI::App*) { return true; })) {
        if (argc > 2 && sub->get_name() == argv[2]) owner = sub;
      }
      for (const CLI::Option* o : owner->get_options()) {
        for (const std::string& name : o->get_lnames()) flags.push_back("--" + name);
      }
    }
    for (int i = 2; command != nullptr && i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.rfind("--", 0) != 0) continue;
      arg = arg.substr(0, arg.find('='));
      if (std::find(flags.begin(), flags.end(), arg) != flags.end()) continue;
      const std::string near = cpattn::nearest(arg, flags);
      return fail(inv, ErrorKind::invalid_input,
                  {{{arg},
                    arg,
                    "unknown flag '" + cpattn::quoted(arg) + "'" +
                        (near.empty() ? "" : "; did you mean '" + near + "'?")}},
                  "run 'cpattn " + inv.command +
                      (owner != command ? " " + owner->get_name() : std::string()) +
                      " --help' for the flags");
    }
    const std::string message = cpattn::quoted(e.what());
    return fail(
        inv, ErrorKind::invalid_input, {{{"arguments"}, "", message}},
        "run 'cpattn " + (inv.command.empty() ? std::string() : inv.command + " ") + "--help' for the flags");
  } catch (const CLI::ParseError& e) {
    const std::string message = cpattn::quoted(e.what());
    return fail(
        inv, ErrorKind::invalid_input, {{{flag_in(message)}, "", message}},
        "run 'cpattn " + (inv.command.empty() ? std::string() : inv.command + " ") + "--help' for the flags");
  } catch (const Error& e) {
    return fail(inv, e.kind(), e.items());
  } catch (const std::bad_alloc&) {
    return fail(
        inv, ErrorKind::out_of_memory,
        {{{"memory"}, "", "out of memory (std::bad_alloc from a container); reduce the problem's size"}});
  } catch (const std::filesystem::filesystem_error& e) {
    const std::string path = e.path1().string();
    return fail(inv, ErrorKind::invalid_input,
                {{{path}, path, "'" + cpattn::quoted(path) + "': " + e.code().message()}});
  } catch (const std::exception& e) {
    return fail(inv, ErrorKind::internal, {{{"internal"}, "", cpattn::quoted(e.what())}});
  }
  finish_mpi();
  return exit_code;
}
