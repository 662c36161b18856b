// The Communicator on MPI (Open MPI from Debian), for many processes and machines. It works on a duplicate of
// the communicator the caller gives (MPI_COMM_WORLD or a sub-communicator per context-parallel group), with
// MPI_ERRORS_RETURN, so MPI failures come back as Error(communication) carrying MPI's error string.
// Debian's Open MPI 4.1 has no fault-tolerant MPI: a rank that dies ends the job (mpirun reports it).
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <vector>

#include "cpattn/comm.hpp"

namespace cpattn {

// Ends the job from this rank (MPI_Abort on `comm`, MPI_COMM_WORLD: every rank of the job), and this process
// within 10 s even where MPI_Abort cannot reach mpirun.
[[noreturn]] void end_mpi_job(MPI_Comm comm, int exit_code = 1);

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `comm` (a collective), then meets every rank to find the hosts under `timeout`: a rank that
  // never arrives ends the job after it, as any later wait does.
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD,
                           std::chrono::milliseconds timeout = std::chrono::seconds(600));
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  // Per-peer messages of derived datatypes (packing around all_to_all where a block passes int counts).
  void all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                          const BlockStrides& recv_strides, const BlockShape& shape,
                          CommDType dtype) override;
  void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv, const BlockList& recv_blocks,
                    CommDType dtype) override;
  void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                          const std::vector<int>& dest) override;
  // MPI_Isend to rank + distance and MPI_Irecv from rank - distance, posted now; wait() polls them against
  // the timeout.
  std::unique_ptr<PendingShift> start_shift_v(const void* send, std::int64_t send_count, void* recv,
                                              std::int64_t recv_count, CommDType dtype,
                                              int distance) override;
  void barrier() override;
  void all_reduce(std::int64_t* values, int n, ReduceOp op) override;
  // MPI_Comm_split (after an all_reduce that every rank reaches within the timeout); the sub-communicator
  // keeps this one's timeout, and its messages name ranks of MPI_COMM_WORLD.
  std::unique_ptr<Communicator> split(int color, int key) override;

  MPI_Comm comm() const { return comm_; }
  // How long any wait of this communicator (a collective's, a shift's) polls before the rank prints what made
  // no progress and ends the job (MPI_Abort; default 600 s).
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Whether a started shift has a thread of its own polling it while the rank computes: where MPI was
  // initialised with MPI_THREAD_MULTIPLE, unless CPATTN_MPI_PROGRESS_THREAD=0 (for comparisons).
  bool progress_thread() const { return progress_thread_; }

 private:
  void find_hosts();
  CollectiveCost agree_on_blocks(const BlockList& send_blocks, const BlockList& recv_blocks, CommDType dtype,
                                 bool& packed);
  void exchange_packed(const void* send, const BlockList& send_blocks, void* recv,
                       const BlockList& recv_blocks, CommDType dtype);
  // What a data collective moves to or from one peer: `count` elements of `type` at `data` (0: nothing).
  struct PeerBlock {
    const void* data = nullptr;
    int count = 0;
    MPI_Datatype type = MPI_BYTE;
  };
  // A data collective as per-peer MPI_Irecv / MPI_Isend (the rank's own block included) on the collective's
  // own tag, completed against the timeout: past it, the ranks whose blocks never came are named; a peer that
  // sent less than expected is a collective mismatch (Error(communication)).
  void exchange(const std::vector<PeerBlock>& sends, const std::vector<PeerBlock>& recvs, const char* what,
                int tag);
  // Completes n requests polling against the timeout (no MPI wait blocks forever); past it, prints which call
  // made no progress (and, when the first requests are receives from the ranks `from`, which of those never
  // came) and ends the job.
  void complete(MPI_Request* requests, int n, const char* what, const std::vector<int>* from = nullptr,
                MPI_Status* statuses = nullptr);
  // An MPI error while requests are in flight: print it and end the job.
  [[noreturn]] void fail(int rc, const char* what);

  // Rank r of this communicator as a rank of MPI_COMM_WORLD (what messages name).
  int world(int r) const { return world_.empty() ? r : world_[static_cast<std::size_t>(r)]; }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_;               // world(r) for each rank r
  std::vector<unsigned char> gathered_;  // reduce_scatter's blocks from every rank, kept between calls
  std::chrono::milliseconds timeout_;
  bool progress_thread_ = false;
  friend class MpiShift;
};

}  // namespace cpattn
