// reorder_sequence: converts a rank's shard between contiguous and dual-chunk-swap order with the two
// collective permutes of reorder_call (sequence_layout.hpp), which moves every chunk to the rank and slot the
// other layout gives it; between any two layouts (those cut by documents too) with one all_to_all_v.
#include <algorithm>
#include <cstring>
#include <string>

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
      throw Error(
          ErrorKind::invalid_input, "layout", to_string(l),
          std::string("reorder_sequence by name converts between contiguous and dual_chunk_swap; layout ") +
              to_string(l) +
              " is cut by the row's documents: pass the layouts themselves (make_layout with the "
              "documents)");
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

namespace {

void check_reorder_layout(const SequenceLayout& l, const char* name, std::int64_t cp, std::int64_t seq_len) {
  if (l.ranks() != cp || l.seq_len != seq_len) {
    throw Error(ErrorKind::invalid_input, name,
                std::to_string(l.ranks()) + " ranks, " + std::to_string(l.seq_len) + " tokens",
                std::string("reorder_sequence: layout `") + name + "` is over " + std::to_string(l.ranks()) +
                    " ranks and " + std::to_string(l.seq_len) + " tokens; it must be over the group's " +
                    std::to_string(cp) + " ranks and `from`'s " + std::to_string(seq_len) + " tokens");
  }
  const auto errors = layout_errors(l);
  if (!errors.empty()) {
    throw Error(
        ErrorKind::invalid_input, name, to_string(l.kind),
        std::string("reorder_sequence: layout `") + name + "` is not a layout of the row: " + errors[0]);
  }
}

}  // namespace

Tensor reorder_sequence(Communicator& comm, const Tensor& x, const SequenceLayout& from,
                        const SequenceLayout& to) {
  const std::int64_t cp = comm.size(), rank = comm.rank(), seq_len = from.seq_len;
  const Shape4 s = x.shape();
  check_reorder_layout(from, "from", cp, seq_len);
  check_reorder_layout(to, "to", cp, seq_len);
  if (s.s * cp != seq_len) {
    throw Error(ErrorKind::invalid_input, "x", std::to_string(s.s) + " tokens",
                "reorder_sequence: a shard of " + std::to_string(s.s) + " tokens; the layouts hold " +
                    std::to_string(seq_len / cp) + " a rank");
  }
  if (from == to) return x;
  // Each position's rank in `from`, and its rank and slot in `to`.
  std::vector<std::int64_t> from_rank(static_cast<std::size_t>(seq_len)), to_rank(from_rank),
      to_slot(from_rank);
  for (std::int64_t p = 0; p < cp; ++p) {
    for (const PositionRange& run : from.runs[static_cast<std::size_t>(p)]) {
      for (std::int64_t i = run.begin; i < run.end; ++i) from_rank[static_cast<std::size_t>(i)] = p;
    }
    std::int64_t slot = 0;
    for (const PositionRange& run : to.runs[static_cast<std::size_t>(p)]) {
      for (std::int64_t i = run.begin; i < run.end; ++i) {
        to_rank[static_cast<std::size_t>(i)] = p;
        to_slot[static_cast<std::size_t>(i)] = slot++;
      }
    }
  }
  // What this rank sends rank p: its slots in `from` whose tokens p holds in `to`, in p's slot order; what it
  // receives from rank r: its slots in `to` whose tokens r holds in `from`, in its own slot order (r's too).
  const auto mine_from = from.positions(rank), mine_to = to.positions(rank);
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> sends(static_cast<std::size_t>(cp));
  for (std::int64_t slot = 0; slot < s.s; ++slot) {
    const auto x_pos = static_cast<std::size_t>(mine_from[static_cast<std::size_t>(slot)]);
    sends[static_cast<std::size_t>(to_rank[x_pos])].push_back({to_slot[x_pos], slot});
  }
  std::vector<std::vector<std::int64_t>> receives(static_cast<std::size_t>(cp));
  for (std::int64_t slot = 0; slot < s.s; ++slot) {
    receives[static_cast<std::size_t>(
                 from_rank[static_cast<std::size_t>(mine_to[static_cast<std::size_t>(slot)])])]
        .push_back(slot);
  }
  // Block p of either buffer: [B][its tokens][H * W], contiguous.
  const std::int64_t row = s.h * s.d;
  const std::size_t elem = dtype_size(x.dtype()), token_bytes = static_cast<std::size_t>(row) * elem;
  BlockList send_blocks, recv_blocks;
  std::int64_t send_at = 0, recv_at = 0;
  for (std::int64_t p = 0; p < cp; ++p) {
    auto& out = sends[static_cast<std::size_t>(p)];
    std::sort(out.begin(), out.end());
    const auto n_out = static_cast<std::int64_t>(out.size());
    const auto n_in = static_cast<std::int64_t>(receives[static_cast<std::size_t>(p)].size());
    send_blocks.shape.push_back({1, 1, s.b * n_out * row});
    send_blocks.offset.push_back(send_at);
    recv_blocks.shape.push_back({1, 1, s.b * n_in * row});
    recv_blocks.offset.push_back(recv_at);
    send_at += s.b * n_out * row;
    recv_at += s.b * n_in * row;
  }
  std::vector<unsigned char> send(static_cast<std::size_t>(send_at) * elem),
      recv(static_cast<std::size_t>(recv_at) * elem);
  const auto* src = static_cast<const unsigned char*>(x.raw());
  for (std::int64_t p = 0; p < cp; ++p) {
    const auto& out = sends[static_cast<std::size_t>(p)];
    unsigned char* block =
        send.data() + static_cast<std::size_t>(send_blocks.offset[static_cast<std::size_t>(p)]) * elem;
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (const auto& [to_at, from_at] : out) {
        std::memcpy(block, src + static_cast<std::size_t>(b * s.s + from_at) * token_bytes, token_bytes);
        block += token_bytes;
      }
    }
  }
  comm.all_to_all_v(send.data(), send_blocks, recv.data(), recv_blocks, comm_dtype(x.dtype()));
  Tensor y(x.dtype(), s);
  auto* dst = static_cast<unsigned char*>(y.raw());
  for (std::int64_t r = 0; r < cp; ++r) {
    const unsigned char* block =
        recv.data() + static_cast<std::size_t>(recv_blocks.offset[static_cast<std::size_t>(r)]) * elem;
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (const std::int64_t slot : receives[static_cast<std::size_t>(r)]) {
        std::memcpy(dst + static_cast<std::size_t>(b * s.s + slot) * token_bytes, block, token_bytes);
        block += token_bytes;
      }
    }
  }
  return y;
}

}  // namespace cpattn
