#include "sequence_collectives.hpp"

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

Tensor all_to_all_sequence_to_heads(Communicator& comm, const Tensor& x) {
  const int cp = comm.size();
  const Shape4 s = x.shape();  // [B, S/cp, H, D]
  CPATTN_ASSERT(s.h % cp == 0);
  const std::int64_t hl = s.h / cp;
  Tensor y(x.dtype(), {s.b, s.s * cp, hl, s.d});
  // Block p of x: the heads of rank p, every token; block p of y: rank p's tokens, which are positions
  // [p*S/cp, (p+1)*S/cp) (contiguous layout). One row = one token's hl heads.
  const BlockShape shape{s.b, s.s, hl * s.d};
  const BlockStrides from{hl * s.d, s.s * s.h * s.d, s.h * s.d};
  const BlockStrides to{s.s * hl * s.d, s.s * cp * hl * s.d, hl * s.d};
  comm.all_to_all_strided(x.raw(), from, y.raw(), to, shape, comm_dtype(x.dtype()));
  return y;
}

Tensor all_to_all_heads_to_sequence(Communicator& comm, const Tensor& y) {
  const int cp = comm.size();
  const Shape4 s = y.shape();  // [B, S, H/cp, D]
  CPATTN_ASSERT(s.s % cp == 0);
  const std::int64_t sl = s.s / cp;
  Tensor x(y.dtype(), {s.b, sl, s.h * cp, s.d});
  // Block p of y: rank p's tokens; block p of x: the heads that came from rank p.
  const BlockShape shape{s.b, sl, s.h * s.d};
  const BlockStrides from{sl * s.h * s.d, s.s * s.h * s.d, s.h * s.d};
  const BlockStrides to{s.h * s.d, sl * s.h * cp * s.d, s.h * cp * s.d};
  comm.all_to_all_strided(y.raw(), from, x.raw(), to, shape, comm_dtype(y.dtype()));
  return x;
}

std::vector<float> all_to_all_lse_heads_to_sequence(Communicator& comm, const std::vector<float>& lse,
                                                    std::int64_t batch, std::int64_t local_heads,
                                                    std::int64_t seq) {
  const int cp = comm.size();
  const std::int64_t sl = seq / cp;
  std::vector<float> out(static_cast<std::size_t>(batch * local_heads * seq));
  // lse: [B, H/cp, S] -> out: [B, H, S/cp]; one row = one head's sl positions.
  const BlockShape shape{batch, local_heads, sl};
  const BlockStrides from{sl, local_heads * seq, seq};
  const BlockStrides to{local_heads * sl, local_heads * cp * sl, sl};
  comm.all_to_all_strided(lse.data(), from, out.data(), to, shape, CommDType::f32);
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

}  // namespace cpattn::cp
