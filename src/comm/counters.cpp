#include <algorithm>

#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

void Communicator::count(CollectiveKind kind, std::int64_t count, CommDType dtype,
                         const std::vector<int>* dest) {
  CollectiveCost c = collective_cost(kind, count, comm_dtype_size(dtype), size(), dest);
  const std::int64_t bytes = count * static_cast<std::int64_t>(comm_dtype_size(dtype));
  for (int p = 0; p < size() && !hosts_.empty(); ++p) {
    const bool sends =
        kind == CollectiveKind::collective_permute ? dest != nullptr && (*dest)[rank()] == p : p != rank();
    if (sends && across_hosts(p)) c.bytes_sent_across_hosts += bytes;
  }
  count_cost(kind, c);
}

void Communicator::count_cost(CollectiveKind kind, const CollectiveCost& cost) {
  Communicator::counters().record(kind, cost, group_);
}

void Communicator::report_to(CollectiveCounters& into, std::string group) {
  report_to_ = &into;
  group_ = std::move(group);
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  throw Error(ErrorKind::invalid_config, "backend", backend(),
              std::string("the ") + backend() + " communicator cannot split into sub-communicators");
}

void Communicator::count_shift(std::int64_t send_count, CommDType dtype, int distance) {
  const std::vector<int> dest = shift_destinations(size(), distance);
  this->count(CollectiveKind::collective_permute, send_count, dtype, &dest);
}

void Communicator::check_shift_counts(std::int64_t send_count, std::int64_t recv_count) {
  for (const auto& [field, n] : {std::pair{"send_count", send_count}, std::pair{"recv_count", recv_count}}) {
    if (n < 0) {
      throw Error(ErrorKind::invalid_input, field, std::to_string(n),
                  std::string("a shift's ") + field + " (" + std::to_string(n) + ") must be >= 0");
    }
  }
}

namespace {
class CompletedShift final : public PendingShift {
 public:
  void wait() override {}
};
}  // namespace

std::unique_ptr<PendingShift> Communicator::start_shift_v(const void* send, std::int64_t send_count,
                                                          void* recv, std::int64_t recv_count,
                                                          CommDType dtype, int distance) {
  check_shift_counts(send_count, recv_count);
  // One block to rank + distance and one from rank - distance (the same rank's block when a whole turn),
  // every other block empty.
  const int n = size(), r = rank();
  const std::vector<int> dest = shift_destinations(n, distance);
  const int to = dest[r], from = static_cast<int>(std::find(dest.begin(), dest.end(), r) - dest.begin());
  BlockList out{std::vector<BlockShape>(n, BlockShape{1, 1, 0}), std::vector<std::int64_t>(n, 0), 0, 0};
  BlockList in = out;
  out.shape[to].row = send_count;
  in.shape[from].row = recv_count;
  all_to_all_v(send, out, recv, in, dtype);
  return std::make_unique<CompletedShift>();
}

void check_permutation(const std::vector<int>& dest, int size) {
  if (static_cast<int>(dest.size()) != size) {
    throw Error(ErrorKind::invalid_input, "dest", std::to_string(dest.size()),
                "collective_permute needs one destination per rank: " + std::to_string(dest.size()) +
                    " given for " + std::to_string(size) + " ranks");
  }
  std::vector<int> seen(static_cast<std::size_t>(size), 0);
  for (int p = 0; p < size; ++p) {
    if (dest[p] < -1 || dest[p] >= size) {
      throw Error(ErrorKind::invalid_input, "dest", std::to_string(dest[p]),
                  "collective_permute destination " + std::to_string(dest[p]) + " of rank " +
                      std::to_string(p) + " is not a rank (valid: -1..." + std::to_string(size - 1) + ")");
    }
    if (dest[p] >= 0 && seen[dest[p]]++ > 0) {
      throw Error(ErrorKind::invalid_input, "dest", std::to_string(dest[p]),
                  "collective_permute sends two blocks to rank " + std::to_string(dest[p]));
    }
  }
}

}  // namespace cpattn
