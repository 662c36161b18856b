// Hardware profiles as data: YAML files (src/plan/profiles, compiled in; `plan --profile FILE`), each key
// checked as a config file's is (unknown keys named with the nearest, numbers by the one decimal parser).
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
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

constexpr const char* kProfileKeys[] = {"name",
                                        "flops",
                                        "bandwidth",
                                        "ranks_per_host",
                                        "inter_bandwidth",
                                        "latency",
                                        "inter_latency",
                                        "ranks_per_switch",
                                        "switch_bandwidth",
                                        "all_to_all_bandwidth",
                                        "ranks_per_socket",
                                        "socket_bandwidth",
                                        "socket_all_to_all_bandwidth",
                                        "socket_latency",
                                        "ring_step_seconds",
                                        "memory_bandwidth",
                                        "merge_bytes",
                                        "accumulate_bytes",
                                        "call_seconds",
                                        "softcap_forward",
                                        "softcap_backward",
                                        "cores",
                                        "block",
                                        "kernel",
                                        "source"};
constexpr std::int64_t kMaxExtent = std::int64_t{1} << 22;  // plan's longest row (kMaxPlanSeq)
// The profile's numbers: each key, its field, its range and what it takes (in messages).
struct RealKey {
  const char* key;
  double HardwareProfile::*field;
  double min, max;
  const char* valid;
};
constexpr RealKey kRealKeys[] = {
    {"flops", &HardwareProfile::flops, 1, 1e30, "FLOP/s, a number"},
    {"bandwidth", &HardwareProfile::bandwidth, 1, 1e30, "bytes/s, a number"},
    {"inter_bandwidth", &HardwareProfile::inter_bandwidth, 1, 1e30, "bytes/s, a number"},
    {"switch_bandwidth", &HardwareProfile::switch_bandwidth, 1, 1e30, "bytes/s, a number"},
    {"all_to_all_bandwidth", &HardwareProfile::all_to_all_bandwidth, 1, 1e30, "bytes/s, a number"},
    {"socket_bandwidth", &HardwareProfile::socket_bandwidth, 1, 1e30, "bytes/s, a number"},
    {"socket_all_to_all_bandwidth", &HardwareProfile::socket_all_to_all_bandwidth, 1, 1e30,
     "bytes/s, a number"},
    {"latency", &HardwareProfile::latency, 0, 10, "seconds, 0 to 10"},
    {"inter_latency", &HardwareProfile::inter_latency, 0, 10, "seconds, 0 to 10"},
    {"socket_latency", &HardwareProfile::socket_latency, 0, 10, "seconds, 0 to 10"},
    {"ring_step_seconds", &HardwareProfile::ring_step_seconds, 0, 10, "seconds, 0 to 10"},
    {"memory_bandwidth", &HardwareProfile::memory_bandwidth, 1, 1e30, "bytes/s, a number"},
    {"merge_bytes", &HardwareProfile::merge_bytes, 0, 1e6, "bytes per element, 0 to 1e6"},
    {"accumulate_bytes", &HardwareProfile::accumulate_bytes, 0, 1e6, "bytes per element, 0 to 1e6"},
    {"call_seconds", &HardwareProfile::call_seconds, 0, 10, "seconds, 0 to 10"},
    {"softcap_forward", &HardwareProfile::softcap_forward, 1, 100, "a factor, 1 to 100"},
    {"softcap_backward", &HardwareProfile::softcap_backward, 1, 100, "a factor, 1 to 100"},
};
struct CountKey {
  const char* key;
  std::int64_t HardwareProfile::*field;
  std::int64_t max;
  const char* valid;
};
constexpr CountKey kCountKeys[] = {
    {"ranks_per_host", &HardwareProfile::ranks_per_host, std::numeric_limits<std::int32_t>::max(),
     "devices, 0: one host"},
    {"ranks_per_switch", &HardwareProfile::ranks_per_switch, std::numeric_limits<std::int32_t>::max(),
     "devices, 0: no switches"},
    {"ranks_per_socket", &HardwareProfile::ranks_per_socket, std::numeric_limits<std::int32_t>::max(),
     "devices, 0: one socket"},
    {"cores", &HardwareProfile::cores, 1 << 20, "cores the ranks share, 0: a device per rank"},
    {"block", &HardwareProfile::block, kMaxExtent, "a tile size, 0: none"},
};

constexpr const char* kKernelKeys[] = {"dtype", "head_dim", "q", "kv", "causal", "forward", "backward"};

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out;
}

[[noreturn]] void bad_profile(const std::string& where, const std::string& key, const std::string& value,
                              const std::string& why) {
  throw Error(ErrorKind::invalid_input, key.empty() ? where : where + ": " + key, value, where + ": " + why);
}

// The mapping's keys checked (known, once each, each a plain value); `on_value(key, value)` reads each.
template <class Fn>
std::vector<std::string> read_mapping(const YAML::Node& map, const std::string& where,
                                      const std::vector<std::string>& keys, const std::string& list_key,
                                      Fn&& on_value) {
  std::vector<std::string> seen;
  for (const auto& entry : map) {
    if (!entry.first.IsScalar()) bad_profile(where, "", "", "a key is not a plain word");
    const std::string key = entry.first.Scalar();
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      const std::string near = nearest(key, keys);
      bad_profile(where, key, entry.second.IsScalar() ? entry.second.Scalar() : "",
                  "unknown key '" + quoted(key) + "'" +
                      (near.empty() ? "" : "; did you mean '" + near + "'?") +
                      " valid keys: " + key_list(keys));
    }
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      bad_profile(where, key, "", "key '" + key + "' is given twice");
    }
    seen.push_back(key);
    if (key == list_key) {
      on_value(key, entry.second);
      continue;
    }
    if (!entry.second.IsScalar()) {
      bad_profile(where, key, "",
                  "key '" + quoted(key) + "' has " +
                      (entry.second.IsNull() ? "no value" : "a list or a mapping") +
                      "; valid: a plain word or number");
    }
    on_value(key, entry.second);
  }
  return seen;
}

void require(const std::vector<std::string>& seen, const std::string& where,
             std::initializer_list<const char*> keys) {
  for (const char* key : keys) {
    if (std::find(seen.begin(), seen.end(), key) == seen.end()) {
      bad_profile(where, key, "", std::string("key '") + key + "' is missing");
    }
  }
}

KernelRate parse_kernel_rate(const YAML::Node& node, const std::string& where) {
  if (!node.IsMap()) {
    bad_profile(
        where, "", "",
        "a kernel entry is a mapping of " + key_list({std::begin(kKernelKeys), std::end(kKernelKeys)}));
  }
  KernelRate k;
  const std::vector<std::string> keys(std::begin(kKernelKeys), std::end(kKernelKeys));
  const auto seen = read_mapping(node, where, keys, "", [&](const std::string& key, const YAML::Node& v) {
    const std::string value = v.Scalar(), field = where + ": " + key;
    if (key == "dtype") {
      try {
        k.dtype = parse_dtype(value, field);
      } catch (const Error& e) {
        bad_profile(where, key, value, e.what());
      }
    } else if (key == "head_dim" || key == "q" || key == "kv") {
      (key == "head_dim" ? k.head_dim
       : key == "q"      ? k.q
                         : k.kv) = parse_integer(value, field, 1, kMaxExtent, "a positive extent");
    } else if (key == "causal") {
      if (value != "true" && value != "false") {
        bad_profile(where, key, value, "causal '" + quoted(value) + "' is not true or false");
      }
      k.causal = value == "true";
    } else {
      (key == "forward" ? k.forward : k.backward) = parse_real(value, field, 1, 1e30, "FLOP/s, a number");
    }
  });
  require(seen, where, {"dtype", "head_dim", "q", "kv", "causal", "forward", "backward"});
  return k;
}

}  // namespace

HardwareProfile parse_hardware_profile(const std::string& text, const std::string& where) {
  const std::vector<std::string> keys(std::begin(kProfileKeys), std::end(kProfileKeys));
  YAML::Node root;
  try {
    if (yaml_documents_up_to_two(text) == 1) root = YAML::Load(text);
    if (!root.IsMap()) {
      bad_profile(where, "", "",
                  "a profile is one YAML mapping of keys to values; valid keys: " + key_list(keys));
    }
  } catch (const YAML::Exception& e) {
    bad_profile(where, "", "", std::string("not valid YAML: ") + e.what());
  }
  HardwareProfile p;
  const auto seen =
      read_mapping(root, where, keys, "kernel", [&](const std::string& key, const YAML::Node& v) {
        const std::string field = where + ": " + key;
        if (key == "kernel") {
          if (!v.IsSequence()) bad_profile(where, key, "", "kernel is a list of measured rates");
          for (std::size_t i = 0; i < v.size(); ++i) {
            p.kernel.push_back(parse_kernel_rate(v[i], where + ": kernel[" + std::to_string(i) + "]"));
          }
          return;
        }
        const std::string value = v.Scalar();
        if (key == "name") {
          if (value.empty() ||
              value.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
            bad_profile(where, key, value,
                        "name '" + quoted(value) +
                            "' is not a profile name; valid: lower-case letters, digits, '.', '-'");
          }
          p.name = value;
        } else if (const auto* real = std::find_if(std::begin(kRealKeys), std::end(kRealKeys),
                                                   [&](const RealKey& k) { return key == k.key; });
                   real != std::end(kRealKeys)) {
          p.*(real->field) = parse_real(value, field, real->min, real->max, real->valid);
        } else if (const auto* count = std::find_if(std::begin(kCountKeys), std::end(kCountKeys),
                                                    [&](const CountKey& k) { return key == k.key; });
                   count != std::end(kCountKeys)) {
          p.*(count->field) = parse_integer(value, field, 0, count->max, count->valid);
        } else {
          CPATTN_ASSERT(key == "source");  // every other key of kProfileKeys has its branch above
          if (value.empty())
            bad_profile(where, key, value, "source is empty; say where each figure comes from");
          p.source = value;
        }
      });
  require(seen, where, {"name", "flops", "bandwidth", "source"});
  if (p.ranks_per_host > 0 && !(p.inter_bandwidth > 0)) {
    bad_profile(where, "inter_bandwidth", "",
                "ranks_per_host (" + std::to_string(p.ranks_per_host) +
                    ") puts ranks on several hosts: give inter_bandwidth, the bytes/s between them");
  }
  if (p.ranks_per_switch > 0 && !(p.switch_bandwidth > 0)) {
    bad_profile(
        where, "switch_bandwidth", "",
        "ranks_per_switch (" + std::to_string(p.ranks_per_switch) +
            ") puts devices behind switches: give switch_bandwidth, the bytes/s a switch's uplink carries");
  }
  if (p.ranks_per_switch > 0 && p.ranks_per_host > 0 && p.ranks_per_host % p.ranks_per_switch != 0) {
    bad_profile(where, "ranks_per_switch", std::to_string(p.ranks_per_switch),
                "ranks_per_switch (" + std::to_string(p.ranks_per_switch) + ") must divide ranks_per_host (" +
                    std::to_string(p.ranks_per_host) + "): a switch sits inside one host");
  }
  if (p.ranks_per_socket > 0 && !(p.socket_bandwidth > 0)) {
    bad_profile(where, "socket_bandwidth", "",
                "ranks_per_socket (" + std::to_string(p.ranks_per_socket) +
                    ") puts devices in sockets: give socket_bandwidth, the bytes/s a socket's link carries");
  }
  if (p.ranks_per_socket > 0 && p.ranks_per_switch > 0 && p.ranks_per_socket % p.ranks_per_switch != 0) {
    bad_profile(where, "ranks_per_socket", std::to_string(p.ranks_per_socket),
                "ranks_per_socket (" + std::to_string(p.ranks_per_socket) + ") must be a multiple of " +
                    "ranks_per_switch (" + std::to_string(p.ranks_per_switch) +
                    "): a switch sits in one socket");
  }
  if (p.ranks_per_socket > 0 && p.ranks_per_host > 0 && p.ranks_per_host % p.ranks_per_socket != 0) {
    bad_profile(where, "ranks_per_socket", std::to_string(p.ranks_per_socket),
                "ranks_per_socket (" + std::to_string(p.ranks_per_socket) + ") must divide ranks_per_host (" +
                    std::to_string(p.ranks_per_host) + "): a socket sits inside one host");
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

namespace cpattn {

double HardwareProfile::kernel_rate(DType dtype, std::int64_t head_dim, std::int64_t q, std::int64_t kv,
                                    bool causal, bool backward) const {
  bool same_causal = false;
  std::vector<std::int64_t> dims;
  for (const KernelRate& k : kernel) {
    if (k.dtype != dtype) continue;
    same_causal = same_causal || k.causal == causal;
    if (std::find(dims.begin(), dims.end(), k.head_dim) == dims.end()) dims.push_back(k.head_dim);
  }
  if (dims.empty()) return flops;
  auto l = [](std::int64_t x) { return std::log2(static_cast<double>(std::max<std::int64_t>(x, 1))); };
  // At one head dim: the entries' rates weighted by inverse squared distance in log2(q, kv).
  auto at = [&](std::int64_t d) {
    double weights = 0, sum = 0;
    for (const KernelRate& k : kernel) {
      if (k.dtype != dtype || k.head_dim != d || (same_causal && k.causal != causal)) continue;
      const double dq = l(k.q) - l(q), dk = l(k.kv) - l(kv);
      const double d2 = dq * dq + dk * dk;
      const double rate = backward ? k.backward : k.forward;
      if (d2 == 0) return rate;
      weights += 1 / d2;
      sum += rate / d2;
    }
    return weights > 0 ? sum / weights : 0.0;
  };
  // Head dims with an entry of the call's causality; between two of them the geometric interpolation in
  // log2(head dim), outside them the nearest (the head dim moves a rate more than the call's extents do).
  std::vector<std::int64_t> usable;
  for (const std::int64_t d : dims) {
    if (at(d) > 0) usable.push_back(d);
  }
  std::sort(usable.begin(), usable.end());
  const auto hi = std::lower_bound(usable.begin(), usable.end(), head_dim);
  if (hi != usable.end() && *hi == head_dim) return at(head_dim);
  if (hi == usable.begin()) return at(usable.front());
  if (hi == usable.end()) return at(usable.back());
  const std::int64_t lo = *(hi - 1);
  const double frac = (l(head_dim) - l(lo)) / (l(*hi) - l(lo));
  return at(lo) * std::pow(at(*hi) / at(lo), frac);
}

namespace {

std::string number(double x) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

}  // namespace

std::string profile_yaml(const HardwareProfile& p) {
  std::ostringstream o;
  o << "name: " << p.name << "\n";
  o << "flops: " << number(p.flops) << "\n";
  o << "bandwidth: " << number(p.bandwidth) << "\n";
  if (p.ranks_per_host > 0) o << "ranks_per_host: " << p.ranks_per_host << "\n";
  if (p.inter_bandwidth > 0) o << "inter_bandwidth: " << number(p.inter_bandwidth) << "\n";
  o << "latency: " << number(p.latency) << "\n";
  if (p.inter_latency > 0) o << "inter_latency: " << number(p.inter_latency) << "\n";
  if (p.ranks_per_switch > 0) {
    o << "ranks_per_switch: " << p.ranks_per_switch << "\n";
    o << "switch_bandwidth: " << number(p.switch_bandwidth) << "\n";
  }
  if (p.all_to_all_bandwidth > 0) o << "all_to_all_bandwidth: " << number(p.all_to_all_bandwidth) << "\n";
  if (p.ranks_per_socket > 0) {
    o << "ranks_per_socket: " << p.ranks_per_socket << "\n";
    o << "socket_bandwidth: " << number(p.socket_bandwidth) << "\n";
    if (p.socket_all_to_all_bandwidth > 0)
      o << "socket_all_to_all_bandwidth: " << number(p.socket_all_to_all_bandwidth) << "\n";
    if (p.socket_latency > 0) o << "socket_latency: " << number(p.socket_latency) << "\n";
  }
  o << "ring_step_seconds: " << number(p.ring_step_seconds) << "\n";
  if (p.memory_bandwidth > 0) o << "memory_bandwidth: " << number(p.memory_bandwidth) << "\n";
  o << "merge_bytes: " << number(p.merge_bytes) << "\n";
  o << "accumulate_bytes: " << number(p.accumulate_bytes) << "\n";
  o << "call_seconds: " << number(p.call_seconds) << "\n";
  if (p.softcap_forward != 1) o << "softcap_forward: " << number(p.softcap_forward) << "\n";
  if (p.softcap_backward != 1) o << "softcap_backward: " << number(p.softcap_backward) << "\n";
  if (p.cores > 0) o << "cores: " << p.cores << "\n";
  if (p.block > 0) o << "block: " << p.block << "\n";
  if (!p.kernel.empty()) {
    o << "kernel:\n";
    for (const KernelRate& k : p.kernel) {
      o << "  - {dtype: " << to_string(k.dtype) << ", head_dim: " << k.head_dim << ", q: " << k.q
        << ", kv: " << k.kv << ", causal: " << (k.causal ? "true" : "false")
        << ", forward: " << number(k.forward) << ", backward: " << number(k.backward) << "}\n";
    }
  }
  // A folded scalar: the source's own line breaks kept out, quotes and colons safe.
  o << "source: " << YAML::Dump(YAML::Node(p.source)) << "\n";
  return o.str();
}

}  // namespace cpattn
