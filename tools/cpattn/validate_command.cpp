#include "validate_command.hpp"

#include <iostream>
#include <memory>

#include "cpattn/documents.hpp"
#include "problem_flags.hpp"

namespace cpattn::cli {
namespace {

struct ValidateOptions {
  ProblemFlags problem;
  bool json = false;
};

}  // namespace

void add_validate_command(CLI::App& app, int& exit_code, std::ostream& out, std::ostream& err) {
  auto opt = std::make_shared<ValidateOptions>();
  CLI::App* sub = app.add_subcommand("validate", "check a configuration and print the head placement");
  opt->problem.add_to(*sub);
  sub->add_flag("--json", opt->json, "print JSON");
  sub->callback([sub, opt, &exit_code, &out, &err] {
    exit_code = print_answer(validate_answer(opt->problem.resolve(*sub)), opt->json, out, err);
  });
}

}  // namespace cpattn::cli
