#include "cpattn/reference.hpp"

#include <cmath>
#include <limits>

#include "cpattn/error.hpp"

namespace cpattn {

ReferenceResult reference_attention(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                                    const Tensor* d_out, const AttentionMask& mask, double scale) {
  const Shape4 qs = q_t.shape();
  const Shape4 ks = k_t.shape();
  CPATTN_ASSERT(ks == v_t.shape() && qs.b == ks.b && qs.d == ks.d && ks.h > 0 && qs.h % ks.h == 0);
  CPATTN_ASSERT(static_cast<std::int64_t>(mask.q_positions.size()) == qs.b * qs.s);
  CPATTN_ASSERT(static_cast<std::int64_t>(mask.kv_positions.size()) == ks.b * ks.s);
  const std::int64_t B = qs.b, Sq = qs.s, Skv = ks.s, Hq = qs.h, Hkv = ks.h, D = qs.d, G = Hq / Hkv;
  const std::vector<double> q = q_t.to_doubles(), k = k_t.to_doubles(), v = v_t.to_doubles();
  std::vector<double> dout;
  if (d_out != nullptr) {
    CPATTN_ASSERT(d_out->shape() == qs);
    dout = d_out->to_doubles();
  }
  auto qi = [&](std::int64_t b, std::int64_t s, std::int64_t h) { return ((b * Sq + s) * Hq + h) * D; };
  auto ki = [&](std::int64_t b, std::int64_t s, std::int64_t h) { return ((b * Skv + s) * Hkv + h) * D; };

  ReferenceResult r;
  r.o.assign(static_cast<std::size_t>(B * Sq * Hq * D), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * Hq * Sq), -std::numeric_limits<double>::infinity());
  if (d_out != nullptr) {
    r.dq.assign(r.o.size(), 0.0);
    r.dk.assign(static_cast<std::size_t>(B * Skv * Hkv * D), 0.0);
    r.dv.assign(r.dk.size(), 0.0);
  }
  const bool sinks = !mask.sinks.empty();
  CPATTN_ASSERT(!sinks || static_cast<std::int64_t>(mask.sinks.size()) == Hq);
  if (sinks && d_out != nullptr) r.dsinks.assign(static_cast<std::size_t>(Hq), 0.0);
  std::vector<double> p(static_cast<std::size_t>(Skv)), t(static_cast<std::size_t>(Skv), 0.0);
  std::vector<char> seen(static_cast<std::size_t>(Skv));
  const double cap = mask.softcap;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / G;
      for (std::int64_t i = 0; i < Sq; ++i) {
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < Skv; ++j) {
          seen[j] = mask.visible(b, i, j, Sq, Skv);
          if (!seen[j]) continue;
          double s = 0;
          for (std::int64_t d = 0; d < D; ++d) s += q[qi(b, i, h) + d] * k[ki(b, j, hk) + d];
          p[j] = s * scale;
          if (cap > 0) {  // soft-capped logit cap * tanh(x / cap); its derivative 1 - tanh^2 for the backward
            t[j] = std::tanh(p[j] / cap);
            p[j] = cap * t[j];
          }
          // A NaN score makes the row NaN, as autograd would (std::max would drop it and the row would read
          // as one that sees nothing).
          m = std::isnan(p[j]) || p[j] > m ? p[j] : m;
        }
        // A sink is one more logit in the denominator, with no value.
        const double sink = sinks ? static_cast<double>(mask.sinks[static_cast<std::size_t>(h)]) : 0.0;
        if (m == -std::numeric_limits<double>::infinity()) {  // sees no key: O = 0, LSE = -inf (or the sink)
          if (sinks) r.lse[(b * Hq + h) * Sq + i] = sink;
          continue;
        }
        if (sinks) m = std::max(m, sink);
        double sum = sinks ? std::exp(sink - m) : 0.0;
        for (std::int64_t j = 0; j < Skv; ++j) {
          if (seen[j]) sum += std::exp(p[j] - m);
        }
        const double lse = m + std::log(sum);
        r.lse[(b * Hq + h) * Sq + i] = lse;
        for (std::int64_t j = 0; j < Skv; ++j) {
          p[j] = seen[j] ? std::exp(p[j] - lse) : 0.0;
          if (p[j] == 0.0) continue;
          for (std::int64_t d = 0; d < D; ++d) r.o[qi(b, i, h) + d] += p[j] * v[ki(b, j, hk) + d];
        }
        if (d_out == nullptr) continue;
        // FA2 backward for one row: dP_j = dO.v_j; Di = dO.o; dS_j = P_j (dP_j - Di).
        double di = 0;
        for (std::int64_t d = 0; d < D; ++d) di += dout[qi(b, i, h) + d] * r.o[qi(b, i, h) + d];
        // The sink's probability times (its dP, 0: no value, minus Di).
        if (sinks) r.dsinks[static_cast<std::size_t>(h)] -= std::exp(sink - lse) * di;
        for (std::int64_t j = 0; j < Skv; ++j) {
          if (p[j] == 0.0) continue;
          double dp = 0;
          for (std::int64_t d = 0; d < D; ++d) dp += dout[qi(b, i, h) + d] * v[ki(b, j, hk) + d];
          const double ds = p[j] * (dp - di) * scale * (cap > 0 ? 1 - t[j] * t[j] : 1.0);
          for (std::int64_t d = 0; d < D; ++d) {
            r.dq[qi(b, i, h) + d] += ds * k[ki(b, j, hk) + d];
            r.dk[ki(b, j, hk) + d] += ds * q[qi(b, i, h) + d];
            r.dv[ki(b, j, hk) + d] += p[j] * dout[qi(b, i, h) + d];
          }
        }
      }
    }
  }
  return r;
}

}  // namespace cpattn

namespace cpattn {

ReferenceRowsResult reference_attention_rows(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor* d_out, const AttentionMask& mask, double scale,
                                             const std::vector<ReferenceRow>& rows) {
  const Shape4 qs = q.shape(), ks = k.shape();
  const std::int64_t D = qs.d, Skv = ks.s, G = qs.h / ks.h;
  ReferenceRowsResult r;
  r.o.assign(rows.size() * static_cast<std::size_t>(D), 0.0);
  r.lse.assign(rows.size(), -std::numeric_limits<double>::infinity());
  if (d_out != nullptr) r.dq.assign(r.o.size(), 0.0);
  std::vector<double> p(static_cast<std::size_t>(Skv)), qrow(static_cast<std::size_t>(D)), dorow(qrow.size());
  std::vector<double> t(static_cast<std::size_t>(Skv), 0.0);
  const double cap = mask.softcap;
  for (std::size_t n = 0; n < rows.size(); ++n) {
    const auto [b, h, i] = rows[n];
    const std::int64_t hk = h / G;
    for (std::int64_t d = 0; d < D; ++d) {
      qrow[d] = q.get(b, i, h, d);
      if (d_out != nullptr) dorow[d] = d_out->get(b, i, h, d);
    }
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < Skv; ++j) {
      if (!mask.visible(b, i, j, qs.s, Skv)) {
        p[j] = -std::numeric_limits<double>::infinity();
        continue;
      }
      double s = 0;
      for (std::int64_t d = 0; d < D; ++d) s += qrow[d] * k.get(b, j, hk, d);
      p[j] = s * scale;
      if (cap > 0) {
        t[j] = std::tanh(p[j] / cap);
        p[j] = cap * t[j];
      }
      m = std::max(m, p[j]);
    }
    const bool sinks = !mask.sinks.empty();
    const double sink = sinks ? static_cast<double>(mask.sinks[static_cast<std::size_t>(h)]) : 0.0;
    if (m == -std::numeric_limits<double>::infinity()) {
      if (sinks) r.lse[n] = sink;
      continue;
    }
    if (sinks) m = std::max(m, sink);
    double sum = sinks ? std::exp(sink - m) : 0.0;
    for (std::int64_t j = 0; j < Skv; ++j) sum += std::exp(p[j] - m);
    const double lse = m + std::log(sum);
    r.lse[n] = lse;
    double* o = &r.o[n * D];
    for (std::int64_t j = 0; j < Skv; ++j) {
      p[j] = std::exp(p[j] - lse);
      if (p[j] == 0.0) continue;
      for (std::int64_t d = 0; d < D; ++d) o[d] += p[j] * v.get(b, j, hk, d);
    }
    if (d_out == nullptr) continue;
    double di = 0;
    for (std::int64_t d = 0; d < D; ++d) di += dorow[d] * o[d];
    double* dq = &r.dq[n * D];
    for (std::int64_t j = 0; j < Skv; ++j) {
      if (p[j] == 0.0) continue;
      double dp = 0;
      for (std::int64_t d = 0; d < D; ++d) dp += dorow[d] * v.get(b, j, hk, d);
      const double ds = p[j] * (dp - di) * scale * (cap > 0 ? 1 - t[j] * t[j] : 1.0);
      for (std::int64_t d = 0; d < D; ++d) dq[d] += ds * k.get(b, j, hk, d);
    }
  }
  return r;
}

}  // namespace cpattn
