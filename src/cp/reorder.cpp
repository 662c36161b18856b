// reorder_sequence: converts a rank's shard between contiguous and dual-chunk-swap order. Both layouts cut S
// into 2*cp chunks of S/(2cp) tokens and give each rank two of them (its local slots 0 and 1); two collective
// permutes move every chunk to the rank and slot the other layout gives it. Each call must be a permutation
// (every rank sends one chunk, receives one): contiguous -> dual chunk swap groups the chunks by source slot
// (even chunks land on distinct ranks, so do odd ones); the way back groups them by destination slot (its
// inverse).
#include <cstring>

#include "cpattn/context_parallel.hpp"
#include "cpattn/error.hpp"
#include "sequence_collectives.hpp"

namespace cpattn {

namespace {

struct Place {
  std::int64_t rank, slot;
};

std::int64_t chunk_at(ShardLayout layout, std::int64_t cp, std::int64_t rank, std::int64_t slot) {
  if (layout == ShardLayout::contiguous) return 2 * rank + slot;
  return slot == 0 ? rank : 2 * cp - 1 - rank;
}

Place place_of(ShardLayout layout, std::int64_t cp, std::int64_t chunk) {
  if (layout == ShardLayout::contiguous) return {chunk / 2, chunk % 2};
  return chunk < cp ? Place{chunk, 0} : Place{2 * cp - 1 - chunk, 1};
}

// Call `call` (0 or 1) of a reorder: the local slot each rank sends and where its chunk lands.
struct ReorderCall {
  std::vector<std::int64_t> sent_slot;
  std::vector<Place> goes_to;
  std::vector<int> dest;
};

ReorderCall reorder_call(std::int64_t cp, ShardLayout from, ShardLayout to, std::int64_t call) {
  const bool by_source_slot = from == ShardLayout::contiguous;
  ReorderCall c;
  for (std::int64_t p = 0; p < cp; ++p) {
    const std::int64_t slot =
        by_source_slot ? call : (place_of(to, cp, chunk_at(from, cp, p, 0)).slot == call ? 0 : 1);
    c.sent_slot.push_back(slot);
    c.goes_to.push_back(place_of(to, cp, chunk_at(from, cp, p, slot)));
    c.dest.push_back(static_cast<int>(c.goes_to.back().rank));
  }
  return c;
}

}  // namespace

std::vector<std::vector<int>> reorder_destinations(std::int64_t cp, ShardLayout from, ShardLayout to) {
  if (from == to) return {};
  return {reorder_call(cp, from, to, 0).dest, reorder_call(cp, from, to, 1).dest};
}

Tensor reorder_sequence(Communicator& comm, const Tensor& x, std::int64_t seq_len, ShardLayout from,
                        ShardLayout to) {
  const std::int64_t cp = comm.size(), rank = comm.rank();
  const Shape4 s = x.shape();
  if (seq_len % (2 * cp) != 0 || s.s * cp != seq_len) {
    throw Error(ErrorKind::invalid_input, "seq_len", std::to_string(seq_len),
                "reorder_sequence needs seq_len (" + std::to_string(seq_len) + ") divisible by 2*cp (" +
                    std::to_string(2 * cp) + ") and shards of seq_len/cp tokens (got " + std::to_string(s.s) +
                    ")");
  }
  if (from == to) return x;
  const std::int64_t c = s.s / 2;
  const std::size_t run = static_cast<std::size_t>(s.h * s.d) * dtype_size(x.dtype());
  const std::size_t chunk_bytes = static_cast<std::size_t>(s.b * c) * run;
  std::vector<unsigned char> send(chunk_bytes), recv(chunk_bytes);
  Tensor y(x.dtype(), s);
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  for (std::int64_t call = 0; call < 2; ++call) {
    const ReorderCall plan = reorder_call(cp, from, to, call);
    const std::vector<int>& dest = plan.dest;
    const std::int64_t slot = plan.sent_slot[rank];
    for (std::int64_t b = 0; b < s.b; ++b) {
      std::memcpy(send.data() + static_cast<std::size_t>(b * c) * run,
                  src + static_cast<std::size_t>(b * s.s + slot * c) * run,
                  static_cast<std::size_t>(c) * run);
    }
    comm.collective_permute(send.data(), recv.data(), s.b * c * s.h * s.d, cp::comm_dtype(x.dtype()), dest);
    for (std::int64_t p = 0; p < cp; ++p) {
      if (dest[p] != rank) continue;
      const Place at = plan.goes_to[p];
      for (std::int64_t b = 0; b < s.b; ++b) {
        std::memcpy(dst + static_cast<std::size_t>(b * s.s + at.slot * c) * run,
                    recv.data() + static_cast<std::size_t>(b * c) * run, static_cast<std::size_t>(c) * run);
      }
    }
  }
  return y;
}

}  // namespace cpattn
