// The bf16 forward and backward with bf16 products: on AMX (Intel's tile matrix unit: tdpbf16ps multiplies
// 16x32 by 32x16 bf16 tiles into a 16x16 fp32 tile, 16x the FLOPs per cycle of an fp32 FMA port pair), or,
// where there is no AMX, with AVX512-BF16 dot products (VDPBF16PS: a pair of bf16 products summed into each
// fp32 lane, twice an fp32 FMA's FLOPs; AMD Zen 4 and 5, Intel Cooper Lake). The same code around either
// unit; flash_bf16_path(config) chooses (AMX where the CPU has AMX-BF16 and the kernel grants the tile state,
// Linux arch_prctl; FlashConfig::allow_amx and allow_avx512_bf16 turn each off).
//
// Its arithmetic differs from the vector path's (S from bf16 products accumulated by the tile unit, P rounded
// to bf16 for P V), but is as deterministic: a row of an output tile depends only on that row of the left
// operand, so a query row's O and LSE do not depend on which rows share its tile, its shard or the thread
// count. Every rank of a run takes the same path (one machine, one decision).
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "cpattn/flash.hpp"
#include "kernels/block_grid.hpp"

namespace cpattn::kernels {

// AMX-BF16, AMX-TILE and AVX512-BF16 present and the tile data permission granted (asked once per process).
bool amx_bf16_usable();
// AVX512-BF16 (VDPBF16PS) and the AVX-512 sets the shared code needs (F, BW, VL, DQ) present.
bool avx512_bf16_usable();

// The forward of flash_forward for bf16 inputs; task_tiles [B][Hq][q blocks] and the full/partial counts are
// filled as the vector path fills them.
void flash_forward_bf16(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                        const AttentionMask& mask, double scale, const FlashConfig& config,
                        const BlockGrid& grid, const TensorRef& o, float* lse,
                        std::vector<std::int64_t>& task_tiles, std::atomic<std::int64_t>& full,
                        std::atomic<std::int64_t>& partial);

// The backward of flash_backward for bf16 inputs with finite values: S, dP, dV^T, dK^T and dQ on the tile
// unit (P and dS rounded to bf16 for the last three), the rest as the vector path: one task per (batch row, q
// head) walking the kv blocks in order, dQ rows summing over kv blocks in that order, dK/dV of a kv block
// over the q blocks in theirs in fp64, and a group's q heads through fp64 partials in stripes of at most
// config.backward_partial_bytes. lse2 and delta: [B][Hq][q_blocks * Bq] as flash_backward computes them.
void flash_backward_bf16(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                         const ConstTensorRef& d_out, const AttentionMask& mask, double scale,
                         const FlashConfig& config, const BlockGrid& grid, const std::vector<float>& lse2,
                         const std::vector<float>& delta, const TensorRef& dq, const TensorRef& dk,
                         const TensorRef& dv, std::vector<std::int64_t>& task_tiles,
                         std::atomic<std::int64_t>& full, std::atomic<std::int64_t>& partial);

}  // namespace cpattn::kernels
