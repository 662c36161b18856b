#include "cpattn/agreement.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "cpattn/parse.hpp"

namespace cpattn {
namespace {

std::int64_t hash_text(const std::string& text) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a
  for (const unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<std::int64_t>(h);
}

// Eight bytes a step, each word mixed in (a multiply and a rotation): gigabytes a second, and any changed
// word changes the result.
std::int64_t hash_bytes(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = 0x9e3779b97f4a7c15ull ^ bytes;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = std::rotl((h ^ w) * 0xff51afd7ed558ccdull, 29);
  }
  for (; i < bytes; ++i) h = std::rotl((h ^ p[i]) * 0xc4ceb9fe1a85ec53ull, 7);
  return static_cast<std::int64_t>(h);
}

// The value as it travels when the ranks disagree: 64 bytes of its text (longer ones cut, marked "...").
constexpr int kTextWords = 8;
constexpr std::size_t kTextBytes = kTextWords * sizeof(std::int64_t);

std::string shown_text(const std::string& text) {
  return text.size() <= kTextBytes ? text : text.substr(0, kTextBytes - 3) + "...";
}

// "rank 3", "ranks 0, 2..5, 7" (at most eight runs, then "and N more").
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  std::size_t runs = 0, i = 0;
  while (i < ranks.size()) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (runs == 8) {
      out += " and " + std::to_string(ranks.size() - i) + " more";
      break;
    }
    out += (runs > 0 ? ", " : "") + std::to_string(ranks[i]) +
           (j > i ? ".." + std::to_string(ranks[j]) : std::string());
    ++runs;
    i = j + 1;
  }
  return out;
}

struct Holders {
  std::int64_t value;
  std::string shown;
  std::vector<int> ranks;
};

// Round two, only when some field differs: every rank's value and text of each differing field, by a sum in
// which each rank fills its own slot.
std::vector<std::vector<Holders>> who_holds_what(Communicator& comm, const std::vector<std::int64_t>& values,
                                                 const std::vector<std::string>& shown,
                                                 const std::vector<std::size_t>& differing) {
  const std::size_t n = comm.size(), fields = differing.size(), slot = fields * (1 + kTextWords);
  std::vector<std::int64_t> table(n * slot, 0);
  for (std::size_t f = 0; f < fields; ++f) {
    std::int64_t* at = table.data() + static_cast<std::size_t>(comm.rank()) * slot + f * (1 + kTextWords);
    at[0] = values[differing[f]];
    const std::string text = shown_text(shown[differing[f]]);
    std::memcpy(at + 1, text.data(), text.size());
  }
  comm.all_reduce(table.data(), static_cast<int>(table.size()), ReduceOp::sum);
  std::vector<std::vector<Holders>> out(fields);
  for (std::size_t f = 0; f < fields; ++f) {
    for (std::size_t r = 0; r < n; ++r) {
      const std::int64_t* at = table.data() + r * slot + f * (1 + kTextWords);
      auto& groups = out[f];
      auto it =
          std::find_if(groups.begin(), groups.end(), [&](const Holders& h) { return h.value == at[0]; });
      if (it == groups.end()) {
        char text[kTextBytes + 1] = {};
        std::memcpy(text, at + 1, kTextBytes);
        groups.push_back({at[0], std::string(text), {}});
        it = groups.end() - 1;
      }
      it->ranks.push_back(static_cast<int>(r));
    }
  }
  return out;
}

std::string holders_text(const std::vector<Holders>& groups) {
  std::string out;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (g == 4) {
      std::size_t rest = 0;
      for (std::size_t h = g; h < groups.size(); ++h) rest += groups[h].ranks.size();
      out += "; " + std::to_string(groups.size() - g) + " other values on " + std::to_string(rest) + " ranks";
      break;
    }
    out += (g > 0 ? "; " : "") + quoted(groups[g].shown) + " on " + rank_list(groups[g].ranks);
  }
  return out;
}

}  // namespace

Agreement& Agreement::add_named(std::string field, std::int64_t value, std::string shown) {
  entries_.push_back({std::move(field), value, std::move(shown)});
  return *this;
}

Agreement& Agreement::add(std::string field, std::int64_t value) {
  return add_named(std::move(field), value, std::to_string(value));
}

Agreement& Agreement::add(std::string field, bool value) {
  return add_named(std::move(field), value ? 1 : 0, value ? "true" : "false");
}

Agreement& Agreement::add(std::string field, double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return add_named(std::move(field), std::bit_cast<std::int64_t>(value), text);
}

Agreement& Agreement::add_text(std::string field, const std::string& value) {
  return add_named(std::move(field), hash_text(value), value.empty() ? "(none)" : "'" + value + "'");
}

Agreement& Agreement::add_bytes(std::string field, const void* data, std::size_t bytes) {
  const std::int64_t h = hash_bytes(data, bytes);
  char text[40];
  std::snprintf(text, sizeof text, "%zu bytes, hash %016llx", bytes, static_cast<unsigned long long>(h));
  return add_named(std::move(field), h, text);
}

void add_specs(Agreement& agreement, const AttentionSpec& a, const ParallelSpec& p) {
  auto named = [&](const char* field, auto value, const char* name) {
    agreement.add_named(field, static_cast<std::int64_t>(value), name);
  };
  agreement.add("batch", a.batch).add("seq_len", a.seq_len).add("num_q_heads", a.num_q_heads);
  agreement.add("num_kv_heads", a.num_kv_heads).add("head_dim", a.head_dim).add("causal", a.causal);
  named("dtype", a.dtype, a.dtype == DType::f32 ? "fp32" : a.dtype == DType::bf16 ? "bf16" : "unknown");
  if (a.softmax_scale) {
    agreement.add("softmax_scale", *a.softmax_scale);
  } else {
    agreement.add_named("softmax_scale", 0, "unset (1/sqrt(head_dim))");
  }
  for (const auto& [field, side] :
       {std::pair<const char*, std::optional<std::int64_t>>{"window_left", a.window_left},
        {"window_right", a.window_right}}) {
    if (side) {
      agreement.add(field, *side);
    } else {
      agreement.add_named(field, -1, "unset (unbounded)");
    }
  }
  if (a.softcap) {
    agreement.add("softcap", *a.softcap);
  } else {
    agreement.add_named("softcap", 0, "unset (none)");
  }
  agreement.add("sinks", a.sinks);
  agreement.add("cp", p.cp).add("tp", p.tp);
  const bool known =
      std::find(std::begin(kStrategies), std::end(kStrategies), p.strategy) != std::end(kStrategies);
  named("strategy", p.strategy, known ? to_string(p.strategy) : "unknown");
  agreement.add("load_balance", p.load_balance);
  named("layout", p.effective_layout(), to_string(p.effective_layout()));
  // The documents the data layouts cut the row by: their count, and a hash of the lengths shown with the
  // first few.
  agreement.add("documents", static_cast<std::int64_t>(p.documents.size()));
  std::uint64_t hash = 1469598103934665603ull;
  std::string shown;
  for (std::size_t d = 0; d < p.documents.size(); ++d) {
    hash = (hash ^ static_cast<std::uint64_t>(p.documents[d])) * 1099511628211ull;
    if (d < 4) shown += (d > 0 ? "," : "") + std::to_string(p.documents[d]);
  }
  if (p.documents.size() > 4) shown += ",...";
  if (p.layout_band) {
    agreement.add("layout_band.left", p.layout_band->left).add("layout_band.right", p.layout_band->right);
  } else {
    agreement.add_named("layout_band.left", -1, "unset (the attention's)")
        .add_named("layout_band.right", -1, "unset (the attention's)");
  }
  agreement.add_named("documents.lengths", static_cast<std::int64_t>(hash >> 1),
                      shown.empty() ? "none" : shown);
  agreement.add("ulysses_degree", p.ulysses_degree);
}

// Whether each of `values` is the same on every rank, in one all_reduce: the largest of each value and the
// largest of its complement (~ the smallest).
std::vector<bool> same_everywhere(Communicator& comm, const std::vector<std::int64_t>& values) {
  const std::size_t n = values.size();
  std::vector<std::int64_t> extremes(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    extremes[i] = values[i];
    extremes[n + i] = ~values[i];
  }
  comm.all_reduce(extremes.data(), static_cast<int>(extremes.size()), ReduceOp::max);
  std::vector<bool> same(n);
  for (std::size_t i = 0; i < n; ++i) same[i] = extremes[i] == ~extremes[n + i];
  return same;
}

void agree(Communicator& comm, const Agreement& agreement) {
  const auto& entries = agreement.entries();
  // values[0], [1]: the fields themselves (their count and names); then each field's value.
  std::string names;
  for (const auto& e : entries) names += e.field + ",";
  std::vector<std::int64_t> values = {static_cast<std::int64_t>(entries.size()), hash_text(names)};
  // The names as shown: their count and hash first (64 bytes travel: lists that differ near their end still
  // show differently), then the list.
  char names_head[48];
  std::snprintf(names_head, sizeof names_head, "%zu fields, hash %016llx: ", entries.size(),
                static_cast<unsigned long long>(hash_text(names)));
  std::vector<std::string> shown = {std::to_string(entries.size()), names_head + names};
  for (const auto& e : entries) {
    values.push_back(e.value);
    shown.push_back(e.shown);
  }
  // The common case in one all_reduce of a fixed size: the count, the names and a hash of every value.
  const std::int64_t all = hash_bytes(values.data() + 2, (values.size() - 2) * sizeof(std::int64_t));
  const std::vector<bool> first = same_everywhere(comm, {values[0], values[1], all});
  if (first[0] && first[1] && first[2]) return;
  // Otherwise (every rank knows it alike): which fields differ, then who holds what.
  std::vector<std::size_t> differing;
  const bool same_fields = first[0] && first[1];
  if (same_fields) {
    const std::vector<bool> each =
        same_everywhere(comm, std::vector<std::int64_t>(values.begin() + 2, values.end()));
    for (std::size_t i = 0; i < each.size(); ++i) {
      if (!each[i]) differing.push_back(i + 2);
    }
  } else {
    differing = {1};  // the names (the count follows from them)
  }
  CPATTN_ASSERT(!differing.empty());  // equal values hash alike
  const auto groups = who_holds_what(comm, values, shown, differing);
  std::vector<ErrorItem> items;
  for (std::size_t f = 0; f < differing.size(); ++f) {
    const std::size_t i = differing[f];
    const std::string field = same_fields ? entries[i - 2].field : "fields";
    items.push_back({{field},
                     shown[i],
                     "the ranks disagree on " + field + ": " + holders_text(groups[f]) +
                         (same_fields ? " (every rank must pass the same)"
                                      : " (the ranks run different versions or commands)")});
  }
  throw Error(ErrorKind::invalid_config, std::move(items));
}

}  // namespace cpattn
