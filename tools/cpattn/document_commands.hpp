// The commands whose answer is one JSON document (validate, plan), for callers other than the program (the
// Python module): the same flags, rules and document as `cpattn <command> --json`.
#pragma once

#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace cpattn::cli {

// A flag's value: text as typed on a command line, or a switch (true: the flag; false: its --no- form where
// the command has one, else nothing).
using FlagValue = std::variant<std::string, bool>;

struct DocumentAnswer {
  int exit_code = 0;     // what the program would exit with: 0, or 2 for a configuration that breaks a rule
  std::string document;  // the JSON document ({"valid": false, "errors": [...]} when exit_code is 2)
};

// Runs `command` ("validate" or "plan") with these flags, named without their leading dashes and with
// underscores for dashes (q_heads for --q-heads). Throws Error(invalid_config) for an unknown command or flag
// (naming the valid ones) and for a value the flag cannot take (the parser's message); the rules a
// configuration breaks are in the document, as the program prints them.
DocumentAnswer run_document_command(const std::string& command,
                                    const std::vector<std::pair<std::string, FlagValue>>& flags);

}  // namespace cpattn::cli
