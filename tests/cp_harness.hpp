// Runs a context-parallel forward+backward on the in-process group from whole-sequence inputs, and the same
// problem on the single-device kernel and the float64 reference, so that tests can compare them.
#pragma once

#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "cpattn/context_parallel.hpp"
#include "cpattn/inproc.hpp"
#include "cpattn/reference.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/shard.hpp"
#include "harness/check.hpp"
#include "harness/whole_problem.hpp"
#include "test_support.hpp"

namespace cpattn::testing {

struct CpCase {
  Strategy strategy = Strategy::ulysses;
  bool load_balance = false;
  bool remat = false;
  std::int64_t cp = 4, hq = 32, hkv = 2, dim = 64, seq = 256, batch = 1;
  std::int64_t ulysses_degree = 0;  // hybrid: U
  bool causal = true;
  std::optional<std::int64_t> window_left, window_right;  // sliding window sides; unset: unbounded
  std::optional<double> softcap;
  bool sinks = false;                  // attention sinks: make_whole_inputs gives one per q head
  std::vector<std::int64_t> segments;  // document lengths; empty: one document
  std::optional<ShardLayout> layout;   // unset: by load_balance; per_document and solver cut by `segments`
  DType dtype = DType::f32;
  NegativeControl control = NegativeControl::none;
  FlashConfig kernel;  // block sizes and the bf16 path, for the ranks and the single-device kernel alike

  std::string name() const {
    std::string s = std::string(to_string(strategy)) + (load_balance ? "_lb" : "") +
                    (layout ? std::string("_") + to_string(*layout) : std::string()) +
                    (remat ? "_remat" : "") + "_cp" + std::to_string(cp) +
                    (ulysses_degree > 0 ? "_U" + std::to_string(ulysses_degree) : std::string()) + "_Hq" +
                    std::to_string(hq) + "_Hkv" + std::to_string(hkv) + "_D" + std::to_string(dim) + "_S" +
                    std::to_string(seq) + "_B" + std::to_string(batch) + (causal ? "_causal" : "_full") +
                    (segments.empty() ? "" : "_packed") + "_" + to_string(dtype);
    if (window_left || window_right) {
      s += "_window" + (window_left ? std::to_string(*window_left) : std::string("inf")) + "," +
           (window_right ? std::to_string(*window_right) : std::string("inf"));
    }
    if (softcap) s += "_softcap" + std::to_string(*softcap);
    if (sinks) s += "_sinks";
    if (dtype == DType::bf16) s += std::string("_") + to_string(flash_bf16_path(kernel));
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
    a.window_left = window_left;
    a.window_right = window_right;
    a.softcap = softcap;
    a.sinks = sinks;
    a.dtype = dtype;
    return a;
  }
  ParallelSpec parallel() const {
    ParallelSpec p;
    p.cp = cp;
    p.strategy = strategy;
    p.load_balance = load_balance;
    p.ulysses_degree = ulysses_degree;
    p.layout = layout;
    if (layout && layout_reads_documents(*layout)) p.documents = segments;
    return p;
  }
};

// The (Hq, Hkv, cp) shapes ulysses takes unevenly or with kv sets shared between ranks (docs/design.md, "Head
// placement"): Qwen2.5-7B's heads at cp 8, Phi-3-medium's at cp 4, 3 kv heads over 4 ranks,
// 7 MHA heads, a group of 4 over 8 ranks, MQA at 6 heads, the seed's, Qwen2.5-32B's at cp 16.
struct HeadCounts {
  std::int64_t hq, hkv, cp;
};
inline constexpr HeadCounts kAnyHeadCounts[] = {{28, 4, 8}, {40, 10, 4}, {24, 3, 4}, {7, 7, 4},
                                                {12, 3, 8}, {6, 1, 4},   {32, 2, 4}, {40, 8, 16}};

using WholeInputs = harness::WholeProblem;

inline WholeInputs make_whole_inputs(const CpCase& c, std::uint32_t seed) {
  WholeInputs in = harness::random_problem(c.attention(), seed, c.segments);
  // Sinks near the logits, one far above them and one far below.
  for (std::int64_t h = 0; c.sinks && h < c.hq; ++h)
    in.sinks.push_back(h % 4 == 1 ? 6.0f : h % 4 == 2 ? -6.0f : 0.5f * static_cast<float>(h % 3) - 0.3f);
  return in;
}

inline Tensor take_rows(const Tensor& t, const std::vector<std::int64_t>& positions) {
  return take_tokens(t, positions);
}

// Whole outputs as floats in natural order, and what each rank counted.
struct CpRun {
  std::vector<float> o, lse, dq, dk, dv, dsinks;
  std::vector<std::vector<CollectiveRecord>> records;  // per rank
  std::vector<std::int64_t> tiles_per_rank;
};

inline CpRun run_context_parallel(const CpCase& c, const WholeInputs& in, int threads_per_rank = 1) {
  harness::RunSettings settings;
  settings.options.remat = c.remat;
  settings.options.threads = threads_per_rank;
  settings.options.kernel = c.kernel;
  settings.negative_control = c.control;
  const harness::WholeResult w = harness::run_in_process(c.attention(), c.parallel(), settings, in);
  CpRun r{w.o.to_floats(), w.lse, w.dq.to_floats(), w.dk.to_floats(), w.dv.to_floats(), w.dsinks, {}, {}};
  for (const harness::RankReport& rank : w.ranks) {
    r.records.push_back(rank.collectives);
    r.tiles_per_rank.push_back(rank.tiles);
  }
  return r;
}

inline CpRun run_single_device(const CpCase& c, const WholeInputs& in) {
  const auto pos = natural_positions(c.batch, c.seq);
  AttentionMask mask = c.attention().mask(pos, pos, in.segment_ids, in.segment_ids);
  mask.sinks = in.sinks;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  FlashConfig cfg = c.kernel;
  cfg.threads = 1;
  const auto fwd = flash_attention_forward(in.q, in.k, in.v, mask, scale, cfg);
  const auto bwd =
      flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, mask, scale, cfg, c.dtype);
  CpRun r;
  r.o = fwd.o.to_floats();
  r.lse = fwd.lse;
  r.dq = bwd.dq.to_floats();
  r.dk = bwd.dk.to_floats();
  r.dv = bwd.dv.to_floats();
  r.dsinks = bwd.dsinks;
  return r;
}

inline ReferenceResult run_reference(const CpCase& c, const WholeInputs& in) {
  const auto pos = natural_positions(c.batch, c.seq);
  AttentionMask mask = c.attention().mask(pos, pos, in.segment_ids, in.segment_ids);
  mask.sinks = in.sinks;
  return reference_attention(in.q, in.k, in.v, &in.d_out, mask, 1.0 / std::sqrt(static_cast<double>(c.dim)));
}

// Forward bit-identical to the single-device kernel; gradients within 1e-6 (fp32) or 1e-2 (bf16) of it, and
// within 1e-5 / 2e-2 of the float64 reference.
inline void expect_matches_single_device(const CpCase& c) {
  SCOPED_TRACE(c.name());
  const auto in = make_whole_inputs(c, 101);
  const auto got = run_context_parallel(c, in);
  const auto single = run_single_device(c, in);
  const auto ref = run_reference(c, in);
  EXPECT_EQ(got.dsinks.size(), c.sinks ? static_cast<std::size_t>(c.hq) : 0u) << "dsinks";
  // Forward: the same bits as the single-device kernel.
  EXPECT_EQ(count_bit_differences(got.o, single.o), 0) << "o";
  EXPECT_EQ(count_bit_differences(got.lse, single.lse), 0) << "lse";
  if (c.dtype == DType::f32) {
    CPATTN_EXPECT_CLOSE(got.dq, single.dq, 1e-6, "dq vs single device");
    CPATTN_EXPECT_CLOSE(got.dk, single.dk, 1e-6, "dk vs single device");
    CPATTN_EXPECT_CLOSE(got.dv, single.dv, 1e-6, "dv vs single device");
    CPATTN_EXPECT_CLOSE(got.o, ref.o, 1e-5, "o vs reference");
    CPATTN_EXPECT_CLOSE(got.dq, ref.dq, 1e-5, "dq vs reference");
    CPATTN_EXPECT_CLOSE(got.dk, ref.dk, 1e-5, "dk vs reference");
    CPATTN_EXPECT_CLOSE(got.dv, ref.dv, 1e-5, "dv vs reference");
    CPATTN_EXPECT_CLOSE(got.dsinks, single.dsinks, 1e-6, "dsinks vs single device");
    CPATTN_EXPECT_CLOSE(got.dsinks, ref.dsinks, 1e-5, "dsinks vs reference");
  } else {
    CPATTN_EXPECT_CLOSE(got.dq, single.dq, 1e-2, "dq vs single device");
    CPATTN_EXPECT_CLOSE(got.dk, single.dk, 1e-2, "dk vs single device");
    CPATTN_EXPECT_CLOSE(got.dv, single.dv, 1e-2, "dv vs single device");
    CPATTN_EXPECT_CLOSE(got.o, ref.o, 2e-2, "o vs reference");
    CPATTN_EXPECT_CLOSE(got.dq, ref.dq, 2e-2, "dq vs reference");
    CPATTN_EXPECT_CLOSE(got.dk, ref.dk, 2e-2, "dk vs reference");
    CPATTN_EXPECT_CLOSE(got.dv, ref.dv, 2e-2, "dv vs reference");
    CPATTN_EXPECT_CLOSE(got.dsinks, single.dsinks, 1e-2, "dsinks vs single device");
    CPATTN_EXPECT_CLOSE(got.dsinks, ref.dsinks, 2e-2, "dsinks vs reference");
  }
}

// ring: each step's result is merged in step order, not the single-device kernel's key order, so the forward
// matches within rounding rather than bit for bit; the bounds are harness::tolerances' (the ones `cpattn run
// --check` applies).
// On these inputs (their segment ids may be any: ids that come back to an earlier document).
inline void expect_ring_matches_single_device(const CpCase& c, const WholeInputs& in) {
  SCOPED_TRACE(c.name());
  const harness::Tolerances tol = harness::tolerances(c.strategy, c.dtype);
  const auto got = run_context_parallel(c, in);
  const auto single = run_single_device(c, in);
  const auto ref = run_reference(c, in);
  EXPECT_EQ(got.dsinks.size(), c.sinks ? static_cast<std::size_t>(c.hq) : 0u) << "dsinks";
  CPATTN_EXPECT_CLOSE(got.o, single.o, tol.o_rel, "o vs single device");
  const auto lse = compare(got.lse, single.lse);
  EXPECT_LE(lse.max_abs, tol.lse_abs) << "lse vs single device";
  EXPECT_EQ(lse.nonfinite, 0) << "lse: non-finite mismatches" << lse.first_mismatches;
  CPATTN_EXPECT_CLOSE(got.o, ref.o, tol.reference_rel, "o vs reference");
  CPATTN_EXPECT_CLOSE(got.dq, single.dq, tol.grad_rel, "dq vs single device");
  CPATTN_EXPECT_CLOSE(got.dk, single.dk, tol.grad_rel, "dk vs single device");
  CPATTN_EXPECT_CLOSE(got.dv, single.dv, tol.grad_rel, "dv vs single device");
  CPATTN_EXPECT_CLOSE(got.dq, ref.dq, tol.reference_rel, "dq vs reference");
  CPATTN_EXPECT_CLOSE(got.dk, ref.dk, tol.reference_rel, "dk vs reference");
  CPATTN_EXPECT_CLOSE(got.dv, ref.dv, tol.reference_rel, "dv vs reference");
  CPATTN_EXPECT_CLOSE(got.dsinks, single.dsinks, tol.grad_rel, "dsinks vs single device");
  CPATTN_EXPECT_CLOSE(got.dsinks, ref.dsinks, tol.reference_rel, "dsinks vs reference");
}

inline void expect_ring_matches_single_device(const CpCase& c, std::uint32_t seed = 101) {
  expect_ring_matches_single_device(c, make_whole_inputs(c, seed));
}

}  // namespace cpattn::testing
