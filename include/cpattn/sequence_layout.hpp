// Sequence layouts: which global token positions each rank holds, in the order it holds them.
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/config.hpp"

namespace cpattn {

// Global positions in rank order (rank 0's tokens, then rank 1's, ...), for S tokens over cp ranks.
// Contiguous: the identity. Dual chunk swap: 2*cp chunks of S/(2cp); rank r holds chunks r and 2cp-1-r.
// cp=2, S=8 -> [0, 1, 6, 7, 2, 3, 4, 5].
std::vector<std::int64_t> dual_chunk_swap_order(std::int64_t seq_len, std::int64_t cp);
std::vector<std::int64_t> layout_order(ShardLayout layout, std::int64_t seq_len, std::int64_t cp);

// inverse[perm[i]] = i.
std::vector<std::int64_t> inverse_permutation(const std::vector<std::int64_t>& perm);

// The global positions of rank `rank`'s local tokens, in its local order (S/cp of them).
std::vector<std::int64_t> local_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                          std::int64_t rank);

// A contiguous run of global positions held by one rank.
struct PositionRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};
// The runs rank `rank` holds, in local order: one for contiguous, two for dual chunk swap.
std::vector<PositionRange> local_ranges(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                        std::int64_t rank);

}  // namespace cpattn
