#include "sequence_collectives.hpp"

#include <algorithm>
#include <cstring>

#include "cpattn/error.hpp"

namespace cpattn::cp {

namespace {

using Bytes = std::vector<unsigned char>;

unsigned char* row_ptr(Tensor& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  const Shape4 sh = t.shape();
  return static_cast<unsigned char*>(t.raw()) +
         static_cast<std::size_t>(((b * sh.s + s) * sh.h + h) * sh.d) * dtype_size(t.dtype());
}
const unsigned char* row_ptr(const Tensor& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  const Shape4 sh = t.shape();
  return static_cast<const unsigned char*>(t.raw()) +
         static_cast<std::size_t>(((b * sh.s + s) * sh.h + h) * sh.d) * dtype_size(t.dtype());
}

}  // namespace

Tensor all_to_all_sequence_to_heads(Communicator& comm, const Tensor& x,
                                    const std::vector<HeadRange>& heads) {
  const int cp = comm.size();
  const Shape4 s = x.shape();  // [B, S/cp, H, D]
  const std::int64_t mine = heads[comm.rank()].size();
  Tensor y(x.dtype(), {s.b, s.s * cp, mine, s.d});
  // Send block p: rank p's heads of every local token; receive block p: this rank's heads of rank p's tokens,
  // positions [p*S/cp, (p+1)*S/cp) (contiguous layout). One row = one token's heads.
  BlockList from{{}, {}, s.s * s.h * s.d, s.h * s.d};
  BlockList to{{}, {}, s.s * cp * mine * s.d, mine * s.d};
  for (int p = 0; p < cp; ++p) {
    from.shape.push_back({s.b, s.s, heads[p].size() * s.d});
    from.offset.push_back(heads[p].begin * s.d);
    to.shape.push_back({s.b, s.s, mine * s.d});
    to.offset.push_back(p * s.s * mine * s.d);
  }
  comm.all_to_all_v(x.raw(), from, y.raw(), to, comm_dtype(x.dtype()));
  return y;
}

Tensor all_to_all_heads_to_sequence(Communicator& comm, const Tensor& y,
                                    const std::vector<HeadRange>& heads) {
  const int cp = comm.size();
  const Shape4 s = y.shape();  // [B, S, n_r, D]
  const std::int64_t sl = s.s / cp;
  std::int64_t slots = 0;
  for (const HeadRange& h : heads) slots += h.size();
  Tensor x(y.dtype(), {s.b, sl, slots, s.d});
  // Send block p: this rank's heads of rank p's tokens; receive block p: rank p's heads, at slots
  // [sum_{v<p} n_v, ...) of every local token.
  BlockList from{{}, {}, s.s * s.h * s.d, s.h * s.d};
  BlockList to{{}, {}, sl * slots * s.d, slots * s.d};
  std::int64_t slot = 0;
  for (int p = 0; p < cp; ++p) {
    from.shape.push_back({s.b, sl, s.h * s.d});
    from.offset.push_back(p * sl * s.h * s.d);
    to.shape.push_back({s.b, sl, heads[p].size() * s.d});
    to.offset.push_back(slot * s.d);
    slot += heads[p].size();
  }
  comm.all_to_all_v(y.raw(), from, x.raw(), to, comm_dtype(y.dtype()));
  return x;
}

std::vector<float> all_to_all_lse_heads_to_sequence(Communicator& comm, const std::vector<float>& lse,
                                                    std::int64_t batch, std::int64_t seq,
                                                    const std::vector<HeadRange>& heads) {
  const int cp = comm.size();
  const std::int64_t sl = seq / cp, mine = heads[comm.rank()].size();
  std::int64_t total = 0;
  for (const HeadRange& h : heads) total += h.size();
  std::vector<float> out(static_cast<std::size_t>(batch * total * sl));
  // lse: [B, n_r, S] -> out: [B, H, S/cp]; one row = one head's sl positions.
  BlockList from{{}, {}, mine * seq, seq};
  BlockList to{{}, {}, total * sl, sl};
  for (int p = 0; p < cp; ++p) {
    from.shape.push_back({batch, mine, sl});
    from.offset.push_back(p * sl);
    to.shape.push_back({batch, heads[p].size(), sl});
    to.offset.push_back(heads[p].begin * sl);
  }
  comm.all_to_all_v(lse.data(), from, out.data(), to, CommDType::f32);
  return out;
}

Tensor all_gather_sequence(Communicator& comm, const Tensor& x, const RankPositions& positions) {
  const int cp = comm.size();
  const Shape4 s = x.shape();
  const std::size_t run = static_cast<std::size_t>(s.h * s.d) * dtype_size(x.dtype());
  Bytes recv(static_cast<std::size_t>(cp) * x.nbytes());
  comm.all_gather(x.raw(), recv.data(), x.numel(), comm_dtype(x.dtype()));
  Tensor y(x.dtype(), {s.b, s.s * cp, s.h, s.d});
  for (int p = 0; p < cp; ++p) {
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t t = 0; t < s.s; ++t) {
        std::memcpy(row_ptr(y, b, positions[p][t], 0), recv.data() + ((p * s.b + b) * s.s + t) * run, run);
      }
    }
  }
  return y;
}

std::vector<std::int32_t> all_gather_segments(Communicator& comm, const std::vector<std::int32_t>& ids,
                                              std::int64_t batch, const RankPositions& positions) {
  const int cp = comm.size();
  const std::int64_t sl = static_cast<std::int64_t>(ids.size()) / batch;
  std::vector<std::int32_t> recv(ids.size() * static_cast<std::size_t>(cp)), out(recv.size());
  comm.all_gather(ids.data(), recv.data(), static_cast<std::int64_t>(ids.size()), CommDType::i32);
  for (int p = 0; p < cp; ++p) {
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t t = 0; t < sl; ++t)
        out[b * sl * cp + positions[p][t]] = recv[(p * batch + b) * sl + t];
    }
  }
  return out;
}

Tensor reduce_scatter_sequence(Communicator& comm, const Tensor& partial, const RankPositions& positions) {
  const int cp = comm.size();
  const Shape4 s = partial.shape();
  CPATTN_ASSERT(partial.dtype() == DType::f32 && s.s % cp == 0);
  const std::int64_t sl = s.s / cp;
  const std::size_t run = static_cast<std::size_t>(s.h * s.d) * 4;
  Bytes send(partial.nbytes());
  for (int p = 0; p < cp; ++p) {
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (std::int64_t t = 0; t < sl; ++t) {
        std::memcpy(send.data() + ((p * s.b + b) * sl + t) * run, row_ptr(partial, b, positions[p][t], 0),
                    run);
      }
    }
  }
  Tensor out(DType::f32, {s.b, sl, s.h, s.d});
  comm.reduce_scatter_sum(send.data(), out.raw(), out.numel(), CommDType::f32);
  return out;
}

namespace {

// The seen-row exchange of one rank: for each peer p, the local rows of this rank whose positions p sees
// (sent to p, in local order) and the local rows of p whose positions this rank sees (received, in p's
// order); and where a position lands among this rank's seen rows.
struct SeenRows {
  std::vector<std::vector<std::int64_t>> to, from;
  std::vector<PositionRange> mine;
  std::vector<std::int64_t> before;  // before[i]: the seen rows of mine's ranges before range i
  std::int64_t total = 0;

  SeenRows(int rank, const RankPositions& positions, const std::vector<std::vector<PositionRange>>& seen)
      : to(positions.size()), from(positions.size()), mine(seen[static_cast<std::size_t>(rank)]) {
    for (std::size_t p = 0; p < positions.size(); ++p) {
      const auto& own = positions[static_cast<std::size_t>(rank)];
      for (std::size_t t = 0; t < own.size(); ++t) {
        if (in_ranges(seen[p], own[t])) to[p].push_back(static_cast<std::int64_t>(t));
      }
      for (std::size_t t = 0; t < positions[p].size(); ++t) {
        if (in_ranges(mine, positions[p][t])) from[p].push_back(static_cast<std::int64_t>(t));
      }
    }
    for (const PositionRange& r : mine) {
      before.push_back(total);
      total += r.size();
    }
  }
  std::int64_t row_of(std::int64_t position) const {
    const auto it = std::upper_bound(mine.begin(), mine.end(), position,
                                     [](std::int64_t v, const PositionRange& r) { return v < r.begin; });
    const auto i = static_cast<std::size_t>(std::prev(it) - mine.begin());
    return before[i] + position - mine[i].begin;
  }
  // Contiguous blocks of `rows[p].size()` rows per batch row, one after another (B-major in each).
  static BlockList blocks(const std::vector<std::vector<std::int64_t>>& rows, std::int64_t batch,
                          std::int64_t row) {
    BlockList list{{}, {}, 0, 0};
    std::int64_t offset = 0;
    for (const auto& r : rows) {
      const std::int64_t count = batch * static_cast<std::int64_t>(r.size()) * row;
      list.shape.push_back({1, 1, count});
      list.offset.push_back(offset);
      offset += count;
    }
    return list;
  }
};

std::int64_t elements_of(const BlockList& list) {
  std::int64_t n = 0;
  for (const BlockShape& s : list.shape) n += s.count();
  return n;
}

}  // namespace

Tensor gather_seen(Communicator& comm, const Tensor& x, const RankPositions& positions,
                   const std::vector<std::vector<PositionRange>>& seen) {
  const int cp = comm.size();
  const Shape4 s = x.shape();
  const SeenRows rows(comm.rank(), positions, seen);
  const std::int64_t row = s.h * s.d;
  const std::size_t bytes = static_cast<std::size_t>(row) * dtype_size(x.dtype());
  const BlockList out = SeenRows::blocks(rows.to, s.b, row), in = SeenRows::blocks(rows.from, s.b, row);
  Bytes send(static_cast<std::size_t>(elements_of(out)) * dtype_size(x.dtype()));
  Bytes recv(static_cast<std::size_t>(elements_of(in)) * dtype_size(x.dtype()));
  for (int p = 0; p < cp; ++p) {
    unsigned char* at = send.data() + static_cast<std::size_t>(out.offset[p]) * dtype_size(x.dtype());
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (const std::int64_t t : rows.to[p]) {
        std::memcpy(at, row_ptr(x, b, t, 0), bytes);
        at += bytes;
      }
    }
  }
  comm.all_to_all_v(send.data(), out, recv.data(), in, comm_dtype(x.dtype()));
  Tensor y(x.dtype(), {s.b, rows.total, s.h, s.d});
  for (int p = 0; p < cp; ++p) {
    const unsigned char* at = recv.data() + static_cast<std::size_t>(in.offset[p]) * dtype_size(x.dtype());
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (const std::int64_t t : rows.from[p]) {
        std::memcpy(row_ptr(y, b, rows.row_of(positions[p][t]), 0), at, bytes);
        at += bytes;
      }
    }
  }
  return y;
}

Tensor scatter_seen(Communicator& comm, const Tensor& partial, const RankPositions& positions,
                    const std::vector<std::vector<PositionRange>>& seen) {
  const int cp = comm.size();
  const Shape4 s = partial.shape();
  CPATTN_ASSERT(partial.dtype() == DType::f32);
  const SeenRows rows(comm.rank(), positions, seen);
  const std::int64_t row = s.h * s.d;
  const std::size_t bytes = static_cast<std::size_t>(row) * 4;
  // The reverse of gather_seen: to each p the partial of p's rows this rank saw, from each p its partial of
  // this rank's rows.
  const BlockList out = SeenRows::blocks(rows.from, s.b, row), in = SeenRows::blocks(rows.to, s.b, row);
  Bytes send(static_cast<std::size_t>(elements_of(out)) * 4),
      recv(static_cast<std::size_t>(elements_of(in)) * 4);
  for (int p = 0; p < cp; ++p) {
    unsigned char* at = send.data() + static_cast<std::size_t>(out.offset[p]) * 4;
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (const std::int64_t t : rows.from[p]) {
        std::memcpy(at, row_ptr(partial, b, rows.row_of(positions[p][t]), 0), bytes);
        at += bytes;
      }
    }
  }
  comm.all_to_all_v(send.data(), out, recv.data(), in, CommDType::f32);
  const std::int64_t sl = static_cast<std::int64_t>(positions[static_cast<std::size_t>(comm.rank())].size());
  Tensor y(DType::f32, {s.b, sl, s.h, s.d});
  for (int p = 0; p < cp; ++p) {  // in rank order
    const float* at =
        reinterpret_cast<const float*>(recv.data() + static_cast<std::size_t>(in.offset[p]) * 4);
    for (std::int64_t b = 0; b < s.b; ++b) {
      for (const std::int64_t t : rows.to[p]) {
        float* into = reinterpret_cast<float*>(row_ptr(y, b, t, 0));
        for (std::int64_t e = 0; e < row; ++e) into[e] += at[e];
        at += row;
      }
    }
  }
  return y;
}

}  // namespace cpattn::cp
