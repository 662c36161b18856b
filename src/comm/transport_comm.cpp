// The Communicator over a Transport (include/cpattn/transport.hpp): every collective as point-to-point byte
// messages, the rank's own block copied locally. Strided and variable blocks are packed into contiguous
// buffers around the messages; the reduce-scatter sums in rank order here (sum_blocks.hpp: the same bits as
// the other backends); a sub-communicator (split) is a subset of the transport's ranks with tags of its own.
#include "cpattn/transport_comm.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "cpattn/error.hpp"
#include "sum_blocks.hpp"

namespace cpattn {

namespace {

// Tags: each communicator has a block of its own (kTagBlock wide); collectives use its first tag, ring shifts
// the next ones by their number (several may be in flight between the same ranks).
constexpr std::int64_t kTagBlock = 4096;
constexpr std::int64_t kShiftTags = kTagBlock - 2;
constexpr std::int64_t kMaxTag = (std::int64_t{1} << 31) - 1;

std::size_t bytes_of(std::int64_t count, CommDType dtype) {
  return static_cast<std::size_t>(count) * comm_dtype_size(dtype);
}

}  // namespace

TransportCommunicator::TransportCommunicator(std::shared_ptr<Transport> transport,
                                             std::chrono::milliseconds timeout)
    : transport_(std::move(transport)), timeout_(timeout), id_(1), failed_(std::make_shared<bool>(false)) {
  if (!transport_) throw Error(ErrorKind::invalid_config, "transport", "", "no transport given");
  members_.resize(static_cast<std::size_t>(transport_->size()));
  std::iota(members_.begin(), members_.end(), 0);
  rank_ = transport_->rank();
}

TransportCommunicator::TransportCommunicator(std::shared_ptr<Transport> transport, std::vector<int> members,
                                             int rank, std::chrono::milliseconds timeout, std::int64_t id,
                                             std::shared_ptr<bool> failed)
    : transport_(std::move(transport)),
      members_(std::move(members)),
      rank_(rank),
      timeout_(timeout),
      id_(id),
      failed_(std::move(failed)) {}

TransportCommunicator::~TransportCommunicator() = default;

std::int64_t TransportCommunicator::tag(std::int64_t offset) const {
  return id_ * kTagBlock + offset;
}

void TransportCommunicator::exchange(const std::vector<Block>& sends, const std::vector<Block>& recvs,
                                     std::int64_t tag_offset) {
  std::vector<Transport::Message> out, in;
  for (std::size_t p = 0; p < sends.size(); ++p) {
    const int peer = static_cast<int>(p);
    if (peer == rank_) {
      CPATTN_ASSERT(sends[p].bytes == recvs[p].bytes);
      if (sends[p].bytes > 0) std::memmove(recvs[p].writable(), sends[p].data, sends[p].bytes);
      continue;
    }
    if (sends[p].bytes > 0) out.push_back({members_[p], const_cast<void*>(sends[p].data), sends[p].bytes});
    if (recvs[p].bytes > 0) in.push_back({members_[p], recvs[p].writable(), recvs[p].bytes});
  }
  if (out.empty() && in.empty()) return;
  check_usable();
  try {
    transport_->start(out, in, tag(tag_offset))->wait(timeout_);
  } catch (...) {
    *failed_ = true;
    throw;
  }
}

void TransportCommunicator::check_usable() const {
  if (*failed_) {
    throw Error(
        ErrorKind::communication, "group", transport_->name(),
        "an earlier collective failed on this " + transport_->name() +
            " communicator (or one split from it): messages of it may still be in flight, so it takes no "
            "more; make a new group and a new object");
  }
}

void TransportCommunicator::all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  const std::size_t block = bytes_of(count, dtype);
  std::vector<Block> sends, recvs;
  for (int p = 0; p < size(); ++p) {
    sends.push_back({static_cast<const char*>(send) + p * block, block});
    recvs.push_back({static_cast<char*>(recv) + p * block, block});
  }
  exchange(sends, recvs, 0);
  this->count(CollectiveKind::all_to_all, count, dtype);
}

void TransportCommunicator::all_to_all_v(const void* send, const BlockList& send_blocks, void* recv,
                                         const BlockList& recv_blocks, CommDType dtype) {
  check_block_list(send_blocks, size(), "send");
  check_block_list(recv_blocks, size(), "recv");
  const auto n = static_cast<std::size_t>(size());
  const std::size_t e = comm_dtype_size(dtype);
  // Before any data moves, each peer's block shape against the one this rank expects, and the verdict agreed
  // by every rank: a disagreement is an error on every rank, never a short or long receive.
  std::vector<std::int64_t> mine(3 * n), theirs(3 * n);
  std::int64_t operand = 0;
  for (std::size_t p = 0; p < n; ++p) {
    const BlockShape& s = send_blocks.shape[p];
    mine[3 * p] = s.outer;
    mine[3 * p + 1] = s.inner;
    mine[3 * p + 2] = s.row;
    operand += s.count();
  }
  {
    std::vector<Block> sends, recvs;
    for (std::size_t p = 0; p < n; ++p) {
      sends.push_back({mine.data() + 3 * p, 3 * sizeof(std::int64_t)});
      recvs.push_back({theirs.data() + 3 * p, 3 * sizeof(std::int64_t)});
    }
    exchange(sends, recvs, 0);
  }
  std::int64_t pair = 0;  // 1 + sender * n + receiver of this rank's first disagreement, 0 when none
  std::string disagreement;
  for (std::size_t p = 0; p < n && pair == 0; ++p) {
    const BlockShape got{theirs[3 * p], theirs[3 * p + 1], theirs[3 * p + 2]};
    if (!(got == recv_blocks.shape[p])) {
      pair = 1 + static_cast<std::int64_t>(p) * size() + rank_;
      disagreement = block_disagreement(static_cast<int>(p), rank_, got, recv_blocks.shape[p]);
    }
  }
  const auto el = static_cast<std::int64_t>(e);
  std::int64_t agreed[3] = {pair, operand * el, (operand - send_blocks.shape[rank_].count()) * el};
  all_reduce(agreed, 3, ReduceOp::max);
  if (agreed[0] != 0) {
    const auto sender = static_cast<int>((agreed[0] - 1) / size()),
               receiver = static_cast<int>((agreed[0] - 1) % size());
    throw_block_mismatch(rank_, sender, receiver, disagreement);
  }
  // Packed: each peer's block contiguous, in a buffer per side.
  std::vector<std::size_t> soff(n + 1, 0), roff(n + 1, 0);
  for (std::size_t p = 0; p < n; ++p) {
    soff[p + 1] = soff[p] + static_cast<std::size_t>(send_blocks.shape[p].count()) * e;
    roff[p + 1] = roff[p] + static_cast<std::size_t>(recv_blocks.shape[p].count()) * e;
  }
  if (pack_send_.size() < soff[n]) pack_send_.resize(soff[n]);
  if (pack_recv_.size() < roff[n]) pack_recv_.resize(roff[n]);
  std::vector<Block> sends, recvs;
  for (std::size_t p = 0; p < n; ++p) {
    const BlockShape& s = send_blocks.shape[p];
    if (s.count() > 0) {
      copy_block(static_cast<const unsigned char*>(send) + send_blocks.offset[p] * el,
                 {0, send_blocks.outer, send_blocks.inner}, pack_send_.data() + soff[p],
                 {0, s.inner * s.row, s.row}, s, e);
    }
    sends.push_back({pack_send_.data() + soff[p], soff[p + 1] - soff[p]});
    recvs.push_back({pack_recv_.data() + roff[p], roff[p + 1] - roff[p]});
  }
  exchange(sends, recvs, 0);
  for (std::size_t p = 0; p < n; ++p) {
    const BlockShape& s = recv_blocks.shape[p];
    if (s.count() == 0) continue;
    copy_block(pack_recv_.data() + roff[p], {0, s.inner * s.row, s.row},
               static_cast<unsigned char*>(recv) + recv_blocks.offset[p] * el,
               {0, recv_blocks.outer, recv_blocks.inner}, s, e);
  }
  count_cost(CollectiveKind::all_to_all, {agreed[1], agreed[2]});
}

void TransportCommunicator::all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  const std::size_t block = bytes_of(count, dtype);
  std::vector<Block> sends, recvs;
  for (int p = 0; p < size(); ++p) {
    sends.push_back({send, block});
    recvs.push_back({static_cast<char*>(recv) + p * block, block});
  }
  exchange(sends, recvs, 0);
  this->count(CollectiveKind::all_gather, count, dtype);
}

void TransportCommunicator::reduce_scatter_sum(const void* send, void* recv, std::int64_t count,
                                               CommDType dtype) {
  if (dtype == CommDType::i32) {
    throw Error(ErrorKind::invalid_input, "dtype", "i32", "reduce_scatter_sum takes f32 or bf16, not i32");
  }
  // Every rank's block for this one, then the sum in rank order here.
  const std::size_t block = bytes_of(count, dtype);
  if (pack_recv_.size() < block * members_.size()) pack_recv_.resize(block * members_.size());
  std::vector<Block> sends, recvs;
  for (int p = 0; p < size(); ++p) {
    sends.push_back({static_cast<const char*>(send) + p * block, block});
    recvs.push_back({pack_recv_.data() + p * block, block});
  }
  exchange(sends, recvs, 0);
  if (count > 0) {
    std::vector<const void*> blocks;
    for (int p = 0; p < size(); ++p) blocks.push_back(pack_recv_.data() + p * block);
    detail::sum_rank_blocks(blocks, count, dtype, recv);
  }
  this->count(CollectiveKind::reduce_scatter, count, dtype);
}

void TransportCommunicator::collective_permute(const void* send, void* recv, std::int64_t count,
                                               CommDType dtype, const std::vector<int>& dest) {
  check_permutation(dest, size());
  const std::size_t bytes = bytes_of(count, dtype);
  std::vector<Block> sends(members_.size()), recvs(members_.size());
  for (int p = 0; p < size(); ++p) {
    if (dest[p] == rank_) recvs[p] = {recv, bytes};
  }
  if (dest[rank_] >= 0) sends[dest[rank_]] = {send, bytes};
  exchange(sends, recvs, 0);
  this->count(CollectiveKind::collective_permute, count, dtype, &dest);
}

namespace {

// The caller waits before its communicator goes (the strategies do: a shift lives inside one call).
class TransportShift final : public PendingShift {
 public:
  TransportShift(std::unique_ptr<Transport::Pending> pending, std::chrono::milliseconds timeout,
                 std::shared_ptr<bool> failed, std::function<void()> counted)
      : pending_(std::move(pending)),
        timeout_(timeout),
        failed_(std::move(failed)),
        counted_(std::move(counted)) {}
  // Left unwaited (its rank is failing): its messages may still be in flight.
  ~TransportShift() override {
    if (pending_) *failed_ = true;
  }
  void wait() override {
    if (pending_) {
      try {
        pending_->wait(timeout_);
      } catch (...) {
        *failed_ = true;
        throw;
      }
    }
    pending_.reset();
    counted_();
  }

 private:
  std::unique_ptr<Transport::Pending> pending_;  // null: nothing to move (one rank, or no bytes)
  std::chrono::milliseconds timeout_;
  std::shared_ptr<bool> failed_;
  std::function<void()> counted_;
};

}  // namespace

std::unique_ptr<PendingShift> TransportCommunicator::start_shift_v(const void* send, std::int64_t send_count,
                                                                   void* recv, std::int64_t recv_count,
                                                                   CommDType dtype, int distance) {
  check_shift_counts(send_count, recv_count);
  const std::size_t out = bytes_of(send_count, dtype), in = bytes_of(recv_count, dtype);
  const int n = size(), d = static_cast<int>(((distance % n) + n) % n);
  const int to = (rank_ + d) % n, from = (rank_ + n - d) % n;
  // Every rank numbers every shift, empty ones too: a peer's tag must match this rank's.
  const std::int64_t offset = 1 + (shifts_++ % kShiftTags);
  std::unique_ptr<Transport::Pending> pending;
  if (to == rank_) {
    if (out != in) {
      throw Error(ErrorKind::communication, "collective", "shift",
                  "shift mismatch: rank " + std::to_string(rank_) + " sends itself " + std::to_string(out) +
                      " bytes but expects " + std::to_string(in));
    }
    if (out > 0) std::memmove(recv, send, out);
  } else if (out > 0 || in > 0) {
    check_usable();
    std::vector<Transport::Message> sends, recvs;
    if (out > 0) sends.push_back({members_[to], const_cast<void*>(send), out});
    if (in > 0) recvs.push_back({members_[from], recv, in});
    try {
      pending = transport_->start(sends, recvs, tag(offset));
    } catch (...) {
      *failed_ = true;
      throw;
    }
  }
  return std::make_unique<TransportShift>(
      std::move(pending), timeout_, failed_,
      [this, send_count, dtype, distance] { count_shift(send_count, dtype, distance); });
}

void TransportCommunicator::barrier() {
  all_reduce(nullptr, 0, ReduceOp::sum);
}

void TransportCommunicator::all_reduce(std::int64_t* values, int n, ReduceOp op) {
  // Control values (n is small) to every rank, after the counts themselves in a message of fixed size: ranks
  // that pass different counts are told apart before a message of the wrong size is posted.
  const auto ranks = members_.size();
  std::vector<std::int64_t> counts(ranks);
  const std::int64_t mine = n;
  std::vector<Block> sends, recvs;
  for (std::size_t p = 0; p < ranks; ++p) {
    sends.push_back({&mine, sizeof mine});
    recvs.push_back({&counts[p], sizeof mine});
  }
  exchange(sends, recvs, 0);
  for (std::size_t p = 0; p < ranks; ++p) {
    if (counts[p] != n) {
      throw Error(ErrorKind::communication, "collective", "all_reduce",
                  "collective mismatch: rank " + std::to_string(p) + " passed " + std::to_string(counts[p]) +
                      " values to all_reduce (or barrier) where rank " + std::to_string(rank_) + " passed " +
                      std::to_string(n));
    }
  }
  const auto un = static_cast<std::size_t>(std::max(n, 0));
  if (un == 0) return;
  std::vector<std::int64_t> theirs(un * ranks);
  sends.clear();
  recvs.clear();
  for (std::size_t p = 0; p < ranks; ++p) {
    sends.push_back({values, un * sizeof(std::int64_t)});
    recvs.push_back({theirs.data() + p * un, un * sizeof(std::int64_t)});
  }
  exchange(sends, recvs, 0);
  for (std::size_t i = 0; i < un; ++i) {
    std::int64_t v = theirs[i];
    for (std::size_t p = 1; p < ranks; ++p) {
      const std::int64_t x = theirs[p * un + i];
      v = op == ReduceOp::sum ? v + x : op == ReduceOp::max ? std::max(v, x) : std::min(v, x);
    }
    values[i] = v;
  }
}

std::unique_ptr<Communicator> TransportCommunicator::split(int color, int key) {
  if (color < 0) {
    throw Error(ErrorKind::invalid_input, "color", std::to_string(color),
                "split color (" + std::to_string(color) + ") must be >= 0");
  }
  const auto ranks = members_.size();
  std::int64_t mine[2] = {color, key};
  std::vector<std::int64_t> all(2 * ranks);
  std::vector<Block> sends, recvs;
  for (std::size_t p = 0; p < ranks; ++p) {
    sends.push_back({mine, sizeof mine});
    recvs.push_back({all.data() + 2 * p, sizeof mine});
  }
  exchange(sends, recvs, 0);
  std::vector<int> order;  // this communicator's ranks of my color, by (key, rank)
  for (std::size_t p = 0; p < ranks; ++p) {
    if (all[2 * p] == color) order.push_back(static_cast<int>(p));
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  std::vector<int> members;
  int me = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (order[i] == rank_) me = static_cast<int>(i);
    members.push_back(members_[static_cast<std::size_t>(order[i])]);
  }
  // Tags of its own, named by this communicator's id and the split's number, 1 to 63 and then again from 1:
  // every exchange completes before its call returns, so sub-communicators that share an id never have
  // messages in flight at once (and those of one split are disjoint: they never exchange messages).
  splits_ = splits_ % 63 + 1;
  const std::int64_t id = id_ * 64 + splits_;
  if (id > kMaxTag / kTagBlock) {
    throw Error(ErrorKind::invalid_config, "split", std::to_string(id_),
                "splits of a " + transport_->name() + " communicator nested too deep for its message tags");
  }
  return std::unique_ptr<Communicator>(
      new TransportCommunicator(transport_, std::move(members), me, timeout_, id, failed_));
}

}  // namespace cpattn
