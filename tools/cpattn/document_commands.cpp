#include "document_commands.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <sstream>

#include "cpattn/error.hpp"
#include "plan_command.hpp"
#include "validate_command.hpp"

namespace cpattn::cli {
namespace {

std::string dashed(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return "--" + name;
}

std::string keyword(std::string flag) {
  flag.erase(0, 2);
  std::replace(flag.begin(), flag.end(), '-', '_');
  return flag;
}

std::string keywords_of(const CLI::App& sub) {
  std::string names;
  for (const CLI::Option* o : sub.get_options()) {
    const std::string name = o->get_single_name();
    if (name.empty() || name == "help" || name == "json") continue;
    if (name.rfind("no-", 0) == 0) continue;  // the false form of a switch
    names += (names.empty() ? "" : ", ") + keyword("--" + name);
  }
  return names;
}

}  // namespace

DocumentAnswer run_document_command(const std::string& command,
                                    const std::vector<std::pair<std::string, FlagValue>>& flags) {
  std::ostringstream out, err;
  CLI::App app{"cpattn"};
  app.require_subcommand(1);
  int exit_code = 0;
  add_validate_command(app, exit_code, out, err);
  add_plan_command(app, exit_code, out, err);
  if (command != "validate" && command != "plan") {
    throw Error(ErrorKind::invalid_config, "command", command,
                "command '" + command + "' has no JSON document; valid: validate, plan");
  }
  CLI::App* sub = app.get_subcommand(command);
  std::vector<std::string> args = {command, "--json"};
  for (const auto& [name, value] : flags) {
    const std::string flag = dashed(name);
    const CLI::Option* option = sub->get_option_no_throw(flag);
    if (option == nullptr || name == "json" || name == "help" || name.rfind("no_", 0) == 0) {
      throw Error(ErrorKind::invalid_config, name, "",
                  "'" + name + "' is not a keyword of " + command + "; valid: " + keywords_of(*sub));
    }
    const bool is_switch = option->get_expected_min() == 0;
    if (const bool* on = std::get_if<bool>(&value)) {
      if (!is_switch) {
        throw Error(ErrorKind::invalid_config, name, *on ? "True" : "False",
                    "'" + name + "' takes a value, not True or False");
      }
      if (*on) {
        args.push_back(flag);
      } else if (sub->get_option_no_throw("--no-" + flag.substr(2)) != nullptr) {
        args.push_back("--no-" + flag.substr(2));
      }
      continue;
    }
    if (is_switch) {
      throw Error(ErrorKind::invalid_config, name, std::get<std::string>(value),
                  "'" + name + "' is a switch: True or False");
    }
    args.push_back(flag);
    args.push_back(std::get<std::string>(value));
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes a vector last argument first
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    throw Error(ErrorKind::invalid_config, command, "", e.what());
  }
  return {exit_code, out.str()};
}

}  // namespace cpattn::cli
