// One body of collective tests for every backend (nccl-tests style): inputs are built so the exact answer is
// known (element = rank * 2^20 + index: unique for every (rank, index) the cases use, and exact in fp32), and
// each case returns the number of wrong elements.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpattn/bf16.hpp"
#include "cpattn/comm.hpp"

namespace cpattn::testing {

// Unique while index < 2^20 and rank < 16 (then below 2^24, where every integer is a float).
inline constexpr std::int64_t kIndexLimit = std::int64_t{1} << 20;
inline float value_of(int rank, std::int64_t index) {
  if (index < 0 || index >= kIndexLimit || rank < 0 || rank >= 16) {
    throw std::logic_error("value_of(" + std::to_string(rank) + ", " + std::to_string(index) +
                           "): outside the range where values are unique and exact");
  }
  return static_cast<float>(rank * kIndexLimit + index);
}

inline std::int64_t wrong_all_to_all(Communicator& c, std::int64_t count) {
  const int n = c.size(), r = c.rank();
  std::vector<float> send(static_cast<std::size_t>(n * count)), recv(send.size(), -1.0f);
  for (std::int64_t i = 0; i < n * count; ++i) send[i] = value_of(r, i);
  c.all_to_all(send.data(), recv.data(), count, CommDType::f32);
  std::int64_t wrong = 0;
  for (int p = 0; p < n; ++p) {
    for (std::int64_t i = 0; i < count; ++i) wrong += recv[p * count + i] != value_of(p, r * count + i);
  }
  return wrong;
}

// Strided blocks with padding on both sides (pad > 0), or rows that follow each other (pad = 0): block p of
// the sender is the columns [p*row, (p+1)*row) of an [outer][inner][n*row + pad] array; block p of the
// receiver is rows [p*inner, (p+1)*inner) of an [outer][n*inner + 1][row + pad] array. Counts wrong elements,
// padding that was written included.
inline std::int64_t wrong_all_to_all_strided(Communicator& c, std::int64_t outer, std::int64_t inner,
                                             std::int64_t row, std::int64_t pad) {
  const int n = c.size(), r = c.rank();
  const BlockShape shape{outer, inner, row};
  const std::int64_t send_row = n * row + pad, recv_row = row + pad;
  const BlockStrides from{row, inner * send_row, send_row};
  const BlockStrides to{inner * recv_row, (n * inner + (pad > 0 ? 1 : 0)) * recv_row, recv_row};
  std::vector<float> send(static_cast<std::size_t>(outer * inner * send_row), -2.0f),
      recv(static_cast<std::size_t>(outer * to.outer), -1.0f), expected(recv.size(), -1.0f);
  auto id = [&](int dst, std::int64_t i, std::int64_t j, std::int64_t k) {
    return ((dst * outer + i) * inner + j) * row + k;
  };
  for (int p = 0; p < n; ++p) {
    for (std::int64_t i = 0; i < outer; ++i) {
      for (std::int64_t j = 0; j < inner; ++j) {
        for (std::int64_t k = 0; k < row; ++k) {
          send[p * from.block + i * from.outer + j * from.inner + k] = value_of(r, id(p, i, j, k));
          expected[p * to.block + i * to.outer + j * to.inner + k] = value_of(p, id(r, i, j, k));
        }
      }
    }
  }
  c.all_to_all_strided(send.data(), from, recv.data(), to, shape, CommDType::f32);
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < recv.size(); ++i) wrong += recv[i] != expected[i];
  return wrong;
}

// Blocks of per-pair sizes: rank r sends rank p outer x inner(r, p) rows of row(p) elements, inner(r, p) =
// (r + 2p + k) % 4 (zero-sized blocks included). Sender: block p is the columns [col_p, col_p + row(p)) of an
// [outer][4][sum_p row(p) + pad] array; receiver: block p is inner(p, r) rows from row sum_{v<p} inner(v, r)
// of an [outer][sum_v inner(v, r) + 1][max row + pad] array. Counts wrong elements, written padding included.
inline std::int64_t wrong_all_to_all_v(Communicator& c, std::int64_t outer, std::int64_t k,
                                       std::int64_t pad) {
  const int n = c.size(), r = c.rank();
  auto inner = [&](int from, int to) -> std::int64_t { return (from + 2 * to + k) % 4; };
  auto row = [](int to) -> std::int64_t { return 3 + to % 2; };
  std::int64_t width = pad, recv_rows = 1;
  for (int p = 0; p < n; ++p) {
    width += row(p);
    recv_rows += inner(p, r);
  }
  const std::int64_t recv_width = 4 + pad;
  BlockList from{{}, {}, 4 * width, width}, to{{}, {}, recv_rows * recv_width, recv_width};
  std::vector<float> send(static_cast<std::size_t>(outer * 4 * width), -2.0f),
      recv(static_cast<std::size_t>(outer * recv_rows * recv_width), -1.0f), expected(recv.size(), -1.0f);
  auto id = [&](int dst, std::int64_t i, std::int64_t j, std::int64_t e) {
    return ((dst * outer + i) * 4 + j) * 8 + e;
  };
  std::int64_t col = 0, first_row = 0;
  for (int p = 0; p < n; ++p) {
    from.shape.push_back({outer, inner(r, p), row(p)});
    from.offset.push_back(col);
    to.shape.push_back({outer, inner(p, r), row(r)});
    to.offset.push_back(first_row * recv_width);
    for (std::int64_t i = 0; i < outer; ++i) {
      for (std::int64_t j = 0; j < 4; ++j) {
        for (std::int64_t e = 0; e < 4; ++e) {
          if (j < inner(r, p) && e < row(p)) {
            send[i * from.outer + j * from.inner + col + e] = value_of(r, id(p, i, j, e));
          }
          if (j < inner(p, r) && e < row(r)) {
            expected[i * to.outer + (first_row + j) * to.inner + e] = value_of(p, id(r, i, j, e));
          }
        }
      }
    }
    col += row(p);
    first_row += inner(p, r);
  }
  c.all_to_all_v(send.data(), from, recv.data(), to, CommDType::f32);
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < recv.size(); ++i) wrong += recv[i] != expected[i];
  return wrong;
}

// An all_to_all_v whose rank r sends every rank r + 1 rows of 2 floats, where rank 1 expects no row from rank
// 0 when `disagree`: returns the error this rank got ("" when none). Every rank must get one naming the pair.
inline std::string all_to_all_v_error(Communicator& c, bool disagree) {
  const int n = c.size(), r = c.rank();
  BlockList from{{}, {}, 0, 2}, to{{}, {}, 0, 2};
  std::int64_t sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    from.shape.push_back({1, r + 1, 2});
    from.offset.push_back(sent);
    sent += (r + 1) * 2;
    const std::int64_t rows = disagree && r == 1 && p == 0 ? 0 : p + 1;
    to.shape.push_back({1, rows, 2});
    to.offset.push_back(received);
    received += rows * 2;
  }
  from.outer = sent;
  to.outer = received;
  std::vector<float> send(static_cast<std::size_t>(sent), 1.0f), recv(static_cast<std::size_t>(received) + 1);
  try {
    c.all_to_all_v(send.data(), from, recv.data(), to, CommDType::f32);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// `steps` ring shifts of `count` elements, each started before and waited after some work of the caller's (a
// sum over a buffer of its own), as the ring strategy does: after step k rank r holds rank (r - k)'s values.
// Counts wrong elements.
inline std::int64_t wrong_shifts(Communicator& c, std::int64_t count, int steps) {
  const int n = c.size(), r = c.rank();
  std::vector<float> a(static_cast<std::size_t>(count)), b(a.size());
  for (std::int64_t i = 0; i < count; ++i) a[i] = value_of(r, i);
  std::int64_t wrong = 0;
  std::vector<float> work(4096, 1.0f);
  float sink = 0;
  for (int k = 1; k <= steps; ++k) {
    auto shift = c.start_shift(a.data(), b.data(), count, CommDType::f32);
    for (float x : work) sink += x;  // the step's compute, while the transfer runs
    shift->wait();
    const int from = ((r - k) % n + n) % n;
    for (std::int64_t i = 0; i < count; ++i) wrong += b[i] != value_of(from, i);
    std::swap(a, b);
  }
  return wrong + (sink < 0 ? 1 : 0);
}

// Two shifts in flight at once (f32 and i32, as the ring's backward has K/V and the dK/dV accumulators),
// waited in the opposite order. Counts wrong elements.
inline std::int64_t wrong_overlapping_shifts(Communicator& c, std::int64_t count) {
  const int n = c.size(), r = c.rank(), from = (r + n - 1) % n;
  std::vector<float> a(static_cast<std::size_t>(count)), b(a.size());
  std::vector<std::int32_t> x(a.size()), y(a.size());
  for (std::int64_t i = 0; i < count; ++i) {
    a[i] = value_of(r, i);
    x[i] = static_cast<std::int32_t>(r * 100000 + i);
  }
  auto first = c.start_shift(a.data(), b.data(), count, CommDType::f32);
  auto second = c.start_shift(x.data(), y.data(), count, CommDType::i32);
  second->wait();
  first->wait();
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    wrong += b[i] != value_of(from, i);
    wrong += y[i] != static_cast<std::int32_t>(from * 100000 + i);
  }
  return wrong;
}

// Shifts by every distance (negative ones and whole turns too) with counts of each rank's own, some empty,
// all in flight at once and waited last first, as the windowed ring has its K/V and dK/dV shifts: rank r
// sends rank r + d (value_of(r, i) + d) x count(r, d). Counts wrong elements and accounting: each shift a
// collective_permute of the rank's own send count.
inline std::int64_t wrong_distance_shifts(Communicator& c) {
  const int n = c.size(), r = c.rank();
  auto count = [](int rank, int d) { return static_cast<std::int64_t>((rank * 7 + d * 3 + 70) % 5) * 37; };
  auto peer = [n](int rank, int d) { return ((rank + d) % n + n) % n; };
  const std::vector<CollectiveRecord> before = c.counters().records();
  std::vector<int> distances;
#if defined(__SANITIZE_THREAD__)
  distances = {-1, 1, 2,
               n};  // under TSan (a thread per shift and rank) a backward, two forward, a whole turn
#else
  for (int d = -n; d <= n + 1; ++d) distances.push_back(d);
#endif
  std::vector<std::vector<float>> send, recv;
  std::vector<std::unique_ptr<PendingShift>> shifts;
  std::int64_t sent = 0;
  for (const int d : distances) {
    send.emplace_back(static_cast<std::size_t>(count(r, d)));
    for (std::size_t i = 0; i < send.back().size(); ++i)
      send.back()[i] = value_of(r, static_cast<std::int64_t>(i)) + static_cast<float>(d);
    // From rank r - d, which sends count(r - d, d); a shift onto itself when d is a whole turn.
    recv.emplace_back(static_cast<std::size_t>(count(peer(r, -d), d)), -1.0f);
    shifts.push_back(c.start_shift_v(send.back().data(), static_cast<std::int64_t>(send.back().size()),
                                     recv.back().data(), static_cast<std::int64_t>(recv.back().size()),
                                     CommDType::f32, d));
    if (peer(r, d) != r) sent += count(r, d) * 4;
  }
  for (std::size_t j = shifts.size(); j-- > 0;) shifts[j]->wait();
  std::int64_t wrong = 0;
  for (std::size_t j = 0; j < distances.size(); ++j) {
    const int from = peer(r, -distances[j]);
    for (std::size_t i = 0; i < recv[j].size(); ++i)
      wrong += recv[j][i] != value_of(from, static_cast<std::int64_t>(i)) + static_cast<float>(distances[j]);
  }
  std::int64_t counted = 0, calls = 0;
  for (const CollectiveRecord& x : c.counters().records()) {
    if (x.kind == CollectiveKind::collective_permute) {
      counted += x.bytes_sent_per_rank;
      calls += x.count;
    }
  }
  for (const CollectiveRecord& x : before) {
    if (x.kind == CollectiveKind::collective_permute) {
      counted -= x.bytes_sent_per_rank;
      calls -= x.count;
    }
  }
  wrong += counted != sent;
  wrong += calls != static_cast<std::int64_t>(distances.size());
  return wrong;
}

inline std::int64_t wrong_all_gather(Communicator& c, std::int64_t count) {
  const int n = c.size(), r = c.rank();
  std::vector<std::int32_t> send(static_cast<std::size_t>(count)),
      recv(static_cast<std::size_t>(n * count), -1);
  for (std::int64_t i = 0; i < count; ++i) send[i] = static_cast<std::int32_t>(value_of(r, i));
  c.all_gather(send.data(), recv.data(), count, CommDType::i32);
  std::int64_t wrong = 0;
  for (int p = 0; p < n; ++p) {
    for (std::int64_t i = 0; i < count; ++i)
      wrong += recv[p * count + i] != static_cast<std::int32_t>(value_of(p, i));
  }
  return wrong;
}

// reduce_scatter_sum of float values as f32, or rounded to bf16 and back.
inline void reduce_scatter_floats(Communicator& c, const std::vector<float>& send, std::vector<float>& recv,
                                  std::int64_t count, CommDType dtype) {
  if (dtype == CommDType::f32) {
    c.reduce_scatter_sum(send.data(), recv.data(), count, dtype);
  } else {
    std::vector<bf16> s(send.size()), o(recv.size());
    for (std::size_t i = 0; i < send.size(); ++i) s[i] = float_to_bf16(send[i]);
    c.reduce_scatter_sum(s.data(), o.data(), count, dtype);
    for (std::size_t i = 0; i < o.size(); ++i) recv[i] = bf16_to_float(o[i]);
  }
}

inline std::int64_t wrong_reduce_scatter(Communicator& c, std::int64_t count, CommDType dtype) {
  const int n = c.size(), r = c.rank();
  std::vector<float> send(static_cast<std::size_t>(n * count));
  // Small integers so that the bf16 sums are exact too.
  for (std::int64_t i = 0; i < n * count; ++i) send[i] = static_cast<float>((r + 1) * (i % 7));
  std::vector<float> recv(static_cast<std::size_t>(count), -1.0f);
  reduce_scatter_floats(c, send, recv, count, dtype);
  std::int64_t wrong = 0;
  const float rank_sum = static_cast<float>(n * (n + 1) / 2);
  for (std::int64_t i = 0; i < count; ++i)
    wrong += recv[i] != rank_sum * static_cast<float>((r * count + i) % 7);
  return wrong;
}

// Non-integer values whose sum depends on the order: every backend must sum in rank order (fp32 left to
// right; bf16 in fp32, rounded once), so that results agree bit for bit across backends.
inline float rounding_value(int rank, std::int64_t index) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(index) + 1.3 * rank) *
                            std::pow(10.0, rank % 3));
}

inline std::int64_t wrong_reduce_scatter_order(Communicator& c, std::int64_t count, CommDType dtype) {
  const int n = c.size(), r = c.rank();
  std::vector<float> send(static_cast<std::size_t>(n * count)), recv(static_cast<std::size_t>(count), -1.0f);
  for (std::int64_t i = 0; i < n * count; ++i) send[i] = rounding_value(r, i);
  std::vector<float> expected(recv.size());
  for (std::int64_t i = 0; i < count; ++i) {
    float sum = dtype == CommDType::f32 ? rounding_value(0, r * count + i) : 0.0f;
    for (int p = dtype == CommDType::f32 ? 1 : 0; p < n; ++p) {
      const float x = rounding_value(p, r * count + i);
      sum += dtype == CommDType::f32 ? x : bf16_to_float(float_to_bf16(x));
    }
    expected[i] = dtype == CommDType::f32 ? sum : bf16_to_float(float_to_bf16(sum));
  }
  reduce_scatter_floats(c, send, recv, count, dtype);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i) wrong += std::memcmp(&recv[i], &expected[i], 4) != 0;
  return wrong;
}

// Rank p sends to (p + shift) % n.
inline std::int64_t wrong_permute(Communicator& c, std::int64_t count, int shift) {
  const int n = c.size(), r = c.rank();
  std::vector<int> dest(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) dest[p] = (p + shift) % n;
  std::vector<float> send(static_cast<std::size_t>(count)), recv(send.size(), -1.0f);
  for (std::int64_t i = 0; i < count; ++i) send[i] = value_of(r, i);
  c.collective_permute(send.data(), recv.data(), count, CommDType::f32, dest);
  const int src = ((r - shift) % n + n) % n;
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i) wrong += recv[i] != value_of(src, i);
  return wrong;
}

inline std::int64_t wrong_all_reduce(Communicator& c) {
  const int n = c.size(), r = c.rank();
  std::int64_t v[3] = {r, r, r + 1};
  std::int64_t wrong = 0;
  c.all_reduce(v, 1, ReduceOp::max);
  wrong += v[0] != n - 1;
  c.all_reduce(v + 1, 1, ReduceOp::min);
  wrong += v[1] != 0;
  c.all_reduce(v + 2, 1, ReduceOp::sum);
  wrong += v[2] != static_cast<std::int64_t>(n) * (n + 1) / 2;
  return wrong;
}

// Every case at a few sizes (including 0 and odd ones); returns the total wrong elements.
inline std::int64_t wrong_in_all_cases(Communicator& c) {
  std::int64_t wrong = 0;
  for (std::int64_t count : {0, 1, 7, 1000, 65537}) {
    wrong += wrong_all_to_all(c, count);
    wrong += wrong_all_to_all_strided(c, 1, 1, count, 0);
    wrong += wrong_all_gather(c, count);
    wrong += wrong_reduce_scatter(c, count, CommDType::f32);
    wrong += wrong_reduce_scatter(c, count, CommDType::bf16);
    wrong += wrong_reduce_scatter_order(c, count, CommDType::f32);
    wrong += wrong_reduce_scatter_order(c, count, CommDType::bf16);
    wrong += wrong_permute(c, count, 1);
    wrong += wrong_permute(c, count, 0);
  }
  for (const auto& [outer, inner, row] :
       {std::array<std::int64_t, 3>{2, 3, 5}, {1, 4, 7}, {3, 1, 16}, {2, 50, 33}, {0, 2, 3}}) {
    wrong += wrong_all_to_all_strided(c, outer, inner, row, 0);
    wrong += wrong_all_to_all_strided(c, outer, inner, row, 3);
  }
  for (std::int64_t k : {0, 1, 3}) {
    wrong += wrong_all_to_all_v(c, 2, k, 0);
    wrong += wrong_all_to_all_v(c, 1, k, 3);
  }
  wrong += wrong_all_to_all_v(c, 0, 1, 2);  // every block empty
  wrong += wrong_shifts(c, 1000, c.size() + 1);
  wrong += wrong_shifts(c, 0, 2);
  wrong += wrong_overlapping_shifts(c, 777);
  wrong += wrong_distance_shifts(c);
  wrong += wrong_all_reduce(c);
  c.barrier();
  return wrong;
}

}  // namespace cpattn::testing
