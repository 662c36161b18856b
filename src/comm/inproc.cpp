#include "cpattn/inproc.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "core/start_thread.hpp"
#include "cpattn/bf16.hpp"
#include "cpattn/error.hpp"
#include "sum_blocks.hpp"

namespace cpattn {

namespace {

enum class Call {
  all_to_all,
  all_to_all_strided,
  all_to_all_v,
  all_gather,
  reduce_scatter,
  permute,
  barrier,
  all_reduce
};

const char* call_name(Call c) {
  switch (c) {
    case Call::all_to_all:
      return "all_to_all";
    case Call::all_to_all_strided:
      return "all_to_all_strided";
    case Call::all_to_all_v:
      return "all_to_all_v";
    case Call::all_gather:
      return "all_gather";
    case Call::reduce_scatter:
      return "reduce_scatter";
    case Call::permute:
      return "collective_permute";
    case Call::barrier:
      return "barrier";
    case Call::all_reduce:
      return "all_reduce";
  }
  return "unknown";
}

// What one rank published for the current collective.
struct Slot {
  Call call = Call::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::int64_t count = 0;
  CommDType dtype = CommDType::f32;
  const std::vector<int>* dest = nullptr;
  ReduceOp op = ReduceOp::sum;
  // all_to_all_strided only.
  BlockShape shape;
  BlockStrides send_strides, recv_strides;
  // all_to_all_v only: the blocks, and where the call's accounting goes.
  const BlockList* send_blocks = nullptr;
  const BlockList* recv_blocks = nullptr;
  CollectiveCost* cost = nullptr;
};

std::string shape_text(const BlockShape& s) {
  return std::to_string(s.outer) + "x" + std::to_string(s.inner) + " rows of " + std::to_string(s.row);
}

Slot make_slot(Call call, const void* send, void* recv, std::int64_t count, CommDType dtype,
               const std::vector<int>* dest = nullptr, ReduceOp op = ReduceOp::sum) {
  Slot s;
  s.call = call;
  s.send = send;
  s.recv = recv;
  s.count = count;
  s.dtype = dtype;
  s.dest = dest;
  s.op = op;
  return s;
}

std::string describe(const Slot& s) {
  std::string d =
      std::string(call_name(s.call)) + "(count=" + std::to_string(s.count) + ", " + to_string(s.dtype);
  if (s.call == Call::all_reduce) d += ", op " + std::to_string(static_cast<int>(s.op));
  if (s.call == Call::all_to_all_strided) {
    d += ", block " + shape_text(s.shape);
  }
  return d + ")";
}

}  // namespace

// What every group split from one InProcessGroup shares: one lock and one wake-up, so that one abort reaches
// every rank waiting in any of them, and the failure that caused it.
struct InProcessFamily {
  std::mutex mutex;
  std::condition_variable cv;
  bool aborted = false;
  int failed_rank = -1;  // in the ranks of the InProcessGroup
  std::string reason;
  // Sub-groups being picked up by their members (split): (parent, the parent's split number, color) -> the
  // sub-group and how many members have yet to take it.
  std::map<std::tuple<const void*, std::uint64_t, std::int64_t>,
           std::pair<std::shared_ptr<InProcessGroup::State>, int>>
      pending;
};

struct InProcessGroup::State {
  State(std::shared_ptr<InProcessFamily> f, std::vector<int> members, InProcessOptions o)
      : family(std::move(f)),
        mutex(family->mutex),
        cv(family->cv),
        size(static_cast<int>(members.size())),
        world(std::move(members)),
        options(o),
        slots(static_cast<std::size_t>(size)),
        calls(static_cast<std::size_t>(size), 0),
        shift_send(static_cast<std::size_t>(size)),
        shift_received(static_cast<std::size_t>(size)),
        shift_cancelled(static_cast<std::size_t>(size)),
        shifts_started(static_cast<std::size_t>(size), 0) {}

  std::shared_ptr<InProcessFamily> family;
  std::mutex& mutex;
  std::condition_variable& cv;
  int size = 0;
  std::vector<int> world;  // each rank's rank in the InProcessGroup (messages name those)
  InProcessOptions options;
  std::vector<Slot> slots;
  std::vector<std::int64_t> calls;  // collectives each rank has entered
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<std::unique_ptr<Communicator>> comms;  // the InProcessGroup's own ranks (not a split's)

  std::string name(int rank) const { return "rank " + std::to_string(world[rank]); }
  bool aborted() const { return family->aborted; }

  [[noreturn]] void throw_aborted(int rank) const {
    throw Error(ErrorKind::communication, "rank", std::to_string(family->failed_rank),
                name(rank) + ": the in-process group was aborted because rank " +
                    std::to_string(family->failed_rank) + " failed: " + family->reason);
  }

  void abort_locked(int rank, const std::string& why) {
    if (!family->aborted) {
      family->aborted = true;
      family->failed_rank = world[rank];
      family->reason = why;
      // No split completes after an abort: drop the sub-groups not all members took (each holds the family).
      family->pending.clear();
    }
    cv.notify_all();
  }

  // Waits until every rank arrives. `abortable`: leave with an error if the group is aborted (phase 1); the
  // closing phase is not abortable, because a peer may still be reading this rank's buffers.
  void arrive_and_wait(std::unique_lock<std::mutex>& lock, int rank, Call call, bool abortable) {
    const std::uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    while (generation == gen && !(abortable && aborted())) {
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout && generation == gen && abortable &&
          !aborted()) {
        std::string missing;
        for (int p = 0; p < size; ++p) {
          if (calls[p] < calls[rank]) missing += (missing.empty() ? "" : ", ") + std::to_string(world[p]);
        }
        abort_locked(rank, std::string(call_name(call)) + " timed out after " +
                               std::to_string(options.timeout.count()) + " ms waiting for rank(s) [" +
                               missing + "]");
      }
    }
    if (generation == gen) {
      --arrived;
      throw_aborted(rank);
    }
  }

  void collective(int rank, const Slot& mine);

  // Ring shifts (start_shift), per rank and keyed by the rank's shift number (a rank may have several in
  // flight; every rank starts the same shifts in the same order): what it posted to send, which of its
  // receives arrived, and which of its copiers should stop (the rank is failing).
  enum class SendState { posted, copying, consumed, withdrawn };
  struct ShiftSend {
    const unsigned char* data = nullptr;
    std::size_t bytes = 0;
    SendState state = SendState::posted;
    int distance = 1;  // the shift's: this rank sends rank + distance
  };
  std::vector<std::map<std::uint64_t, ShiftSend>> shift_send;
  std::vector<std::set<std::uint64_t>> shift_received, shift_cancelled;
  std::vector<std::uint64_t> shifts_started;

  // The rank `distance` places after (before, when negative) `rank`, round the group.
  int peer(int rank, int distance) const {
    const long long n = size;
    return static_cast<int>((((rank + static_cast<long long>(distance)) % n) + n) % n);
  }
  // Rank r's copier for its shift `seq` (sent `distance` places on): waits for the post of the rank
  // `distance` places before it, then copies it into recv on this thread, while rank r computes.
  void copy_shift(int rank, std::uint64_t seq, unsigned char* recv, std::size_t bytes, int distance);
  // Rank r's wait() for shift `seq`: until its data arrived and its own send was consumed; throws if the
  // group was aborted or the wait timed out.
  void wait_shift(int rank, std::uint64_t seq, int distance);
  // Rank r gives up shift `seq` (its handle dies unwaited): its send is withdrawn or, if a peer is copying
  // it, waited for; its copier is told to stop.
  void withdraw_shift(int rank, std::uint64_t seq);
};

void InProcessGroup::State::copy_shift(int rank, std::uint64_t seq, unsigned char* recv, std::size_t bytes,
                                       int distance) {
  const int pred = peer(rank, -distance);
  std::unique_lock<std::mutex> lock(mutex);
  auto posted = [&] {
    const auto it = shift_send[pred].find(seq);
    return it != shift_send[pred].end() && it->second.state == SendState::posted;
  };
  cv.wait(lock, [&] { return aborted() || shift_cancelled[rank].count(seq) != 0 || posted(); });
  if (aborted() || shift_cancelled[rank].count(seq) != 0) return;
  ShiftSend& from = shift_send[pred].at(seq);
  if (from.distance != distance) {
    abort_locked(rank, "shift mismatch: " + name(rank) + "'s shift " + std::to_string(seq) + " goes " +
                           std::to_string(distance) + " places on, " + name(pred) + "'s " +
                           std::to_string(from.distance));
    return;
  }
  if (from.bytes != bytes) {
    abort_locked(rank, "shift mismatch: " + name(pred) + " sends " + name(rank) + " " +
                           std::to_string(from.bytes) + " bytes but " + name(rank) + " expects " +
                           std::to_string(bytes));
    return;
  }
  from.state = SendState::copying;
  const unsigned char* data = from.data;
  lock.unlock();
  if (bytes > 0) std::memcpy(recv, data, bytes);
  lock.lock();
  shift_send[pred].at(seq).state = SendState::consumed;
  shift_received[rank].insert(seq);
  cv.notify_all();
}

void InProcessGroup::State::wait_shift(int rank, std::uint64_t seq, int distance) {
  std::unique_lock<std::mutex> lock(mutex);
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  auto came = [&] { return shift_received[rank].count(seq) != 0; };
  auto taken = [&] { return shift_send[rank].at(seq).state == SendState::consumed; };
  while (!aborted() && !(came() && taken())) {
    if (cv.wait_until(lock, deadline) == std::cv_status::timeout && !aborted() && !(came() && taken())) {
      const int pred = peer(rank, -distance), succ = peer(rank, distance);
      abort_locked(
          rank, "shift " + std::to_string(seq) + " timed out after " +
                    std::to_string(options.timeout.count()) + " ms: " +
                    (!came() ? "no data from " + name(pred) : name(succ) + " did not take this rank's data"));
    }
  }
  if (!(came() && taken())) throw_aborted(rank);
  shift_received[rank].erase(seq);
  shift_send[rank].erase(seq);
}

void InProcessGroup::State::withdraw_shift(int rank, std::uint64_t seq) {
  std::unique_lock<std::mutex> lock(mutex);
  const auto it = shift_send[rank].find(seq);
  if (it != shift_send[rank].end()) {
    if (it->second.state == SendState::posted) it->second.state = SendState::withdrawn;
    cv.wait(lock, [&] { return it->second.state != SendState::copying; });
  }
  shift_cancelled[rank].insert(seq);
  cv.notify_all();
}

namespace {

// A shift of the in-process group: the copy into this rank's receive buffer runs on a thread of its own.
class InProcessShift final : public PendingShift {
 public:
  InProcessShift(InProcessGroup::State& state, int rank, std::uint64_t seq, unsigned char* recv,
                 std::size_t bytes, int distance, std::function<void()> count)
      : state_(state), rank_(rank), seq_(seq), distance_(distance), count_(std::move(count)) {
    try {
      copier_ = start_thread("rank " + std::to_string(rank) + "'s ring shift",
                             [this, recv, bytes] { state_.copy_shift(rank_, seq_, recv, bytes, distance_); });
    } catch (...) {
      state_.withdraw_shift(rank_, seq_);  // no peer may read a send that no handle guards
      throw;
    }
  }
  ~InProcessShift() override {
    if (!waited_) state_.withdraw_shift(rank_, seq_);
    if (copier_.joinable()) copier_.join();
  }
  void wait() override {
    state_.wait_shift(rank_, seq_, distance_);
    copier_.join();
    waited_ = true;
    count_();
  }

 private:
  InProcessGroup::State& state_;
  int rank_;
  std::uint64_t seq_;
  int distance_;
  std::function<void()> count_;
  std::thread copier_;
  bool waited_ = false;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup::State& state, int rank) : state_(state), rank_(rank) {}
  // A rank of a split: it shares the sub-group with the other members.
  InProcessCommunicator(std::shared_ptr<InProcessGroup::State> sub, int rank)
      : keep_(std::move(sub)), state_(*keep_), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return state_.size; }
  const char* backend() const override { return "inproc"; }

  void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    state_.collective(rank_, make_slot(Call::all_to_all, send, recv, count, dtype));
    this->count(CollectiveKind::all_to_all, count, dtype);
  }
  void all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                          const BlockStrides& recv_strides, const BlockShape& shape,
                          CommDType dtype) override {
    check_block_layout(shape, send_strides, recv_strides);
    Slot slot = make_slot(Call::all_to_all_strided, send, recv, shape.count(), dtype);
    slot.shape = shape;
    slot.send_strides = send_strides;
    slot.recv_strides = recv_strides;
    state_.collective(rank_, slot);
    this->count(CollectiveKind::all_to_all, shape.count(), dtype);
  }
  void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv, const BlockList& recv_blocks,
                    CommDType dtype) override {
    check_block_list(send_blocks, size(), "send");
    check_block_list(recv_blocks, size(), "recv");
    Slot slot = make_slot(Call::all_to_all_v, send, recv, 0, dtype);
    CollectiveCost cost;
    slot.send_blocks = &send_blocks;
    slot.recv_blocks = &recv_blocks;
    slot.cost = &cost;
    state_.collective(rank_, slot);
    count_cost(CollectiveKind::all_to_all, cost);
  }
  void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    state_.collective(rank_, make_slot(Call::all_gather, send, recv, count, dtype));
    this->count(CollectiveKind::all_gather, count, dtype);
  }
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    if (dtype == CommDType::i32) {
      throw Error(ErrorKind::invalid_input, "dtype", "i32", "reduce_scatter_sum takes f32 or bf16, not i32");
    }
    state_.collective(rank_, make_slot(Call::reduce_scatter, send, recv, count, dtype));
    this->count(CollectiveKind::reduce_scatter, count, dtype);
  }
  void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                          const std::vector<int>& dest) override {
    check_permutation(dest, size());
    state_.collective(rank_, make_slot(Call::permute, send, recv, count, dtype, &dest));
    this->count(CollectiveKind::collective_permute, count, dtype, &dest);
  }
  std::unique_ptr<PendingShift> start_shift_v(const void* send, std::int64_t send_count, void* recv,
                                              std::int64_t recv_count, CommDType dtype,
                                              int distance) override {
    check_shift_counts(send_count, recv_count);
    const std::size_t e = comm_dtype_size(dtype);
    std::uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lock(state_.mutex);
      if (state_.aborted()) state_.throw_aborted(rank_);
      seq = ++state_.shifts_started[rank_];
      state_.shift_send[rank_][seq] = {static_cast<const unsigned char*>(send),
                                       static_cast<std::size_t>(send_count) * e,
                                       InProcessGroup::State::SendState::posted, distance};
      state_.cv.notify_all();
    }
    return std::make_unique<InProcessShift>(
        state_, rank_, seq, static_cast<unsigned char*>(recv), static_cast<std::size_t>(recv_count) * e,
        distance, [this, send_count, dtype, distance] { count_shift(send_count, dtype, distance); });
  }
  void barrier() override {
    state_.collective(rank_, make_slot(Call::barrier, nullptr, nullptr, 0, CommDType::i32));
  }
  void all_reduce(std::int64_t* values, int n, ReduceOp op) override {
    state_.collective(rank_, make_slot(Call::all_reduce, values, values, n, CommDType::i32, nullptr, op));
  }
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  std::shared_ptr<InProcessGroup::State> keep_;  // a split's sub-group (the group's own ranks: null)
  InProcessGroup::State& state_;
  int rank_;
  std::uint64_t splits_ = 0;  // splits made so far (every rank makes the same ones in the same order)
};

// Every rank's (color, key) by an all_reduce; the first member to arrive creates the sub-group, the others
// take it from the family's table.
std::unique_ptr<Communicator> InProcessCommunicator::split(int color, int key) {
  const int n = size();
  std::vector<std::int64_t> ck(static_cast<std::size_t>(2 * n), 0);
  ck[2 * rank_] = color;
  ck[2 * rank_ + 1] = key;
  all_reduce(ck.data(), 2 * n, ReduceOp::sum);
  // Checked after the exchange, so that every rank refuses the same split.
  for (int p = 0; p < n; ++p) {
    if (ck[2 * p] < 0) {
      throw Error(ErrorKind::invalid_input, "color", std::to_string(ck[2 * p]),
                  "split color (" + std::to_string(ck[2 * p]) + ") of rank " +
                      std::to_string(state_.world[p]) + " must be >= 0");
    }
  }
  std::vector<int> members;  // parent ranks of this color, by (key, rank)
  for (int p = 0; p < n; ++p) {
    if (ck[2 * p] == color) members.push_back(p);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return ck[2 * a + 1] < ck[2 * b + 1]; });
  const int sub_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  const std::uint64_t seq = ++splits_;
  std::shared_ptr<InProcessGroup::State> sub;
  {
    std::lock_guard<std::mutex> lock(state_.mutex);
    if (state_.aborted()) state_.throw_aborted(rank_);
    const auto id = std::make_tuple(static_cast<const void*>(&state_), seq, std::int64_t{color});
    auto& entry = state_.family->pending[id];
    if (!entry.first) {
      std::vector<int> world;
      for (const int p : members) world.push_back(state_.world[p]);
      entry = {std::make_shared<InProcessGroup::State>(state_.family, std::move(world), state_.options),
               static_cast<int>(members.size())};
    }
    sub = entry.first;
    if (--entry.second == 0) state_.family->pending.erase(id);
  }
  return std::make_unique<InProcessCommunicator>(std::move(sub), sub_rank);
}

void sum_blocks(const std::vector<Slot>& slots, int rank, std::int64_t count, CommDType dtype, void* out) {
  const std::size_t off =
      static_cast<std::size_t>(rank) * static_cast<std::size_t>(count) * comm_dtype_size(dtype);
  std::vector<const void*> blocks;
  for (const Slot& s : slots) blocks.push_back(static_cast<const unsigned char*>(s.send) + off);
  detail::sum_rank_blocks(blocks, count, dtype, out);
}

// all_to_all_v: what each rank sends each peer must be what the peer expects, checked over every pair so
// that every rank reaches the same verdict; then the call's accounting.
CollectiveCost check_variable_blocks(const std::vector<Slot>& slots, int rank,
                                     const std::vector<int>& world) {
  const int n = static_cast<int>(slots.size());
  std::vector<std::vector<std::int64_t>> sent(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    for (int q = 0; q < n; ++q) {
      const BlockShape& out = slots[p].send_blocks->shape[q];
      const BlockShape& in = slots[q].recv_blocks->shape[p];
      if (!(out == in)) {
        throw Error(ErrorKind::communication, "collective", "all_to_all_v",
                    "collective mismatch (seen by rank " + std::to_string(world[rank]) +
                        "): in all_to_all_v rank " + std::to_string(world[p]) + " sends rank " +
                        std::to_string(world[q]) + " a block of " + shape_text(out) + " but rank " +
                        std::to_string(world[q]) + " expects " + shape_text(in));
      }
      sent[p].push_back(out.count());
    }
  }
  return all_to_all_v_cost(sent, comm_dtype_size(slots[rank].dtype));
}

}  // namespace

void InProcessGroup::State::collective(int rank, const Slot& mine) {
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (aborted()) throw_aborted(rank);
    slots[rank] = mine;
    ++calls[rank];
    arrive_and_wait(lock, rank, mine.call, true);
  }
  // Every rank sees the same slots, so every rank reaches the same verdict on a mismatch. The verdict is
  // thrown only after the closing rendezvous: until then a peer may still be reading this rank's slot (its
  // permutation, its block lists).
  std::exception_ptr mismatch;
  try {
    for (int p = 0; p < size; ++p) {
      const Slot& s = slots[p];
      const bool same = s.call == mine.call && s.count == mine.count && s.dtype == mine.dtype &&
                        s.op == mine.op && (mine.call != Call::permute || *s.dest == *mine.dest) &&
                        s.shape == mine.shape;
      if (!same) {
        throw Error(ErrorKind::communication, "collective", describe(s),
                    "collective mismatch: " + name(rank) + " called " + describe(mine) + " but " + name(p) +
                        " called " + describe(s));
      }
    }
    if (mine.call == Call::all_to_all_v) *mine.cost = check_variable_blocks(slots, rank, world);
  } catch (const Error&) {
    mismatch = std::current_exception();
  }
  if (mismatch) {
    std::unique_lock<std::mutex> lock(mutex);
    arrive_and_wait(lock, rank, mine.call, false);
    std::rethrow_exception(mismatch);
  }
  const std::size_t e = comm_dtype_size(mine.dtype);
  const std::size_t block = static_cast<std::size_t>(mine.count) * e;
  auto* recv = static_cast<unsigned char*>(mine.recv);
  // Empty collectives still rendezvous (every rank made the call), but move nothing: their buffers may be
  // null.
  const bool empty = block == 0 && mine.call != Call::all_reduce && mine.call != Call::barrier &&
                     mine.call != Call::all_to_all_v;
  switch (empty ? Call::barrier : mine.call) {
    case Call::all_to_all:
      for (int p = 0; p < size; ++p) {
        std::memcpy(recv + p * block, static_cast<const unsigned char*>(slots[p].send) + rank * block, block);
      }
      break;
    case Call::all_to_all_strided:
      // Block `rank` of each peer's send layout, straight into block p of this rank's receive layout.
      for (int p = 0; p < size; ++p) {
        const auto* src = static_cast<const unsigned char*>(slots[p].send) +
                          static_cast<std::size_t>(rank * slots[p].send_strides.block) * e;
        copy_block(src, slots[p].send_strides,
                   recv + static_cast<std::size_t>(p * mine.recv_strides.block) * e, mine.recv_strides,
                   mine.shape, e);
      }
      break;
    case Call::all_to_all_v:
      // Block `rank` of each peer's send list, straight into block p of this rank's receive list.
      for (int p = 0; p < size; ++p) {
        const BlockList& from = *slots[p].send_blocks;
        const BlockList& to = *mine.recv_blocks;
        if (to.shape[p].count() == 0) continue;  // the buffers may be null
        copy_block(static_cast<const unsigned char*>(slots[p].send) +
                       static_cast<std::size_t>(from.offset[rank]) * e,
                   {0, from.outer, from.inner}, recv + static_cast<std::size_t>(to.offset[p]) * e,
                   {0, to.outer, to.inner}, to.shape[p], e);
      }
      break;
    case Call::all_gather:
      for (int p = 0; p < size; ++p) std::memcpy(recv + p * block, slots[p].send, block);
      break;
    case Call::reduce_scatter:
      sum_blocks(slots, rank, mine.count, mine.dtype, mine.recv);
      break;
    case Call::permute:
      for (int p = 0; p < size; ++p) {
        if ((*mine.dest)[p] == rank && block > 0) std::memcpy(recv, slots[p].send, block);
      }
      break;
    case Call::all_reduce: {
      std::vector<std::int64_t> result(static_cast<std::size_t>(mine.count));
      for (std::int64_t i = 0; i < mine.count; ++i) {
        std::int64_t v = static_cast<const std::int64_t*>(slots[0].send)[i];
        for (int p = 1; p < size; ++p) {
          const std::int64_t x = static_cast<const std::int64_t*>(slots[p].send)[i];
          v = mine.op == ReduceOp::sum ? v + x : mine.op == ReduceOp::max ? std::max(v, x) : std::min(v, x);
        }
        result[i] = v;
      }
      // Peers read our values until the closing rendezvous: write the result only after it.
      std::unique_lock<std::mutex> lock(mutex);
      arrive_and_wait(lock, rank, mine.call, false);
      lock.unlock();
      std::memcpy(mine.recv, result.data(), result.size() * sizeof(std::int64_t));
      return;
    }
    case Call::barrier:
      break;
  }
  std::unique_lock<std::mutex> lock(mutex);
  arrive_and_wait(lock, rank, mine.call, false);
}

InProcessGroup::InProcessGroup(int size, InProcessOptions options) {
  if (size < 1) {
    throw Error(ErrorKind::invalid_config, "cp", std::to_string(size),
                "the in-process group needs at least 1 rank");
  }
  std::vector<int> members(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) members[r] = r;
  state_ = std::make_unique<State>(std::make_shared<InProcessFamily>(), std::move(members), options);
  for (int r = 0; r < size; ++r) state_->comms.push_back(std::make_unique<InProcessCommunicator>(*state_, r));
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const {
  return state_->size;
}

Communicator& InProcessGroup::communicator(int rank) {
  CPATTN_ASSERT(rank >= 0 && rank < state_->size);
  return *state_->comms[rank];
}

void InProcessGroup::abort(int rank, const std::string& reason) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->abort_locked(rank, reason);
}

bool InProcessGroup::aborted() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->aborted();
}

void InProcessGroup::run(const std::function<void(Communicator&)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(state_->size));
  auto body = [&](int r) {
    try {
      fn(communicator(r));
    } catch (const Error& e) {
      // An allocation that failed says on which rank (the bytes and what for, it said itself).
      errors[r] = e.kind() == ErrorKind::out_of_memory ? std::make_exception_ptr(on_rank(e, r))
                                                       : std::current_exception();
      abort(r, e.what());
    } catch (const std::bad_alloc&) {
      const Error e(ErrorKind::out_of_memory, "memory", "",
                    "out of memory on rank " + std::to_string(r) + " (std::bad_alloc from a container)");
      errors[r] = std::make_exception_ptr(e);
      abort(r, e.what());
    } catch (const std::exception& e) {
      errors[r] = std::current_exception();
      abort(r, e.what());
    } catch (...) {
      errors[r] = std::current_exception();
      abort(r, "unknown exception");
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(state_->size - 1));
  try {
    for (int r = 1; r < state_->size; ++r) {
      threads.push_back(start_thread("rank " + std::to_string(r) + " of the in-process group (" +
                                         std::to_string(state_->size) + " ranks)",
                                     body, r));
    }
  } catch (...) {
    // The ranks already started meet the abort at their next collective and end; none is left joinable.
    abort(static_cast<int>(threads.size()) + 1, "its thread could not be started");
    for (auto& t : threads) t.join();
    throw;
  }
  body(0);
  for (auto& t : threads) t.join();
  // The root cause: the failed rank's own error (the others only report that it failed).
  int root = -1;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    root = state_->family->failed_rank;
  }
  if (root >= 0 && errors[root]) std::rethrow_exception(errors[root]);
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace cpattn
