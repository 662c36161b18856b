// How ranks talk: the Communicator interface the strategies use (and nothing else), with every collective
// counted in the accounting of collectives.hpp so that the planner's predictions can be checked against what
// ran.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpattn/collectives.hpp"

namespace cpattn {

enum class ReduceOp { sum, max, min };

// The blocks of a strided all_to_all, in elements. A block holds shape.outer x shape.inner rows of shape.row
// contiguous elements; in a buffer with strides st, block p starts at p * st.block and its row (i, j) at
// i * st.outer + j * st.inner from there. Row i * inner + j of the block a rank sends lands as the same row
// of the block its peer receives, so one call can split a [B, S/cp, H, D] shard by heads and place what
// arrives straight into a [B, S, H/cp, D] one.
struct BlockShape {
  std::int64_t outer = 1, inner = 1, row = 0;
  std::int64_t count() const { return outer * inner * row; }
  bool operator==(const BlockShape&) const = default;
};
struct BlockStrides {
  std::int64_t block = 0, outer = 0, inner = 0;
};
// Throws Error(invalid_input) naming the field when a shape or stride is negative or the count overflows.
void check_block_layout(const BlockShape& shape, const BlockStrides& send, const BlockStrides& recv);
// One rank's side of an all_to_all_v: block p (sent to, or received from, rank p) holds shape[p] rows laid
// out by the shared strides (outer, inner; in elements), starting offset[p] elements into the buffer. Blocks
// may differ in size from rank to rank and be empty.
struct BlockList {
  std::vector<BlockShape> shape;
  std::vector<std::int64_t> offset;
  std::int64_t outer = 0, inner = 0;
};
// Throws Error(invalid_input) naming the field when a list does not hold `ranks` blocks, or a shape, offset
// or stride is negative or overflows.
void check_block_list(const BlockList& list, int ranks, const char* side);
// all_to_all_v's agreement, shared by the backends that check it before data moves: what a receiver says of
// the first block it did not expect (ranks as the backend names them), and the error every rank raises once
// the ranks agreed that some pair disagrees (`seen`: this rank's own words, empty when it saw none).
std::string block_disagreement(int sender, int receiver, const BlockShape& sent, const BlockShape& expected);
[[noreturn]] void throw_block_mismatch(int me, int sender, int receiver, const std::string& seen);

// Copies one block's rows from src (laid out by `from`) to dst (laid out by `to`), both pointing at the
// block.
void copy_block(const void* src, const BlockStrides& from, void* dst, const BlockStrides& to,
                const BlockShape& shape, std::size_t element_size);

// A ring shift in flight (Communicator::start_shift). wait() completes it (and counts it); until then the
// caller leaves both buffers alone. A shift destroyed without wait() (its rank is failing) withdraws this
// rank's part first, so that no peer reads or writes its buffers afterwards: declare the buffers before the
// handle, so that they outlive it.
class PendingShift {
 public:
  virtual ~PendingShift() = default;
  virtual void wait() = 0;
};

// Collectives over typed buffers. Buffers are rank-major: block p of a send or receive buffer is `count`
// elements at offset p * count. Every rank must make the same calls in the same order with the same counts
// and dtypes; a mismatch, a failed peer or a timeout is an Error(communication) on every rank, never a hang.
class Communicator {
 public:
  Communicator();
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;

  // send: size() blocks of `count`; block p goes to rank p. recv: size() blocks; block p came from rank p.
  virtual void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) = 0;
  // The same exchange (and the same accounting, count = shape.count()) between strided layouts. The default
  // packs into a contiguous buffer, calls all_to_all and unpacks (two extra copies); the in-process group
  // copies each byte once, straight from the sender's layout into the receiver's.
  virtual void all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                                  const BlockStrides& recv_strides, const BlockShape& shape, CommDType dtype);
  // Blocks of per-rank sizes (MPI_Alltoallv's exchange, between strided layouts): send_blocks.shape[p] goes
  // to rank p, recv_blocks.shape[p] comes from rank p. What rank r sends rank p must have the shape rank p
  // expects from r, row for row; otherwise every rank gets an Error(communication) naming the pair. Counted
  // as one all_to_all (all_to_all_v_cost: the largest operand over ranks, and the largest sent). The
  // in-process group copies each byte once, from the sender's layout into the receiver's.
  virtual void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv,
                            const BlockList& recv_blocks, CommDType dtype) = 0;
  // send: `count` elements; recv: size() blocks, block p from rank p.
  virtual void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) = 0;
  // send: size() blocks of `count`; recv: `count` = the sum over ranks of their block rank(). f32 or bf16
  // (bf16 sums accumulate in fp32 in the in-process group).
  virtual void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) = 0;
  // dest[p] is where rank p's `count` elements go (-1: nowhere); recv is written only if some p has
  // dest[p] == rank(). dest must be the same on every rank and send no two blocks to one rank.
  virtual void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                                  const std::vector<int>& dest) = 0;
  // The ring's point-to-point step: `count` elements of send go to rank (r + 1) mod size() and as many from
  // rank (r - 1) mod size() arrive in recv, started now and completed by the handle's wait(), so that the
  // transfer runs while the caller computes: start_shift_v(send, count, recv, count, dtype, 1).
  std::unique_ptr<PendingShift> start_shift(const void* send, void* recv, std::int64_t count,
                                            CommDType dtype) {
    return start_shift_v(send, count, recv, count, dtype, 1);
  }
  // A shift by any distance with counts of this rank's own: send_count elements of send go to rank
  // (r + distance) mod size() and recv_count elements from rank (r - distance) mod size() arrive in recv (a
  // negative distance shifts backwards; the direct ring sends each rank only the rows it can see). Every
  // rank starts the same shifts (same distance) in the same order, empty ones included; what rank r sends
  // must be what its receiver expects. A count that disagrees with the peer's, a failed peer or a timeout is
  // an Error(communication) naming the rank (under MPI a count mismatch is known to the receiver only: its
  // error ends the job, and the others' waits reach the deadline; over a transport a mismatch where one side
  // is empty goes unseen: transport_comm.hpp). Counted when it completes as a
  // collective_permute of send_count (dest[p] = (p + distance) mod size()). The default runs an all_to_all_v
  // at once (counted as that) and returns a completed handle (no overlap); the backends start real transfers.
  virtual std::unique_ptr<PendingShift> start_shift_v(const void* send, std::int64_t send_count, void* recv,
                                                      std::int64_t recv_count, CommDType dtype, int distance);
  virtual void barrier() = 0;
  // Small control values (shapes, error flags); not counted.
  virtual void all_reduce(std::int64_t* values, int n, ReduceOp op) = 0;

  // The ranks of the same `color` as a communicator of their own (MPI_Comm_split), ranked by (key, rank);
  // every rank calls it, in the same order as its collectives. Failures in a sub-communicator reach every
  // communicator of the group it came from (in-process: one abort for the whole family; MPI: the deadline).
  // The default throws Error(invalid_config): the backend cannot split.
  virtual std::unique_ptr<Communicator> split(int color, int key);

  // What this communicator counted (after report_to, the counters it reports to). A communicator that
  // forwards to another returns the other's.
  virtual CollectiveCounters& counters() { return report_to_ != nullptr ? *report_to_ : counters_; }
  // From now on this communicator's accounting goes into `into` (its phase) with `group` on every record
  // (the hybrid strategy counts its two sub-communicators in the caller's counters). `into` must outlive it.
  void report_to(CollectiveCounters& into, std::string group);

  // The host of each rank (0, 1, ... by first appearance), as the backend knows it: the MPI backend by
  // MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), as Open MPI tells nodes apart; empty where every rank shares
  // one host (the in-process group). The accounting counts the bytes sent to ranks on other hosts.
  const std::vector<int>& hosts() const { return hosts_; }

 protected:
  // The accounting for one call; backends call it once per collective, after it succeeded.
  void count(CollectiveKind kind, std::int64_t count, CommDType dtype,
             const std::vector<int>* dest = nullptr);
  // count_cost's callers fill cost.bytes_sent_across_hosts themselves (across_hosts helps).
  void count_cost(CollectiveKind kind, const CollectiveCost& cost);
  // The accounting of one completed shift (start_shift_v): send_count elements, `distance` places on.
  void count_shift(std::int64_t send_count, CommDType dtype, int distance);
  // Throws Error(invalid_input) when a shift's count is negative.
  static void check_shift_counts(std::int64_t send_count, std::int64_t recv_count);
  void set_hosts(std::vector<int> hosts) { hosts_ = std::move(hosts); }
  // Whether rank p is on another host than this rank.
  bool across_hosts(int p) const { return !hosts_.empty() && hosts_[p] != hosts_[rank()]; }

 private:
  CollectiveCounters counters_;
  CollectiveCounters* report_to_ = nullptr;  // report_to's target; null: counters_
  std::string group_;
  std::vector<int> hosts_;
  struct PackBuffers;  // all_to_all_strided's fallback buffers, kept between calls
  std::unique_ptr<PackBuffers> pack_;
};

// Checks a permutation's shape before any rank waits on it; throws Error(invalid_input).
void check_permutation(const std::vector<int>& dest, int size);

}  // namespace cpattn
