#include "cpattn/mpi_comm.hpp"

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "core/start_thread.hpp"
#include "cpattn/bf16.hpp"
#include "cpattn/error.hpp"
#include "sum_blocks.hpp"

namespace cpattn {

namespace {

MPI_Datatype mpi_type(CommDType t) {
  switch (t) {
    case CommDType::f32:
      return MPI_FLOAT;
    case CommDType::bf16:
      return MPI_UINT16_T;  // moved as raw 16-bit words
    case CommDType::i32:
      return MPI_INT32_T;
  }
  return MPI_BYTE;
}

void check(int rc, const char* what, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(ErrorKind::communication, "mpi", what,
              std::string(what) + " failed on rank " + std::to_string(rank) + ": " + std::string(text, len));
}

int as_int(std::int64_t count, const char* what) {
  if (count < 0 || count > INT_MAX) {
    throw Error(ErrorKind::invalid_input, "count", std::to_string(count),
                std::string(what) + ": " + std::to_string(count) +
                    " elements per rank exceed MPI's int count (" + std::to_string(INT_MAX) + ")");
  }
  return static_cast<int>(count);
}

// One block of a strided all_to_all as an MPI datatype: outer x inner rows of `row` elements.
MPI_Datatype block_type(const BlockShape& shape, const BlockStrides& st, CommDType dtype) {
  const auto e = static_cast<MPI_Aint>(comm_dtype_size(dtype));
  MPI_Datatype row = MPI_DATATYPE_NULL, inner = MPI_DATATYPE_NULL, outer = MPI_DATATYPE_NULL;
  MPI_Type_contiguous(static_cast<int>(shape.row), mpi_type(dtype), &row);
  MPI_Type_create_hvector(static_cast<int>(shape.inner), 1, st.inner * e, row, &inner);
  MPI_Type_create_hvector(static_cast<int>(shape.outer), 1, st.outer * e, inner, &outer);
  MPI_Type_commit(&outer);
  MPI_Type_free(&inner);
  MPI_Type_free(&row);
  return outer;
}

// Whether one derived datatype per block (int counts; byte strides are MPI_Aint) can describe these blocks.
bool fits_datatypes(const BlockList& send_blocks, const BlockList& recv_blocks) {
  bool fits = true;
  for (std::size_t p = 0; p < send_blocks.shape.size(); ++p) {
    for (const BlockList* l : {&send_blocks, &recv_blocks}) {
      const BlockShape& s = l->shape[p];
      fits = fits && s.outer <= INT_MAX && s.inner <= INT_MAX && s.row <= INT_MAX;
    }
  }
  return fits;
}

// CPATTN_MPI_PACKED_ALLTOALLV=1: all_to_all_v always takes its packed path (the tests run both paths).
bool force_packed_alltoallv() {
  static const bool forced = [] {
    const char* v = std::getenv("CPATTN_MPI_PACKED_ALLTOALLV");
    return v != nullptr && std::string(v) == "1";
  }();
  return forced;
}

}  // namespace

[[noreturn]] void end_mpi_job(MPI_Comm comm, int exit_code) {
  // MPI_Abort asks mpirun (through this host's daemon) to end every rank; where mpirun cannot be reached (a
  // host cut off from it) it may never return: leave on our own after a grace period.
  std::thread([exit_code] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::fprintf(stderr, "MPI_Abort did not end this process in 10 s; exiting\n");
    std::fflush(stderr);
    std::_Exit(exit_code);
  }).detach();
  MPI_Abort(comm == MPI_COMM_NULL ? MPI_COMM_WORLD : comm, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; the compiler cannot know
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::chrono::milliseconds timeout) : timeout_(timeout) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    throw Error(ErrorKind::invalid_config, "backend", "mpi",
                "the MPI backend needs MPI_Init first (run under mpirun)");
  }
  check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup", -1);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  {
    MPI_Group mine = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &all);
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) ranks[r] = r;
    world_.resize(ranks.size());
    MPI_Group_translate_ranks(mine, size_, ranks.data(), all, world_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&all);
  }
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  const char* env = std::getenv("CPATTN_MPI_PROGRESS_THREAD");
  progress_thread_ = level == MPI_THREAD_MULTIPLE && !(env != nullptr && std::string(env) == "0");
  try {
    find_hosts();
  } catch (...) {
    MPI_Comm_free(&comm_);
    throw;
  }
}

// Hosts as Open MPI tells nodes apart: the ranks that can share memory (MPI_Comm_split_type), each host named
// by its lowest world rank, then numbered by first appearance. The exchanges are this communicator's own,
// under its deadline; MPI_Comm_split_type blocks without one, right after every rank met.
void MpiCommunicator::find_hosts() {
  barrier();
  MPI_Comm node = MPI_COMM_NULL;
  check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "MPI_Comm_split_type",
        world(rank_));
  MPI_Group mine = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
  MPI_Comm_group(node, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &all);
  int n = 0;
  MPI_Group_size(mine, &n);
  std::vector<int> local(static_cast<std::size_t>(n)), in_world(local.size());
  for (int r = 0; r < n; ++r) local[r] = r;
  MPI_Group_translate_ranks(mine, n, local.data(), all, in_world.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&all);
  MPI_Comm_free(&node);
  std::vector<std::int64_t> leaders(static_cast<std::size_t>(size_), 0);
  leaders[rank_] = *std::min_element(in_world.begin(), in_world.end());
  all_reduce(leaders.data(), size_, ReduceOp::sum);
  std::vector<int> hosts(leaders.size());
  std::vector<std::int64_t> seen;
  for (std::size_t r = 0; r < leaders.size(); ++r) {
    auto it = std::find(seen.begin(), seen.end(), leaders[r]);
    if (it == seen.end()) it = seen.insert(seen.end(), leaders[r]);
    hosts[r] = static_cast<int>(it - seen.begin());
  }
  if (seen.size() > 1) set_hosts(std::move(hosts));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  const int n = as_int(count, "all_to_all");
  const auto block = static_cast<std::ptrdiff_t>(count * static_cast<std::int64_t>(comm_dtype_size(dtype)));
  std::vector<PeerBlock> sends, recvs;
  for (int p = 0; p < size_; ++p) {
    sends.push_back({static_cast<const char*>(send) + p * block, n, mpi_type(dtype)});
    recvs.push_back({static_cast<char*>(recv) + p * block, n, mpi_type(dtype)});
  }
  exchange(sends, recvs, "all_to_all", 7010);
  this->count(CollectiveKind::all_to_all, count, dtype);
}

void MpiCommunicator::all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                                         const BlockStrides& recv_strides, const BlockShape& shape,
                                         CommDType dtype) {
  check_block_layout(shape, send_strides, recv_strides);
  const auto e = static_cast<std::int64_t>(comm_dtype_size(dtype));
  if (shape.count() == 0 || shape.outer > INT_MAX || shape.inner > INT_MAX || shape.row > INT_MAX) {
    // Beyond what one derived datatype's int counts describe: pack around all_to_all instead.
    Communicator::all_to_all_strided(send, send_strides, recv, recv_strides, shape, dtype);
    return;
  }
  // One derived datatype per side: MPI moves the rows without a pack step of ours.
  MPI_Datatype send_type = block_type(shape, send_strides, dtype);
  MPI_Datatype recv_type = block_type(shape, recv_strides, dtype);
  std::vector<PeerBlock> sends, recvs;
  for (int p = 0; p < size_; ++p) {
    sends.push_back({static_cast<const char*>(send) + p * send_strides.block * e, 1, send_type});
    recvs.push_back({static_cast<char*>(recv) + p * recv_strides.block * e, 1, recv_type});
  }
  exchange(sends, recvs, "all_to_all_strided", 7011);
  MPI_Type_free(&send_type);
  MPI_Type_free(&recv_type);
  this->count(CollectiveKind::all_to_all, shape.count(), dtype);
}

// Before any data moves: every rank hands each peer the shape it will send (an uncounted control exchange),
// compares it with the shape it expects, and the verdict, the accounting's two maxima and the path (`packed`:
// in, whether this rank needs the packed one; out, whether any rank does) are agreed by an all_reduce, so
// that a disagreement is an error on every rank, not a truncated or short receive, and every rank takes one
// path.
CollectiveCost MpiCommunicator::agree_on_blocks(const BlockList& send_blocks, const BlockList& recv_blocks,
                                                CommDType dtype, bool& packed) {
  const auto n = static_cast<std::size_t>(size_);
  std::vector<std::int64_t> mine(3 * n), theirs(3 * n);
  std::int64_t operand = 0;
  for (std::size_t p = 0; p < n; ++p) {
    const BlockShape& s = send_blocks.shape[p];
    mine[3 * p] = s.outer;
    mine[3 * p + 1] = s.inner;
    mine[3 * p + 2] = s.row;
    operand += s.count();
  }
  std::vector<PeerBlock> sends, recvs;
  for (std::size_t p = 0; p < n; ++p) {
    sends.push_back({mine.data() + 3 * p, 3, MPI_INT64_T});
    recvs.push_back({theirs.data() + 3 * p, 3, MPI_INT64_T});
  }
  exchange(sends, recvs, "all_to_all_v (block shapes)", 7012);
  std::string disagreement;
  std::int64_t pair = 0;  // 1 + sender * n + receiver of the first disagreement this rank saw, 0 when none
  for (std::size_t p = 0; p < n && disagreement.empty(); ++p) {
    const BlockShape got{theirs[3 * p], theirs[3 * p + 1], theirs[3 * p + 2]};
    if (!(got == recv_blocks.shape[p])) {
      pair = 1 + static_cast<std::int64_t>(p) * size_ + rank_;
      disagreement = block_disagreement(world(static_cast<int>(p)), world(rank_), got, recv_blocks.shape[p]);
    }
  }
  const std::int64_t e = static_cast<std::int64_t>(comm_dtype_size(dtype));
  std::int64_t received = 0;  // elements; with `operand`, what the packed path's int counts must hold
  for (const BlockShape& r : recv_blocks.shape) received += r.count();
  std::int64_t agreed[5] = {pair, operand * e, (operand - send_blocks.shape[rank_].count()) * e,
                            packed ? 1 : 0, std::max(operand, received)};
  all_reduce(agreed, 5, ReduceOp::max);
  packed = agreed[3] != 0;
  if (agreed[0] == 0 && packed && agreed[4] > INT_MAX) {
    throw Error(ErrorKind::communication, "collective", "all_to_all_v",
                "all_to_all_v moves " + std::to_string(agreed[4]) +
                    " elements to or from one rank; MPI's int counts hold at most " +
                    std::to_string(INT_MAX) + " (split the call)");
  }
  if (agreed[0] != 0) {
    const auto sender = static_cast<int>((agreed[0] - 1) / size_),
               receiver = static_cast<int>((agreed[0] - 1) % size_);
    throw_block_mismatch(world(rank_), world(sender), world(receiver), disagreement);
  }
  return {agreed[1], agreed[2]};
}

void MpiCommunicator::all_to_all_v(const void* send, const BlockList& send_blocks, void* recv,
                                   const BlockList& recv_blocks, CommDType dtype) {
  check_block_list(send_blocks, size_, "send");
  check_block_list(recv_blocks, size_, "recv");
  const auto e = static_cast<std::int64_t>(comm_dtype_size(dtype));
  const auto n = static_cast<std::size_t>(size_);
  // One derived datatype per block when int counts can describe the blocks; else (or when
  // CPATTN_MPI_PACKED_ALLTOALLV=1 forces it, for the tests) the blocks packed into contiguous buffers.
  bool packed = force_packed_alltoallv() || !fits_datatypes(send_blocks, recv_blocks);
  CollectiveCost cost = agree_on_blocks(send_blocks, recv_blocks, dtype, packed);
  for (std::size_t p = 0; p < n; ++p) {
    if (across_hosts(static_cast<int>(p))) cost.bytes_sent_across_hosts += send_blocks.shape[p].count() * e;
  }
  if (!packed) {
    std::vector<PeerBlock> sends(n), recvs(n);
    for (std::size_t p = 0; p < n; ++p) {
      if (send_blocks.shape[p].count() > 0) {
        sends[p] = {static_cast<const char*>(send) + send_blocks.offset[p] * e, 1,
                    block_type(send_blocks.shape[p], {0, send_blocks.outer, send_blocks.inner}, dtype)};
      }
      if (recv_blocks.shape[p].count() > 0) {
        recvs[p] = {static_cast<char*>(recv) + recv_blocks.offset[p] * e, 1,
                    block_type(recv_blocks.shape[p], {0, recv_blocks.outer, recv_blocks.inner}, dtype)};
      }
    }
    exchange(sends, recvs, "all_to_all_v", 7013);
    for (std::size_t p = 0; p < n; ++p) {
      if (sends[p].count > 0) MPI_Type_free(&sends[p].type);
      if (recvs[p].count > 0) MPI_Type_free(&recvs[p].type);
    }
  } else {
    exchange_packed(send, send_blocks, recv, recv_blocks, dtype);
  }
  count_cost(CollectiveKind::all_to_all, cost);
}

void MpiCommunicator::exchange_packed(const void* send, const BlockList& send_blocks, void* recv,
                                      const BlockList& recv_blocks, CommDType dtype) {
  const auto e = static_cast<std::int64_t>(comm_dtype_size(dtype));
  const auto n = static_cast<std::size_t>(size_);
  std::vector<int> scounts(n), rcounts(n), sdispls(n), rdispls(n);
  std::int64_t stotal = 0, rtotal = 0;
  for (std::size_t p = 0; p < n; ++p) {
    sdispls[p] = as_int(stotal, "all_to_all_v");
    rdispls[p] = as_int(rtotal, "all_to_all_v");
    scounts[p] = as_int(send_blocks.shape[p].count(), "all_to_all_v");
    rcounts[p] = as_int(recv_blocks.shape[p].count(), "all_to_all_v");
    stotal += scounts[p];
    rtotal += rcounts[p];
  }
  std::vector<unsigned char> a(static_cast<std::size_t>(stotal * e)), b(static_cast<std::size_t>(rtotal * e));
  for (std::size_t p = 0; p < n; ++p) {
    const BlockShape& s = send_blocks.shape[p];
    if (s.count() == 0) continue;  // the buffer may be null
    copy_block(static_cast<const unsigned char*>(send) + send_blocks.offset[p] * e,
               {0, send_blocks.outer, send_blocks.inner}, a.data() + sdispls[p] * e,
               {0, s.inner * s.row, s.row}, s, static_cast<std::size_t>(e));
  }
  std::vector<PeerBlock> sends, recvs;
  for (std::size_t p = 0; p < n; ++p) {
    sends.push_back({a.data() + sdispls[p] * e, scounts[p], mpi_type(dtype)});
    recvs.push_back({b.data() + rdispls[p] * e, rcounts[p], mpi_type(dtype)});
  }
  exchange(sends, recvs, "all_to_all_v", 7013);
  for (std::size_t p = 0; p < n; ++p) {
    const BlockShape& s = recv_blocks.shape[p];
    if (s.count() == 0) continue;
    copy_block(b.data() + rdispls[p] * e, {0, s.inner * s.row, s.row},
               static_cast<unsigned char*>(recv) + recv_blocks.offset[p] * e,
               {0, recv_blocks.outer, recv_blocks.inner}, s, static_cast<std::size_t>(e));
  }
}

// A shift under MPI: its Isend and Irecv, polled against the timeout until both complete (past it the rank
// prints which peer made no progress and ends the job: MPI_Abort). Open MPI moves data only inside MPI calls,
// so where MPI runs with MPI_THREAD_MULTIPLE a progress thread of the shift polls them (MPI_Testall every
// kProgressPoll) while the rank computes, and wait() waits for that thread; otherwise wait() polls, and the
// transfer advances during the compute only as far as the transports do on their own (docs/performance.md).
class MpiShift final : public PendingShift {
 public:
  MpiShift(MpiCommunicator& comm, std::int64_t send_count, std::int64_t recv_count, CommDType dtype, int to,
           int from, int distance)
      : comm_(comm),
        send_count_(send_count),
        recv_count_(recv_count),
        dtype_(dtype),
        to_(to),
        from_(from),
        distance_(distance) {}
  ~MpiShift() override {
    stop_progress();
    if (done_) return;
    // An MPI error seen by the progress thread: some requests may still be active on the caller's buffers.
    if (finished_ && rc_ != MPI_SUCCESS) comm_.fail(rc_, "a ring shift");
    // The rank is failing with this shift in flight: its buffers may go only once both requests are done (a
    // matched receive cannot be cancelled). Give them a short while; if they cannot finish, end the job
    // rather than let MPI touch freed memory.
    if (!finished_ && !poll(std::chrono::seconds(5))) {
      std::fprintf(stderr, "rank %d: a ring shift was abandoned in flight; ending the job\n",
                   comm_.world(comm_.rank_));
      std::fflush(stderr);
      end_mpi_job(MPI_COMM_WORLD);
    }
  }
  // Starts the thread that progresses the posted requests.
  void start_progress() {
    progress_ = start_thread("an MPI ring shift's progress", [this] {
      for (;;) {
        int flag = 0;
        MPI_Status statuses[2];
        const int rc = MPI_Testall(2, requests_, &flag, statuses);
        std::unique_lock<std::mutex> lock(mutex_);
        if (rc != MPI_SUCCESS || flag) {
          rc_ = rc;
          if (flag) status_ = statuses[1];
          finished_ = true;
          cv_.notify_all();
          return;
        }
        if (stop_) return;
        lock.unlock();
        std::this_thread::sleep_for(kProgressPoll);
      }
    });
  }
  void wait() override {
    const auto t0 = std::chrono::steady_clock::now();
    bool ok = false;
    if (progress_.joinable()) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait_until(lock, t0 + comm_.timeout_, [this] { return finished_; });
      }
      stop_progress();  // joined: finished_ and rc_ are final (it may have finished at the deadline)
      if (finished_ && rc_ != MPI_SUCCESS) comm_.fail(rc_, "a ring shift");
      ok = finished_;
    } else {
      ok = poll(comm_.timeout_);
    }
    if (!ok) {
      // No fault-tolerant MPI: a peer that makes no progress cannot be worked around, and the pending
      // requests still point at the caller's buffers. Say which rank, then end the job.
      int received = 0;
      MPI_Test(&requests_[1], &received, MPI_STATUS_IGNORE);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int peer = received ? to_ : from_;
      std::fprintf(stderr,
                   "rank %d: no progress from rank %d in %.0f s (a ring shift's %s); ending the job\n",
                   comm_.world(comm_.rank_), comm_.world(peer), s, received ? "send" : "receive");
      std::fflush(stderr);
      end_mpi_job(MPI_COMM_WORLD);
    }
    done_ = true;
    int got = 0;
    MPI_Get_count(&status_, mpi_type(dtype_), &got);
    if (got != recv_count_) {
      throw Error(ErrorKind::communication, "collective", "shift",
                  "shift mismatch: rank " + std::to_string(comm_.world(from_)) + " sent rank " +
                      std::to_string(comm_.world(comm_.rank_)) + " " + std::to_string(got) +
                      " elements but it expects " + std::to_string(recv_count_));
    }
    comm_.count_shift(send_count_, dtype_, distance_);
  }
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};  // send, receive

 private:
  static constexpr std::chrono::microseconds kProgressPoll{50};

  // Ends the progress thread (it stops at its next poll) and joins it.
  void stop_progress() {
    if (!progress_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    progress_.join();
  }
  // MPI_Testall until done or `limit`; the receive's status lands in status_. An MPI error ends the job (the
  // requests would still point at the caller's buffers).
  bool poll(std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    MPI_Status statuses[2];
    for (;;) {
      int flag = 0;
      const int rc = MPI_Testall(2, requests_, &flag, statuses);
      if (rc != MPI_SUCCESS) comm_.fail(rc, "a ring shift");
      if (flag) {
        status_ = statuses[1];
        finished_ = true;
        return true;
      }
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::yield();
    }
  }
  MpiCommunicator& comm_;
  std::int64_t send_count_, recv_count_;
  CommDType dtype_;
  int to_, from_, distance_;  // the peers' ranks in comm_, and the shift's distance
  bool done_ = false;
  std::thread progress_;
  std::mutex mutex_;  // guards what the progress thread writes: finished_, rc_, status_, stop_
  std::condition_variable cv_;
  bool finished_ = false, stop_ = false;
  int rc_ = MPI_SUCCESS;
  MPI_Status status_{};
};

std::unique_ptr<PendingShift> MpiCommunicator::start_shift_v(const void* send, std::int64_t send_count,
                                                             void* recv, std::int64_t recv_count,
                                                             CommDType dtype, int distance) {
  check_shift_counts(send_count, recv_count);
  const int sent = as_int(send_count, "shift"), expected = as_int(recv_count, "shift");
  const int d = static_cast<int>(((distance % size_) + size_) % size_);
  const int to = (rank_ + d) % size_, from = (rank_ + size_ - d) % size_;
  auto shift = std::make_unique<MpiShift>(*this, send_count, recv_count, dtype, to, from, distance);
  constexpr int kShiftTag = 7;
  check(MPI_Irecv(recv, expected, mpi_type(dtype), from, kShiftTag, comm_, &shift->requests_[1]), "MPI_Irecv",
        world(rank_));
  check(MPI_Isend(send, sent, mpi_type(dtype), to, kShiftTag, comm_, &shift->requests_[0]), "MPI_Isend",
        world(rank_));
  if (progress_thread_) shift->start_progress();
  return shift;
}

void MpiCommunicator::all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  const int n = as_int(count, "all_gather");
  const auto block = static_cast<std::ptrdiff_t>(count * static_cast<std::int64_t>(comm_dtype_size(dtype)));
  std::vector<PeerBlock> sends(static_cast<std::size_t>(size_), {send, n, mpi_type(dtype)}), recvs;
  for (int p = 0; p < size_; ++p) recvs.push_back({static_cast<char*>(recv) + p * block, n, mpi_type(dtype)});
  exchange(sends, recvs, "all_gather", 7014);
  this->count(CollectiveKind::all_gather, count, dtype);
}

void MpiCommunicator::reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  if (dtype == CommDType::i32) {
    throw Error(ErrorKind::invalid_input, "dtype", "i32", "reduce_scatter_sum takes f32 or bf16, not i32");
  }
  // Every rank's block for this one (an all_to_all), then the sum in rank order here: the same bits as the
  // in-process group (MPI's own reduce_scatter chooses its order, and Open MPI's ran 3-6x slower than this on
  // one node).
  const int n = as_int(count, "reduce_scatter");
  const std::size_t bytes = static_cast<std::size_t>(count) * comm_dtype_size(dtype) * size_;
  if (gathered_.size() < bytes) gathered_.resize(bytes);
  const auto block = static_cast<std::ptrdiff_t>(bytes / size_);
  std::vector<PeerBlock> sends, recvs;
  for (int p = 0; p < size_; ++p) {
    sends.push_back({static_cast<const char*>(send) + p * block, n, mpi_type(dtype)});
    recvs.push_back({gathered_.data() + p * block, n, mpi_type(dtype)});
  }
  exchange(sends, recvs, "reduce_scatter", 7015);
  if (count > 0) {
    std::vector<const void*> blocks;
    for (int p = 0; p < size_; ++p) blocks.push_back(gathered_.data() + bytes / size_ * p);
    detail::sum_rank_blocks(blocks, count, dtype, recv);
  }
  this->count(CollectiveKind::reduce_scatter, count, dtype);
}

void MpiCommunicator::collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                                         const std::vector<int>& dest) {
  check_permutation(dest, size_);
  const int n = as_int(count, "collective_permute");
  int source = -1;
  for (int p = 0; p < size_; ++p) {
    if (dest[p] == rank_) source = p;
  }
  const int to = dest[rank_];
  const std::size_t bytes = static_cast<std::size_t>(count) * comm_dtype_size(dtype);
  MPI_Request requests[2];
  int pending = 0;
  if (source >= 0 && source != rank_) {
    check(MPI_Irecv(recv, n, mpi_type(dtype), source, 7001, comm_, &requests[pending++]), "MPI_Irecv",
          world(rank_));
  }
  if (to >= 0 && to != rank_) {
    check(MPI_Isend(send, n, mpi_type(dtype), to, 7001, comm_, &requests[pending++]), "MPI_Isend",
          world(rank_));
  }
  if (to == rank_ && bytes > 0) std::memcpy(recv, send, bytes);
  complete(requests, pending, "collective_permute");
  this->count(CollectiveKind::collective_permute, count, dtype, &dest);
}

void MpiCommunicator::barrier() {
  all_reduce(nullptr, 0, ReduceOp::sum);
}

void MpiCommunicator::all_reduce(std::int64_t* values, int n, ReduceOp op) {
  // Per-peer messages rather than MPI_Allreduce, so that at the deadline the ranks that never sent are named.
  // Control values only (flags, shapes): n is small.
  constexpr int kControlTag = 7002;
  const auto un = static_cast<std::size_t>(n);
  std::vector<std::int64_t> theirs(un * static_cast<std::size_t>(size_));
  std::vector<MPI_Request> requests;
  std::vector<int> from;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    requests.emplace_back();
    from.push_back(p);
    check(MPI_Irecv(theirs.data() + un * p, n, MPI_INT64_T, p, kControlTag, comm_, &requests.back()),
          "MPI_Irecv", world(rank_));
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    requests.emplace_back();
    check(MPI_Isend(values, n, MPI_INT64_T, p, kControlTag, comm_, &requests.back()), "MPI_Isend",
          world(rank_));
  }
  std::vector<MPI_Status> statuses(requests.size());
  complete(requests.data(), static_cast<int>(requests.size()), "all_reduce", &from, statuses.data());
  for (std::size_t i = 0; i < from.size(); ++i) {
    int got = 0;
    MPI_Get_count(&statuses[i], MPI_INT64_T, &got);
    if (got != n) {
      throw Error(ErrorKind::communication, "collective", "all_reduce",
                  "collective mismatch: rank " + std::to_string(world(from[i])) + " passed " +
                      std::to_string(got) + " values to all_reduce (or barrier) where rank " +
                      std::to_string(world(rank_)) + " passed " + std::to_string(n));
    }
  }
  for (std::size_t i = 0; i < un; ++i) theirs[un * rank_ + i] = values[i];
  for (std::size_t i = 0; i < un; ++i) {
    std::int64_t v = theirs[i];
    for (int p = 1; p < size_; ++p) {
      const std::int64_t x = theirs[un * p + i];
      v = op == ReduceOp::sum ? v + x : op == ReduceOp::max ? std::max(v, x) : std::min(v, x);
    }
    values[i] = v;
  }
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  if (color < 0) {
    throw Error(ErrorKind::invalid_input, "color", std::to_string(color),
                "split color (" + std::to_string(color) + ") must be >= 0");
  }
  // MPI_Comm_split blocks with no deadline: first meet every rank under this communicator's.
  barrier();
  MPI_Comm sub = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", world(rank_));
  std::unique_ptr<MpiCommunicator> out;
  try {
    out = std::make_unique<MpiCommunicator>(sub, timeout_);
  } catch (...) {
    MPI_Comm_free(&sub);
    throw;
  }
  MPI_Comm_free(&sub);
  return out;
}

void MpiCommunicator::fail(int rc, const char* what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  std::fprintf(stderr, "rank %d: %s failed: %.*s; ending the job\n", world(rank_), what, len, text);
  std::fflush(stderr);
  end_mpi_job(MPI_COMM_WORLD);
}

void MpiCommunicator::exchange(const std::vector<PeerBlock>& sends, const std::vector<PeerBlock>& recvs,
                               const char* what, int tag) {
  std::vector<MPI_Request> requests;
  std::vector<int> from;
  for (int p = 0; p < size_; ++p) {
    const PeerBlock& r = recvs[static_cast<std::size_t>(p)];
    if (r.count == 0) continue;
    requests.emplace_back();
    from.push_back(p);
    const int rc = MPI_Irecv(const_cast<void*>(r.data), r.count, r.type, p, tag, comm_, &requests.back());
    if (rc != MPI_SUCCESS) fail(rc, what);
  }
  for (int p = 0; p < size_; ++p) {
    const PeerBlock& s = sends[static_cast<std::size_t>(p)];
    if (s.count == 0) continue;
    requests.emplace_back();
    const int rc = MPI_Isend(s.data, s.count, s.type, p, tag, comm_, &requests.back());
    if (rc != MPI_SUCCESS) fail(rc, what);
  }
  std::vector<MPI_Status> statuses(requests.size());
  complete(requests.data(), static_cast<int>(requests.size()), what, &from, statuses.data());
  // A peer that sent less than this rank expects (more is MPI's truncation error, which ends the job).
  for (std::size_t i = 0; i < from.size(); ++i) {
    const PeerBlock& r = recvs[static_cast<std::size_t>(from[i])];
    int got = 0;
    MPI_Get_count(&statuses[i], r.type, &got);
    if (got != r.count) {
      int bytes = 0, size = 0;
      MPI_Get_count(&statuses[i], MPI_BYTE, &bytes);
      MPI_Type_size(r.type, &size);
      throw Error(ErrorKind::communication, "collective", what,
                  "collective mismatch in " + std::string(what) + ": rank " + std::to_string(world(from[i])) +
                      " sent rank " + std::to_string(world(rank_)) + " " + std::to_string(bytes) +
                      " bytes where it expects " + std::to_string(static_cast<std::int64_t>(size) * r.count));
    }
  }
}

void MpiCommunicator::complete(MPI_Request* requests, int n, const char* what, const std::vector<int>* from,
                               MPI_Status* statuses) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + timeout_;
  for (;;) {
    int done = 0;
    const int rc = MPI_Testall(n, requests, &done, statuses == nullptr ? MPI_STATUSES_IGNORE : statuses);
    if (rc != MPI_SUCCESS) fail(rc, what);
    if (done) return;
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::yield();
  }
  // No fault-tolerant MPI: a peer that never joins cannot be worked around, and the pending requests still
  // point at the caller's buffers. Say which peers (when the first requests are receives from them), then end
  // the job.
  std::string missing;
  for (std::size_t i = 0; from != nullptr && i < from->size(); ++i) {
    int done = 0;
    MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE);
    if (!done) missing += (missing.empty() ? "" : ", ") + std::to_string(world((*from)[i]));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (missing.empty()) {
    std::fprintf(stderr,
                 "rank %d: no progress in %s for %.0f s (a peer is stopped or gone); ending the job\n",
                 world(rank_), what, s);
  } else {
    std::fprintf(stderr, "rank %d: no progress from rank %s in %s for %.0f s; ending the job\n", world(rank_),
                 missing.c_str(), what, s);
  }
  std::fflush(stderr);
  end_mpi_job(MPI_COMM_WORLD);
}

}  // namespace cpattn
