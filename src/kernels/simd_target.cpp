// The SIMD target of the vector kernels: Highway dispatches every exported kernel on one global choice, so
// forcing a target here forces it for flash_forward.cpp's and flash_backward.cpp's kernels too.
#include "kernels/simd_target.hpp"

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cpattn/error.hpp"
#include "cpattn/flash.hpp"

// Compiled once per SIMD target, like the kernels: vector_target_name names the copy that dispatch picks.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd_target.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace cpattn::kernels::HWY_NAMESPACE {

// The SIMD target this copy was compiled for (Highway's name).
const char* vector_target_name() {
  return hwy::TargetName(HWY_TARGET);
}

}  // namespace cpattn::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cpattn {

namespace kernels {
HWY_EXPORT(vector_target_name);
}  // namespace kernels

using namespace kernels;

namespace {
std::int64_t forced_target = 0;  // flash_force_vector_target's, 0: none

// Every compiled target this CPU supports, whatever is forced now.
std::vector<std::int64_t> all_vector_targets() {
  hwy::SetSupportedTargetsForTest(0);
  std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  hwy::SetSupportedTargetsForTest(forced_target);
  return targets;
}

void force_vector_target(const std::string& name) {
  std::int64_t chosen = 0;
  std::string valid;
  for (const std::int64_t t : all_vector_targets()) {
    if (name == hwy::TargetName(t)) chosen = t;
    valid += (valid.empty() ? "" : ", ") + std::string(hwy::TargetName(t));
  }
  if (!name.empty() && chosen == 0) {
    throw Error(
        ErrorKind::invalid_input, "simd_target", name,
        "SIMD target '" + name + "' is not compiled in or not supported by this CPU (valid: " + valid + ")");
  }
  forced_target = chosen;
  hwy::SetSupportedTargetsForTest(forced_target);
}
}  // namespace

std::vector<std::string> flash_vector_targets() {
  kernels::apply_simd_target_env();
  std::vector<std::string> names;
  for (const std::int64_t t : all_vector_targets()) names.emplace_back(hwy::TargetName(t));
  return names;
}

std::string flash_vector_target() {
  kernels::apply_simd_target_env();
  return HWY_DYNAMIC_DISPATCH(vector_target_name)();
}

void flash_force_vector_target(const std::string& name) {
  kernels::apply_simd_target_env();
  force_vector_target(name);
}

namespace kernels {
// CPATTN_SIMD_TARGET, read once before the kernels first run (an invalid name is an error on every call).
void apply_simd_target_env() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("CPATTN_SIMD_TARGET");
    if (env == nullptr || *env == 0) return;
    try {
      force_vector_target(env);
    } catch (const Error& e) {
      throw Error(ErrorKind::invalid_config, "CPATTN_SIMD_TARGET", env,
                  std::string("environment variable CPATTN_SIMD_TARGET=") + env + ": " + e.what());
    }
  });
}
}  // namespace kernels

}  // namespace cpattn
#endif  // HWY_ONCE
