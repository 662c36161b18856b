#include "cpattn/sequence_layout.hpp"

namespace cpattn {

std::vector<PositionRange> local_ranges(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                        std::int64_t rank) {
  CPATTN_ASSERT(cp > 0 && rank >= 0 && rank < cp);
  if (layout == ShardLayout::contiguous) {
    CPATTN_ASSERT(seq_len % cp == 0);
    const std::int64_t n = seq_len / cp;
    return {{rank * n, (rank + 1) * n}};
  }
  CPATTN_ASSERT(seq_len % (2 * cp) == 0);
  const std::int64_t c = seq_len / (2 * cp);
  const std::int64_t mirror = 2 * cp - 1 - rank;
  return {{rank * c, (rank + 1) * c}, {mirror * c, (mirror + 1) * c}};
}

std::vector<std::int64_t> local_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                          std::int64_t rank) {
  std::vector<std::int64_t> positions;
  positions.reserve(static_cast<std::size_t>(seq_len / cp));
  for (const PositionRange& r : local_ranges(layout, seq_len, cp, rank)) {
    for (std::int64_t p = r.begin; p < r.end; ++p) positions.push_back(p);
  }
  return positions;
}

std::vector<std::int64_t> layout_order(ShardLayout layout, std::int64_t seq_len, std::int64_t cp) {
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(seq_len));
  for (std::int64_t r = 0; r < cp; ++r) {
    const auto local = local_positions(layout, seq_len, cp, r);
    order.insert(order.end(), local.begin(), local.end());
  }
  return order;
}

std::vector<std::int64_t> dual_chunk_swap_order(std::int64_t seq_len, std::int64_t cp) {
  return layout_order(ShardLayout::dual_chunk_swap, seq_len, cp);
}

std::vector<std::int64_t> inverse_permutation(const std::vector<std::int64_t>& perm) {
  std::vector<std::int64_t> inverse(perm.size(), -1);
  for (std::size_t i = 0; i < perm.size(); ++i) {
    CPATTN_ASSERT(perm[i] >= 0 && static_cast<std::size_t>(perm[i]) < perm.size() && inverse[perm[i]] == -1);
    inverse[perm[i]] = static_cast<std::int64_t>(i);
  }
  return inverse;
}

}  // namespace cpattn
