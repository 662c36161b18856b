// validate's answer: the rules, then each rank's heads (docs/cli.md, "validate").
#include <nlohmann/json.hpp>

#include <sstream>

#include "cpattn/documents.hpp"
#include "cpattn/placement.hpp"
#include "documents/json_document.hpp"

namespace cpattn {
namespace {

std::string range_text(const HeadRange& r) {
  return r.size() == 1 ? std::to_string(r.begin) : std::to_string(r.begin) + ".." + std::to_string(r.end - 1);
}

}  // namespace

DocumentAnswer validate_answer(const ConfigValues& values) {
  DocumentAnswer answer;
  Specs specs;
  answer.errors = all_config_errors(values, specs);
  if (!answer.errors.empty()) {
    answer.exit_code = 2;
    answer.document = failure_json("valid", answer.errors);
    return answer;
  }
  const AttentionSpec& a = specs.attention;
  const ParallelSpec& p = specs.parallel;
  const bool hybrid = p.traits().sub_groups;
  const bool ulysses = p.traits().heads != HeadSplit::none;  // heads placed over a ulysses group
  // validate lists each rank's heads: bounded, so that the answer (and the placement behind it) stays small.
  // Every rank lists every local head under all_gather and ring; a ulysses group lists them once between
  // its ranks.
  const std::int64_t local_heads = a.num_q_heads / p.tp + a.num_kv_heads / p.tp;
  const std::int64_t group = p.head_group_size();
  const double listed = ulysses ? static_cast<double>(p.cp / group) * static_cast<double>(local_heads + group)
                                : static_cast<double>(p.cp) * static_cast<double>(local_heads);
  if (listed > static_cast<double>(kMaxListedHeads)) {
    std::ostringstream text;
    text << "validate lists every rank's heads: cp (" << p.cp << ") with " << local_heads
         << " local heads comes to " << listed << " entries, more than it lists (at most " << kMaxListedHeads
         << "); the configuration passes every rule";
    throw Error(ErrorKind::invalid_input, "cp", std::to_string(p.cp), text.str());
  }
  const auto placement = head_placement(a, p);
  const UlyssesHeads u =
      ulysses ? ulysses_heads(a.num_q_heads / p.tp, a.num_kv_heads / p.tp, group) : UlyssesHeads{};
  const std::int64_t rep = ulysses ? u.replication() : 1;

  {
    nlohmann::json doc;
    doc["valid"] = true;
    doc["strategy"] = to_string(p.strategy);
    doc["cp"] = p.cp;
    doc["tp"] = p.tp;
    if (hybrid) {
      doc["ulysses_degree"] = p.ulysses_degree;
      doc["ring_degree"] = p.ring_degree();
    }
    doc["load_balance"] = p.load_balance;
    doc["layout"] = to_string(p.effective_layout());
    const auto problem = attention_to_json(a);
    doc["window"] = problem["window"];
    doc["softcap"] = problem["softcap"];
    doc["replication"] = rep;
    doc["work_skew"] = ulysses ? u.work_skew() : 1.0;
    if (ulysses) doc["kv_head_order"] = u.kv_head_order();
    doc["ranks"] = nlohmann::json::array();
    for (const auto& r : placement) {
      std::vector<std::int64_t> q;
      for (std::int64_t h = r.q_heads.begin; h < r.q_heads.end; ++h) q.push_back(h);
      doc["ranks"].push_back({{"rank", r.rank}, {"q_heads", q}, {"kv_heads", r.kv_heads}});
    }
    answer.document = json_text(doc);
  }
  std::ostringstream out;
  out << "valid: " << to_string(p.strategy) << ", cp=" << p.cp
      << (hybrid ? " (ulysses groups of " + std::to_string(p.ulysses_degree) + " x a ring of " +
                       std::to_string(p.ring_degree()) + ")"
                 : std::string())
      << ", tp=" << p.tp << ", q heads " << a.num_q_heads << ", kv heads " << a.num_kv_heads << ", head dim "
      << a.head_dim << ", seq " << a.seq_len << ", batch " << a.batch << ", " << to_string(a.dtype)
      << (p.load_balance ? ", load balance (dual chunk swap)" : "") << window_text(a) << "\n";
  if (p.tp > 1) out << "heads below are local to one tp rank (heads / tp)\n";
  if (ulysses) {
    out << "replication: " << rep << " (kv head order before the all-to-all: [";
    const auto order = u.kv_head_order();
    for (std::size_t i = 0; i < order.size(); ++i) out << (i ? ", " : "") << "kv" << order[i];
    out << "])\n";
    out << "work skew: " << u.work_skew() << " (most q heads on a rank over the fewest"
        << (u.work_skew() > 1.0 ? "; the ranks with more q heads set the time" : "") << ")\n";
  } else {
    out << "replication: 1 (" << to_string(p.strategy)
        << ": every rank holds every head for its sequence shard)\n";
  }
  for (const auto& r : placement) {
    out << "rank " << r.rank << " -> q heads " << range_text(r.q_heads) << ", kv head"
        << (r.kv_heads.size() > 1 ? "s " : " ");
    for (std::size_t i = 0; i < r.kv_heads.size(); ++i) out << (i ? "," : "") << r.kv_heads[i];
    out << "\n";
  }
  answer.text = out.str();
  return answer;
}

}  // namespace cpattn
