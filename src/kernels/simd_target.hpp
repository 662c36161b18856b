// Which SIMD target the vector kernels run on: Highway picks the best one compiled in that the CPU has;
// CPATTN_SIMD_TARGET or flash_force_vector_target (cpattn/flash.hpp) may force another.
#pragma once

namespace cpattn::kernels {

// Applies CPATTN_SIMD_TARGET (a name from flash_vector_targets()) once per process, before the first kernel;
// an invalid name throws Error(invalid_config) naming the valid ones, on every call.
void apply_simd_target_env();

}  // namespace cpattn::kernels
