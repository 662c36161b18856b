// The flash kernels against the float64 reference, the independent vectors, hand-counted tiles, and the
// determinism contract (bit-identical rows whatever the shard, order or thread count).
#include <gtest/gtest.h>

#include <array>
#include <limits>
#include <tuple>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "cpattn/error.hpp"
#include "cpattn/flash.hpp"
#include "cpattn/npy.hpp"
#include "cpattn/reference.hpp"
#include "test_support.hpp"

namespace cpattn {
namespace {

using testing::natural_positions;
using testing::segment_ids_from_lengths;

struct Case {
  std::int64_t batch = 1, seq = 64, hq = 4, hkv = 4, dim = 32;
  bool causal = true;
  std::vector<std::int64_t> segments;  // document lengths, empty: one document
  DType dtype = DType::f32;
  std::string name() const {
    std::string s = "B" + std::to_string(batch) + "_S" + std::to_string(seq) + "_Hq" + std::to_string(hq) +
                    "_Hkv" + std::to_string(hkv) + "_D" + std::to_string(dim) +
                    (causal ? "_causal" : "_full");
    if (!segments.empty()) s += "_packed" + std::to_string(segments.size());
    return s + "_" + to_string(dtype);
  }
};

struct Inputs {
  Tensor q, k, v, d_out;
  std::vector<std::int32_t> pos, seg;
  AttentionMask mask(bool causal) const { return {pos, pos, seg, seg, causal}; }
};

Inputs make_inputs(const Case& c, std::uint32_t seed) {
  AttentionSpec spec;
  spec.batch = c.batch;
  spec.seq_len = c.seq;
  spec.num_q_heads = c.hq;
  spec.num_kv_heads = c.hkv;
  spec.head_dim = c.dim;
  spec.dtype = c.dtype;
  harness::WholeProblem p = harness::random_problem(spec, seed, c.segments);
  Inputs in{std::move(p.q),
            std::move(p.k),
            std::move(p.v),
            std::move(p.d_out),
            natural_positions(c.batch, c.seq),
            std::move(p.segment_ids)};
  return in;
}

// Forward and backward through `mask` against the float64 reference: O and LSE within tol_o of their largest
// magnitude, dQ, dK, dV (and dsinks, with the mask's sinks) within tol_grad. Returns the forward.
FlashForwardResult expect_kernel_matches_reference(const Inputs& in, const AttentionMask& mask, double scale,
                                                   const FlashConfig& cfg, double tol_o, double tol_grad) {
  FlashForwardResult fwd = flash_attention_forward(in.q, in.k, in.v, mask, scale, cfg);
  const auto bwd =
      flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, mask, scale, cfg, DType::f32);
  const auto ref = reference_attention(in.q, in.k, in.v, &in.d_out, mask, scale);
  CPATTN_EXPECT_CLOSE(fwd.o.to_floats(), ref.o, tol_o, "o");
  CPATTN_EXPECT_CLOSE(fwd.lse, ref.lse, tol_o, "lse");
  CPATTN_EXPECT_CLOSE(bwd.dq.to_floats(), ref.dq, tol_grad, "dq");
  CPATTN_EXPECT_CLOSE(bwd.dk.to_floats(), ref.dk, tol_grad, "dk");
  CPATTN_EXPECT_CLOSE(bwd.dv.to_floats(), ref.dv, tol_grad, "dv");
  EXPECT_EQ(bwd.dsinks.size(), mask.sinks.size());
  CPATTN_EXPECT_CLOSE(bwd.dsinks, ref.dsinks, tol_grad, "dsinks");
  return fwd;
}

// Runs kernel and reference; fp32 within `tol` of max |ref|; bf16 against the reference on the bf16 values.
void check_against_reference(const Case& c, double tol, int threads = 1, FlashConfig cfg = {}) {
  SCOPED_TRACE(c.name());
  const Inputs in = make_inputs(c, 17);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  cfg.threads = threads;
  expect_kernel_matches_reference(in, in.mask(c.causal), scale, cfg, tol, tol);
}

TEST(FlashKernel, MatchesReferenceOnAwkwardSizesFp32) {
  const std::vector<Case> cases = {
      {1, 1, 2, 1, 8, true, {}},
      {1, 7, 4, 2, 20, false, {}},
      {2, 127, 4, 1, 64, true, {}},
      {1, 129, 16, 1, 8, true, {}},
      {1, 129, 8, 2, 128, false, {50, 79}},
      {1, 1000, 2, 1, 64, true, {}},
      {1, 300, 4, 4, 256, true, {1, 150, 149}},
      {2, 200, 16, 4, 20, true, {64, 64, 72}},
      {1, 65, 2, 2, 512, false, {}},
      {1, 33, 3, 3, 1, true, {}},
      {1, 70, 2, 1, 17, false, {30, 40}},
  };
  for (const Case& c : cases) check_against_reference(c, 1e-5);
}

// Every SIMD target compiled in and supported here (one in a -march=native build; SSSE3 .. AVX3_DL and the
// portable scalar one in a generic build, scripts/test --portable) is selectable and matches the reference.
TEST(FlashKernel, EverySimdTargetIsSelectableAndMatchesTheReference) {
  const std::vector<std::string> targets = flash_vector_targets();
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(flash_vector_target(), targets.front());  // the best one by default
  for (const std::string& t : targets) {
    SCOPED_TRACE(t);
    flash_force_vector_target(t);
    EXPECT_EQ(flash_vector_target(), t);
    for (const Case& c : std::vector<Case>{{1, 70, 2, 1, 17, false, {30, 40}},
                                           {2, 129, 4, 2, 64, true, {60, 69}},
                                           {1, 33, 3, 3, 1, true, {}},
                                           {1, 100, 2, 1, 128, true, {}}}) {
      check_against_reference(c, 1e-5);
    }
  }
  flash_force_vector_target("");
  EXPECT_EQ(flash_vector_target(), targets.front());
  try {
    flash_force_vector_target("AVX9");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'AVX9' is not compiled in"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(targets.front()), std::string::npos) << e.what();
  }
  EXPECT_EQ(flash_vector_target(), targets.front());  // a bad name changes nothing
}

TEST(FlashKernel, MatchesReferenceWithTwoThreads) {
  check_against_reference({2, 257, 8, 2, 64, true, {100, 157}}, 1e-5, 2);
}

// bf16 on every path this CPU has, against the float64 reference on the bf16-rounded inputs: awkward sizes
// (S = 1, 7, 63, 65, 1000; D = 64, 80, 128, 256), causal and packed, GQA and MQA, one and two threads.
TEST(FlashKernel, Bf16MatchesReferenceOnRoundedInputsOnEveryPath) {
  const std::vector<Case> cases = {
      {1, 200, 8, 2, 64, true, {}},
      {2, 129, 4, 1, 128, false, {60, 69}},
      {1, 1, 2, 1, 64, true, {}},
      {1, 7, 4, 2, 80, false, {3, 4}},
      {2, 63, 4, 1, 128, true, {}},
      {1, 65, 2, 2, 256, false, {30, 35}},
      {1, 1000, 4, 1, 128, true, {1, 500, 499}},
      {1, 1000, 2, 2, 80, false, {}},
  };
  for (const auto& [path, cfg] : testing::bf16_paths()) {
    SCOPED_TRACE(to_string(path));
    for (Case c : cases) {
      c.dtype = DType::bf16;
      check_against_reference(c, 2e-2, c.seq == 1000 ? 2 : 1, cfg);
    }
  }
}

TEST(FlashKernel, MatchesIndependentVectors) {
  const std::filesystem::path root = CPATTN_TEST_DATA_DIR "/attention";
  const auto paths = testing::bf16_paths();
  int cases = 0;
  for (const auto& dir : std::filesystem::directory_iterator(root)) {
    if (!dir.is_directory()) continue;
    ++cases;
    SCOPED_TRACE(dir.path().filename().string());
    const auto spec = nlohmann::json::parse(std::ifstream(dir.path() / "case.json"));
    auto load = [&](const char* name) { return read_npy((dir.path() / name).string()); };
    auto tensor = [&](const char* name) {
      const NpyArray a = load(name);
      return Tensor::from_floats(DType::f32, {a.shape[0], a.shape[1], a.shape[2], a.shape[3]}, a.as_floats());
    };
    const Tensor q = tensor("q.npy"), k = tensor("k.npy"), v = tensor("v.npy"), d_out = tensor("do.npy");
    const auto seg = load("segment_ids.npy").as_int32();
    const auto pos = natural_positions(q.shape().b, q.shape().s);
    const AttentionMask mask{pos, pos, seg, seg, spec["causal"].get<bool>()};
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.shape().d));
    const auto fwd = flash_attention_forward(q, k, v, mask, scale, {});
    const auto bwd = flash_attention_backward(q, k, v, fwd.o, fwd.lse, d_out, mask, scale, {}, DType::f32);
    CPATTN_EXPECT_CLOSE(fwd.o.to_floats(), load("o.npy").as_doubles(), 1e-5, "o");
    CPATTN_EXPECT_CLOSE(fwd.lse, load("lse.npy").as_doubles(), 1e-5, "lse");
    CPATTN_EXPECT_CLOSE(bwd.dq.to_floats(), load("dq.npy").as_doubles(), 1e-5, "dq");
    CPATTN_EXPECT_CLOSE(bwd.dk.to_floats(), load("dk.npy").as_doubles(), 1e-5, "dk");
    CPATTN_EXPECT_CLOSE(bwd.dv.to_floats(), load("dv.npy").as_doubles(), 1e-5, "dv");
    // bf16 on every path: the inputs rounded to bf16, against PyTorch's float64 outputs for the unrounded
    // ones (the rounding itself moves them well under the bound).
    for (const auto& [path, cfg] : paths) {
      SCOPED_TRACE(to_string(path));
      const Tensor qb = q.to(DType::bf16), kb = k.to(DType::bf16), vb = v.to(DType::bf16),
                   db = d_out.to(DType::bf16);
      const auto f = flash_attention_forward(qb, kb, vb, mask, scale, cfg);
      const auto g = flash_attention_backward(qb, kb, vb, f.o, f.lse, db, mask, scale, cfg, DType::f32);
      CPATTN_EXPECT_CLOSE(f.o.to_floats(), load("o.npy").as_doubles(), 2e-2, "o bf16");
      CPATTN_EXPECT_CLOSE(f.lse, load("lse.npy").as_doubles(), 2e-2, "lse bf16");
      CPATTN_EXPECT_CLOSE(g.dq.to_floats(), load("dq.npy").as_doubles(), 2e-2, "dq bf16");
      CPATTN_EXPECT_CLOSE(g.dk.to_floats(), load("dk.npy").as_doubles(), 2e-2, "dk bf16");
      CPATTN_EXPECT_CLOSE(g.dv.to_floats(), load("dv.npy").as_doubles(), 2e-2, "dv bf16");
    }
  }
  EXPECT_EQ(cases, 6);
}

// Segment ids that are not runs of one document each: a document that comes back after another
// ([0]*64 + [1]*128 + [0]*64, so a q block of the second 0-run first meets kv blocks it cannot see, then
// visible ones again) and ids drawn at random per run of 1..40 tokens from {0, 1, 2}. A row whose running
// maximum is first -inf and then finite must be rescaled correctly; fp32 on every SIMD target (two threads on
// the default one), bf16 on every product path (one and two threads), causal and not.
TEST(FlashKernel, SegmentsThatReturnToAnEarlierDocumentOnEveryPath) {
  std::vector<std::int32_t> returning(256, 0);
  std::fill(returning.begin() + 64, returning.begin() + 192, 1);
  std::vector<std::int32_t> drawn;
  std::mt19937 gen(11);
  while (drawn.size() < 300) {
    const auto id = static_cast<std::int32_t>(gen() % 3);
    for (auto n = 1 + gen() % 40; n > 0 && drawn.size() < 300; --n) drawn.push_back(id);
  }
  auto check = [](const std::vector<std::int32_t>& seg, DType dtype, bool causal, int threads,
                  FlashConfig cfg) {
    const auto S = static_cast<std::int64_t>(seg.size());
    Case c{1, S, 4, 2, dtype == DType::bf16 ? 128 : 64, causal, {}, dtype};
    SCOPED_TRACE(c.name() + " threads " + std::to_string(threads));
    const Inputs in = make_inputs(c, 23);
    const AttentionMask mask{in.pos, in.pos, seg, seg, causal};
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim)),
                 tol = dtype == DType::bf16 ? 2e-2 : 1e-5;
    cfg.threads = threads;
    expect_kernel_matches_reference(in, mask, scale, cfg, tol, tol);
  };
  for (const std::vector<std::int32_t>* seg : {&returning, &drawn}) {
    for (bool causal : {true, false}) {
      for (const std::string& t : flash_vector_targets()) {
        SCOPED_TRACE(t);
        flash_force_vector_target(t);
        check(*seg, DType::f32, causal, 1, {});
      }
      flash_force_vector_target("");
      check(*seg, DType::f32, causal, 2, {});  // two threads on the default target
      for (const auto& [path, cfg] : testing::bf16_paths()) {
        SCOPED_TRACE(to_string(path));
        for (int threads : {1, 2}) check(*seg, DType::bf16, causal, threads, cfg);
      }
    }
  }
}

// Sliding windows (flash-attention's window_size) against the float64 reference: causal windows of 0, 1, 7,
// 64, 1000 keys back and two-sided ones without the causal mask, on a packed row whose documents are shorter
// and longer than the windows; D 64, 80, 128; GQA and MQA. fp32 on every SIMD target (O within 2e-6 of max
// |O|, gradients 1e-5; two threads on the default target), bf16 on every product path (1e-2 / 2e-2).
TEST(FlashKernel, SlidingWindowsMatchTheReferenceOnEveryPath) {
  auto check = [](DType dtype, bool causal, std::int64_t left, std::int64_t right, std::int64_t dim,
                  std::int64_t hkv, int threads, FlashConfig cfg) {
    Case c{1, 300, 4, hkv, dim, causal, {40, 200, 60}, dtype};
    SCOPED_TRACE(c.name() + " window " + std::to_string(left) + "," + std::to_string(right) + " threads " +
                 std::to_string(threads));
    const Inputs in = make_inputs(c, 29);
    AttentionMask mask = in.mask(causal);
    mask.window_left = left;
    mask.window_right = right;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
    const double tol_o = dtype == DType::bf16 ? 1e-2 : 2e-6, tol_grad = dtype == DType::bf16 ? 2e-2 : 1e-5;
    cfg.threads = threads;
    expect_kernel_matches_reference(in, mask, scale, cfg, tol_o, tol_grad);
  };
#if defined(__SANITIZE_ADDRESS__)  // the band's edges inside a block and across blocks; the rest in other
                                   // builds
  const std::int64_t windows[] = {7, 64};
#else
  const std::int64_t windows[] = {0, 1, 7, 64, 1000};
#endif
  for (std::size_t i = 0; i < std::size(windows); ++i) {
    const std::int64_t w = windows[i], dim = std::array<std::int64_t, 3>{64, 80, 128}[i % 3],
                       hkv = i % 2 == 0 ? 2 : 1;
    for (const bool causal : {true, false}) {
      const std::int64_t right = causal ? kUnboundedWindow : w / 2 + 3;
      for (const std::string& t : flash_vector_targets()) {
        SCOPED_TRACE(t);
        flash_force_vector_target(t);
        check(DType::f32, causal, w, right, dim, hkv, 1, {});
      }
      flash_force_vector_target("");
      check(DType::f32, causal, w, right, dim, hkv, 2, {});
      for (const auto& [path, cfg] : testing::bf16_paths()) {
        SCOPED_TRACE(to_string(path));
        check(DType::bf16, causal, w, right, dim, hkv, 1 + static_cast<int>(i % 2), cfg);
      }
    }
  }
}

// Negative control for the windows above: the kernel's window against the reference's with one key more
// (or less) on either side is far outside the tolerances that hold at the same window, causal and not. A
// kernel that masked one key too many or too few would fail SlidingWindowsMatchTheReferenceOnEveryPath so.
TEST(FlashKernel, AWindowOffByOneIsFarOutsideTheTolerance) {
  Case c{1, 300, 4, 2, 64, true, {40, 200, 60}, DType::f32};
  const Inputs in = make_inputs(c, 29);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  for (const bool causal : {true, false}) {
    AttentionMask mask = in.mask(causal);
    mask.window_left = 7;
    if (!causal) mask.window_right = 5;
    const auto fwd = flash_attention_forward(in.q, in.k, in.v, mask, scale, {});
    for (const auto& [left, right] : {std::pair{1, 0}, std::pair{-1, 0}, std::pair{0, 1}, std::pair{0, -1}}) {
      if (causal && right != 0) continue;
      SCOPED_TRACE(std::string(causal ? "causal" : "non-causal") + " left " + std::to_string(left) +
                   " right " + std::to_string(right));
      AttentionMask off = mask;
      off.window_left = mask.window_left + left;
      if (!causal) off.window_right = mask.window_right + right;
      const auto ref = reference_attention(in.q, in.k, in.v, nullptr, off, scale);
      EXPECT_GT(testing::compare(fwd.o.to_floats(), ref.o, 2e-6).max_rel, 100 * 2e-6);
    }
  }
}

// Logit soft-capping (Gemma 2) against the float64 reference: caps 2, 30 and 50 on logits of spread 2 (scale
// 0.25 at D = 64: larger logits cost fp32 its 2e-6 on O without any cap, 2.1e-6 at scale 1), causal and not,
// packed, with and without a window; fp32 on every SIMD target,
// bf16 on every product path. Negative controls: the cap left out of the backward, or out of the forward,
// is caught by the same comparison. A cap far past every logit is no cap, within rounding.
TEST(FlashKernel, SoftCapMatchesTheReferenceOnEveryPath) {
  auto run = [](DType dtype, bool causal, double cap, std::int64_t window, FlashConfig cfg, int threads,
                bool cap_in_backward) {
    Case c{1, 200, 4, 2, 64, causal, {70, 130}, dtype};
    SCOPED_TRACE(c.name() + " softcap " + std::to_string(cap) + " window " + std::to_string(window));
    const Inputs in = make_inputs(c, 37);
    AttentionMask mask = in.mask(causal);
    mask.softcap = cap;
    if (window >= 0) mask.window_left = window;
    cfg.threads = threads;
    const auto fwd = flash_attention_forward(in.q, in.k, in.v, mask, 0.25, cfg);
    AttentionMask bwd_mask = mask;
    if (!cap_in_backward) bwd_mask.softcap = 0;
    const auto bwd =
        flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, bwd_mask, 0.25, cfg, DType::f32);
    const auto ref = reference_attention(in.q, in.k, in.v, &in.d_out, mask, 0.25);
    std::array<double, 5> errors{};
    for (const auto& [i, got, want] :
         {std::tuple{0, fwd.o.to_floats(), ref.o}, std::tuple{1, std::vector<float>(fwd.lse), ref.lse},
          std::tuple{2, bwd.dq.to_floats(), ref.dq}, std::tuple{3, bwd.dk.to_floats(), ref.dk},
          std::tuple{4, bwd.dv.to_floats(), ref.dv}}) {
      errors[static_cast<std::size_t>(i)] = testing::compare(got, want, 1.0).max_rel;
    }
    return errors;
  };
#if defined(__SANITIZE_ADDRESS__)  // one cap under ASan: its memory is the same whatever the cap
  for (const double cap : {2.0}) {
#else
  for (const double cap : {2.0, 30.0, 50.0}) {
#endif
    for (const bool causal : {true, false}) {
      for (const std::int64_t window : {std::int64_t{-1}, std::int64_t{40}}) {
        SCOPED_TRACE("softcap " + std::to_string(cap) + (causal ? " causal" : " full") + " window " +
                     std::to_string(window));
        auto expect = [&](const std::array<double, 5>& e, double tol_o, double tol_grad) {
          EXPECT_LE(e[0], tol_o) << "o";
          EXPECT_LE(e[1], tol_o) << "lse";
          EXPECT_LE(e[2], tol_grad) << "dq";
          EXPECT_LE(e[3], tol_grad) << "dk";
          EXPECT_LE(e[4], tol_grad) << "dv";
        };
        for (const std::string& t : flash_vector_targets()) {
          SCOPED_TRACE(t);
          flash_force_vector_target(t);
          expect(run(DType::f32, causal, cap, window, {}, 1, true), 2e-6, 1e-5);
        }
        flash_force_vector_target("");
        expect(run(DType::f32, causal, cap, window, {}, 2, true), 2e-6, 1e-5);
        for (const auto& [path, cfg] : testing::bf16_paths()) {
          SCOPED_TRACE(to_string(path));
          expect(run(DType::bf16, causal, cap, window, cfg, 1, true), 1e-2, 2e-2);
        }
      }
    }
  }
  // The cap left out of the backward: dQ and dK off by far more than their bound (dV does not read dS), at
  // the tight cap and at Gemma's 30.
  for (const double cap : {2.0, 30.0}) {
    const auto wrong = run(DType::f32, true, cap, -1, {}, 1, false);
    EXPECT_GT(wrong[2], 1e-4) << cap;
    EXPECT_GT(wrong[3], 1e-4) << cap;
  }
  // A cap of 1e30 is no cap: within fp32 rounding of the uncapped kernel.
  Case c{1, 200, 4, 2, 64, true, {70, 130}};
  const Inputs in = make_inputs(c, 37);
  AttentionMask capped = in.mask(true);
  capped.softcap = 1e30;
  const auto plain = flash_attention_forward(in.q, in.k, in.v, in.mask(true), 0.125, {});
  const auto far = flash_attention_forward(in.q, in.k, in.v, capped, 0.125, {});
  CPATTN_EXPECT_CLOSE(far.o.to_floats(), plain.o.to_floats(), 1e-6, "o, cap 1e30");
  // The rules' extremes (scale 1e-25, cap 1e25) stay finite on every path: no factor of scale / cap is
  // formed.
  for (const auto& [path, cfg] : testing::bf16_paths()) {
    Case e{1, 100, 4, 2, 64, true, {}, DType::bf16};
    const Inputs ein = make_inputs(e, 5);
    AttentionMask m = ein.mask(true);
    m.softcap = 1e25;
    const auto f = flash_attention_forward(ein.q, ein.k, ein.v, m, 1e-25, cfg);
    const auto g =
        flash_attention_backward(ein.q, ein.k, ein.v, f.o, f.lse, ein.d_out, m, 1e-25, cfg, DType::f32);
    const auto r = reference_attention(ein.q, ein.k, ein.v, &ein.d_out, m, 1e-25);
    CPATTN_EXPECT_CLOSE(f.o.to_floats(), r.o, 1e-2, to_string(path));
    CPATTN_EXPECT_CLOSE(g.dv.to_floats(), r.dv, 2e-2, to_string(path));
    for (const float x : g.dq.to_floats()) ASSERT_TRUE(std::isfinite(x)) << to_string(path);
  }
  // ... and the forward's cap is visible: a cap of 2 moves O far from the uncapped one.
  AttentionMask tight = in.mask(true);
  tight.softcap = 2.0;
  const auto capped_o = flash_attention_forward(in.q, in.k, in.v, tight, 1.0, {});
  const auto uncapped_o = flash_attention_forward(in.q, in.k, in.v, in.mask(true), 1.0, {});
  EXPECT_GT(testing::compare(capped_o.o.to_floats(), uncapped_o.o.to_floats(), 1.0).max_rel, 1e-1);
}

// Attention sinks (gpt-oss) against the float64 reference: a sink per q head (one far above the logits, one
// far below, the rest near them), causal and not, packed, alone and with a window and a soft-cap; O, LSE, dQ,
// dK, dV and dsinks; fp32 on every SIMD target, bf16 on every product path. A row that sees no key gives O =
// 0 and its LSE is the sink. Negative control: the same outputs against the reference without sinks are far
// off.
TEST(FlashKernel, SinksMatchTheReferenceOnEveryPath) {
  const std::vector<float> sinks = {0.5f, 9.0f, -7.0f, 1.5f};
  auto check = [&](DType dtype, bool causal, std::int64_t window, double cap, FlashConfig cfg, int threads) {
    Case c{1, 150, 4, 2, 64, causal, {50, 100}, dtype};
    SCOPED_TRACE(c.name() + " window " + std::to_string(window) + " softcap " + std::to_string(cap) +
                 " threads " + std::to_string(threads));
    const Inputs in = make_inputs(c, 41);
    AttentionMask mask = in.mask(causal);
    mask.sinks = sinks;
    mask.softcap = cap;
    if (window >= 0) mask.window_left = window;
    cfg.threads = threads;
    const double scale = 0.125, tol_o = dtype == DType::bf16 ? 1e-2 : 2e-6,
                 tol_grad = dtype == DType::bf16 ? 2e-2 : 1e-5;
    const FlashForwardResult fwd = expect_kernel_matches_reference(in, mask, scale, cfg, tol_o, tol_grad);
    AttentionMask plain = mask;
    plain.sinks = {};
    const auto without = reference_attention(in.q, in.k, in.v, &in.d_out, plain, scale);
    EXPECT_GT(testing::compare(fwd.o.to_floats(), without.o, 1.0).max_rel, 1e-1);
  };
  for (const bool causal : {true, false}) {
    for (const auto& [window, cap] : {std::pair{std::int64_t{-1}, 0.0}, std::pair{std::int64_t{30}, 5.0}}) {
      for (const std::string& t : flash_vector_targets()) {
        SCOPED_TRACE(t);
        flash_force_vector_target(t);
        check(DType::f32, causal, window, cap, {}, 1);
      }
      flash_force_vector_target("");
      check(DType::f32, causal, window, cap, {}, 2);
      for (const auto& [path, cfg] : testing::bf16_paths()) {
        SCOPED_TRACE(to_string(path));
        check(DType::bf16, causal, window, cap, cfg, 1);
      }
    }
  }
  // Rows that see no key (a query whose only document's keys are all in another batch row's... here: every
  // key of another segment): O = 0, LSE = the head's sink.
  Case c{1, 8, 4, 2, 16, true, {}};
  const Inputs in = make_inputs(c, 3);
  const std::vector<std::int32_t> q_seg(8, 1), kv_seg(8, 2);
  AttentionMask mask{in.pos, in.pos, q_seg, kv_seg, true};
  mask.sinks = sinks;
  const auto fwd = flash_attention_forward(in.q, in.k, in.v, mask, 0.25, {});
  for (const float x : fwd.o.to_floats()) EXPECT_EQ(x, 0.0f);
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t i = 0; i < 8; ++i) EXPECT_EQ(fwd.lse[static_cast<std::size_t>(h * 8 + i)], sinks[h]);
}

// A window that reaches past the row (left >= S, or the widest side) is no window: the same bits, fp32 and
// bf16, forward and backward; and the tiles a window leaves are those it reaches.
TEST(FlashKernel, AWindowPastTheRowIsNoWindowBitForBit) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const bool causal : {true, false}) {
      Case c{1, 200, 4, 2, 64, causal, {120, 80}, dtype};
      SCOPED_TRACE(c.name());
      const Inputs in = make_inputs(c, 31);
      const AttentionMask plain = in.mask(causal);
      const auto fwd = flash_attention_forward(in.q, in.k, in.v, plain, 0.125, {});
      const auto bwd =
          flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, plain, 0.125, {}, DType::f32);
      for (const std::int64_t side : {std::int64_t{200}, (std::int64_t{1} << 31) - 1}) {
        AttentionMask m = plain;
        m.window_left = side;
        if (!causal) m.window_right = side;
        const auto wf = flash_attention_forward(in.q, in.k, in.v, m, 0.125, {});
        const auto wb =
            flash_attention_backward(in.q, in.k, in.v, wf.o, wf.lse, in.d_out, m, 0.125, {}, DType::f32);
        EXPECT_EQ(testing::count_bit_differences(wf.o.to_floats(), fwd.o.to_floats()), 0) << side;
        EXPECT_EQ(testing::count_bit_differences(wf.lse, fwd.lse), 0) << side;
        EXPECT_EQ(testing::count_bit_differences(wb.dq.to_floats(), bwd.dq.to_floats()), 0) << side;
        EXPECT_EQ(testing::count_bit_differences(wb.dk.to_floats(), bwd.dk.to_floats()), 0) << side;
        EXPECT_EQ(testing::count_bit_differences(wb.dv.to_floats(), bwd.dv.to_floats()), 0) << side;
        EXPECT_EQ(wf.tiles.per_head, fwd.tiles.per_head);
      }
    }
  }
  // 1024 tokens, 64-token blocks, a causal window of 100 keys (left 99): q block 0 computes 1 tile, block 1
  // two, every later one three (its first query reaches back into the block two before it); forward and
  // backward alike. Two-sided 10,10: a block and both neighbours.
  Case c{1, 1024, 1, 1, 8, true, {}};
  const Inputs in = make_inputs(c, 3);
  for (const auto& [causal, left, right, tiles] :
       {std::tuple<bool, std::int64_t, std::int64_t, std::int64_t>{true, 99, kUnboundedWindow,
                                                                   1 + 2 + 14 * 3},
        std::tuple<bool, std::int64_t, std::int64_t, std::int64_t>{false, 10, 10, 16 + 2 * 15}}) {
    AttentionMask m = in.mask(causal);
    m.window_left = left;
    m.window_right = right;
    const auto fwd = flash_attention_forward(in.q, in.k, in.v, m, 1.0, {});
    const auto bwd =
        flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, m, 1.0, {}, DType::f32);
    EXPECT_EQ(fwd.tiles.total(), tiles);
    EXPECT_EQ(bwd.tiles.total(), tiles);
  }
}

TEST(FlashKernel, FullyMaskedRowsAreZeroWithMinusInfinityLse) {
  Case c{1, 100, 4, 2, 32, true, {}};
  Inputs in = make_inputs(c, 5);
  // Query segments that no key has: rows 10..19 and 70..99 see nothing.
  std::vector<std::int32_t> q_seg(100, 0), kv_seg(100, 0);
  for (int i = 10; i < 20; ++i) q_seg[i] = 7;
  for (int i = 70; i < 100; ++i) q_seg[i] = 9;
  const AttentionMask mask{in.pos, in.pos, q_seg, kv_seg, true};
  const auto fwd = flash_attention_forward(in.q, in.k, in.v, mask, 0.2, {});
  const auto bwd =
      flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, mask, 0.2, {}, DType::f32);
  const auto ref = reference_attention(in.q, in.k, in.v, &in.d_out, mask, 0.2);
  for (std::int64_t h = 0; h < 4; ++h) {
    for (int i : {10, 19, 70, 99}) {
      EXPECT_EQ(fwd.lse[h * 100 + i], -std::numeric_limits<float>::infinity());
      for (std::int64_t d = 0; d < 32; ++d) {
        EXPECT_EQ(fwd.o.get(0, i, h, d), 0.0f);
        EXPECT_EQ(bwd.dq.get(0, i, h, d), 0.0f);
      }
    }
  }
  for (float x : bwd.dk.to_floats()) ASSERT_TRUE(std::isfinite(x));
  for (float x : bwd.dv.to_floats()) ASSERT_TRUE(std::isfinite(x));
  CPATTN_EXPECT_CLOSE(fwd.o.to_floats(), ref.o, 1e-5, "o");
  CPATTN_EXPECT_CLOSE(fwd.lse, ref.lse, 1e-5, "lse");
  CPATTN_EXPECT_CLOSE(bwd.dk.to_floats(), ref.dk, 1e-5, "dk");
  CPATTN_EXPECT_CLOSE(bwd.dv.to_floats(), ref.dv, 1e-5, "dv");
}

// Tile counts for one head on a single document, from the formula in flash.hpp written out by hand.
std::int64_t tiles_for(std::int64_t seq, bool causal, std::int64_t bq, std::int64_t bk,
                       std::vector<std::int64_t> segments = {}) {
  Case c{1, seq, 1, 1, 8, causal, segments};
  const Inputs in = make_inputs(c, 3);
  FlashConfig cfg;
  cfg.block_q = bq;
  cfg.block_kv = bk;
  const auto fwd = flash_attention_forward(in.q, in.k, in.v, in.mask(causal), 1.0, cfg);
  const auto bwd = flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, in.mask(causal), 1.0,
                                            cfg, DType::f32);
  EXPECT_EQ(fwd.tiles.per_head, bwd.tiles.per_head) << "backward computes the same tiles";
  EXPECT_EQ(fwd.tiles.total(), fwd.tiles.per_head.at(0));
  return fwd.tiles.per_head.at(0);
}

TEST(FlashKernel, TileCountsMatchHandCounts) {
  EXPECT_EQ(tiles_for(256, true, 64, 64), 10);   // T = 4: T(T+1)/2
  EXPECT_EQ(tiles_for(512, true, 64, 64), 36);   // T = 8
  EXPECT_EQ(tiles_for(256, false, 64, 64), 16);  // T^2
  // Bq = 32, Bk = 64 on 256 tokens: q blocks see 1, 1, 2, 2, 3, 3, 4, 4 kv blocks.
  EXPECT_EQ(tiles_for(256, true, 32, 64), 20);
  EXPECT_EQ(tiles_for(256, false, 32, 64), 32);
  // Bq = 128, Bk = 64: q block 0 sees kv 0..1, q block 1 sees kv 0..3.
  EXPECT_EQ(tiles_for(256, true, 128, 64), 6);
  // Two causal documents of 128 (T = 2 each): 3 + 3; non-causal: 4 + 4.
  EXPECT_EQ(tiles_for(256, true, 64, 64, {128, 128}), 6);
  EXPECT_EQ(tiles_for(256, false, 64, 64, {128, 128}), 8);
  // Ragged: 100 tokens causal, 64-blocks: q block 0 sees kv 0; q block 1 sees kv 0 and 1.
  EXPECT_EQ(tiles_for(100, true, 64, 64), 3);
}

TEST(FlashKernel, FullAndPartialTilesAreClassified) {
  Case c{1, 100, 1, 1, 8, true, {}};
  const Inputs in = make_inputs(c, 3);
  const auto fwd = flash_attention_forward(in.q, in.k, in.v, in.mask(true), 1.0, {});
  EXPECT_EQ(fwd.tiles.full, 1);     // q block 1 x kv block 0: every key before every query
  EXPECT_EQ(fwd.tiles.partial, 2);  // the two diagonal tiles (kv block 1 is also a ragged tail)
}

// ---- Determinism: the same rows, computed in other company, are the same bits. ----

struct RowsResult {
  std::vector<float> o, lse, dq;  // o, dq: [rows][Hq][D]; lse: [Hq][rows]
};

// Forward (and dQ) for the query rows `rows` (global positions) against the whole kv sequence.
RowsResult run_rows(const Inputs& in, const Case& c, const std::vector<std::int64_t>& rows, int threads) {
  const std::int64_t n = static_cast<std::int64_t>(rows.size());
  Tensor q(c.dtype, {1, n, c.hq, c.dim}), d_out(c.dtype, {1, n, c.hq, c.dim});
  std::vector<std::int32_t> q_pos(n), q_seg;
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t h = 0; h < c.hq; ++h) {
      for (std::int64_t d = 0; d < c.dim; ++d) {
        q.set(0, i, h, d, in.q.get(0, rows[i], h, d));
        d_out.set(0, i, h, d, in.d_out.get(0, rows[i], h, d));
      }
    }
    q_pos[i] = static_cast<std::int32_t>(rows[i]);
    if (!in.seg.empty()) q_seg.push_back(in.seg[rows[i]]);
  }
  const AttentionMask mask{q_pos, in.pos, q_seg, in.seg, c.causal};
  FlashConfig cfg;
  cfg.threads = threads;
  const double scale = 0.125;
  const auto fwd = flash_attention_forward(q, in.k, in.v, mask, scale, cfg);
  const auto bwd =
      flash_attention_backward(q, in.k, in.v, fwd.o, fwd.lse, d_out, mask, scale, cfg, DType::f32);
  return {fwd.o.to_floats(), fwd.lse, bwd.dq.to_floats()};
}

// Picks row `i` of `full` (rows in natural order) for each listed global row.
std::vector<float> gather_rows(const std::vector<float>& full, const std::vector<std::int64_t>& rows,
                               std::int64_t width) {
  std::vector<float> out;
  for (auto r : rows) out.insert(out.end(), full.begin() + r * width, full.begin() + (r + 1) * width);
  return out;
}

std::vector<float> gather_lse(const std::vector<float>& full, const std::vector<std::int64_t>& rows,
                              std::int64_t heads, std::int64_t seq) {
  std::vector<float> out;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (auto r : rows) out.push_back(full[h * seq + r]);
  }
  return out;
}

TEST(FlashKernel, RowsAreBitIdenticalAcrossShardsOrdersAndThreads) {
  for (const Case& c : {Case{1, 300, 4, 2, 40, true, {}}, Case{1, 250, 4, 1, 64, true, {90, 160}},
                        Case{1, 200, 2, 2, 24, false, {}}, Case{1, 180, 4, 2, 32, true, {}, DType::bf16},
                        Case{1, 250, 4, 2, 40, true, {90, 160}, DType::bf16}}) {
    SCOPED_TRACE(c.name());
    const Inputs in = make_inputs(c, 29);
    std::vector<std::int64_t> all(static_cast<std::size_t>(c.seq));
    std::iota(all.begin(), all.end(), 0);
    const RowsResult whole = run_rows(in, c, all, 1);
    const std::int64_t width = c.hq * c.dim;

    // Shards whose lengths are not multiples of 16 (or of the block).
    const std::vector<std::int64_t> cuts = {0, 37, 90, 151, c.seq};
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
      std::vector<std::int64_t> rows(all.begin() + cuts[s], all.begin() + cuts[s + 1]);
      const RowsResult part = run_rows(in, c, rows, 1);
      EXPECT_EQ(testing::count_bit_differences(part.o, gather_rows(whole.o, rows, width)), 0)
          << "o shard " << s;
      EXPECT_EQ(testing::count_bit_differences(part.lse, gather_lse(whole.lse, rows, c.hq, c.seq)), 0)
          << "lse shard " << s;
      EXPECT_EQ(testing::count_bit_differences(part.dq, gather_rows(whole.dq, rows, width)), 0)
          << "dq shard " << s;
    }
    // A reordered sequence: odd rows reversed, then even rows (every row in new company, new lanes).
    std::vector<std::int64_t> shuffled;
    for (std::int64_t i = c.seq - 1; i >= 0; --i) {
      if (i % 2 == 1) shuffled.push_back(i);
    }
    for (std::int64_t i = 0; i < c.seq; i += 2) shuffled.push_back(i);
    const RowsResult reordered = run_rows(in, c, shuffled, 2);
    EXPECT_EQ(testing::count_bit_differences(reordered.o, gather_rows(whole.o, shuffled, width)), 0)
        << "o reordered";
    EXPECT_EQ(testing::count_bit_differences(reordered.lse, gather_lse(whole.lse, shuffled, c.hq, c.seq)), 0);
    EXPECT_EQ(testing::count_bit_differences(reordered.dq, gather_rows(whole.dq, shuffled, width)), 0);
    // Two threads, whole sequence.
    const RowsResult two = run_rows(in, c, all, 2);
    EXPECT_EQ(testing::count_bit_differences(two.o, whole.o), 0);
    EXPECT_EQ(testing::count_bit_differences(two.lse, whole.lse), 0);
    EXPECT_EQ(testing::count_bit_differences(two.dq, whole.dq), 0);
  }
}

// bf16 forward and backward on each path with bf16 products this CPU has (AMX, AVX512-BF16): it agrees with
// the vector path and matches the float64 reference on the bf16 values; tile counts are the same. A path the
// CPU lacks is reported as skipped.
TEST(FlashKernel, Bf16ProductPathsMatchTheVectorPathAndTheReference) {
  FlashConfig vector_path;
  vector_path.allow_amx = false;
  vector_path.allow_avx512_bf16 = false;
  EXPECT_EQ(flash_bf16_path(vector_path), Bf16Path::vector);
  FlashConfig amx, dot;
  dot.allow_amx = false;
  std::vector<std::pair<Bf16Path, FlashConfig>> paths;
  if (flash_bf16_path(amx) == Bf16Path::amx) paths.emplace_back(Bf16Path::amx, amx);
  if (flash_bf16_path(dot) == Bf16Path::avx512_bf16) paths.emplace_back(Bf16Path::avx512_bf16, dot);
  EXPECT_FALSE(flash_uses_amx(DType::f32, amx));
  if (paths.empty()) GTEST_SKIP() << "neither AMX-BF16 nor AVX512-BF16 on this CPU";
  for (const auto& [path, config] : paths) {
    if (path != Bf16Path::amx && flash_bf16_path(amx) != Bf16Path::amx) {
      std::printf("note: no AMX-BF16 on this CPU; the amx path is not tested here\n");
    }
    for (const Case& c : {Case{1, 300, 4, 2, 40, true, {}, DType::bf16},
                          Case{2, 129, 8, 2, 128, false, {60, 69}, DType::bf16},
                          Case{1, 200, 2, 1, 256, true, {1, 120, 79}, DType::bf16},
                          Case{1, 70, 3, 3, 1, true, {}, DType::bf16}}) {
      SCOPED_TRACE(std::string(to_string(path)) + " " + c.name());
      const Inputs in = make_inputs(c, 5);
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
      const auto a = flash_attention_forward(in.q, in.k, in.v, in.mask(c.causal), scale, config);
      const auto v = flash_attention_forward(in.q, in.k, in.v, in.mask(c.causal), scale, vector_path);
      const auto ref = reference_attention(in.q, in.k, in.v, &in.d_out, in.mask(c.causal), scale);
      const std::vector<float> vf = v.o.to_floats();
      CPATTN_EXPECT_CLOSE(a.o.to_floats(), std::vector<double>(vf.begin(), vf.end()), 1e-2,
                          "o path vs vector");
      CPATTN_EXPECT_CLOSE(a.o.to_floats(), ref.o, 2e-2, "o path vs reference");
      CPATTN_EXPECT_CLOSE(a.lse, ref.lse, 2e-2, "lse path vs reference");
      EXPECT_EQ(a.tiles.per_head, v.tiles.per_head);
      EXPECT_EQ(a.tiles.full, v.tiles.full);
      // The backward from the path's forward outputs, on either path.
      const auto ga = flash_attention_backward(in.q, in.k, in.v, a.o, a.lse, in.d_out, in.mask(c.causal),
                                               scale, config, DType::f32);
      const auto gv = flash_attention_backward(in.q, in.k, in.v, a.o, a.lse, in.d_out, in.mask(c.causal),
                                               scale, vector_path, DType::f32);
      for (const auto& [got, want, name] :
           {std::tuple{&ga.dq, &gv.dq, "dq"}, std::tuple{&ga.dk, &gv.dk, "dk"},
            std::tuple{&ga.dv, &gv.dv, "dv"}}) {
        const std::vector<float> w = want->to_floats();
        CPATTN_EXPECT_CLOSE(got->to_floats(), std::vector<double>(w.begin(), w.end()), 1e-2, name);
      }
      CPATTN_EXPECT_CLOSE(ga.dq.to_floats(), ref.dq, 2e-2, "dq path vs reference");
      CPATTN_EXPECT_CLOSE(ga.dk.to_floats(), ref.dk, 2e-2, "dk path vs reference");
      CPATTN_EXPECT_CLOSE(ga.dv.to_floats(), ref.dv, 2e-2, "dv path vs reference");
      EXPECT_EQ(ga.tiles.per_head, gv.tiles.per_head);
    }
  }
}

// NaN and Inf in the inputs: no crash, and a row's outputs are non-finite exactly where the float64
// reference's are (a NaN must not turn into a silent 0); the other rows are unaffected and match as usual.
// bf16 on every path this CPU has; with and without a non-finite V (with one, the forward takes the vector
// path; without, a bf16 product path's forward sees the NaN Q and Inf K).
TEST(FlashKernel, NonFiniteInputsPropagateLikeTheReference) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<std::tuple<DType, FlashConfig, bool>> runs = {{DType::f32, FlashConfig{}, true}};
  for (const auto& [path, cfg] : testing::bf16_paths()) {
    runs.emplace_back(DType::bf16, cfg, true);
    runs.emplace_back(DType::bf16, cfg, false);
  }
  for (const auto& [dtype, cfg, v_inf] : runs) {
    Case c{1, 150, 4, 2, 32, true, {}, dtype};
    SCOPED_TRACE(c.name() + " " + to_string(flash_bf16_path(cfg)) + (v_inf ? " with" : " without") +
                 " a non-finite V");
    Inputs in = make_inputs(c, 41);
    in.q.set(0, 10, 1, 3, nan);               // one query row of head 1
    in.k.set(0, 70, 0, 5, inf);               // one key of kv head 0: every later query of heads 0, 1 sees it
    if (v_inf) in.v.set(0, 120, 1, 0, -inf);  // one value of kv head 1
    in.d_out.set(0, 30, 2, 7, nan);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
    const auto fwd = flash_attention_forward(in.q, in.k, in.v, in.mask(true), scale, cfg);
    const auto bwd = flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, in.mask(true),
                                              scale, cfg, DType::f32);
    const auto ref = reference_attention(in.q, in.k, in.v, &in.d_out, in.mask(true), scale);
    const std::vector<float> o = fwd.o.to_floats(), dq = bwd.dq.to_floats(), dk = bwd.dk.to_floats(),
                             dv = bwd.dv.to_floats();
    std::int64_t nonfinite_rows = 0, mismatched_rows = 0;
    for (std::int64_t row = 0; row < c.seq * c.hq; ++row) {  // (s, h) rows of O and dQ; (s, hkv) of dK, dV
      for (const auto& [got, want] : {std::pair{&o, &ref.o}, std::pair{&dq, &ref.dq}, std::pair{&dk, &ref.dk},
                                      std::pair{&dv, &ref.dv}}) {
        if ((got == &dk || got == &dv) && row >= c.seq * c.hkv) continue;
        bool got_finite = true, want_finite = true;
        for (std::int64_t d = 0; d < c.dim; ++d) {
          got_finite = got_finite && std::isfinite((*got)[row * c.dim + d]);
          want_finite = want_finite && std::isfinite((*want)[row * c.dim + d]);
        }
        nonfinite_rows += !want_finite;
        if (got_finite != want_finite && mismatched_rows < 8) {
          const std::int64_t heads = got == &dk || got == &dv ? c.hkv : c.hq;
          ADD_FAILURE() << (got == &o    ? "o"
                            : got == &dq ? "dq"
                            : got == &dk ? "dk"
                                         : "dv")
                        << " row (s " << row / heads << ", h " << row % heads << "): kernel "
                        << (got_finite ? "finite" : "non-finite") << ", reference "
                        << (want_finite ? "finite" : "non-finite");
        }
        mismatched_rows += got_finite != want_finite;
      }
    }
    EXPECT_GT(nonfinite_rows, 0) << "the injected values must reach some outputs";
    EXPECT_EQ(mismatched_rows, 0) << "rows whose finiteness differs from the reference's";
    for (std::int64_t h = 0; h < c.hq; ++h) {
      for (std::int64_t i = 0; i < c.seq; ++i) {
        const double want = ref.lse[h * c.seq + i];
        const float got = fwd.lse[h * c.seq + i];
        EXPECT_EQ(std::isfinite(got), std::isfinite(want)) << "lse h " << h << " row " << i;
      }
    }
  }
}

// The GQA backward walks kv blocks in stripes sized by a memory budget; a one-block stripe must give the same
// bits as one stripe for everything, since each kv block's sums and each dQ row's order are the same.
TEST(FlashKernel, BackwardStripesDoNotChangeTheBits) {
  for (const auto& [causal, dtype] :
       {std::pair{true, DType::f32}, std::pair{false, DType::f32},
        std::pair{true, DType::bf16}}) {  // bf16: the AMX path where there is one
    Case c{2, 300, 8, 2, 20, causal, {}, dtype};
    const Inputs in = make_inputs(c, 11);
    FlashConfig one_stripe, many;
    many.backward_partial_bytes = 1;  // one kv block per stripe
    many.threads = 2;
    const auto fwd = flash_attention_forward(in.q, in.k, in.v, in.mask(causal), 0.3, one_stripe);
    const auto a = flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, in.mask(causal), 0.3,
                                            one_stripe, DType::f32);
    const auto b = flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, in.mask(causal), 0.3,
                                            many, DType::f32);
    EXPECT_EQ(testing::count_bit_differences(a.dq.to_floats(), b.dq.to_floats()), 0) << "causal " << causal;
    EXPECT_EQ(testing::count_bit_differences(a.dk.to_floats(), b.dk.to_floats()), 0) << "causal " << causal;
    EXPECT_EQ(testing::count_bit_differences(a.dv.to_floats(), b.dv.to_floats()), 0) << "causal " << causal;
    EXPECT_EQ(a.tiles.per_head, b.tiles.per_head);
    // And the striped result is the gradient: against the float64 reference.
    const ReferenceResult ref = reference_attention(in.q, in.k, in.v, &in.d_out, in.mask(causal), 0.3);
    const double tol = dtype == DType::f32 ? 1e-5 : 2e-2;
    CPATTN_EXPECT_CLOSE(b.dk.to_floats(), ref.dk, tol, "dk");
    CPATTN_EXPECT_CLOSE(b.dv.to_floats(), ref.dv, tol, "dv");
    CPATTN_EXPECT_CLOSE(b.dq.to_floats(), ref.dq, tol, "dq");
  }
}

TEST(FlashKernel, BadArgumentsAreNamed) {
  Case c{1, 16, 4, 2, 8, true, {}};
  const Inputs in = make_inputs(c, 1);
  Tensor bad_v(DType::f32, {1, 16, 3, 8});
  auto expect_field = [](auto&& call, const char* field) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected an error naming " << field;
    } catch (const Error& e) {
      EXPECT_EQ(e.items().at(0).fields.at(0), field) << e.what();
    }
  };
  expect_field([&] { flash_attention_forward(in.q, in.k, bad_v, in.mask(true), 1.0, {}); }, "v");
  std::vector<std::int32_t> short_pos(5, 0);
  expect_field(
      [&] {
        flash_attention_forward(in.q, in.k, in.v, {short_pos, in.pos, {}, {}, true}, 1.0, {});
      },
      "q_positions");
  FlashConfig cfg;
  cfg.block_kv = 48;
  expect_field([&] { flash_attention_forward(in.q, in.k, in.v, in.mask(true), 1.0, cfg); }, "block_kv");
  Tensor q3(DType::f32, {1, 16, 3, 8});
  expect_field([&] { flash_attention_forward(q3, in.k, in.v, in.mask(true), 1.0, {}); }, "num_kv_heads");
}

}  // namespace
}  // namespace cpattn

namespace cpattn {
namespace {

// The kernel's own gradients against central differences of its own forward (loss = sum(O * dO)), fp32.
TEST(FlashKernel, GradientsMatchFiniteDifferences) {
  for (bool causal : {false, true}) {
    Case c{1, 6, 4, 2, 3, causal, {}};
    Inputs in = make_inputs(c, 41);
    in.seg = {0, 0, 0, 1, 1, 1};
    const double scale = 0.6;
    const auto fwd = flash_attention_forward(in.q, in.k, in.v, in.mask(causal), scale, {});
    const auto bwd = flash_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.d_out, in.mask(causal),
                                              scale, {}, DType::f32);
    const auto dout = in.d_out.to_doubles();
    auto loss = [&](const Inputs& x) {
      const auto o = flash_attention_forward(x.q, x.k, x.v, x.mask(causal), scale, {}).o.to_doubles();
      double sum = 0;
      for (std::size_t i = 0; i < o.size(); ++i) sum += o[i] * dout[i];
      return sum;
    };
    const float h = 1e-2f;
    auto check = [&](Tensor Inputs::*which, const Tensor& grad, const char* name) {
      for (std::int64_t i = 0; i < (in.*which).numel(); ++i) {
        Inputs plus = in, minus = in;
        (plus.*which).data<float>()[i] += h;
        (minus.*which).data<float>()[i] -= h;
        const double step = double((plus.*which).data<float>()[i]) - double((minus.*which).data<float>()[i]);
        const double fd = (loss(plus) - loss(minus)) / step;
        EXPECT_NEAR(grad.flat(i), fd, 1e-3 * (1 + std::abs(fd))) << name << "[" << i << "] causal " << causal;
      }
    };
    check(&Inputs::q, bwd.dq, "dq");
    check(&Inputs::k, bwd.dk, "dk");
    check(&Inputs::v, bwd.dv, "dv");
  }
}

}  // namespace
}  // namespace cpattn
