// The Communicator over a Transport: every collective as point-to-point byte messages (a torch.distributed
// process group's isend/irecv, through the Python module), counted like the other backends. Made by
// make_communicator(Backend::transport, options) with options.transport set. Ranks that pass different
// counts to all_reduce, or different block shapes to all_to_all_v, get an Error(communication) on every rank;
// the other collectives' counts are the strategies' (agreed before any data moves): a mismatch there is the
// transport's error (gloo refuses a message longer than its receive). After any failure the communicator
// takes no more calls.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/transport.hpp"

namespace cpattn {

class TransportCommunicator final : public Communicator {
 public:
  // The transport's whole group; every wait (a collective's, a shift's) within `timeout`.
  TransportCommunicator(std::shared_ptr<Transport> transport, std::chrono::milliseconds timeout);
  ~TransportCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  const char* backend() const override { return "transport"; }

  void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  // Blocks packed into contiguous buffers; the shapes agreed by every rank first.
  void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv, const BlockList& recv_blocks,
                    CommDType dtype) override;
  void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                          const std::vector<int>& dest) override;
  // The send to rank + distance and the receive from rank - distance started now (the transport moves them
  // while the rank computes); wait() completes them within the timeout. Counts are not exchanged and an
  // empty side posts no message: a peer that sends where this rank expects nothing is not seen here (the
  // strategies take both sides from one schedule of specs the ranks agreed on).
  std::unique_ptr<PendingShift> start_shift_v(const void* send, std::int64_t send_count, void* recv,
                                              std::int64_t recv_count, CommDType dtype,
                                              int distance) override;
  void barrier() override;
  void all_reduce(std::int64_t* values, int n, ReduceOp op) override;
  // The ranks of `color` by (key, rank), on the same transport with message tags of their own.
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  TransportCommunicator(std::shared_ptr<Transport> transport, std::vector<int> members, int rank,
                        std::chrono::milliseconds timeout, std::int64_t id, std::shared_ptr<bool> failed);
  // After a failed exchange messages of it may still be in flight: the communicator (and every one split from
  // the same root) refuses further calls with Error(communication).
  void check_usable() const;
  // A block to send, or (made from a writable buffer) to receive into.
  struct Block {
    const void* data = nullptr;
    std::size_t bytes = 0;
    void* writable() const { return const_cast<void*>(data); }
  };
  // One data exchange: block p of `sends` to rank p, block p of `recvs` from it (the rank's own copied here),
  // completed within the timeout.
  void exchange(const std::vector<Block>& sends, const std::vector<Block>& recvs, std::int64_t tag_offset);
  std::int64_t tag(std::int64_t offset) const;

  std::shared_ptr<Transport> transport_;
  std::vector<int> members_;  // this communicator's ranks as the transport's
  int rank_ = 0;
  std::chrono::milliseconds timeout_;
  std::int64_t id_ = 1;  // names this communicator's block of tags
  std::int64_t splits_ = 0, shifts_ = 0;
  std::shared_ptr<bool> failed_;                      // shared by the communicators split from one root
  std::vector<unsigned char> pack_send_, pack_recv_;  // all_to_all_v's packed blocks, reduce_scatter's
};

}  // namespace cpattn
