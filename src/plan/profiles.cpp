// Hardware profiles as data: YAML files (src/plan/profiles, compiled in; `plan --profile FILE`), each key
// checked as a config file's is (unknown keys named with the nearest, numbers by the one decimal parser).
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

#include "cpattn/config_file.hpp"
#include "cpattn/parse.hpp"
#include "cpattn/planner.hpp"
#include "plan/profiles_data.hpp"

namespace cpattn {
namespace {

constexpr const char* kProfileKeys[] = {"name",           "flops",           "bandwidth",
                                        "ranks_per_host", "inter_bandwidth", "source"};

[[noreturn]] void bad_profile(const std::string& where, const std::string& key, const std::string& value,
                              const std::string& why) {
  throw Error(ErrorKind::invalid_input, key.empty() ? where : where + ": " + key, value, where + ": " + why);
}

}  // namespace

HardwareProfile parse_hardware_profile(const std::string& text, const std::string& where) {
  YAML::Node root;
  try {
    if (yaml_documents_up_to_two(text) == 1) root = YAML::Load(text);
    if (!root.IsMap()) {
      bad_profile(where, "", "",
                  "a profile is one YAML mapping of keys to values; valid keys: name, flops, "
                  "bandwidth, ranks_per_host, inter_bandwidth, source");
    }
  } catch (const YAML::Exception& e) {
    bad_profile(where, "", "", std::string("not valid YAML: ") + e.what());
  }
  HardwareProfile p;
  std::vector<std::string> seen;
  const std::vector<std::string> keys(std::begin(kProfileKeys), std::end(kProfileKeys));
  for (const auto& entry : root) {
    if (!entry.first.IsScalar()) bad_profile(where, "", "", "a key is not a plain word");
    const std::string key = entry.first.Scalar();
    if (!entry.second.IsScalar()) {
      bad_profile(where, key, "",
                  "key '" + quoted(key) + "' has " +
                      (entry.second.IsNull() ? "no value" : "a list or a mapping") +
                      "; valid: a plain word or number");
    }
    const std::string value = entry.second.Scalar();
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      const std::string near = nearest(key, keys);
      bad_profile(where, key, value,
                  "unknown key '" + quoted(key) + "'" +
                      (near.empty() ? "" : "; did you mean '" + near + "'?") +
                      " valid keys: name, flops, bandwidth, ranks_per_host, inter_bandwidth, source");
    }
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      bad_profile(where, key, value, "key '" + key + "' is given twice");
    }
    seen.push_back(key);
    const std::string field = where + ": " + key;
    if (key == "name") {
      if (value.empty() ||
          value.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
        bad_profile(where, key, value,
                    "name '" + quoted(value) +
                        "' is not a profile name; valid: lower-case letters, digits, '.', '-'");
      }
      p.name = value;
    } else if (key == "flops") {
      p.flops = parse_real(value, field, 1, 1e30, "FLOP/s, a number");
    } else if (key == "bandwidth") {
      p.bandwidth = parse_real(value, field, 1, 1e30, "bytes/s, a number");
    } else if (key == "inter_bandwidth") {
      p.inter_bandwidth = parse_real(value, field, 1, 1e30, "bytes/s, a number");
    } else if (key == "ranks_per_host") {
      p.ranks_per_host = parse_integer(value, field, 0, std::numeric_limits<std::int32_t>::max(),
                                       "devices per host, 0: one host");
    } else {
      if (value.empty()) bad_profile(where, key, value, "source is empty; say where each figure comes from");
      p.source = value;
    }
  }
  for (const char* required : {"name", "flops", "bandwidth", "source"}) {
    if (std::find(seen.begin(), seen.end(), required) == seen.end()) {
      bad_profile(where, required, "", std::string("key '") + required + "' is missing");
    }
  }
  if (p.ranks_per_host > 0 && !(p.inter_bandwidth > 0)) {
    bad_profile(where, "inter_bandwidth", "",
                "ranks_per_host (" + std::to_string(p.ranks_per_host) +
                    ") puts ranks on several hosts: give inter_bandwidth, the bytes/s between them");
  }
  return p;
}

HardwareProfile read_hardware_profile(const std::string& path) {
  std::ifstream in;
  const std::uint64_t size = open_input_file(path, in);
  if (size > (1u << 20)) bad_profile(path, "", std::to_string(size), "a profile over 1 MiB is not one");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_hardware_profile(text.str(), path);
}

const std::vector<HardwareProfile>& hardware_profiles() {
  static const std::vector<HardwareProfile> profiles = [] {
    std::vector<HardwareProfile> out;
    for (const plan::EmbeddedProfile& e : plan::embedded_profiles()) {
      out.push_back(parse_hardware_profile(e.text, std::string("src/plan/profiles/") + e.file));
    }
    return out;
  }();
  return profiles;
}

}  // namespace cpattn
