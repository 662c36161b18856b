#include "cpattn/planner.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>

#include "cpattn/flash.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/schedule.hpp"
#include "cpattn/sequence_layout.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn {

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = {
      {{"qwen3.5-397b-a17b", 4096, 60, 4, {}, 1}, 32, 2, 256},
      {{"qwen3-next-80b-a3b", 2048, 48, 4, {}, 1}, 16, 2, 256},
      {{"llama3-70b", 8192, 80, 1, {}, 1}, 64, 8, 128},
      // Their config.json (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head
      // dim). The first three have head counts that cp = 8 or 16 does not divide (ulysses splits them
      // unevenly); llama3-8b's 8 kv heads are replicated at cp = 16.
      {{"qwen2.5-7b", 3584, 28, 1, {}, 1}, 28, 4, 128},
      {{"qwen2.5-32b", 5120, 64, 1, {}, 1}, 40, 8, 128},
      {{"phi-3-medium", 5120, 40, 1, {}, 1}, 40, 10, 128},
      {{"llama3-8b", 4096, 32, 1, {}, 1}, 32, 8, 128},
      // Sliding-window models (config.json: sliding_window W keys, the query's own included: window W - 1).
      // Gemma 3 27B: five local layers of 1024 keys to each global one (sliding_window_pattern 6), no
      // soft-cap; gpt-oss-120b: local (128 keys) and global layers alternate, with sinks (which move
      // nothing).
      {{"gemma3-27b", 5376, 62, 1, 1023, 6}, 32, 16, 128},
      {{"gpt-oss-120b", 2880, 36, 1, 127, 2}, 64, 8, 64},
  };
  return presets;
}

const ModelPreset* find_preset(const std::string& name) {
  for (const auto& p : model_presets()) {
    if (p.model.name == name) return &p;
  }
  return nullptr;
}

const HardwareProfile* find_hardware(const std::string& name) {
  for (const auto& h : hardware_profiles()) {
    if (h.name == name) return &h;
  }
  return nullptr;
}

namespace {

void add_call(std::vector<CollectiveRecord>& list, CollectiveKind kind, const std::string& phase,
              std::int64_t count, std::size_t element_size, int ranks,
              const std::vector<int>* dest = nullptr) {
  add_to_records(list, kind, phase, collective_cost(kind, count, element_size, ranks, dest));
}

std::vector<kernels::BlockMeta> blocks_of(const std::vector<std::int32_t>& positions,
                                          const std::vector<std::int32_t>& segments, std::int64_t block) {
  return kernels::block_meta(positions, segments, 0, static_cast<std::int64_t>(positions.size()), block);
}

// Tiles of one q head for the query tokens `q_positions` (local order) against kv blocks `kb`, counted
// without visiting every pair (kernels::count_nonempty_tiles), so any accepted grid plans in little time.
// With the full ones among them (count_full_tiles): the rest are partial, the mask applied tile by tile.
std::pair<std::int64_t, std::int64_t> count_tiles(const std::vector<std::int32_t>& q_positions,
                                                  const std::vector<std::int32_t>& q_segments,
                                                  const std::vector<kernels::BlockMeta>& kb,
                                                  const PositionBand& band, std::int64_t block) {
  const auto qb = blocks_of(q_positions, q_segments, block);
  const bool segments = !q_segments.empty();
  return {kernels::count_nonempty_tiles(qb, kb, band, segments),
          kernels::count_full_tiles(qb, kb, band, segments, block)};
}

// The ring's route (ring, hybrid: over the ring's rows; round the ring otherwise) on one row's segment ids.
RingRoute plan_route(const AttentionSpec& a, const ParallelSpec& p,
                     const std::vector<std::int32_t>& row_segments) {
  if (!p.traits().ring || p.ring_degree() <= 1) return {};
  const SequenceLayout ring = ring_layout_of(a, p);
  return ring_route(ring.rank_positions(), ring.rank_run_lengths(), a.band(), a.windowed(), row_segments);
}

// attention_collectives on the route (and the all_gather's keys, null: worked out) of these segment ids.
std::vector<CollectiveRecord> collectives_of(const AttentionSpec& a, const ParallelSpec& p, bool remat,
                                             const std::vector<std::int32_t>& row_segments,
                                             const RingRoute& route,
                                             const std::vector<std::vector<PositionRange>>* keys,
                                             bool forward_only, std::int64_t block) {
  const bool packed = !row_segments.empty();
  // The calls differ between ranks in hybrid's ring (by ulysses rank) and in a direct ring (each ring rank
  // sends the rows its receivers see); each field's largest over the ranks.
  const std::int64_t ranks = route.direct ? p.cp : p.traits().sub_groups ? p.head_group_size() : 1;
  std::vector<CollectiveRecord> out;
  for (std::int64_t r = 0; r < ranks; ++r) {
    StrategySchedule schedule =
        strategy_schedule(a, p, {remat, packed, r, &route, block, &row_segments, keys});
    if (forward_only) schedule.backward.clear();
    const auto records = scheduled_records(schedule, p.cp);
    if (out.empty()) {
      out = records;
      continue;
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i].bytes = std::max(out[i].bytes, records[i].bytes);
      out[i].bytes_sent_per_rank = std::max(out[i].bytes_sent_per_rank, records[i].bytes_sent_per_rank);
    }
  }
  return out;
}

}  // namespace

std::vector<CollectiveRecord> attention_collectives(const AttentionSpec& a, const ParallelSpec& p, bool remat,
                                                    const std::vector<std::int64_t>& documents,
                                                    bool forward_only, std::int64_t block) {
  // The all_gather's keys and the ring's route follow the row's documents (all_gather_keys, ring_route; one
  // row: every batch row alike).
  const std::vector<std::int32_t> row_segments =
      documents.empty() ? std::vector<std::int32_t>{} : segment_ids_from_lengths(1, documents);
  return collectives_of(a, p, remat, row_segments, plan_route(a, p, row_segments), nullptr, forward_only,
                        block);
}

namespace {

struct KernelFit {
  std::int64_t head_dim = 0;
  double tile = 0, partial = 0, q_row = 0, kv_row = 0;  // seconds, per head
  double seconds(double tiles, double partial_tiles, double q, double kv) const {
    return tile * tiles + partial * partial_tiles + q_row * q + kv_row * kv;
  }
};

// What one rank sends in one collective: bytes and messages by link (inside its host, to other hosts) and the
// bytes that leave its switch for the rest of its host.
struct Traffic {
  double intra = 0, inter = 0, out_of_switch = 0, out_of_socket = 0;
  std::int64_t intra_messages = 0, inter_messages = 0, socket_messages = 0;  // socket: those leaving it
  bool all_to_all = false;  // an all-to-all: at the profile's all_to_all_bandwidth (Links::seconds)
};

// Where ranks sit (HardwareProfile): rank r on host r / per_host, in socket r / per_socket, behind switch
// r / per_switch. A rank's time in a collective is the slowest of its links, each latency x messages + bytes
// / bandwidth, all links at once; a switch's uplink carries what all its ranks send out of it, a socket's
// link what all its ranks send to the host's other sockets. Where ranks share cores (`share` ranks per core
// beyond one), every transfer is that much slower: the copies take turns on the cores.
struct Links {
  std::int64_t per_host = 0, per_switch = 0;  // 0: one host, no switches
  double intra = 1, inter = 1, uplink = 1, latency = 0, inter_latency = 0, share = 1, all_to_all = 1;
  std::int64_t per_socket = 0;  // 0: one socket
  // A socket's link to the host's others: a permute's rate, an all-to-all's, the latency of a message on it.
  double socket = 1, socket_all_to_all = 1, socket_latency = 0;
  bool crosses(std::int64_t a, std::int64_t b) const { return per_host > 0 && a / per_host != b / per_host; }
  bool leaves_switch(std::int64_t a, std::int64_t b) const {
    return per_switch > 0 && !crosses(a, b) && a / per_switch != b / per_switch;
  }
  bool leaves_socket(std::int64_t a, std::int64_t b) const {
    return per_socket > 0 && !crosses(a, b) && a / per_socket != b / per_socket;
  }
  void add(Traffic& t, std::int64_t from, std::int64_t to, double bytes) const {
    if (crosses(from, to)) {
      t.inter += bytes;
      ++t.inter_messages;
    } else {
      t.intra += bytes;
      ++t.intra_messages;
      if (leaves_switch(from, to)) t.out_of_switch += bytes;
      if (leaves_socket(from, to)) {
        t.out_of_socket += bytes;
        ++t.socket_messages;
      }
    }
  }
  double seconds(const Traffic& t, double switch_total, double socket_total) const {
    // An all-to-all's slow part is what crosses a switch's uplink where there are switches, else the device's
    // link: all_to_all (the profile's all_to_all_bandwidth) there.
    const bool slow_a2a = t.all_to_all && per_switch == 0;
    // The messages' latencies first (each link's in turn, the links at once), then the bytes at the slowest
    // link: a link's bytes cannot start before its messages are set up, nor hide another link's latency.
    const double messages = std::max({static_cast<double>(t.intra_messages - t.socket_messages) * latency,
                                      static_cast<double>(t.socket_messages) * socket_latency,
                                      static_cast<double>(t.inter_messages) * inter_latency});
    const double host = t.intra / (slow_a2a ? all_to_all : intra);
    const double uplink_s = per_switch > 0 ? switch_total / (t.all_to_all ? all_to_all : uplink) : 0.0;
    const double socket_s = per_socket > 0 ? socket_total / (t.all_to_all ? socket_all_to_all : socket) : 0.0;
    const double across = t.inter / inter;
    return share * (messages + std::max({host, uplink_s, socket_s, across}));
  }
  // One call's time per rank from every rank's traffic (the switches' and sockets' totals summed first).
  std::vector<double> call_seconds(const std::vector<Traffic>& traffic) const {
    std::vector<double> by_switch(traffic.size(), 0.0), by_socket(by_switch), out(by_switch);
    const std::int64_t n = static_cast<std::int64_t>(traffic.size());
    for (std::int64_t r = 0; r < n; ++r) {
      if (per_switch > 0) by_switch[static_cast<std::size_t>(r / per_switch)] += traffic[r].out_of_switch;
      if (per_socket > 0) by_socket[static_cast<std::size_t>(r / per_socket)] += traffic[r].out_of_socket;
    }
    for (std::int64_t r = 0; r < n; ++r) {
      out[r] = seconds(traffic[r], per_switch > 0 ? by_switch[static_cast<std::size_t>(r / per_switch)] : 0.0,
                       per_socket > 0 ? by_socket[static_cast<std::size_t>(r / per_socket)] : 0.0);
    }
    return out;
  }
};

// What one plan_strategy call works from: the request with the strategy's parallel spec and the sizes.
struct PlanContext {
  const PlanRequest& req;
  const AttentionSpec& a;
  ParallelSpec p;
  std::int64_t cp = 1, B = 1, S = 1, D = 1, sl = 1, hq = 1, hkv = 1, E = 4;
  // The ring's shape: ring U = 1, R = cp; hybrid U x R; the others U = 1, R = 1 (no ring).
  std::int64_t U = 1, R = 1;
  bool packed = false;
  UlyssesHeads heads;  // ulysses: over cp; hybrid: over U
  Links links;
  std::int64_t threads = 1;  // kernel threads per rank where ranks share cores (run's default), else 1
  std::vector<KernelFit> forward_fits, backward_fits;  // the profile's kernel entries, fitted
  // The ring's route (ring, hybrid, R > 1: ring_route); direct (a window, or documents that leave rows
  // unseen): its steps (`route.steps`), each rank's rows straight to the ranks that see them.
  RingRoute route;
  bool direct_ring = false;
  std::vector<std::int64_t> reach_at;  // reach_at[d]: the index in route.steps of distance d, or -1
  // all_gather's key rows per rank: S, or with a window or on packed rows the rows it sees (all_gather_keys).
  std::vector<std::int64_t> gathered_rows;
  // Packed rows: one row's segment ids ([1, S]), whose documents decide the all_gather's keys and the ring's
  // route.
  std::vector<std::int32_t> row_segments;
  // all_gather's keys (all_gather_keys; empty: the whole row to every rank), for gathered_rows and its
  // schedule.
  std::vector<std::vector<PositionRange>> gather_keys;
  // Ranks sharing cores whose kernel threads occupy every one of them.
  bool cores_saturated() const { return req.hardware.cores > 0 && cp * threads >= req.hardware.cores; }

  bool ring_like() const { return p.traits().ring; }
  // The rank's place among the U ulysses ranks a ring's schedule differs by (0 but for hybrid).
  std::int64_t u_of(std::int64_t rank) const { return rank % U; }
  bool heads_split() const { return p.traits().heads != HeadSplit::none; }
  std::int64_t local_q_heads(std::int64_t rank) const {
    return heads_split() ? heads.q[p.ulysses_rank(rank)].size() : hq;
  }
  std::int64_t local_kv_heads(std::int64_t rank) const {
    return heads_split() ? heads.kv[p.ulysses_rank(rank)].size() : hkv;
  }
};

// A layout cut by documents around a layer whose neighbours need contiguous order: an all_to_all_v in
// (rank r sends rank p the tokens of r's contiguous shard that p holds) and its transpose out, in forward,
// both again in backward and the forward's under remat.
double plan_document_reorder(const PlanContext& c, StrategyPlan& s, std::vector<std::int64_t>& inter_bytes) {
  const SequenceLayout layout = layout_of(c.a, c.p);
  const std::int64_t row = c.B * c.req.model.emb_dim;
  std::vector<std::vector<std::int64_t>> in(static_cast<std::size_t>(c.cp),
                                            std::vector<std::int64_t>(static_cast<std::size_t>(c.cp), 0));
  // Each run of rank p, over the contiguous shards r it meets.
  for (std::int64_t p = 0; p < c.cp; ++p) {
    for (const PositionRange& run : layout.runs[static_cast<std::size_t>(p)]) {
      for (std::int64_t r = run.begin / c.sl; r * c.sl < run.end; ++r)
        in[r][p] += row * (std::min(run.end, (r + 1) * c.sl) - std::max(run.begin, r * c.sl));
    }
  }
  auto out = in;
  for (std::int64_t r = 0; r < c.cp; ++r) {
    for (std::int64_t p = 0; p < c.cp; ++p) out[r][p] = in[p][r];
  }
  double seconds = 0;
  auto both = [&](const std::string& phase) {
    for (const auto* blocks : {&in, &out}) {
      add_to_records(s.reorder, CollectiveKind::all_to_all, phase,
                     all_to_all_v_cost(*blocks, static_cast<std::size_t>(c.E)));
      std::vector<Traffic> traffic(static_cast<std::size_t>(c.cp));
      for (std::int64_t r = 0; r < c.cp; ++r) {
        for (std::int64_t p = 0; p < c.cp; ++p) {
          const std::int64_t bytes = (*blocks)[r][p] * c.E;
          if (p == r || bytes == 0) continue;
          c.links.add(traffic[r], r, p, static_cast<double>(bytes));
          if (c.links.crosses(r, p)) inter_bytes[r] += bytes;
        }
      }
      const auto t = c.links.call_seconds(traffic);
      seconds += *std::max_element(t.begin(), t.end());
    }
  };
  both("forward");
  if (c.req.forward_only) return seconds;
  if (c.req.remat) both("remat");
  both("backward");
  return seconds;
}

// Reorders around a load-balanced layer whose neighbours need contiguous order: entry (contiguous -> dual
// chunk swap) and exit in forward, their transposes in backward, and the forward's again under remat. Adds
// their time (each permute at the slower link any rank uses) and each rank's bytes to other hosts.
double plan_reorder(const PlanContext& c, StrategyPlan& s, std::vector<std::int64_t>& inter_bytes) {
  if (!c.req.model.other_layers_need_contiguous_order()) return 0;
  if (layout_reads_documents(c.p.effective_layout())) return plan_document_reorder(c, s, inter_bytes);
  if (!c.p.load_balance) return 0;
  const std::int64_t chunk = c.B * (c.S / (2 * c.cp)) * c.req.model.emb_dim;
  const auto entry = reorder_destinations(c.cp, ShardLayout::contiguous, ShardLayout::dual_chunk_swap);
  const auto exit = reorder_destinations(c.cp, ShardLayout::dual_chunk_swap, ShardLayout::contiguous);
  const double bytes = static_cast<double>(chunk * c.E);
  double seconds = 0;
  auto both = [&](const std::string& phase) {
    for (const auto* dests : {&entry, &exit}) {
      for (const auto& dest : *dests) {
        add_call(s.reorder, CollectiveKind::collective_permute, phase, chunk, c.E, static_cast<int>(c.cp),
                 &dest);
        std::vector<Traffic> traffic(static_cast<std::size_t>(c.cp));
        for (std::int64_t r = 0; r < c.cp; ++r) {
          if (dest[r] < 0 || dest[r] == r) continue;
          c.links.add(traffic[r], r, dest[r], bytes);
          if (c.links.crosses(r, dest[r])) inter_bytes[r] += chunk * c.E;
        }
        const auto t = c.links.call_seconds(traffic);
        seconds += *std::max_element(t.begin(), t.end());
      }
    }
  };
  both("forward");
  if (c.req.forward_only) return seconds;
  if (c.req.remat) both("remat");
  both("backward");  // the transposes: exit's gradient enters, entry's leaves
  return seconds;
}

// One kernel call of a rank: its tiles per q head, the partial ones among them (the mask applied tile by
// tile: a diagonal's, a document boundary's, a short block's), and its shape as the rate table reads it
// (query and key rows; `diagonal`: the band cuts some of its tiles).
struct KernelCall {
  std::int64_t tiles = 0, partial = 0, q = 0, kv = 0;
  bool diagonal = false;
};
// Per rank, per ring step (one step for the strategies without a ring), its calls.
using CallPlan = std::vector<std::vector<std::vector<KernelCall>>>;

// The ring's kernel calls (ring_strategy.cpp): each ring rank's rows cut into the calls' pieces (its
// layout's runs, each on a grid of its own), made once; per step the rank's pieces
// against the visiting ones (a direct ring's: the arrived spans), the calls the band hides whole skipped.
struct RingTiles {
  struct Piece {
    std::vector<kernels::BlockMeta> blocks;
    std::int32_t pos_min = 0, pos_max = 0;
    std::int64_t rows = 0;
    std::int32_t seg_min = 0, seg_max = 0;  // its documents (packed)
  };
  using Tokens = std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>;  // positions, segment ids
  const PlanContext& c;
  SequenceLayout layout;  // the ring's rows (ring_layout_of)
  std::vector<Tokens> tokens;
  std::vector<std::vector<Piece>> pieces;
  std::vector<std::vector<std::int64_t>> starts;  // [ring rank][run]: the run's first local row

  template <class TokensOf>
  RingTiles(const PlanContext& context, TokensOf tokens_of) : c(context), layout(ring_layout_of(c.a, c.p)) {
    for (std::int64_t rr = 0; rr < c.R; ++rr) {
      tokens.push_back(tokens_of(layout, rr));
      pieces.emplace_back();
      starts.emplace_back();
      std::int64_t first = 0;
      for (const std::int64_t n : layout.run_lengths(rr)) {
        starts.back().push_back(first);
        pieces.back().push_back(make_piece(tokens.back(), first, n));
        first += n;
      }
    }
  }
  // Rows [first, first + count) of a ring rank's tokens as a piece.
  Piece make_piece(const Tokens& t, std::int64_t first, std::int64_t count) const {
    auto cut = [&](const std::vector<std::int32_t>& v) {
      return v.empty() ? v : std::vector<std::int32_t>(v.begin() + first, v.begin() + first + count);
    };
    const auto p_pos = cut(t.first), p_seg = cut(t.second);
    Piece piece{blocks_of(p_pos, p_seg, c.req.block), 0, 0, count, 0, 0};
    if (!p_pos.empty()) {
      piece.pos_min = *std::min_element(p_pos.begin(), p_pos.end());
      piece.pos_max = *std::max_element(p_pos.begin(), p_pos.end());
    }
    if (!p_seg.empty()) {
      piece.seg_min = *std::min_element(p_seg.begin(), p_seg.end());
      piece.seg_max = *std::max_element(p_seg.begin(), p_seg.end());
    }
    return piece;
  }
  // The pieces of src's rows a step's calls take: all of them, or (direct, step > 0) each run's seen span
  // (a whole run: its piece as made once; `cut` keeps the others). Empty where no query reaches.
  std::vector<const Piece*> visiting(std::int64_t ring_rank, std::int64_t step,
                                     std::vector<Piece>& cut) const {
    const std::int64_t src = (ring_rank - step + c.R) % c.R;
    std::vector<const Piece*> theirs;
    if (!c.direct_ring || step == 0) {
      for (const Piece& p : pieces[static_cast<std::size_t>(src)]) theirs.push_back(&p);
      return theirs;
    }
    const std::int64_t at = c.reach_at[static_cast<std::size_t>(step)];
    if (at < 0) return theirs;
    const auto& seen = c.route.steps[static_cast<std::size_t>(at)].seen[static_cast<std::size_t>(ring_rank)];
    cut.reserve(seen.size());
    const auto& src_pieces = pieces[static_cast<std::size_t>(src)];
    for (std::size_t part = 0; part < seen.size(); ++part) {
      if (seen[part].size() == src_pieces[part].rows) {
        theirs.push_back(&src_pieces[part]);
      } else if (seen[part].size() > 0) {
        cut.push_back(make_piece(tokens[static_cast<std::size_t>(src)],
                                 starts[static_cast<std::size_t>(src)][part] + seen[part].begin,
                                 seen[part].size()));
        theirs.push_back(&cut.back());
      }
    }
    return theirs;
  }
  std::vector<std::vector<KernelCall>> steps_of(std::int64_t ring_rank) const {
    const PositionBand band = c.a.band();
    const auto& mine = pieces[static_cast<std::size_t>(ring_rank)];
    std::vector<std::vector<KernelCall>> steps;
    for (std::int64_t step = 0; step < c.R; ++step) {
      std::vector<Piece> cut;
      const std::vector<const Piece*> theirs = visiting(ring_rank, step, cut);
      std::vector<KernelCall> calls;
      for (const Piece& qp : mine) {
        for (const Piece* k : theirs) {
          const Piece& kp = *k;
          if (!band.sees_any(qp.pos_min, qp.pos_max, kp.pos_min, kp.pos_max)) continue;
          if (c.packed && (qp.seg_max < kp.seg_min || kp.seg_max < qp.seg_min)) continue;  // other documents
          const std::int64_t tiles = kernels::count_nonempty_tiles(qp.blocks, kp.blocks, band, c.packed);
          if (tiles == 0) continue;
          const std::int64_t full =
              kernels::count_full_tiles(qp.blocks, kp.blocks, band, c.packed, c.req.block);
          const bool diagonal = !band.sees_all(qp.pos_min, qp.pos_max, kp.pos_min, kp.pos_max);
          calls.push_back({tiles, tiles - full, qp.rows, kp.rows, diagonal});
        }
      }
      steps.push_back(std::move(calls));
    }
    return steps;
  }
};

// Tiles on the block grid, with the kernel's classification: per rank and q head (ulysses: over the whole
// sequence for each of its n_r heads; ring and hybrid: per step against the visiting ring rank's rows, chunk
// by chunk on each chunk's own grid; all_gather: the rank's queries against the whole sequence).
CallPlan plan_tiles(const PlanContext& c, StrategyPlan& s) {
  CallPlan calls;
  const std::vector<std::int32_t> natural = natural_positions(1, c.S);
  const std::vector<std::int32_t> segments = segment_ids_from_lengths(1, c.req.segments);
  // The rows of rank r in `layout`: positions and (packed) segment ids.
  auto tokens = [&](const SequenceLayout& layout, std::int64_t r) {
    const auto local = layout.positions(r);
    std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> t{positions_as_int32(local), {}};
    for (auto x : local) {
      if (c.packed) t.second.push_back(segments[x]);
    }
    return t;
  };
  const SequenceLayout layout = layout_of(c.a, c.p);
  // Computed once and shared by the ranks that see the same rows: the whole sequence's kv blocks; ulysses's
  // per-head count (every rank sees the whole sequence); ring: each ring rank's rows and its steps' counts
  // (hybrid's ranks of one ulysses group share their ring rank).
  const auto natural_blocks = blocks_of(natural, segments, c.req.block);
  std::optional<std::pair<std::int64_t, std::int64_t>> ulysses_per_head;  // tiles, full
  std::optional<RingTiles> ring;
  if (c.ring_like()) ring.emplace(c, tokens);
  std::vector<std::optional<std::vector<std::vector<KernelCall>>>> ring_steps(static_cast<std::size_t>(c.R));
  for (std::int64_t r = 0; r < c.cp; ++r) {
    std::int64_t per_head = 0;
    if (c.heads_split() && !c.ring_like()) {  // the whole row in one kernel call per head
      if (!ulysses_per_head) {
        const bool packed = !segments.empty();
        ulysses_per_head = {
            kernels::count_nonempty_tiles(natural_blocks, natural_blocks, c.a.band(), packed),
            kernels::count_full_tiles(natural_blocks, natural_blocks, c.a.band(), packed, c.req.block)};
      }
      per_head = ulysses_per_head->first;
      calls.push_back({{{per_head, per_head - ulysses_per_head->second, c.S, c.S, c.a.band().bounded()}}});
    } else if (c.ring_like()) {
      // The kernel's calls of a step (ring_strategy.cpp): the ring rank's rows whole, or chunk by chunk with
      // load balance, each on a grid of its own; calls the mask's band hides whole are skipped.
      const std::int64_t ring_rank = c.p.ring_rank(r);
      auto& steps = ring_steps[static_cast<std::size_t>(ring_rank)];
      if (!steps) steps = ring->steps_of(ring_rank);
      std::vector<std::int64_t> per_step;
      for (const auto& step : *steps) {
        std::int64_t tiles = 0;
        for (const KernelCall& k : step) tiles += k.tiles;
        per_step.push_back(tiles);
        per_head += tiles;
      }
      s.tiles_per_rank_per_step.push_back(per_step);
      calls.push_back(*steps);
    } else {
      const auto [q_pos, q_seg] = tokens(layout, r);
      const auto [tiles, full] = count_tiles(q_pos, q_seg, natural_blocks, c.a.band(), c.req.block);
      per_head = tiles;
      calls.push_back({{{tiles, tiles - full, c.sl, c.gathered_rows[static_cast<std::size_t>(r)],
                         c.a.band().bounded()}}});
    }
    s.tiles_per_rank_per_q_head.push_back(per_head);
    s.tiles_per_rank.push_back(per_head * c.local_q_heads(r) * c.B);
  }
  const auto [mn, mx] = std::minmax_element(s.tiles_per_rank.begin(), s.tiles_per_rank.end());
  s.tiles_skew = *mn > 0 ? static_cast<double>(*mx) / static_cast<double>(*mn) : 1.0;
  return calls;
}

// Memory: what forward keeps for backward (nothing in a prefill), and the K/V the kernel reads.
void plan_memory(const PlanContext& c, StrategyPlan& s) {
  const std::int64_t B = c.B, S = c.S, D = c.D, E = c.E, sl = c.sl, hq = c.hq, hkv = c.hkv;
  if (c.heads_split() && !c.ring_like()) {
    // Per rank (n_q q heads, n_kv kv heads; uneven when cp does not divide Hq): the largest.
    for (std::int64_t r = 0; r < c.cp; ++r) {
      const std::int64_t n_q = c.heads.q[r].size(), n_kv = c.heads.kv[r].size();
      const std::int64_t q_heads = B * S * n_q * D * E, kv_heads = 2 * B * S * n_kv * D * E;
      const std::int64_t inputs = c.req.remat ? B * sl * (hq + 2 * hkv) * D * E : q_heads + kv_heads;
      s.memory_bytes_per_rank = std::max(
          s.memory_bytes_per_rank, inputs + q_heads /* O */ + B * n_q * S * 4 + (c.packed ? B * S * 4 : 0));
      s.kv_buffer_bytes_per_rank = std::max(s.kv_buffer_bytes_per_rank, kv_heads);
    }
  } else if (c.ring_like()) {
    // Saved: the ring rank's rows of q, O, LSE and K/V (hybrid: its ulysses heads; the largest over ranks);
    // in flight: the visiting K/V and the next one (direct: two messages in and two out, of the most rows
    // a step receives and sends, and in backward as many rows of fp32 dK/dV going back and coming back).
    const std::int64_t rows = S / c.R;
    std::int64_t in_flight = 2 * rows, partial_rows = 0;
    if (c.direct_ring) {
      in_flight = 0;
      for (std::int64_t rr = 0; rr < c.R; ++rr) {
        std::int64_t most_in = 0, most_out = 0;
        for (const ReachStep& st : c.route.steps) {
          most_in = std::max(most_in, st.rows_received(rr));
          most_out = std::max(most_out, st.rows_sent(rr));
        }
        in_flight = std::max(in_flight, 2 * (most_in + most_out));
      }
      if (!c.req.forward_only) partial_rows = in_flight;
    }
    for (std::int64_t r = 0; r < c.U; ++r) {
      const std::int64_t n_q = c.local_q_heads(r), kv_row = 2 * B * c.local_kv_heads(r) * D * E;
      s.memory_bytes_per_rank =
          std::max(s.memory_bytes_per_rank, 2 * B * rows * n_q * D * E + B * n_q * rows * 4 + kv_row * rows +
                                                (c.packed ? B * rows * 4 + B * S * 4 : 0));
      s.kv_buffer_bytes_per_rank =
          std::max(s.kv_buffer_bytes_per_rank, kv_row * in_flight + kv_row / E * 4 * partial_rows);
    }
  } else {
    // The gathered K/V and their segment ids (with a window or on packed rows, of the most rows a rank
    // sees).
    const std::int64_t most = *std::max_element(c.gathered_rows.begin(), c.gathered_rows.end());
    const std::int64_t kv_full = 2 * B * most * hkv * D * E;
    s.memory_bytes_per_rank = 2 * B * sl * hq * D * E /* q, O */ + B * hq * sl * 4 +
                              (c.req.remat ? 2 * B * sl * hkv * D * E : kv_full) +
                              (c.packed ? B * sl * 4 + B * most * 4 : 0);
    s.kv_buffer_bytes_per_rank = kv_full;
  }
  if (c.req.forward_only) s.memory_bytes_per_rank = 0;  // prefill keeps nothing for a backward
}

// Communication by link, from the schedule each rank runs: every call's time on its slowest rank, each rank's
// bytes to other hosts, and for the ring (ring, hybrid) each rank's K||V and dK||dV hop (its ring's slowest
// link) instead of summing those calls.
struct CommModel {
  double collectives = 0;                 // the calls that do not overlap compute
  double hops = 0;                        // the ring's shifts end to end (reported, not added)
  std::vector<double> kv_hop, dkv_hop;    // per rank
  std::vector<std::int64_t> inter_bytes;  // per rank
  // A direct ring: each step's K||V shift and its dK||dV shift back, at the slowest rank, by the step's
  // distance.
  std::map<std::int64_t, double> kv_step, dkv_step;
};

CommModel plan_communication(const PlanContext& c) {
  const std::int64_t U = c.U;
  // The schedules ranks differ by: hybrid's by ulysses rank; a direct ring's by rank (made as they are
  // needed: a ring of many ranks has many).
  auto schedule_of = [&](std::int64_t r) {
    StrategySchedule s = strategy_schedule(c.a, c.p,
                                           {c.req.remat, c.packed, r, &c.route, c.req.block, &c.row_segments,
                                            c.p.strategy == Strategy::all_gather ? &c.gather_keys : nullptr});
    if (c.req.forward_only) s.backward.clear();
    return s;
  };
  std::vector<StrategySchedule> by_u;
  if (!c.direct_ring) {
    for (std::int64_t u = 0; u < U; ++u) by_u.push_back(schedule_of(u));
  }
  const StrategySchedule first = c.direct_ring ? schedule_of(0) : by_u[0];
  const std::size_t calls = first.forward.size() + first.backward.size();
  // traffic[k][rank]: what the rank sends in the k-th call of its schedule.
  std::vector<std::vector<Traffic>> traffic(calls, std::vector<Traffic>(static_cast<std::size_t>(c.cp)));
  std::vector<bool> hop(calls, false), kv(calls, false);
  CommModel m;
  m.kv_hop.assign(static_cast<std::size_t>(c.cp), 0.0);
  m.dkv_hop.assign(static_cast<std::size_t>(c.cp), 0.0);
  m.inter_bytes.assign(static_cast<std::size_t>(c.cp), 0);
  std::vector<std::int64_t> distance(calls, 1);
  for (std::int64_t rank = 0; rank < c.cp; ++rank) {
    const StrategySchedule own = c.direct_ring ? schedule_of(rank) : StrategySchedule{};
    const StrategySchedule& sch = c.direct_ring ? own : by_u[static_cast<std::size_t>(c.u_of(rank))];
    std::size_t k = 0;
    for (const auto* list : {&sch.forward, &sch.backward}) {
      for (const ScheduledCollective& call : *list) {
        // The call's group: hybrid's ulysses group (ranks rU..rU+U-1) or ring (ranks iU + u), else all.
        std::int64_t n = c.cp, me = rank, base = 0, stride = 1;
        if (call.group == kUlyssesGroup) {
          n = U;
          me = c.p.ulysses_rank(rank);
          base = c.p.ring_rank(rank) * U;
        } else if (call.group == kRingGroup) {
          n = c.R;
          me = c.p.ring_rank(rank);
          base = c.p.ulysses_rank(rank);
          stride = U;
        }
        const std::int64_t e = static_cast<std::int64_t>(comm_dtype_size(call.dtype));
        // A permute (a shift) sends to one rank alone, `distance` places on: one peer, not n (a ring of 1024
        // ranks has 2046 of them); a direct ring's empty shift sends nothing.
        const bool permute = call.kind == CollectiveKind::collective_permute;
        hop[k] = c.ring_like() && permute;
        traffic[k][rank].all_to_all = call.kind == CollectiveKind::all_to_all;
        kv[k] = call.tensor == "kv";
        distance[k] = call.distance < 0 ? -call.distance : call.distance;
        auto send = [&](std::int64_t i, std::int64_t elements) {
          const std::int64_t peer = base + i * stride, bytes = elements * e;
          c.links.add(traffic[k][rank], rank, peer, static_cast<double>(bytes));
          if (c.links.crosses(rank, peer)) m.inter_bytes[rank] += bytes;
        };
        if (permute) {
          const std::int64_t to = ((me + call.distance) % n + n) % n;
          if (to != me && call.count > 0) send(to, call.count);
        } else {
          for (std::int64_t i = 0; i < n; ++i) {
            if (i != me) send(i, call.blocks.empty() ? call.count : call.blocks[me][i]);
          }
        }
        ++k;
      }
    }
  }
  std::vector<double> kv_send(static_cast<std::size_t>(c.cp), 0.0), dkv_send(kv_send);
  for (std::size_t k = 0; k < calls; ++k) {
    const auto t = c.links.call_seconds(traffic[k]);
    const double slowest = *std::max_element(t.begin(), t.end());
    (hop[k] ? m.hops : m.collectives) += slowest;
    if (hop[k]) (kv[k] ? kv_send : dkv_send) = t;
    if (hop[k] && c.direct_ring) (kv[k] ? m.kv_step : m.dkv_step)[distance[k]] = slowest;
  }
  // A ring moves at its slowest link.
  for (std::int64_t rank = 0; rank < c.cp; ++rank) {
    for (std::int64_t i = 0; i < c.R; ++i) {
      const std::int64_t member = i * c.U + c.u_of(rank);
      m.kv_hop[rank] = std::max(m.kv_hop[rank], kv_send[member]);
      m.dkv_hop[rank] = std::max(m.dkv_hop[rank], dkv_send[member]);
    }
  }
  return m;
}

// The kernel's time per call from the profile's measured entries, as a sum of costs the entries separate: per
// computed tile, per partial tile (the mask applied: a calibration cell's diagonal), per query row and per
// key row (each per head: the rows' loads and stores, the backward's dK/dV partials zeroed and summed),
// fitted per (dtype, head dim, pass) by least squares on the relative error (a term that would come out
// negative dropped). A call's cost then follows its shape, which a rate alone does not: an all_gather rank's
// queries see half of their keys, a calibration cell's all.

// A measured cell's tiles on the grid of `block` (its queries at its keys' end, as calibration placed them),
// and the partial ones among them.
std::pair<double, double> cell_tiles(const KernelRate& k, std::int64_t block) {
  std::vector<std::int32_t> q_pos(static_cast<std::size_t>(k.q)), kv_pos(static_cast<std::size_t>(k.kv));
  for (std::int64_t i = 0; i < k.kv; ++i) kv_pos[i] = static_cast<std::int32_t>(i);
  for (std::int64_t i = 0; i < k.q; ++i)
    q_pos[i] = static_cast<std::int32_t>(std::max<std::int64_t>(k.kv - k.q, 0) + i);
  const auto qb = kernels::block_meta(q_pos, {}, 0, k.q, block);
  const auto kb = kernels::block_meta(kv_pos, {}, 0, k.kv, block);
  const auto tiles = kernels::count_nonempty_tiles(qb, kb, causal_band(k.causal), false);
  const auto full = kernels::count_full_tiles(qb, kb, causal_band(k.causal), false, block);
  return {static_cast<double>(tiles), static_cast<double>(tiles - full)};
}

// Solves the weighted least squares over the terms in `use` (at most 4), dropping a negative one and solving
// again; false when too few entries.
bool fit_terms(const std::vector<std::array<double, 5>>& rows, KernelFit& fit) {
  std::array<bool, 4> use{};
  // A term no entry varies (no causal entry and every extent a multiple of the block: no partial tiles)
  // cannot be told apart: dropped.
  for (std::size_t t = 0; t < 4; ++t) {
    use[t] = std::any_of(rows.begin(), rows.end(), [&](const auto& r) { return r[t] != 0; });
  }
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::vector<std::size_t> terms;
    for (std::size_t t = 0; t < 4; ++t) {
      if (use[t]) terms.push_back(t);
    }
    const std::size_t n = terms.size();
    if (n == 0 || rows.size() < n + 1) return false;
    std::vector<double> m(n * n, 0.0), v(n, 0.0);
    for (const auto& r : rows) {  // r: tiles, partial, q, kv, seconds; weighted by 1 / seconds
      const double w = 1 / r[4];
      for (std::size_t i = 0; i < n; ++i) {
        v[i] += r[terms[i]] * w;  // (x_i / t) * (t / t)
        for (std::size_t j = 0; j < n; ++j) m[i * n + j] += r[terms[i]] * r[terms[j]] * w * w;
      }
    }
    double scale = 0;
    for (std::size_t i = 0; i < n; ++i) scale = std::max(scale, std::abs(m[i * n + i]));
    // Gaussian elimination with partial pivoting; a pivot that vanishes (a term the others already carry, as
    // the partial tiles where every causal entry's q is a multiple of the block) drops its term.
    std::optional<std::size_t> dependent;
    for (std::size_t c = 0; c < n; ++c) {
      std::size_t piv = c;
      for (std::size_t r = c + 1; r < n; ++r) {
        if (std::abs(m[r * n + c]) > std::abs(m[piv * n + c])) piv = r;
      }
      if (std::abs(m[piv * n + c]) <= 1e-12 * scale) {
        dependent = terms[c];  // column c is the term terms[c] (rows are swapped, columns are not)
        break;
      }
      for (std::size_t j = 0; j < n; ++j) std::swap(m[c * n + j], m[piv * n + j]);
      std::swap(v[c], v[piv]);
      for (std::size_t r = c + 1; r < n; ++r) {
        const double f = m[r * n + c] / m[c * n + c];
        for (std::size_t j = c; j < n; ++j) m[r * n + j] -= f * m[c * n + j];
        v[r] -= f * v[c];
      }
    }
    if (dependent) {
      use[*dependent] = false;
      continue;
    }
    std::vector<double> x(n, 0.0);
    for (std::size_t c = n; c-- > 0;) {
      double sum = v[c];
      for (std::size_t j = c + 1; j < n; ++j) sum -= m[c * n + j] * x[j];
      x[c] = sum / m[c * n + c];
    }
    std::size_t worst = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (x[i] < 0 && (worst == n || x[i] < x[worst])) worst = i;
    }
    if (worst == n) {
      double* out[4] = {&fit.tile, &fit.partial, &fit.q_row, &fit.kv_row};
      for (std::size_t t = 0; t < 4; ++t) *out[t] = 0;
      for (std::size_t i = 0; i < n; ++i) *out[terms[i]] = x[i];
      return fit.tile > 0;
    }
    use[terms[worst]] = false;
  }
  return false;
}

// The fits of the profile's entries of `dtype` and this pass, one per head dim with enough entries.
std::vector<KernelFit> kernel_fits(const HardwareProfile& hw, DType dtype, bool backward,
                                   std::int64_t block) {
  // An entry's rate counts the profile's tiles (its block): its seconds come from those, while the fit's
  // terms count the request's (`block`), as the calls are counted, so that any --block prices a call alike.
  const std::int64_t rate_block = hw.block > 0 ? hw.block : block;
  std::vector<std::int64_t> dims;
  for (const KernelRate& k : hw.kernel) {
    if (k.dtype == dtype && std::find(dims.begin(), dims.end(), k.head_dim) == dims.end())
      dims.push_back(k.head_dim);
  }
  std::sort(dims.begin(), dims.end());
  std::vector<KernelFit> fits;
  for (const std::int64_t d : dims) {
    std::vector<std::array<double, 5>> rows;
    for (const KernelRate& k : hw.kernel) {
      if (k.dtype != dtype || k.head_dim != d) continue;
      const auto [tiles, partial] = cell_tiles(k, block);
      const double rate_tiles = rate_block == block ? tiles : cell_tiles(k, rate_block).first;
      const double flops = rate_tiles * attention_forward_flops(1, rate_block, 1, d, false) *
                           (backward ? kBackwardFlopsPerForward : 1.0);
      rows.push_back({tiles, partial, static_cast<double>(k.q), static_cast<double>(k.kv),
                      flops / (backward ? k.backward : k.forward)});
    }
    KernelFit fit;
    fit.head_dim = d;
    if (fit_terms(rows, fit)) fits.push_back(fit);
  }
  return fits;
}

// A call's seconds per head from the fits: at a fitted head dim its own, between two the geometric
// interpolation in log2(head dim), outside them the nearest scaled by the head dims' ratio.
std::optional<double> fitted_seconds(const std::vector<KernelFit>& fits, std::int64_t d,
                                     const KernelCall& k) {
  if (fits.empty()) return std::nullopt;
  auto at = [&](const KernelFit& f) {
    return f.seconds(static_cast<double>(k.tiles), static_cast<double>(k.partial), static_cast<double>(k.q),
                     static_cast<double>(k.kv));
  };
  const auto hi = std::find_if(fits.begin(), fits.end(), [&](const KernelFit& f) { return f.head_dim >= d; });
  if (hi != fits.end() && hi->head_dim == d) return at(*hi);
  if (hi == fits.begin()) return at(*hi) * static_cast<double>(d) / static_cast<double>(hi->head_dim);
  if (hi == fits.end())
    return at(fits.back()) * static_cast<double>(d) / static_cast<double>(fits.back().head_dim);
  const KernelFit& lo = *(hi - 1);
  const double frac = std::log2(static_cast<double>(d) / static_cast<double>(lo.head_dim)) /
                      std::log2(static_cast<double>(hi->head_dim) / static_cast<double>(lo.head_dim));
  return at(lo) * std::pow(at(*hi) / at(lo), frac);
}

// A rank's kernel seconds for `calls` (its heads and batch rows): from the fits of the profile's measured
// entries where there are any for the dtype, else each call's tiles x a full tile's FLOPs at the profile's
// rate for the call's shape (the backward: 2.5x the FLOPs at the backward's rate); plus the call's fixed
// cost. Where ranks share cores the rates are per core, times the rank's threads.
double kernel_seconds(const PlanContext& c, std::int64_t rank, const std::vector<KernelCall>& calls,
                      bool backward) {
  const HardwareProfile& hw = c.req.hardware;
  const double heads = static_cast<double>(c.local_q_heads(rank) * c.B);
  const double threads = static_cast<double>(hw.cores > 0 ? c.threads : 1);
  const std::vector<KernelFit>& fits = backward ? c.backward_fits : c.forward_fits;
  const double tile_flops = attention_forward_flops(1, c.req.block, 1, c.D, false) * heads *
                            (backward ? kBackwardFlopsPerForward : 1.0);
  double t = 0, launches = 0;
  for (const KernelCall& k : calls) {
    if (k.tiles == 0) continue;
    launches += hw.call_seconds;
    if (const auto fitted = fitted_seconds(fits, c.D, k)) {
      t += *fitted * heads / threads;
      continue;
    }
    const double rate = hw.kernel_rate(c.a.dtype, c.D, k.q, k.kv, k.diagonal, backward) * threads;
    t += static_cast<double>(k.tiles) * tile_flops / rate;
  }
  // A soft-cap's tanh per score, at the profile's measured factor.
  if (c.a.softcap) t *= backward ? hw.softcap_backward : hw.softcap_forward;
  return t + launches;
}

// The rows of dK/dV a ring rank adds into its accumulator at `step`: the whole shard as it travels (or, in a
// direct ring, its own step 0), else the direct ring's rows that come back at that distance (none where
// no band reaches).
double accumulated_rows(const PlanContext& c, std::int64_t rank, std::int64_t step) {
  if (!c.direct_ring || step == 0) return static_cast<double>(c.S / c.R);
  const std::int64_t at = c.reach_at[static_cast<std::size_t>(step)];
  return at < 0 ? 0.0
                : static_cast<double>(
                      c.route.steps[static_cast<std::size_t>(at)].rows_sent(c.p.ring_rank(rank)));
}

// The memory traffic of a ring step outside its kernel calls (ring, hybrid), at the profile's
// memory_bandwidth: the forward folds each call's output rows into the running output (merge_bytes per
// element); the backward sums each call's dQ, dK and dV into the rank's and the step's, and the step's dK/dV
// into the travelling accumulator (accumulate_bytes per element).
double merge_seconds(const PlanContext& c, std::int64_t rank, const std::vector<KernelCall>& calls,
                     bool backward, std::int64_t step) {
  const HardwareProfile& hw = c.req.hardware;
  if (!c.ring_like() || !(hw.memory_bandwidth > 0)) return 0;
  const double hq = static_cast<double>(c.local_q_heads(rank)),
               hkv = static_cast<double>(c.local_kv_heads(rank));
  const double row = static_cast<double>(c.B * c.D);  // elements per token and head
  double elements = 0;
  for (const KernelCall& k : calls) {
    if (k.tiles == 0) continue;
    elements += static_cast<double>(k.q) * hq * row;
    if (backward) elements += 2 * static_cast<double>(k.kv) * hkv * row;
  }
  if (backward) elements += 2 * accumulated_rows(c, rank, step) * hkv * row;
  const double threads = static_cast<double>(hw.cores > 0 ? c.threads : 1);
  return elements * (backward ? hw.accumulate_bytes : hw.merge_bytes) / (hw.memory_bandwidth * threads);
}

// A rank's seconds for one step's calls: their kernels and the step's merges.
double step_seconds(const PlanContext& c, std::int64_t rank, const std::vector<KernelCall>& calls,
                    bool backward, std::int64_t step) {
  return kernel_seconds(c, rank, calls, backward) + merge_seconds(c, rank, calls, backward, step);
}

// A compute phase's seconds from each rank's own: the slowest rank's; where ranks share cores, at least all
// their work spread over the cores (ranks that finish early free theirs).
double phase_seconds(const PlanContext& c, const std::vector<double>& per_rank) {
  double slowest = 0, sum = 0;
  for (const double t : per_rank) {
    slowest = std::max(slowest, t);
    sum += t;
  }
  const std::int64_t cores = c.req.hardware.cores;
  return cores > 0 ? std::max(slowest, sum * static_cast<double>(c.threads) / static_cast<double>(cores))
                   : slowest;
}

// The ring's layer time (ring, hybrid), crediting the overlap the code has, step by step (the ranks of a ring
// move in step: each step waits for its slowest rank and its slowest hop): step 0 computes while the K/V hop
// flies; a middle step while its K/V hop and the previous step's dK/dV hop fly; the last step while the
// previous dK/dV hop flies, then its own dK/dV hop home is exposed. The forward: each step but the last
// against its K/V hop. Every step of a ring of more than one rank adds the profile's ring_step_seconds (its
// synchronisation). `fixed`: what does not overlap (hybrid's all-to-alls, the segment ids, the reorder).
double direct_ring_seconds(const PlanContext& c, const CallPlan& calls, double fixed, const CommModel& m);

double ring_layer_seconds(const PlanContext& c, const CallPlan& calls, double fixed, const CommModel& m) {
  if (c.direct_ring) return direct_ring_seconds(c, calls, fixed, m);
  const double kv_hop = *std::max_element(m.kv_hop.begin(), m.kv_hop.end());
  const double dkv_hop = *std::max_element(m.dkv_hop.begin(), m.dkv_hop.end());
  const double sync = c.R > 1 ? c.req.hardware.ring_step_seconds : 0.0;
  double t = fixed;
  std::vector<double> fwd_r(static_cast<std::size_t>(c.cp)), bwd_r(fwd_r);
  for (std::int64_t step = 0; step < c.R; ++step) {
    for (std::int64_t r = 0; r < c.cp; ++r) {
      fwd_r[r] = step_seconds(c, r, calls[r][step], false, step);
      bwd_r[r] = c.req.forward_only ? 0.0 : step_seconds(c, r, calls[r][step], true, step);
    }
    const double fwd = phase_seconds(c, fwd_r), bwd = phase_seconds(c, bwd_r);
    const bool first = step == 0, last = step + 1 == c.R;
    // Compute and a hop overlap where each has hardware of its own; ranks whose threads fill the cores they
    // share copy on those cores too, so there a hop adds to its step.
    auto both = [&](double compute, double hop) {
      return c.cores_saturated() ? compute + hop : std::max(compute, hop);
    };
    t += (last ? fwd : both(fwd, kv_hop)) + sync;
    if (c.req.forward_only) {
      continue;
    } else if (c.R == 1) {
      t += bwd;
    } else if (last) {
      t += both(bwd, dkv_hop) + dkv_hop + sync;
    } else {
      t += both(bwd, first ? kv_hop : kv_hop + dkv_hop) + sync;
    }
  }
  return t;
}

// The direct ring's layer time: only step 0 and the steps some query reaches (c.route.steps), each while the
// next step's K||V shift flies and (backward) the previous step's dK||dV shift back; the last step's shift
// back is exposed. Each such step adds ring_step_seconds; a ring whose band reaches no other rank moves
// nothing.
double direct_ring_seconds(const PlanContext& c, const CallPlan& calls, double fixed, const CommModel& m) {
  std::vector<std::int64_t> active{0};
  for (const ReachStep& st : c.route.steps) active.push_back(st.distance);
  const double sync = active.size() > 1 ? c.req.hardware.ring_step_seconds : 0.0;
  auto hop = [](const std::map<std::int64_t, double>& by, std::int64_t d) {
    const auto it = by.find(d);
    return it == by.end() ? 0.0 : it->second;
  };
  auto both = [&](double compute, double shift) {
    return c.cores_saturated() ? compute + shift : std::max(compute, shift);
  };
  double t = fixed;
  std::vector<double> fwd_r(static_cast<std::size_t>(c.cp)), bwd_r(fwd_r);
  for (std::size_t j = 0; j < active.size(); ++j) {
    const std::int64_t step = active[j];
    for (std::int64_t r = 0; r < c.cp; ++r) {
      fwd_r[r] = step_seconds(c, r, calls[r][step], false, step);
      bwd_r[r] = c.req.forward_only ? 0.0 : step_seconds(c, r, calls[r][step], true, step);
    }
    const double fwd = phase_seconds(c, fwd_r), bwd = phase_seconds(c, bwd_r);
    const bool last = j + 1 == active.size();
    const double kv_next = last ? 0.0 : hop(m.kv_step, active[j + 1]);
    const double dkv_prev = j >= 2 ? hop(m.dkv_step, active[j - 1]) : 0.0;
    t += both(fwd, kv_next) + sync;
    if (c.req.forward_only) continue;
    t += both(bwd, kv_next + dkv_prev) + sync;
    if (last && j > 0) t += hop(m.dkv_step, step);
  }
  return t;
}

// Time: each rank's kernel calls at the profile's rates (forward and backward; remat re-moves inputs, its
// collectives, and computes no forward again); communication by link, not overlapped except the ring's hops.
void plan_time(const PlanContext& c, StrategyPlan& s, const CallPlan& calls, const CommModel& m,
               double reorder_seconds) {
  std::int64_t sent = 0;
  for (const auto& x : s.collectives) sent += x.bytes_sent_per_rank;
  for (const auto& x : s.reorder) sent += x.bytes_sent_per_rank;
  s.communication_seconds = m.collectives + m.hops + reorder_seconds;
  std::vector<double> fwd_r, bwd_r;
  double fastest = 1e300, slowest = 0;
  for (std::int64_t r = 0; r < c.cp; ++r) {
    double fwd = 0, bwd = 0;
    for (std::size_t step = 0; step < calls[r].size(); ++step) {
      const auto at = static_cast<std::int64_t>(step);
      fwd += step_seconds(c, r, calls[r][step], false, at);
      bwd += c.req.forward_only ? 0.0 : step_seconds(c, r, calls[r][step], true, at);
    }
    fwd_r.push_back(fwd);
    bwd_r.push_back(bwd);
    const double t = fwd + bwd;  // remat moves inputs again (its collectives), it computes no forward again
    s.compute_seconds_per_rank.push_back(t);
    if (t > slowest) {
      slowest = t;
      s.straggler_rank = static_cast<int>(r);
    }
    fastest = std::min(fastest, t);
  }
  if (c.ring_like()) {
    s.layer_seconds = ring_layer_seconds(c, calls, m.collectives + reorder_seconds, m);
  } else {
    s.layer_seconds = s.communication_seconds + phase_seconds(c, fwd_r) + phase_seconds(c, bwd_r);
  }
  s.exposed_seconds = s.layer_seconds - fastest;
  s.model_seconds = s.layer_seconds * static_cast<double>(c.req.model.global_layers());
  s.model_bytes_sent_per_rank = sent * c.req.model.global_layers();
}

// The most pairs of runs a ring's plan on a layout cut by documents counts (its runs squared): a few seconds.
constexpr std::int64_t kMostPlannedRunPairs = std::int64_t{1} << 24;

// The profile's kernel entries fitted once per plan (forward, backward): every strategy prices its calls
// alike.
using KernelFits = std::pair<std::vector<KernelFit>, std::vector<KernelFit>>;

StrategyPlan plan_strategy(const PlanRequest& req, const KernelFits& fits, const std::string& name,
                           Strategy strategy, ShardLayout layout, std::int64_t ulysses_degree = 0) {
  const bool load_balance = layout == ShardLayout::dual_chunk_swap;
  PlanContext c{req, req.attention, req.parallel, 1,  1,  1, 1, 1, 1, 1, 4, 1, 1, false, {}, {}, 1, {}, {},
                {},  false,         {},           {}, {}, {}};
  c.p.strategy = strategy;
  c.p.load_balance = load_balance;
  c.p.layout = layout;
  c.p.documents = req.segments;
  c.p.ulysses_degree = ulysses_degree;
  StrategyPlan s;
  s.name = name;
  s.strategy = strategy;
  s.load_balance = load_balance;
  s.layout = layout;
  if (c.heads_split() || c.ring_like()) {
    s.ulysses_degree = c.p.head_group_size();
    s.ring_degree = c.p.ring_degree();
  }
  s.why_not = validation_errors(c.a, c.p);
  if (auto refusal = remat_refusal(strategy, req.remat)) s.why_not.push_back(std::move(*refusal));
  if (s.why_not.empty() && c.p.traits().ring && layout_reads_documents(layout)) {
    // The ring's kernel calls are counted pair by pair of runs, over every step: the square of its runs.
    std::int64_t runs = 0;
    for (const auto& mine : ring_layout_of(c.a, c.p).runs) runs += static_cast<std::int64_t>(mine.size());
    if (runs * runs > kMostPlannedRunPairs) {
      s.why_not.push_back({{"layout", "segments"},
                           to_string(layout),
                           std::string(to_string(strategy)) + " on layout " + to_string(layout) + " holds " +
                               std::to_string(runs) + " runs of tokens round its ring: its kernel calls (" +
                               std::to_string(runs) + "^2 pairs) are more than plan counts (" +
                               std::to_string(kMostPlannedRunPairs) + "); fewer documents or ranks plan it"});
    }
  }
  if (!s.why_not.empty()) {
    s.possible = false;
    return s;
  }
  c.cp = c.p.cp;
  c.B = c.a.batch;
  c.S = c.a.seq_len;
  c.D = c.a.head_dim;
  c.sl = c.S / c.cp;
  c.hq = c.a.num_q_heads / c.p.tp;
  c.hkv = c.a.num_kv_heads / c.p.tp;
  c.E = static_cast<std::int64_t>(dtype_size(c.a.dtype));
  c.packed = !req.segments.empty();
  c.U = c.ring_like() ? c.p.head_group_size() : 1;
  c.R = c.p.ring_degree();
  c.gathered_rows.assign(static_cast<std::size_t>(c.cp), c.S);
  // One row's ids: every batch row is packed alike, and the keys are the union over the rows.
  if (c.packed) c.row_segments = segment_ids_from_lengths(1, req.segments);
  if (c.p.strategy == Strategy::all_gather && (c.a.windowed() || c.packed)) {
    const SequenceLayout shards = layout_of(c.a, c.p);
    c.gather_keys = all_gather_keys(shards.rank_positions(), shards.rank_run_lengths(), c.S, c.a.band(),
                                    c.a.windowed(), req.block, c.row_segments);
    for (std::int64_t r = 0; r < c.cp && !c.gather_keys.empty(); ++r) {
      std::int64_t rows = 0;
      for (const PositionRange& x : c.gather_keys[static_cast<std::size_t>(r)]) rows += x.size();
      c.gathered_rows[static_cast<std::size_t>(r)] = rows;
    }
  }
  c.route = plan_route(c.a, c.p, c.row_segments);
  c.direct_ring = c.route.direct;
  if (c.direct_ring) {
    c.reach_at.assign(static_cast<std::size_t>(c.R), -1);
    for (std::size_t i = 0; i < c.route.steps.size(); ++i)
      c.reach_at[static_cast<std::size_t>(c.route.steps[i].distance)] = static_cast<std::int64_t>(i);
  }
  if (c.heads_split()) c.heads = ulysses_heads(c.hq, c.hkv, c.p.head_group_size());
  const HardwareProfile& hw = req.hardware;
  c.forward_fits = fits.first;
  c.backward_fits = fits.second;
  c.threads = hw.cores > 0 ? std::max<std::int64_t>(1, hw.cores / c.cp) : 1;
  c.links = {hw.ranks_per_host,
             hw.ranks_per_switch,
             hw.bandwidth,
             hw.inter_bandwidth > 0 ? hw.inter_bandwidth : hw.bandwidth,
             hw.switch_bandwidth > 0 ? hw.switch_bandwidth : hw.bandwidth,
             hw.latency,
             hw.inter_latency > 0 ? hw.inter_latency : hw.latency,
             hw.cores > 0 ? std::max(1.0, static_cast<double>(c.cp) / static_cast<double>(hw.cores)) : 1.0,
             hw.all_to_all_bandwidth > 0 ? hw.all_to_all_bandwidth
             : hw.ranks_per_switch > 0   ? hw.switch_bandwidth
                                         : hw.bandwidth,
             hw.ranks_per_socket,
             hw.socket_bandwidth,
             hw.socket_all_to_all_bandwidth > 0 ? hw.socket_all_to_all_bandwidth : hw.socket_bandwidth,
             hw.socket_latency > 0 ? hw.socket_latency : hw.latency};
  s.collectives = collectives_of(c.a, c.p, req.remat, c.row_segments, c.route,
                                 c.p.strategy == Strategy::all_gather ? &c.gather_keys : nullptr,
                                 req.forward_only, req.block);
  CommModel m = plan_communication(c);
  const double reorder_seconds = plan_reorder(c, s, m.inter_bytes);
  s.inter_host_bytes_sent_per_rank = *std::max_element(m.inter_bytes.begin(), m.inter_bytes.end());
  const CallPlan calls = plan_tiles(c, s);
  plan_memory(c, s);
  plan_time(c, s, calls, m, reorder_seconds);
  return s;
}

std::string fmt(double x) {
  std::ostringstream o;
  o.precision(3);
  o << x;
  return o.str();
}

}  // namespace

std::string model_preset_names() {
  std::string names;
  for (const auto& x : model_presets()) names += (names.empty() ? "" : ", ") + x.model.name;
  return names;
}

std::string hardware_profile_names() {
  std::string names;
  for (const auto& h : hardware_profiles()) names += (names.empty() ? "" : ", ") + h.name;
  return names;
}

std::string plan_name(Strategy strategy, std::int64_t ulysses_degree, std::int64_t ring_degree,
                      ShardLayout layout) {
  const std::string base = strategy == Strategy::hybrid ? hybrid_name(ulysses_degree, ring_degree, false)
                                                        : std::string(to_string(strategy));
  switch (layout) {
    case ShardLayout::contiguous:
      return base;
    case ShardLayout::dual_chunk_swap:
      return base + "_load_balanced";
    default:
      return base + "_" + to_string(layout);
  }
}

std::string hybrid_name(std::int64_t ulysses_degree, std::int64_t ring_degree, bool load_balance) {
  return "hybrid_u" + std::to_string(ulysses_degree) + "_r" + std::to_string(ring_degree) +
         (load_balance ? "_load_balanced" : "");
}

namespace {

// The profile's figures the parser checks, checked again for a profile made or overridden in code: a switch
// inside one host, positive rates, latencies not negative.
void check_profile(const HardwareProfile& hw, std::int64_t cp) {
  auto bad = [&](const std::string& field, const std::string& value, const std::string& why) {
    throw Error(ErrorKind::invalid_config, field, value, why);
  };
  if (hw.ranks_per_switch < 0 || (hw.ranks_per_switch > 0 && !(hw.switch_bandwidth > 0))) {
    bad("ranks_per_switch", std::to_string(hw.ranks_per_switch),
        "ranks_per_switch must be >= 0 (0: no switches), and with switches switch_bandwidth positive");
  }
  if (hw.ranks_per_socket < 0 || (hw.ranks_per_socket > 0 && !(hw.socket_bandwidth > 0))) {
    bad("ranks_per_socket", std::to_string(hw.ranks_per_socket),
        "ranks_per_socket must be >= 0 (0: one socket), and with sockets socket_bandwidth positive");
  }
  if (hw.ranks_per_socket > 0 && hw.ranks_per_switch > 0 && hw.ranks_per_socket % hw.ranks_per_switch != 0) {
    bad("ranks_per_socket", std::to_string(hw.ranks_per_socket),
        "ranks_per_socket (" + std::to_string(hw.ranks_per_socket) +
            ") must be a multiple of the profile's " + "ranks_per_switch (" +
            std::to_string(hw.ranks_per_switch) + "): a switch sits inside one socket");
  }
  if (hw.ranks_per_socket > 0 && hw.ranks_per_host > 0 && cp > hw.ranks_per_host &&
      hw.ranks_per_host % hw.ranks_per_socket != 0) {
    bad("ranks_per_host", std::to_string(hw.ranks_per_host),
        "ranks_per_host (" + std::to_string(hw.ranks_per_host) + ") must be a multiple of the profile's " +
            "ranks_per_socket (" + std::to_string(hw.ranks_per_socket) + "): a socket sits inside one host");
  }
  if (hw.ranks_per_switch > 0 && hw.ranks_per_host > 0 && cp > hw.ranks_per_host &&
      hw.ranks_per_host % hw.ranks_per_switch != 0) {
    bad("ranks_per_host", std::to_string(hw.ranks_per_host),
        "ranks_per_host (" + std::to_string(hw.ranks_per_host) + ") must be a multiple of the profile's " +
            "ranks_per_switch (" + std::to_string(hw.ranks_per_switch) + "): a switch sits inside one host");
  }
  for (const auto& [name, x] : {std::pair<const char*, double>{"latency", hw.latency},
                                {"inter_latency", hw.inter_latency},
                                {"ring_step_seconds", hw.ring_step_seconds},
                                {"memory_bandwidth", hw.memory_bandwidth},
                                {"merge_bytes", hw.merge_bytes},
                                {"accumulate_bytes", hw.accumulate_bytes},
                                {"call_seconds", hw.call_seconds},
                                {"all_to_all_bandwidth", hw.all_to_all_bandwidth},
                                {"socket_all_to_all_bandwidth", hw.socket_all_to_all_bandwidth},
                                {"socket_latency", hw.socket_latency}}) {
    if (!(x >= 0) || !std::isfinite(x)) bad(name, std::to_string(x), std::string(name) + " must be >= 0");
  }
  for (const KernelRate& k : hw.kernel) {
    if (!(k.forward > 0) || !(k.backward > 0) || k.head_dim < 1 || k.q < 1 || k.kv < 1) {
      bad("kernel", to_string(k.dtype), "a kernel entry needs positive extents and rates");
    }
  }
}

}  // namespace

namespace {

// The local (sliding-window) layers: each strategy again on one of them (its reorder as the model's), added
// to the model's time and bytes.
void plan_local_layers(const PlanRequest& req, const KernelFits& fits, Plan& plan) {
  if (req.model.local_layers() == 0) return;
  PlanRequest local = req;
  local.attention.window_left = *req.model.local_window;
  local.attention.window_right.reset();
  if (!req.attention.causal) local.attention.window_right = *req.model.local_window;
  local.model.local_window.reset();
  local.model.num_layers = local.model.attention_every;  // one attention layer
  local.parallel.layout_band = req.attention.band();     // the global layers' layout (the solver's deal)
  const double n = static_cast<double>(req.model.local_layers());
  for (StrategyPlan& s : plan.strategies) {
    auto l = std::make_shared<StrategyPlan>(plan_strategy(
        local, fits, s.name, s.strategy, s.layout, s.strategy == Strategy::hybrid ? s.ulysses_degree : 0));
    s.model_seconds += n * l->model_seconds;
    s.model_bytes_sent_per_rank += req.model.local_layers() * l->model_bytes_sent_per_rank;
    s.local = std::move(l);
  }
}

// The local layers' recommendation among the strategies whose tokens sit where the global recommendation's
// (`best`) do (the same layout): another layout would reorder the activations at every switch between the
// kinds of layer, which the plan does not price.
std::optional<std::size_t> recommended_local(const PlanRequest& req, const Plan& plan, std::size_t best) {
  if (req.model.local_layers() == 0 || best >= plan.strategies.size()) return std::nullopt;
  const ShardLayout layout = plan.strategies[best].layout;
  std::optional<std::size_t> local;
  for (std::size_t i = 0; i < plan.strategies.size(); ++i) {
    const StrategyPlan& s = *plan.strategies[i].local;
    if (s.possible && plan.strategies[i].layout == layout &&
        (!local || s.layer_seconds < plan.strategies[*local].local->layer_seconds))
      local = i;
  }
  return local;
}

}  // namespace

Plan make_plan(const PlanRequest& req) {
  if (req.block < 1) {
    throw Error(ErrorKind::invalid_config, "block", std::to_string(req.block),
                "block must be a positive tile size");
  }
  ParallelSpec general = req.parallel;
  general.strategy = Strategy::all_gather;
  general.ulysses_degree = 0;
  general.load_balance = false;
  general.layout.reset();
  validate(req.attention, general);
  if (!req.segments.empty()) {
    std::int64_t total = 0;
    for (auto n : req.segments) total += n > 0 ? n : -1'000'000'000'000;
    if (total != req.attention.seq_len) {
      throw Error(ErrorKind::invalid_config, "segments", std::to_string(total),
                  "segments must be positive document lengths adding up to seq_len (" +
                      std::to_string(req.attention.seq_len) + ")");
    }
  }
  if (!(req.hardware.flops > 0) || !(req.hardware.bandwidth > 0)) {
    throw Error(ErrorKind::invalid_config, "hardware", req.hardware.name,
                "flops and bandwidth must be positive");
  }
  if (req.model.num_layers < 1 || req.model.attention_every < 1 || req.model.global_every < 1) {
    throw Error(ErrorKind::invalid_config, "model", req.model.name,
                "the model's num_layers, attention_every and global_every must be >= 1 (" +
                    std::to_string(req.model.num_layers) + ", " + std::to_string(req.model.attention_every) +
                    ", " + std::to_string(req.model.global_every) + ")");
  }
  if (req.model.local_window && (*req.model.local_window < 0 || *req.model.local_window > kMaxWindowSide)) {
    throw Error(ErrorKind::invalid_config, "local_window", std::to_string(*req.model.local_window),
                "the model's local_window must be 0.." + std::to_string(kMaxWindowSide));
  }
  if (req.forward_only && req.remat) {
    throw Error(
        ErrorKind::invalid_config, "remat", "true",
        "remat recomputes in a backward, and a forward-only plan (prefill) has none; drop one of them");
  }
  if (req.hardware.ranks_per_host < 0 ||
      (req.hardware.ranks_per_host > 0 && !(req.hardware.inter_bandwidth > 0))) {
    throw Error(
        ErrorKind::invalid_config, "ranks_per_host", std::to_string(req.hardware.ranks_per_host),
        "ranks_per_host must be >= 0 (0: one host), and with hosts the inter-host bandwidth positive");
  }
  if (req.hardware.ranks_per_host > 0 && req.parallel.cp > req.hardware.ranks_per_host &&
      req.parallel.cp % req.hardware.ranks_per_host != 0) {
    // Hosts of unequal rank counts: no ulysses group of a host's size would stay inside a host.
    throw Error(
        ErrorKind::invalid_config, "ranks_per_host", std::to_string(req.hardware.ranks_per_host),
        "ranks_per_host (" + std::to_string(req.hardware.ranks_per_host) + ") must divide cp (" +
            std::to_string(req.parallel.cp) +
            ") when the ranks span hosts: every host holds as many ranks (or give ranks_per_host >= cp: "
            "one host)");
  }
  check_profile(req.hardware, req.parallel.cp);
  const KernelFits fits{kernel_fits(req.hardware, req.attention.dtype, false, req.block),
                        kernel_fits(req.hardware, req.attention.dtype, true, req.block)};
  Plan plan;
  // Each strategy on the whole group; those of sub-groups (hybrid) for every factorisation U x R of cp with
  // both above 1 (U = 1 is ring, U = cp is ulysses). Load balance where the strategy takes it.
  for (const Strategy strategy : kStrategies) {
    const StrategyTraits traits = strategy_traits(strategy);
    const std::int64_t cp = req.parallel.cp;
    for (std::int64_t u = traits.sub_groups ? 2 : 0; u < (traits.sub_groups ? cp : 1); ++u) {
      if (u > 0 && cp % u != 0) continue;
      for (const ShardLayout layout : kShardLayouts) {
        // Layouts other than contiguous are for the strategies that shard the sequence; those cut by
        // documents are planned on packed rows (on one document they are the dual chunk swap, finer).
        if (layout != ShardLayout::contiguous && !traits.load_balance) continue;
        if (layout_reads_documents(layout) && req.segments.empty()) continue;
        plan.strategies.push_back(plan_strategy(req, fits, plan_name(strategy, u, u > 0 ? cp / u : 0, layout),
                                                strategy, layout, u));
      }
    }
  }
  plan_local_layers(req, fits, plan);
  std::size_t best = plan.strategies.size();
  for (std::size_t i = 0; i < plan.strategies.size(); ++i) {
    const StrategyPlan& s = plan.strategies[i];
    if (s.possible &&
        (best == plan.strategies.size() || s.layer_seconds < plan.strategies[best].layer_seconds))
      best = i;
  }
  plan.recommended = best;
  plan.recommended_local = recommended_local(req, plan, best);
  const bool hosts = req.hardware.ranks_per_host > 0 && req.parallel.cp > req.hardware.ranks_per_host;
  auto detail = [&](const StrategyPlan& s) {
    std::ostringstream d;
    d << fmt(s.layer_seconds * 1e3) << " ms: " << fmt(s.communication_seconds * 1e3)
      << " ms of communication, " << fmt(s.exposed_seconds * 1e3) << " ms exposed, tiles max/min "
      << fmt(s.tiles_skew);
    if (hosts)
      d << ", " << fmt(static_cast<double>(s.inter_host_bytes_sent_per_rank) / (1 << 20))
        << " MiB across hosts";
    return d.str();
  };
  const StrategyPlan& b = plan.strategies[best];
  std::ostringstream why;
  why << b.name << ": the shortest estimated attention layer (" << detail(b) << ")";
  for (const auto& s : plan.strategies) {
    if (&s == &b) continue;
    if (!s.possible) {
      why << "; " << s.name << " is impossible: " << s.why_not.front().message;
    } else {
      why << "; " << s.name << " " << detail(s);
    }
  }
  if (plan.recommended_local) {
    const StrategyPlan& l = plan.strategies[*plan.recommended_local];
    why << ". Local layers (window " << *req.model.local_window << ", " << req.model.local_layers() << " of "
        << req.model.attention_layers() << "): " << l.name
        << ", the shortest estimated local layer of the strategies with the global layers' layout ("
        << detail(*l.local)
        << "; another layout would reorder the activations at each switch between the kinds, not priced)";
  }
  plan.recommendation = why.str();
  return plan;
}

}  // namespace cpattn
