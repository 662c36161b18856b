#include "harness/check.hpp"

#include <limits>

#include "cpattn/flash.hpp"
#include "cpattn/reference.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn::harness {

Tolerances tolerances(Strategy strategy, DType dtype) {
  const bool bf16 = dtype == DType::bf16;
  if (strategy_traits(strategy).ring)  // steps merged in ring order
    return {false, bf16 ? 1e-2 : 5e-6, bf16 ? 1e-2 : 1e-5, bf16 ? 1e-2 : 1e-5, bf16 ? 2e-2 : 2e-5};
  return {true, 0, 0, bf16 ? 1e-2 : 1e-6, bf16 ? 2e-2 : 1e-5};
}

WholeCheck check_whole_result(const AttentionSpec& a, Strategy strategy, const WholeProblem& problem,
                              const WholeResult& result, bool forward_only, int threads) {
  WholeCheck c;
  c.tolerances = tolerances(strategy, a.dtype);
  const Tolerances& tol = c.tolerances;
  const std::vector<std::int32_t> pos = natural_positions(a.batch, a.seq_len);
  AttentionMask mask = a.mask(pos, pos, problem.segment_ids, problem.segment_ids);
  mask.sinks = problem.sinks;
  FlashConfig config;
  config.threads = threads;
  const auto fwd = flash_attention_forward(problem.q, problem.k, problem.v, mask, a.scale(), config);
  const Diff o = compare(result.o.to_floats(), fwd.o.to_floats());
  c.single_device_abs.emplace_back("o", o.abs_or_inf());
  c.single_device_abs.emplace_back("lse", compare(result.lse, fwd.lse).abs_or_inf());
  c.single_device_rel.emplace_back("o", o.rel_or_inf());
  bool pass = tol.forward_exact ? c.single_device_abs[0].second == 0.0 && c.single_device_abs[1].second == 0.0
                                : o.rel_or_inf() <= tol.o_rel && c.single_device_abs[1].second <= tol.lse_abs;
  if (!forward_only) {
    const auto bwd = flash_attention_backward(problem.q, problem.k, problem.v, fwd.o, fwd.lse, problem.d_out,
                                              mask, a.scale(), config, a.dtype);
    const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> grads[] = {
        {"dq", {&result.dq, &bwd.dq}}, {"dk", {&result.dk, &bwd.dk}}, {"dv", {&result.dv, &bwd.dv}}};
    for (const auto& [name, tensors] : grads) {
      const Diff d = compare(tensors.first->to_floats(), tensors.second->to_floats());
      c.single_device_abs.emplace_back(name, d.abs_or_inf());
      c.single_device_rel.emplace_back(name, d.rel_or_inf());
      pass = pass && d.rel_or_inf() <= tol.grad_rel;
    }
    if (!problem.sinks.empty()) {
      const Diff d = compare(result.dsinks, bwd.dsinks);
      // a result without dsinks (or with other heads) is as far off as can be
      const bool sized = result.dsinks.size() == bwd.dsinks.size();
      const double inf = std::numeric_limits<double>::infinity();
      c.single_device_abs.emplace_back("dsinks", sized ? d.abs_or_inf() : inf);
      c.single_device_rel.emplace_back("dsinks", sized ? d.rel_or_inf() : inf);
      pass = pass && sized && d.rel_or_inf() <= tol.grad_rel;
    }
  }
  const double work = static_cast<double>(a.batch * a.num_q_heads) * static_cast<double>(a.seq_len) *
                      static_cast<double>(a.seq_len) * static_cast<double>(a.head_dim);
  const Tensor* d_out = forward_only ? nullptr : &problem.d_out;
  if (work <= 1.5e9) {
    c.reference_scope = "whole problem";
    const auto ref = reference_attention(problem.q, problem.k, problem.v, d_out, mask, a.scale());
    c.reference_rel.emplace_back("o", compare(result.o.to_floats(), ref.o).rel_or_inf());
    if (!forward_only) {
      c.reference_rel.emplace_back("dq", compare(result.dq.to_floats(), ref.dq).rel_or_inf());
      c.reference_rel.emplace_back("dk", compare(result.dk.to_floats(), ref.dk).rel_or_inf());
      c.reference_rel.emplace_back("dv", compare(result.dv.to_floats(), ref.dv).rel_or_inf());
      if (!problem.sinks.empty()) {
        c.reference_rel.emplace_back("dsinks", result.dsinks.size() == ref.dsinks.size()
                                                   ? compare(result.dsinks, ref.dsinks).rel_or_inf()
                                                   : std::numeric_limits<double>::infinity());
      }
    }
  } else {
    std::vector<ReferenceRow> rows;
    const std::int64_t heads = std::min<std::int64_t>(a.num_q_heads, 8), per_head = 24;
    for (std::int64_t b = 0; b < a.batch; ++b) {
      for (std::int64_t hi = 0; hi < heads; ++hi) {
        const std::int64_t h = hi * a.num_q_heads / heads;
        for (std::int64_t n = 0; n < per_head; ++n)
          rows.push_back({b, h, n * (a.seq_len - 1) / (per_head - 1)});
      }
    }
    c.reference_scope = "sampled " + std::to_string(rows.size()) + " rows (O, dQ; dK/dV need every row)";
    const auto ref = reference_attention_rows(problem.q, problem.k, problem.v, d_out, mask, a.scale(), rows);
    std::vector<float> o_rows, dq_rows;
    for (const auto& r : rows) {
      for (std::int64_t d = 0; d < a.head_dim; ++d) {
        o_rows.push_back(result.o.get(r.b, r.i, r.h, d));
        if (!forward_only) dq_rows.push_back(result.dq.get(r.b, r.i, r.h, d));
      }
    }
    c.reference_rel.emplace_back("o", compare(o_rows, ref.o).rel_or_inf());
    if (!forward_only) {
      c.reference_rel.emplace_back("dq", compare(dq_rows, ref.dq).rel_or_inf());
      c.reference_rel.emplace_back("dk", std::nullopt);
      c.reference_rel.emplace_back("dv", std::nullopt);
    }
  }
  for (const auto& [name, value] : c.reference_rel) {
    if (value) pass = pass && *value <= tol.reference_rel;
  }
  c.pass = pass;
  return c;
}

}  // namespace cpattn::harness
