// Runs a context-parallel forward+backward on the in-process group from whole-sequence inputs, and the same
// problem on the single-device kernel and the float64 reference, so that tests can compare them.
#pragma once

#include <cstring>
#include <mutex>
#include <string>

#include "cpattn/context_parallel.hpp"
#include "cpattn/inproc.hpp"
#include "cpattn/reference.hpp"
#include "cpattn/sequence_layout.hpp"
#include "test_support.hpp"

namespace cpattn::testing {

struct CpCase {
  Strategy strategy = Strategy::ulysses;
  bool load_balance = false;
  bool remat = false;
  std::int64_t cp = 4, hq = 32, hkv = 2, dim = 64, seq = 256, batch = 1;
  bool causal = true;
  std::vector<std::int64_t> segments;  // document lengths; empty: one document
  DType dtype = DType::f32;
  NegativeControl control = NegativeControl::none;

  std::string name() const {
    std::string s = std::string(to_string(strategy)) + (load_balance ? "_lb" : "") + (remat ? "_remat" : "") + "_cp" +
                    std::to_string(cp) + "_Hq" + std::to_string(hq) + "_Hkv" + std::to_string(hkv) + "_D" +
                    std::to_string(dim) + "_S" + std::to_string(seq) + "_B" + std::to_string(batch) +
                    (causal ? "_causal" : "_full") + (segments.empty() ? "" : "_packed") + "_" + to_string(dtype);
    return s;
  }
  AttentionSpec attention() const {
    AttentionSpec a;
    a.batch = batch;
    a.seq_len = seq;
    a.num_q_heads = hq;
    a.num_kv_heads = hkv;
    a.head_dim = dim;
    a.causal = causal;
    a.dtype = dtype;
    return a;
  }
  ParallelSpec parallel() const {
    ParallelSpec p;
    p.cp = cp;
    p.strategy = strategy;
    p.load_balance = load_balance;
    return p;
  }
};

struct WholeInputs {
  Tensor q, k, v, d_out;         // natural order
  std::vector<std::int32_t> seg;  // [B, S] or empty
};

inline WholeInputs make_whole_inputs(const CpCase& c, std::uint32_t seed) {
  WholeInputs in;
  in.q = random_tensor(c.dtype, {c.batch, c.seq, c.hq, c.dim}, seed);
  in.k = random_tensor(c.dtype, {c.batch, c.seq, c.hkv, c.dim}, seed + 1);
  in.v = random_tensor(c.dtype, {c.batch, c.seq, c.hkv, c.dim}, seed + 2);
  in.d_out = random_tensor(c.dtype, {c.batch, c.seq, c.hq, c.dim}, seed + 3);
  if (!c.segments.empty()) in.seg = segments_from_lengths(c.batch, c.segments);
  return in;
}

// Rows at `positions` of every batch row: [B, S, H, D] -> [B, n, H, D].
inline Tensor take_rows(const Tensor& t, const std::vector<std::int64_t>& positions) {
  const Shape4 s = t.shape();
  const std::int64_t n = static_cast<std::int64_t>(positions.size());
  Tensor out(t.dtype(), {s.b, n, s.h, s.d});
  const std::size_t run = static_cast<std::size_t>(s.h * s.d) * dtype_size(t.dtype());
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t i = 0; i < n; ++i) {
      std::memcpy(static_cast<unsigned char*>(out.raw()) + (b * n + i) * run,
                  static_cast<const unsigned char*>(t.raw()) + (b * s.s + positions[i]) * run, run);
    }
  }
  return out;
}

struct WholeResult {
  std::vector<float> o, lse, dq, dk, dv;  // natural order; lse [B, Hq, S]
  std::vector<std::vector<CollectiveRecord>> records;  // per rank
  std::vector<std::int64_t> tiles_per_rank;
};

inline WholeResult run_context_parallel(const CpCase& c, const WholeInputs& in, int threads_per_rank = 1) {
  const std::int64_t S = c.seq, B = c.batch, cp = c.cp, sl = c.seq / c.cp;
  WholeResult r;
  r.o.assign(static_cast<std::size_t>(B * S * c.hq * c.dim), 0.0f);
  r.dq = r.o;
  r.lse.assign(static_cast<std::size_t>(B * c.hq * S), 0.0f);
  r.dk.assign(static_cast<std::size_t>(B * S * c.hkv * c.dim), 0.0f);
  r.dv = r.dk;
  r.records.resize(static_cast<std::size_t>(cp));
  r.tiles_per_rank.assign(static_cast<std::size_t>(cp), 0);
  InProcessGroup group(static_cast<int>(cp));
  group.run([&](Communicator& comm) {
    const int rank = comm.rank();
    const auto pos = local_positions(c.parallel().effective_layout(), S, cp, rank);
    ContextParallelOptions opt;
    opt.remat = c.remat;
    opt.threads = threads_per_rank;
    opt.negative_control = c.control;
    ContextParallelAttention attn(c.attention(), c.parallel(), comm, opt);
    std::vector<std::int32_t> seg;
    for (std::int64_t b = 0; b < B && !in.seg.empty(); ++b) {
      for (auto p : pos) seg.push_back(in.seg[b * S + p]);
    }
    const auto out = attn.forward(take_rows(in.q, pos), take_rows(in.k, pos), take_rows(in.v, pos), seg);
    const auto g = attn.backward(take_rows(in.d_out, pos));
    for (std::int64_t t : attn.forward_tiles().per_head) r.tiles_per_rank[rank] += t;
    r.records[rank] = comm.counters().records();
    // Scatter into natural order: ranks write disjoint rows.
    auto scatter = [&](const Tensor& local, std::vector<float>& whole, std::int64_t heads) {
      const auto f = local.to_floats();
      const std::int64_t w = heads * c.dim;
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t i = 0; i < sl; ++i) {
          std::memcpy(&whole[(b * S + pos[i]) * w], &f[(b * sl + i) * w], static_cast<std::size_t>(w) * 4);
        }
      }
    };
    scatter(out.o, r.o, c.hq);
    scatter(g.dq, r.dq, c.hq);
    scatter(g.dk, r.dk, c.hkv);
    scatter(g.dv, r.dv, c.hkv);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < c.hq; ++h) {
        for (std::int64_t i = 0; i < sl; ++i) r.lse[(b * c.hq + h) * S + pos[i]] = out.lse[(b * c.hq + h) * sl + i];
      }
    }
  });
  return r;
}

inline WholeResult run_single_device(const CpCase& c, const WholeInputs& in) {
  const auto pos = natural_positions(c.batch, c.seq);
  const AttentionMask mask{pos, pos, in.seg, in.seg, c.causal};
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  const auto fwd = flash_attention_forward(in.q, in.k, in.v, mask, scale, {});
  const auto bwd = flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, mask, scale, {}, c.dtype);
  WholeResult r;
  r.o = fwd.o.to_floats();
  r.lse = fwd.lse;
  r.dq = bwd.dq.to_floats();
  r.dk = bwd.dk.to_floats();
  r.dv = bwd.dv.to_floats();
  return r;
}

inline ReferenceResult run_reference(const CpCase& c, const WholeInputs& in) {
  const auto pos = natural_positions(c.batch, c.seq);
  return reference_attention(in.q, in.k, in.v, &in.d_out, {pos, pos, in.seg, in.seg, c.causal},
                             1.0 / std::sqrt(static_cast<double>(c.dim)));
}

}  // namespace cpattn::testing
