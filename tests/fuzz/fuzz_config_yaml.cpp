// libFuzzer target: the YAML config reader and, on what it accepts, the validator. Any input must either be
// read or throw cpattn::Error naming a field; a configuration without errors must validate and place its
// heads.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cpattn/config_file.hpp"
#include "cpattn/error.hpp"
#include "cpattn/placement.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const cpattn::ConfigValues values = cpattn::parse_config_yaml(text, "fuzz.yaml");
    cpattn::Specs specs;
    const auto errors = cpattn::all_config_errors(values, specs);
    for (const auto& e : errors) {
      if (e.fields.empty() || e.message.empty()) std::abort();  // every error names a field and says why
    }
    if (errors.empty()) {
      cpattn::validate(specs.attention, specs.parallel);  // must not throw what all_config_errors accepted
      const auto ranks = cpattn::head_placement(specs.attention, specs.parallel);
      if (static_cast<std::int64_t>(ranks.size()) != specs.parallel.cp) std::abort();
    }
  } catch (const cpattn::Error& e) {
    if (e.items().empty()) std::abort();
  }
  return 0;
}
