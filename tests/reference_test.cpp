#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "cpattn/npy.hpp"
#include "cpattn/reference.hpp"
#include "cpattn/shard.hpp"
#include "test_support.hpp"

namespace cpattn {
namespace {

using testing::natural_positions;

struct Problem {
  Tensor q, k, v, d_out;
  std::vector<std::int32_t> pos, seg;
  AttentionMask mask(bool causal) const { return {pos, pos, seg, seg, causal}; }
};

Problem make_problem(Shape4 qs, std::int64_t hkv, std::uint32_t seed) {
  AttentionSpec spec;
  spec.batch = qs.b;
  spec.seq_len = qs.s;
  spec.num_q_heads = qs.h;
  spec.num_kv_heads = hkv;
  spec.head_dim = qs.d;
  harness::WholeProblem w = harness::random_problem(spec, seed);
  return {
      std::move(w.q), std::move(w.k), std::move(w.v), std::move(w.d_out), natural_positions(qs.b, qs.s), {}};
}

TEST(Reference, HandComputedTinyCase) {
  // One head, D=1, S=2, causal, scale 1: q = [1, 2], k = [0, 1], v = [10, 20].
  // Row 0 sees key 0 only: O = 10, LSE = 0. Row 1 scores [0, 2]: p = [1, e^2]/(1+e^2).
  Tensor q = Tensor::from_floats(DType::f32, {1, 2, 1, 1}, std::vector<float>{1, 2});
  Tensor k = Tensor::from_floats(DType::f32, {1, 2, 1, 1}, std::vector<float>{0, 1});
  Tensor v = Tensor::from_floats(DType::f32, {1, 2, 1, 1}, std::vector<float>{10, 20});
  Tensor d_out = Tensor::from_floats(DType::f32, {1, 2, 1, 1}, std::vector<float>{0, 1});
  const auto pos = natural_positions(1, 2);
  const auto r = reference_attention(q, k, v, &d_out, {pos, pos, {}, {}, true}, 1.0);
  const double e2 = std::exp(2.0), p1 = e2 / (1 + e2), p0 = 1 / (1 + e2);
  EXPECT_DOUBLE_EQ(r.o[0], 10.0);
  EXPECT_DOUBLE_EQ(r.lse[0], 0.0);
  EXPECT_NEAR(r.o[1], 10 * p0 + 20 * p1, 1e-12);
  EXPECT_NEAR(r.lse[1], std::log(1 + e2), 1e-12);
  // dO only on row 1: dV = [p0, p1]; dS_j = p_j (v_j - O_1); dQ_1 = sum dS_j k_j; dK_j = dS_j q_1.
  const double o1 = 10 * p0 + 20 * p1;
  EXPECT_NEAR(r.dv[0], p0, 1e-12);
  EXPECT_NEAR(r.dv[1], p1, 1e-12);
  EXPECT_NEAR(r.dq[1], p1 * (20 - o1) * 1.0, 1e-12);
  EXPECT_NEAR(r.dk[0], p0 * (10 - o1) * 2.0, 1e-12);
  EXPECT_NEAR(r.dk[1], p1 * (20 - o1) * 2.0, 1e-12);
  EXPECT_DOUBLE_EQ(r.dq[0], 0.0);
}

// The window's meaning, from outside the mask code: query i of a windowed problem is plain attention (no
// mask) of that one query over the keys i - left .. i + right only (flash-attention's window_size; causal:
// right 0), cut out of the row. O and LSE of every row, causal and two-sided windows, GQA.
TEST(Reference, AWindowIsPlainAttentionOverTheKeysItReaches) {
  const std::int64_t S = 40, H = 2, D = 8;
  const Problem p = make_problem({1, S, H, D}, 1, 7);
  for (const auto& [causal, left, right] : {std::tuple{true, std::int64_t{5}, std::int64_t{0}},
                                            std::tuple{true, std::int64_t{0}, std::int64_t{0}},
                                            std::tuple{false, std::int64_t{3}, std::int64_t{6}}}) {
    AttentionMask mask = p.mask(causal);
    mask.window_left = left;
    if (!causal) mask.window_right = right;
    const ReferenceResult whole = reference_attention(p.q, p.k, p.v, nullptr, mask, 0.3);
    for (std::int64_t i = 0; i < S; ++i) {
      std::vector<std::int64_t> keys;
      for (std::int64_t j = std::max<std::int64_t>(0, i - left); j <= std::min(S - 1, i + right); ++j)
        keys.push_back(j);
      const auto n = static_cast<std::int64_t>(keys.size());
      const auto q_pos = natural_positions(1, 1), kv_pos = natural_positions(1, n);
      const AttentionMask plain{q_pos, kv_pos, {}, {}, false};
      const ReferenceResult one = reference_attention(take_tokens(p.q, {i}), take_tokens(p.k, keys),
                                                      take_tokens(p.v, keys), nullptr, plain, 0.3);
      for (std::int64_t h = 0; h < H; ++h) {
        EXPECT_NEAR(one.lse[h], whole.lse[h * S + i], 1e-12) << "row " << i << " head " << h;
        for (std::int64_t d = 0; d < D; ++d)
          EXPECT_NEAR(one.o[h * D + d], whole.o[(i * H + h) * D + d], 1e-12) << "row " << i;
      }
    }
  }
}

TEST(Reference, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  Problem p = make_problem({1, 4, 2, 3}, 1, 7);
  // Query 0 is in segment 5, no key is: it sees nothing.
  std::vector<std::int32_t> q_seg = {5, 1, 1, 1}, kv_seg = {0, 1, 1, 1};
  const auto r = reference_attention(p.q, p.k, p.v, &p.d_out, {p.pos, p.pos, q_seg, kv_seg, false}, 0.5);
  for (std::int64_t h = 0; h < 2; ++h) {
    EXPECT_TRUE(std::isinf(r.lse[h * 4 + 0]) && r.lse[h * 4 + 0] < 0);
    for (std::int64_t d = 0; d < 3; ++d) {
      EXPECT_EQ(r.o[(0 * 2 + h) * 3 + d], 0.0);
      EXPECT_EQ(r.dq[(0 * 2 + h) * 3 + d], 0.0);
    }
  }
  for (double x : r.dk) EXPECT_FALSE(std::isnan(x));
  for (std::int64_t d = 0; d < 3; ++d) EXPECT_EQ(r.dk[d], 0.0);  // key 0 is seen by nobody
}

// Loss = sum(O * dO); its gradient is what backward returns. Central differences in float64 on tiny cases.
TEST(Reference, GradientsMatchFiniteDifferences) {
  for (bool causal : {false, true}) {
    Problem p = make_problem({1, 5, 4, 3}, 2, 11);
    p.seg = {0, 0, 1, 1, 1};
    const double scale = 0.7;
    const auto r = reference_attention(p.q, p.k, p.v, &p.d_out, p.mask(causal), scale);
    const std::vector<double> dout = p.d_out.to_doubles();
    auto loss = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      const auto o = reference_attention(q, k, v, nullptr, p.mask(causal), scale).o;
      double sum = 0;
      for (std::size_t i = 0; i < o.size(); ++i) sum += o[i] * dout[i];
      return sum;
    };
    // Perturb in double through float tensors: use h large enough for float storage (values ~1).
    const float h = 1e-2f;
    auto check = [&](Tensor Problem::*which, const std::vector<double>& grad, const char* name) {
      for (std::int64_t i = 0; i < (p.*which).numel(); ++i) {
        Problem plus = p, minus = p;
        float* xp = (plus.*which).template data<float>();
        float* xm = (minus.*which).template data<float>();
        const float x = xp[i];
        xp[i] = x + h;
        xm[i] = x - h;
        const double step = static_cast<double>(xp[i]) - static_cast<double>(xm[i]);
        const double fd = (loss(plus.q, plus.k, plus.v) - loss(minus.q, minus.k, minus.v)) / step;
        EXPECT_NEAR(grad[i], fd, 2e-4 * (1 + std::abs(fd))) << name << "[" << i << "] causal " << causal;
      }
    };
    check(&Problem::q, r.dq, "dq");
    check(&Problem::k, r.dk, "dk");
    check(&Problem::v, r.dv, "dv");
  }
}

// The independent vectors (PyTorch autograd, float64) copied from shared/testdata/attention.
TEST(Reference, MatchesIndependentVectors) {
  const std::filesystem::path root = CPATTN_TEST_DATA_DIR "/attention";
  int cases = 0;
  for (const auto& dir : std::filesystem::directory_iterator(root)) {
    if (!dir.is_directory()) continue;
    ++cases;
    SCOPED_TRACE(dir.path().filename().string());
    std::ifstream f(dir.path() / "case.json");
    const auto spec = nlohmann::json::parse(f);
    auto load = [&](const char* name) { return read_npy((dir.path() / name).string()); };
    auto tensor = [&](const char* name) {
      const NpyArray a = load(name);
      EXPECT_EQ(a.shape.size(), 4u);
      return Tensor::from_floats(DType::f32, {a.shape[0], a.shape[1], a.shape[2], a.shape[3]}, a.as_floats());
    };
    const Tensor q = tensor("q.npy"), k = tensor("k.npy"), v = tensor("v.npy"), d_out = tensor("do.npy");
    const auto seg = load("segment_ids.npy").as_int32();
    const auto pos = natural_positions(q.shape().b, q.shape().s);
    const bool causal = spec["causal"].get<bool>();
    EXPECT_EQ(q.shape().h, spec["num_q_heads"].get<std::int64_t>());
    const auto r = reference_attention(q, k, v, &d_out, {pos, pos, seg, seg, causal},
                                       1.0 / std::sqrt(double(q.shape().d)));
    CPATTN_EXPECT_CLOSE(r.o, load("o.npy").as_doubles(), 1e-12, "o");
    CPATTN_EXPECT_CLOSE(r.lse, load("lse.npy").as_doubles(), 1e-12, "lse");
    CPATTN_EXPECT_CLOSE(r.dq, load("dq.npy").as_doubles(), 1e-12, "dq");
    CPATTN_EXPECT_CLOSE(r.dk, load("dk.npy").as_doubles(), 1e-12, "dk");
    CPATTN_EXPECT_CLOSE(r.dv, load("dv.npy").as_doubles(), 1e-12, "dv");
  }
  EXPECT_EQ(cases, 6);
}

}  // namespace
}  // namespace cpattn

namespace cpattn {
namespace {

TEST(Reference, ChosenRowsMatchTheWholeReference) {
  AttentionSpec spec;
  spec.batch = 2;
  spec.seq_len = 40;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 8;
  const harness::WholeProblem problem = harness::random_problem(spec, 1, {15, 25});
  const Tensor &q = problem.q, &k = problem.k, &v = problem.v, &d_out = problem.d_out;
  const auto pos = testing::natural_positions(2, 40);
  const auto& seg = problem.segment_ids;
  const AttentionMask mask{pos, pos, seg, seg, true};
  const auto whole = reference_attention(q, k, v, &d_out, mask, 0.3);
  const std::vector<ReferenceRow> rows = {{0, 0, 0}, {1, 3, 39}, {0, 2, 15}, {1, 1, 7}};
  const auto some = reference_attention_rows(q, k, v, &d_out, mask, 0.3, rows);
  for (std::size_t n = 0; n < rows.size(); ++n) {
    const auto [b, h, i] = rows[n];
    EXPECT_NEAR(some.lse[n], whole.lse[(b * 4 + h) * 40 + i], 1e-12);
    for (std::int64_t d = 0; d < 8; ++d) {
      EXPECT_NEAR(some.o[n * 8 + d], whole.o[((b * 40 + i) * 4 + h) * 8 + d], 1e-12);
      EXPECT_NEAR(some.dq[n * 8 + d], whole.dq[((b * 40 + i) * 4 + h) * 8 + d], 1e-12);
    }
  }
}

}  // namespace
}  // namespace cpattn
