// reorder_sequence: converts a rank's shard between contiguous and dual-chunk-swap order with the two
// collective permutes of reorder_call (sequence_layout.hpp), which moves every chunk to the rank and slot the
// other layout gives it.
#include <cstring>

#include "cpattn/context_parallel.hpp"
#include "cpattn/error.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {

Tensor reorder_sequence(Communicator& comm, const Tensor& x, std::int64_t seq_len, ShardLayout from,
                        ShardLayout to) {
  const std::int64_t cp = comm.size(), rank = comm.rank();
  const Shape4 s = x.shape();
  for (const ShardLayout l : {from, to}) {
    if (layout_reads_documents(l)) {
      throw Error(ErrorKind::invalid_input, "layout", to_string(l),
                  std::string("reorder_sequence converts between contiguous and dual_chunk_swap; layout ") +
                      to_string(l) +
                      " is cut by the row's documents (put_tokens/take_tokens with its positions)");
    }
  }
  if (seq_len % layout_chunks(ShardLayout::dual_chunk_swap, cp) != 0 || s.s * cp != seq_len) {
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
    comm.collective_permute(send.data(), recv.data(), s.b * c * s.h * s.d, comm_dtype(x.dtype()), dest);
    for (std::int64_t p = 0; p < cp; ++p) {
      if (dest[p] != rank) continue;
      const ChunkPlace at = plan.goes_to[p];
      for (std::int64_t b = 0; b < s.b; ++b) {
        std::memcpy(dst + static_cast<std::size_t>(b * s.s + at.slot * c) * run,
                    recv.data() + static_cast<std::size_t>(b * c) * run, static_cast<std::size_t>(c) * run);
      }
    }
  }
  return y;
}

}  // namespace cpattn
