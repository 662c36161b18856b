// cpattn: the command-line program. It only wires the library's parts together.
#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <string>

#include "cpattn/error.hpp"

#ifdef CPATTN_WITH_MPI
#include <mpi.h>
#endif
#include "bench_command.hpp"
#include "plan_command.hpp"
#include "run_command.hpp"
#include "validate_command.hpp"

int main(int argc, char** argv) {
  CLI::App app{"cpattn: context-parallel attention (all_gather and ulysses with KV-head replication)"};
  app.require_subcommand(1);
  int exit_code = 0;
  cpattn::cli::add_validate_command(app, exit_code);
  cpattn::cli::add_run_command(app, exit_code);
  cpattn::cli::add_bench_command(app, exit_code);
  cpattn::cli::add_plan_command(app, exit_code);
  std::string names;
  bool known = false;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    known = known || (argc > 1 && sub->get_name() == argv[1]);
  }
  if (argc > 1 && argv[1][0] != '-' && !known) {
    std::cerr << "error: unknown command '" << argv[1] << "'; valid: " << names << "\n";
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "error: " << e.what() << "\n"
              << "run 'cpattn --help' for the flags\n";
    return 2;
  } catch (const cpattn::Error& e) {
    std::cerr << "error (" << cpattn::to_string(e.kind()) << "): " << e.what() << "\n";
    return e.kind() == cpattn::ErrorKind::invalid_config || e.kind() == cpattn::ErrorKind::invalid_input ? 2
                                                                                                         : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
#ifdef CPATTN_WITH_MPI
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
#endif
  return exit_code;
}
