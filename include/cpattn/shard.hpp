// Cutting whole-sequence tensors into a rank's shard and putting shards back: the glue between a caller that
// holds whole tensors (the program, tests) and the per-rank API.
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/tensor.hpp"

namespace cpattn {

// whole: [B, S, H, D]; positions: the tokens to take (the same for every batch row) -> [B, n, H, D].
Tensor take_tokens(const Tensor& whole, const std::vector<std::int64_t>& positions);
// Writes local [B, n, H, D] into whole at `positions`.
void put_tokens(Tensor& whole, const Tensor& local, const std::vector<std::int64_t>& positions);
// ids: [B, S] -> [B, n].
std::vector<std::int32_t> take_tokens(const std::vector<std::int32_t>& ids, std::int64_t batch,
                                      const std::vector<std::int64_t>& positions);

}  // namespace cpattn
