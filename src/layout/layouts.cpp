// The named layouts as data (sequence_layout.hpp, SequenceLayout): contiguous, dual_chunk_swap,
// per_document and the solver's greedy deal (docs/design.md, "Sequence layouts").
#include <algorithm>
#include <numeric>
#include <queue>
#include <tuple>

#include "cpattn/error.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {

std::vector<std::int64_t> SequenceLayout::positions(std::int64_t rank) const {
  std::vector<std::int64_t> out;
  for (const PositionRange& r : runs.at(static_cast<std::size_t>(rank))) {
    for (std::int64_t p = r.begin; p < r.end; ++p) out.push_back(p);
  }
  return out;
}

std::vector<std::vector<std::int32_t>> SequenceLayout::rank_positions() const {
  std::vector<std::vector<std::int32_t>> out;
  for (std::int64_t r = 0; r < ranks(); ++r) out.push_back(positions_as_int32(positions(r)));
  return out;
}

std::vector<std::int64_t> SequenceLayout::run_lengths(std::int64_t rank) const {
  std::vector<std::int64_t> out;
  for (const PositionRange& r : runs.at(static_cast<std::size_t>(rank))) out.push_back(r.size());
  return out;
}

std::vector<std::vector<std::int64_t>> SequenceLayout::rank_run_lengths() const {
  std::vector<std::vector<std::int64_t>> out;
  for (std::int64_t r = 0; r < ranks(); ++r) out.push_back(run_lengths(r));
  return out;
}

std::vector<std::int64_t> SequenceLayout::order() const {
  std::vector<std::int64_t> out;
  for (std::int64_t r = 0; r < ranks(); ++r) {
    const auto mine = positions(r);
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

namespace {

// Drops empty runs and joins a run to the one before it where it starts where that one ends.
std::vector<PositionRange> merged(const std::vector<PositionRange>& runs) {
  std::vector<PositionRange> out;
  for (const PositionRange& r : runs) {
    if (r.size() == 0) continue;
    if (!out.empty() && out.back().end == r.begin) {
      out.back().end = r.end;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

std::vector<std::int64_t> or_one_document(const std::vector<std::int64_t>& documents, std::int64_t seq_len) {
  return documents.empty() ? std::vector<std::int64_t>{seq_len} : documents;
}

SequenceLayout per_document(std::int64_t seq_len, std::int64_t cp,
                            const std::vector<std::int64_t>& documents) {
  SequenceLayout l{ShardLayout::per_document, seq_len, std::vector<std::vector<PositionRange>>(cp)};
  std::int64_t start = 0;                                     // F_d
  std::vector<std::pair<std::int64_t, std::int64_t>> pieces;  // (piece 0..2cp-1, tokens)
  for (const std::int64_t length : or_one_document(documents, seq_len)) {
    // Rank r's share of the document (Hermite's identity makes the shares sum to the length, and each
    // rank's shares over the row to S/cp), split floor / ceil between its pieces r and 2cp-1-r. A document
    // shorter than cp gives one token to each of `length` ranks (those with (F_d + r) mod cp >= cp - length),
    // in their second piece: O(length) work, not O(cp).
    pieces.clear();
    if (length >= cp) {
      for (std::int64_t r = 0; r < cp; ++r) {
        const std::int64_t share = (start + length + r) / cp - (start + r) / cp;
        pieces.emplace_back(r, share / 2);
        pieces.emplace_back(2 * cp - 1 - r, share - share / 2);
      }
    } else {
      for (std::int64_t t = cp - length; t < cp; ++t)
        pieces.emplace_back(2 * cp - 1 - (t - start % cp + cp) % cp, 1);
    }
    std::sort(pieces.begin(), pieces.end());
    std::int64_t at = start;
    for (const auto& [piece, tokens] : pieces) {
      if (tokens == 0) continue;
      const std::int64_t r = piece < cp ? piece : 2 * cp - 1 - piece;
      l.runs[static_cast<std::size_t>(r)].push_back({at, at + tokens});
      at += tokens;
    }
    CPATTN_ASSERT(at == start + length);
    start += length;
  }
  for (auto& mine : l.runs) mine = merged(mine);
  return l;
}

// The ranks a deal looks at for a neighbour when several are equally loaded (a bound on the work per chunk
// when every chunk costs the same).
constexpr std::size_t kMostTied = 64;

// The greedy deal: chunks by cost, costliest first (the earlier position on a tie), each to the least-loaded
// rank with room; among the equally least loaded, one holding a neighbouring chunk, else the lowest rank.
std::vector<std::int64_t> deal(const std::vector<std::int64_t>& costs, std::int64_t cp) {
  const auto chunks = static_cast<std::int64_t>(costs.size());
  const std::int64_t room = chunks / cp;
  std::vector<std::int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t a, std::int64_t b) { return costs[a] > costs[b]; });
  using Entry = std::pair<std::int64_t, std::int64_t>;  // (load, rank)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> ranks;
  for (std::int64_t r = 0; r < cp; ++r) ranks.push({0, r});
  std::vector<std::int64_t> owner(costs.size(), -1), held(static_cast<std::size_t>(cp), 0);
  for (const std::int64_t c : order) {
    std::vector<Entry> tied{ranks.top()};
    ranks.pop();
    while (!ranks.empty() && ranks.top().first == tied.front().first && tied.size() < kMostTied) {
      tied.push_back(ranks.top());
      ranks.pop();
    }
    std::size_t pick = 0;  // the lowest rank among the tied (the heap gives them in rank order)
    for (std::size_t i = 0; i < tied.size(); ++i) {
      const std::int64_t r = tied[i].second;
      if ((c > 0 && owner[c - 1] == r) || (c + 1 < chunks && owner[c + 1] == r)) {
        pick = i;
        break;
      }
    }
    const std::int64_t r = tied[pick].second;
    owner[static_cast<std::size_t>(c)] = r;
    ++held[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < tied.size(); ++i) {
      if (i == pick) {
        if (held[static_cast<std::size_t>(r)] < room) ranks.push({tied[i].first + costs[c], r});
      } else {
        ranks.push(tied[i]);
      }
    }
  }
  return owner;
}

SequenceLayout solver(std::int64_t seq_len, std::int64_t cp, const std::vector<std::int64_t>& documents,
                      const PositionBand& band) {
  const std::int64_t chunk = solver_chunk(seq_len, cp);
  const std::vector<std::int64_t> owner = deal(solver_chunk_costs(seq_len, chunk, documents, band), cp);
  SequenceLayout l{ShardLayout::solver, seq_len, std::vector<std::vector<PositionRange>>(cp)};
  for (std::size_t c = 0; c < owner.size(); ++c) {
    const auto begin = static_cast<std::int64_t>(c) * chunk;
    l.runs[static_cast<std::size_t>(owner[c])].push_back({begin, begin + chunk});
  }
  for (auto& mine : l.runs) mine = merged(mine);
  return l;
}

}  // namespace

std::vector<std::int64_t> solver_chunk_costs(std::int64_t seq_len, std::int64_t chunk,
                                             const std::vector<std::int64_t>& documents,
                                             const PositionBand& band) {
  CPATTN_ASSERT(chunk > 0 && seq_len % chunk == 0);
  const std::int64_t g = std::gcd(chunk, std::int64_t{64});
  // first[d]: document d's first position; doc_of(p) by binary search.
  std::vector<std::int64_t> first{0};
  for (const std::int64_t n : or_one_document(documents, seq_len)) first.push_back(first.back() + n);
  auto doc_of = [&](std::int64_t p) {
    return static_cast<std::int64_t>(std::upper_bound(first.begin(), first.end(), p) - first.begin()) - 1;
  };
  const std::int64_t last_block = seq_len / g - 1;
  std::vector<std::int64_t> costs;
  for (std::int64_t c0 = 0; c0 < seq_len; c0 += chunk) {
    std::int64_t cost = 0;
    for (std::int64_t a = c0; a < c0 + chunk; a += g) {
      const std::int64_t e = a + g - 1;
      // Key blocks meeting the block's documents: from the block holding its first document's first
      // token to the one holding its last document's last token.
      std::int64_t lo = first[static_cast<std::size_t>(doc_of(a))] / g;
      std::int64_t hi = (first[static_cast<std::size_t>(doc_of(e) + 1)] - 1) / g;
      // ... and some position of it within the band of some query of it.
      if (band.left < a) lo = std::max(lo, (a - band.left) / g);
      if (band.right < seq_len) hi = std::min(hi, std::min(last_block, (e + band.right) / g));
      cost += std::max<std::int64_t>(0, hi - lo + 1);
    }
    costs.push_back(cost);
  }
  return costs;
}

SequenceLayout make_layout(ShardLayout kind, std::int64_t seq_len, std::int64_t cp,
                           const std::vector<std::int64_t>& documents, const PositionBand& band) {
  CPATTN_ASSERT(cp > 0 && seq_len % layout_chunks(kind, cp) == 0);
  switch (kind) {
    case ShardLayout::contiguous: {
      SequenceLayout l{kind, seq_len, {}};
      const std::int64_t n = seq_len / cp;
      for (std::int64_t r = 0; r < cp; ++r) l.runs.push_back({{r * n, (r + 1) * n}});
      return l;
    }
    case ShardLayout::dual_chunk_swap: {
      SequenceLayout l{kind, seq_len, {}};
      const std::int64_t c = seq_len / (2 * cp);
      for (std::int64_t r = 0; r < cp; ++r)
        l.runs.push_back({{r * c, (r + 1) * c}, {(2 * cp - 1 - r) * c, (2 * cp - r) * c}});
      return l;
    }
    case ShardLayout::per_document:
      return per_document(seq_len, cp, documents);
    case ShardLayout::solver:
      return solver(seq_len, cp, documents, band);
  }
  CPATTN_ASSERT(false);
}

SequenceLayout layout_of(const AttentionSpec& attention, const ParallelSpec& parallel) {
  return make_layout(parallel.effective_layout(), attention.seq_len, parallel.cp, parallel.documents,
                     parallel.layout_band.value_or(attention.band()));
}

SequenceLayout ring_layout_of(const AttentionSpec& attention, const ParallelSpec& parallel) {
  const std::int64_t R = parallel.ring_degree(), U = parallel.head_group_size(), S = attention.seq_len;
  const ShardLayout kind = parallel.effective_layout();
  if (!layout_reads_documents(kind)) return make_layout(R <= 1 ? ShardLayout::contiguous : kind, S, R);
  const SequenceLayout caller = layout_of(attention, parallel);
  if (U == 1) return caller;  // the ring (a ring of one rank: one run, the whole row)
  SequenceLayout l{kind, S, {}};
  for (std::int64_t rr = 0; rr < R; ++rr) {
    std::vector<PositionRange> rows;
    for (std::int64_t u = 0; u < U; ++u) {
      const auto& member = caller.runs[static_cast<std::size_t>(rr * U + u)];
      rows.insert(rows.end(), member.begin(), member.end());
    }
    l.runs.push_back(merged(rows));
  }
  return l;
}

std::vector<std::string> layout_errors(const SequenceLayout& layout) {
  std::vector<std::string> errors;
  const std::int64_t S = layout.seq_len;
  std::vector<std::int64_t> holder(static_cast<std::size_t>(std::max<std::int64_t>(S, 0)), -1);
  std::int64_t first_count = -1;
  for (std::int64_t r = 0; r < layout.ranks(); ++r) {
    std::int64_t count = 0;
    for (const PositionRange& run : layout.runs[static_cast<std::size_t>(r)]) {
      if (run.begin < 0 || run.end > S || run.size() <= 0) {
        errors.push_back("rank " + std::to_string(r) + " holds the run [" + std::to_string(run.begin) + ", " +
                         std::to_string(run.end) + "), not a non-empty run within [0, " + std::to_string(S) +
                         ")");
        continue;
      }
      count += run.size();
      for (std::int64_t p = run.begin; p < run.end; ++p) {
        auto& h = holder[static_cast<std::size_t>(p)];
        if (h >= 0) {
          errors.push_back("position " + std::to_string(p) + " is held by rank " + std::to_string(h) +
                           " and rank " + std::to_string(r));
          return errors;
        }
        h = r;
      }
    }
    if (first_count < 0) first_count = count;
    if (count != first_count) {
      errors.push_back("rank " + std::to_string(r) + " holds " + std::to_string(count) + " tokens, rank 0 " +
                       std::to_string(first_count) + ": every rank holds seq_len / cp");
    }
  }
  const auto missing = std::find(holder.begin(), holder.end(), -1);
  if (missing != holder.end()) {
    errors.push_back("position " + std::to_string(missing - holder.begin()) + " is held by no rank");
  }
  return errors;
}

}  // namespace cpattn
