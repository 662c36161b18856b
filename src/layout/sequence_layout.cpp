#include "cpattn/sequence_layout.hpp"

#include <algorithm>
#include <limits>

namespace cpattn {

namespace {

// The helpers that take a layout's name alone know contiguous and dual_chunk_swap; the layouts cut by
// documents need the documents and the band.
void refuse_document_layout(ShardLayout layout) {
  if (!layout_reads_documents(layout)) return;
  throw Error(ErrorKind::invalid_input, "layout", to_string(layout),
              std::string("layout ") + to_string(layout) +
                  " is cut by the row's documents and the mask: take its positions from make_layout or "
                  "layout_of (sequence_layout.hpp), or ContextParallelAttention::local_positions()");
}

}  // namespace

std::vector<PositionRange> local_ranges(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                        std::int64_t rank) {
  refuse_document_layout(layout);
  CPATTN_ASSERT(cp > 0 && rank >= 0 && rank < cp && seq_len % layout_chunks(layout, cp) == 0);
  if (layout == ShardLayout::contiguous) {
    const std::int64_t n = seq_len / cp;
    return {{rank * n, (rank + 1) * n}};
  }
  const std::int64_t c = seq_len / (2 * cp);
  return {{rank * c, (rank + 1) * c}, {(2 * cp - 1 - rank) * c, (2 * cp - rank) * c}};
}

std::vector<std::int64_t> local_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                          std::int64_t rank) {
  std::vector<std::int64_t> positions;
  positions.reserve(static_cast<std::size_t>(seq_len / cp));
  for (const PositionRange& r : local_ranges(layout, seq_len, cp, rank)) {
    for (std::int64_t p = r.begin; p < r.end; ++p) positions.push_back(p);
  }
  return positions;
}

std::vector<std::int64_t> layout_order(ShardLayout layout, std::int64_t seq_len, std::int64_t cp) {
  refuse_document_layout(layout);
  return make_layout(layout, seq_len, cp).order();
}

std::vector<std::int64_t> dual_chunk_swap_order(std::int64_t seq_len, std::int64_t cp) {
  return layout_order(ShardLayout::dual_chunk_swap, seq_len, cp);
}

std::vector<std::int64_t> inverse_permutation(const std::vector<std::int64_t>& perm) {
  std::vector<std::int64_t> inverse(perm.size(), -1);
  for (std::size_t i = 0; i < perm.size(); ++i) {
    CPATTN_ASSERT(perm[i] >= 0 && static_cast<std::size_t>(perm[i]) < perm.size() && inverse[perm[i]] == -1);
    inverse[perm[i]] = static_cast<std::int64_t>(i);
  }
  return inverse;
}

std::int64_t chunk_at(ShardLayout layout, std::int64_t cp, std::int64_t rank, std::int64_t slot) {
  if (layout == ShardLayout::contiguous) return 2 * rank + slot;
  return slot == 0 ? rank : 2 * cp - 1 - rank;
}

ChunkPlace place_of_chunk(ShardLayout layout, std::int64_t cp, std::int64_t chunk) {
  if (layout == ShardLayout::contiguous) return {chunk / 2, chunk % 2};
  return chunk < cp ? ChunkPlace{chunk, 0} : ChunkPlace{2 * cp - 1 - chunk, 1};
}

ReorderCall reorder_call(std::int64_t cp, ShardLayout from, ShardLayout to, std::int64_t call) {
  const bool by_source_slot = from == ShardLayout::contiguous;
  ReorderCall c;
  for (std::int64_t p = 0; p < cp; ++p) {
    const std::int64_t slot =
        by_source_slot ? call : (place_of_chunk(to, cp, chunk_at(from, cp, p, 0)).slot == call ? 0 : 1);
    c.sent_slot.push_back(slot);
    c.goes_to.push_back(place_of_chunk(to, cp, chunk_at(from, cp, p, slot)));
    c.dest.push_back(static_cast<int>(c.goes_to.back().rank));
  }
  return c;
}

std::vector<std::vector<int>> reorder_destinations(std::int64_t cp, ShardLayout from, ShardLayout to) {
  if (from == to) return {};
  return {reorder_call(cp, from, to, 0).dest, reorder_call(cp, from, to, 1).dest};
}

std::vector<std::int32_t> natural_positions(std::int64_t batch, std::int64_t seq_len) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(batch * seq_len));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i < seq_len; ++i) p[b * seq_len + i] = static_cast<std::int32_t>(i);
  }
  return p;
}

std::vector<std::int32_t> segment_ids_from_lengths(std::int64_t batch,
                                                   const std::vector<std::int64_t>& lengths) {
  std::vector<std::int32_t> row;
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    CPATTN_ASSERT(lengths[d] >= 0);
    row.insert(row.end(), static_cast<std::size_t>(lengths[d]), static_cast<std::int32_t>(d));
  }
  std::vector<std::int32_t> all;
  all.reserve(row.size() * static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) all.insert(all.end(), row.begin(), row.end());
  return all;
}

std::vector<std::int64_t> document_lengths(const std::vector<std::int32_t>& row_segment_ids) {
  std::vector<std::int64_t> lengths;
  for (std::size_t i = 0; i < row_segment_ids.size(); ++i) {
    if (i == 0 || row_segment_ids[i] != row_segment_ids[i - 1]) lengths.push_back(0);
    ++lengths.back();
  }
  return lengths;
}

std::vector<std::int32_t> positions_as_int32(const std::vector<std::int64_t>& positions, std::int64_t batch) {
  std::vector<std::int32_t> out;
  out.reserve(positions.size() * static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t x : positions) out.push_back(static_cast<std::int32_t>(x));
  }
  return out;
}

RankPositions rank_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp) {
  refuse_document_layout(layout);
  return make_layout(layout, seq_len, cp).rank_positions();
}

std::int64_t ReachStep::rows_received(std::int64_t r) const {
  std::int64_t rows = 0;
  for (const RowSpan& s : seen[static_cast<std::size_t>(r)]) rows += s.size();
  return rows;
}

std::int64_t ReachStep::rows_sent(std::int64_t r) const {
  const auto ranks = static_cast<std::int64_t>(seen.size());
  return rows_received((r + distance) % ranks);
}

namespace {

// One run of a ring rank's rows: its local rows [first, first + n) and the smallest and largest position;
// `consecutive` when position t is lo + (t - first) (every layout today), so a span is found without a scan.
struct Run {
  std::int64_t first = 0, n = 0, lo = 0, hi = 0;
  bool consecutive = true;
};

std::vector<Run> runs_of(const std::vector<std::int32_t>& positions,
                         const std::vector<std::int64_t>& lengths) {
  std::vector<Run> runs;
  std::int64_t first = 0;
  for (const std::int64_t n : lengths) {
    Run run{first, n, 0, 0, true};
    if (n > 0) {
      const auto at = positions.begin() + first;
      const auto [lo, hi] = std::minmax_element(at, at + n);
      run.lo = *lo;
      run.hi = *hi;
      for (std::int64_t t = 0; t < n && run.consecutive; ++t) run.consecutive = at[t] == run.lo + t;
    }
    runs.push_back(run);
    first += n;
  }
  CPATTN_ASSERT(first == static_cast<std::int64_t>(positions.size()));
  return runs;
}

// The hull of the rows of `kv` (local to the run) that some query of the runs `q` sees.
RowSpan seen_span(const std::vector<Run>& q, const Run& kv, const std::vector<std::int32_t>& kv_positions,
                  const PositionBand& band) {
  std::int64_t begin = kv.n, end = 0;
  for (const Run& qr : q) {
    if (qr.n == 0 || kv.n == 0 || !band.sees_any(qr.lo, qr.hi, kv.lo, kv.hi)) continue;
    // Positions [qr.lo - left, qr.hi + right] are within some query's reach.
    const std::int64_t from = qr.lo - band.left, to = qr.hi + band.right;
    if (kv.consecutive) {
      begin = std::min(begin, std::max<std::int64_t>(from, kv.lo) - kv.lo);
      end = std::max(end, std::min<std::int64_t>(to, kv.hi) - kv.lo + 1);
      continue;
    }
    for (std::int64_t t = 0; t < kv.n; ++t) {
      const std::int64_t p = kv_positions[static_cast<std::size_t>(kv.first + t)];
      if (p >= from && p <= to && band.sees_any(qr.lo, qr.hi, p, p)) {
        begin = std::min(begin, t);
        end = std::max(end, t + 1);
      }
    }
  }
  return begin < end ? RowSpan{begin, end} : RowSpan{};
}

}  // namespace

std::vector<PositionRange> seen_positions(const std::vector<std::int32_t>& positions,
                                          const std::vector<std::int64_t>& runs, const PositionBand& band,
                                          std::int64_t seq_len, std::int64_t block) {
  std::vector<PositionRange> out;
  for (const Run& run : runs_of(positions, runs)) {
    if (run.n == 0) continue;
    const std::int64_t from = std::max<std::int64_t>(0, run.lo - band.left);
    const std::int64_t to = std::min<std::int64_t>(seq_len - 1, run.hi + band.right);
    if (from > to) continue;
    out.push_back({from / block * block, std::min(seq_len, (to / block + 1) * block)});
  }
  std::sort(out.begin(), out.end(),
            [](const PositionRange& a, const PositionRange& b) { return a.begin < b.begin; });
  std::vector<PositionRange> merged;
  for (const PositionRange& r : out) {
    if (!merged.empty() && r.begin <= merged.back().end) {
      merged.back().end = std::max(merged.back().end, r.end);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

std::vector<std::vector<PositionRange>> seen_positions(const RankPositions& positions, const RankRuns& runs,
                                                       const PositionBand& band, std::int64_t seq_len,
                                                       std::int64_t block) {
  std::vector<std::vector<PositionRange>> out;
  for (std::size_t p = 0; p < positions.size(); ++p)
    out.push_back(seen_positions(positions[p], runs[p], band, seq_len, block));
  return out;
}

namespace {

// Each batch row's documents: its positions' ids made dense (0..n-1 in order of value), and each document's
// runs of positions in natural order (an id may come back after others).
struct RowDocuments {
  std::vector<std::int32_t> index;               // [seq_len]
  std::vector<std::vector<PositionRange>> runs;  // [document]
};

std::vector<RowDocuments> row_documents(const std::vector<std::int32_t>& segments, std::int64_t seq_len) {
  std::vector<RowDocuments> rows;
  const auto n = static_cast<std::size_t>(seq_len);
  for (std::size_t at = 0; at + n <= segments.size(); at += n) {
    std::vector<std::int32_t> ids;  // one per run of equal ids, then sorted and made unique
    for (std::size_t k = 0; k < n; ++k) {
      if (k == 0 || segments[at + k] != segments[at + k - 1]) ids.push_back(segments[at + k]);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    RowDocuments row;
    row.index.resize(n);
    row.runs.resize(ids.size());
    for (std::size_t k = 0; k < n; ++k) {
      const auto doc =
          static_cast<std::int32_t>(std::lower_bound(ids.begin(), ids.end(), segments[at + k]) - ids.begin());
      row.index[k] = doc;
      auto& runs = row.runs[static_cast<std::size_t>(doc)];
      const auto x = static_cast<std::int64_t>(k);
      if (!runs.empty() && runs.back().end == x) {
        ++runs.back().end;
      } else {
        runs.push_back({x, x + 1});
      }
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

// The kv blocks a rank's queries (`mine`) reach in their own documents, in any batch row: per document the
// rank has a query of, its runs within [the lowest query - left, the highest + right]. O(|mine| log |mine|
// + the runs met + the blocks marked), so that a plan of many ranks over a long row stays quick.
void document_blocks(const std::vector<RowDocuments>& rows, const std::vector<std::int32_t>& mine,
                     const PositionBand& band, std::int64_t block, std::vector<char>& hit) {
  std::fill(hit.begin(), hit.end(), 0);
  std::vector<std::pair<std::int32_t, std::int32_t>> by_document(mine.size());  // (document, position)
  for (const RowDocuments& row : rows) {
    for (std::size_t i = 0; i < mine.size(); ++i)
      by_document[i] = {row.index[static_cast<std::size_t>(mine[i])], mine[i]};
    std::sort(by_document.begin(), by_document.end());
    for (std::size_t i = 0; i < by_document.size();) {
      const std::int32_t doc = by_document[i].first;
      std::size_t j = i;
      while (j < by_document.size() && by_document[j].first == doc) ++j;
      const std::int64_t lo = std::int64_t{by_document[i].second} - band.left;
      const std::int64_t hi = std::int64_t{by_document[j - 1].second} + band.right;
      const auto& runs = row.runs[static_cast<std::size_t>(doc)];
      auto run = std::upper_bound(runs.begin(), runs.end(), lo,
                                  [](std::int64_t v, const PositionRange& r) { return v < r.end; });
      for (; run != runs.end() && run->begin <= hi; ++run) {
        const std::int64_t first = std::max(run->begin, lo), last = std::min(run->end - 1, hi);
        for (std::int64_t b = first / block; b <= last / block; ++b) hit[static_cast<std::size_t>(b)] = 1;
      }
      i = j;
    }
  }
}

// Ranges widened to aligned pairs of blocks (from position 0, the last pair cut at seq_len) and merged: the
// bf16 kernels take the kv blocks two at a time (one softmax step over both), so that a pair split apart in
// the gathered rows would be summed in another order than the single device's.
std::vector<PositionRange> in_pairs(const std::vector<PositionRange>& ranges, std::int64_t seq_len,
                                    std::int64_t block) {
  const std::int64_t pair = 2 * block;
  std::vector<PositionRange> out;
  for (const PositionRange& r : ranges) {
    const PositionRange w{r.begin / pair * pair, std::min(seq_len, (r.end + pair - 1) / pair * pair)};
    if (!out.empty() && w.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, w.end);
    } else {
      out.push_back(w);
    }
  }
  return out;
}

}  // namespace

std::vector<std::vector<PositionRange>> all_gather_keys(const RankPositions& positions, const RankRuns& runs,
                                                        std::int64_t seq_len, const PositionBand& band,
                                                        bool windowed, std::int64_t block,
                                                        const std::vector<std::int32_t>& segments) {
  if (!windowed && segments.empty()) return {};
  std::vector<std::vector<PositionRange>> seen;
  if (windowed) {
    seen = seen_positions(positions, runs, band, seq_len, block);
    for (auto& r : seen) r = in_pairs(r, seq_len, block);
  } else {
    seen.assign(positions.size(), {{0, seq_len}});
  }
  if (!segments.empty()) {
    const std::vector<RowDocuments> rows = row_documents(segments, seq_len);
    std::vector<char> hit(static_cast<std::size_t>((seq_len + block - 1) / block));
    for (std::size_t p = 0; p < seen.size(); ++p) {
      document_blocks(rows, positions[p], band, block, hit);
      // The band's pairs (the whole row without a window) that hold a block the documents reach.
      std::vector<PositionRange> kept;
      for (const PositionRange& r : seen[p]) {
        for (std::int64_t first = r.begin; first < r.end; first += 2 * block) {
          const auto b = static_cast<std::size_t>(first / block);
          if (!hit[b] && !(b + 1 < hit.size() && hit[b + 1])) continue;
          const std::int64_t last = std::min(first + 2 * block, r.end);
          if (!kept.empty() && kept.back().end == first) {
            kept.back().end = last;
          } else {
            kept.push_back({first, last});
          }
        }
      }
      seen[p] = std::move(kept);
    }
  }
  const bool whole = std::all_of(seen.begin(), seen.end(), [&](const std::vector<PositionRange>& r) {
    return r.size() == 1 && r[0].begin == 0 && r[0].end == seq_len;
  });
  if (!windowed && whole) return {};
  return seen;
}

bool in_ranges(const std::vector<PositionRange>& ranges, std::int64_t x) {
  const auto it = std::upper_bound(ranges.begin(), ranges.end(), x,
                                   [](std::int64_t v, const PositionRange& r) { return v < r.begin; });
  return it != ranges.begin() && x < std::prev(it)->end;
}

std::int64_t overlap(const std::vector<PositionRange>& a, const std::vector<PositionRange>& b) {
  // Both in increasing order: one merge.
  std::int64_t n = 0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    n += std::max<std::int64_t>(0, std::min(a[i].end, b[j].end) - std::max(a[i].begin, b[j].begin));
    if (a[i].end < b[j].end) {
      ++i;
    } else {
      ++j;
    }
  }
  return n;
}

namespace {

// Each rank's queries by document, per batch row: (document, position) sorted ([rank][batch row]).
using DocumentQueries = std::vector<std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>>;

DocumentQueries document_queries(const std::vector<RowDocuments>& rows, const RankPositions& positions) {
  DocumentQueries out(positions.size());
  for (std::size_t r = 0; r < positions.size(); ++r) {
    std::vector<std::int32_t> sorted = positions[r];
    if (!std::is_sorted(sorted.begin(), sorted.end())) std::sort(sorted.begin(), sorted.end());
    for (const RowDocuments& row : rows) {
      std::vector<std::pair<std::int64_t, std::int64_t>> q;
      q.reserve(sorted.size());
      for (const std::int32_t x : sorted) q.emplace_back(row.index[static_cast<std::size_t>(x)], x);
      if (!std::is_sorted(q.begin(), q.end())) std::sort(q.begin(), q.end());  // ids out of position order
      out[r].push_back(std::move(q));
    }
  }
  return out;
}

// The band's span of the rows of `kv` narrowed to the hull of those some query of the rank (`mine`) sees in
// its own document, in some batch row: a key at x is seen by a query at q of its document in [x - right,
// x + left]. A run of consecutive positions is taken piece by piece, a piece the keys of one document: its
// first key seen is max(a, q - left) for the first query q >= a - right (none where that is past the piece's
// end z), its last min(z, q + right) for the last q <= z + left, each one binary search; other runs row by
// row.
RowSpan document_span(RowSpan span, const Run& kv, const std::vector<std::int32_t>& kv_positions,
                      const std::vector<RowDocuments>& rows,
                      const std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>& mine,
                      const PositionBand& band) {
  std::int64_t begin = span.end, end = span.begin;
  for (std::size_t b = 0; b < rows.size(); ++b) {
    const auto& q = mine[b];
    if (!kv.consecutive) {
      for (std::int64_t t = span.begin; t < span.end; ++t) {
        const std::int64_t x = kv_positions[static_cast<std::size_t>(kv.first + t)];
        const std::int64_t doc = rows[b].index[static_cast<std::size_t>(x)];
        const auto it = std::lower_bound(q.begin(), q.end(), std::pair{doc, x - band.right});
        if (it != q.end() && it->first == doc && it->second <= x + band.left) {
          begin = std::min(begin, t);
          end = std::max(end, t + 1);
        }
      }
      continue;
    }
    for (std::int64_t a = kv.lo + span.begin, hi = kv.lo + span.end - 1; a <= hi;) {
      const std::int64_t doc = rows[b].index[static_cast<std::size_t>(a)];
      const auto& pieces = rows[b].runs[static_cast<std::size_t>(doc)];
      const auto piece = std::upper_bound(pieces.begin(), pieces.end(), a,
                                          [](std::int64_t v, const PositionRange& r) { return v < r.end; });
      const std::int64_t z = std::min(hi, piece->end - 1);
      const auto first = std::lower_bound(q.begin(), q.end(), std::pair{doc, a - band.right});
      if (first != q.end() && first->first == doc && first->second - band.left <= z) {
        const auto last = std::prev(std::upper_bound(q.begin(), q.end(), std::pair{doc, z + band.left}));
        begin = std::min(begin, std::max(a, first->second - band.left) - kv.lo);
        end = std::max(end, std::min(z, last->second + band.right) - kv.lo + 1);
      }
      a = z + 1;
    }
  }
  return begin < end ? RowSpan{begin, end} : RowSpan{};
}

// Whether the steps move every row of every rank to every other (the relay's traffic).
bool every_row_moves(const std::vector<ReachStep>& steps, const RankRuns& runs) {
  const auto ranks = static_cast<std::int64_t>(runs.size());
  if (static_cast<std::int64_t>(steps.size()) + 1 != ranks) return false;
  for (const ReachStep& st : steps) {
    for (std::int64_t r = 0; r < ranks; ++r) {
      const auto& lengths = runs[static_cast<std::size_t>((r - st.distance + ranks) % ranks)];
      const auto& seen = st.seen[static_cast<std::size_t>(r)];
      for (std::size_t k = 0; k < lengths.size(); ++k) {
        if (seen[k].size() != lengths[k]) return false;
      }
    }
  }
  return true;
}

}  // namespace

std::vector<ReachStep> ring_reach(const RankPositions& positions, const RankRuns& lengths,
                                  const PositionBand& band, const std::vector<std::int32_t>& segments) {
  const auto ranks = static_cast<std::int64_t>(positions.size());
  std::vector<std::vector<Run>> runs;
  std::int64_t seq_len = 0;
  for (std::size_t p = 0; p < positions.size(); ++p) {
    runs.push_back(runs_of(positions[p], lengths[p]));
    seq_len += static_cast<std::int64_t>(positions[p].size());
  }
  const std::vector<RowDocuments> rows =
      segments.empty() ? std::vector<RowDocuments>{} : row_documents(segments, seq_len);
  const DocumentQueries queries = document_queries(rows, positions);
  std::vector<ReachStep> steps;
  for (std::int64_t d = 1; d < ranks; ++d) {
    ReachStep step{d, {}};
    bool any = false;
    for (std::int64_t r = 0; r < ranks; ++r) {
      const auto src = static_cast<std::size_t>((r - d + ranks) % ranks);
      step.seen.emplace_back();
      for (const Run& kv : runs[src]) {
        RowSpan span = seen_span(runs[static_cast<std::size_t>(r)], kv, positions[src], band);
        if (!rows.empty() && span.size() > 0)
          span = document_span(span, kv, positions[src], rows, queries[static_cast<std::size_t>(r)], band);
        step.seen.back().push_back(span);
        any = any || span.size() > 0;
      }
    }
    if (any) steps.push_back(std::move(step));
  }
  return steps;
}

RingRoute ring_route(const RankPositions& positions, const RankRuns& runs, const PositionBand& band,
                     bool windowed, const std::vector<std::int32_t>& segments) {
  if (!windowed && segments.empty()) return {};
  if (!windowed) {
    // Every (rank, run of another rank) pair has a span, and each is found against the rank's runs: past
    // kMostRouteSpans spans or kMostRunPairs pairs of runs the packed ring goes round instead.
    std::int64_t total = 0;
    for (const auto& r : runs) total += static_cast<std::int64_t>(r.size());
    const auto ranks = static_cast<std::int64_t>(runs.size());
    if (total > kMostRouteSpans / std::max<std::int64_t>(ranks - 1, 1) || total * total > kMostRunPairs)
      return {};
  }
  std::vector<ReachStep> steps = ring_reach(positions, runs, band, segments);
  if (!windowed && every_row_moves(steps, runs)) return {};
  return {true, std::move(steps)};
}

}  // namespace cpattn
