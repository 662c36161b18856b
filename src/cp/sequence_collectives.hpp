// Collectives over sequence-sharded tensors, built on the Communicator's flat ones with a pack step:
// the Ulysses head/sequence swaps, the all_gather into natural order and the reduce-scatter back to shards.
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn::cp {

// The ulysses swaps over any head placement (placement.hpp); heads[p] is rank p's contiguous range.
// x: [B, S/cp, H, D] contiguous shard -> [B, S, n_r, D]: this rank's heads heads[r] for the whole sequence.
Tensor all_to_all_sequence_to_heads(Communicator& comm, const Tensor& x, const std::vector<HeadRange>& heads);
// y: [B, S, n_r, D] -> [B, S/cp, sum_p n_p, D]: every rank's heads for this rank's tokens, rank p's at slots
// [sum_{v<p} n_v, ...). For ranges that tile [0, H) in order that is [B, S/cp, H, D].
Tensor all_to_all_heads_to_sequence(Communicator& comm, const Tensor& y, const std::vector<HeadRange>& heads);
// lse: [B, n_r, S] -> [B, H, S/cp], for ranges that tile [0, H) in order.
std::vector<float> all_to_all_lse_heads_to_sequence(Communicator& comm, const std::vector<float>& lse,
                                                    std::int64_t batch, std::int64_t seq,
                                                    const std::vector<HeadRange>& heads);

// x: [B, S/cp, H, D] -> [B, S, H, D] in natural (global position) order.
Tensor all_gather_sequence(Communicator& comm, const Tensor& x, const RankPositions& positions);
// ids: [B, S/cp] -> [B, S] natural order.
std::vector<std::int32_t> all_gather_segments(Communicator& comm, const std::vector<std::int32_t>& ids,
                                              std::int64_t batch, const RankPositions& positions);
// partial: [B, S, H, D] fp32 natural order -> [B, S/cp, H, D] fp32: the sum over ranks of this rank's tokens.
Tensor reduce_scatter_sequence(Communicator& comm, const Tensor& partial, const RankPositions& positions);

// The windowed all_gather's (seen[r]: the positions rank r's queries see, seen_positions), as all_to_all_v's
// that move only those rows. x: [B, S/cp, H, D] -> [B, V, H, D]: the rows of this rank's seen positions in
// natural order (V of them).
Tensor gather_seen(Communicator& comm, const Tensor& x, const RankPositions& positions,
                   const std::vector<std::vector<PositionRange>>& seen);
// partial: [B, V, H, D] fp32, this rank's seen rows -> [B, S/cp, H, D] fp32: each rank's partial of this
// rank's rows, summed in rank order (reduce_scatter_sum's order).
Tensor scatter_seen(Communicator& comm, const Tensor& partial, const RankPositions& positions,
                    const std::vector<std::vector<PositionRange>>& seen);

}  // namespace cpattn::cp
