#include "cpattn/planner.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "cpattn/flash.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/schedule.hpp"
#include "cpattn/sequence_layout.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn {

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = {
      {{"qwen3.5-397b-a17b", 4096, 60, 4}, 32, 2, 256},
      {{"qwen3-next-80b-a3b", 2048, 48, 4}, 16, 2, 256},
      {{"llama3-70b", 8192, 80, 1}, 64, 8, 128},
      // Their config.json (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head
      // dim). The first three have head counts that cp = 8 or 16 does not divide (ulysses splits them
      // unevenly); llama3-8b's 8 kv heads are replicated at cp = 16.
      {{"qwen2.5-7b", 3584, 28, 1}, 28, 4, 128},
      {{"qwen2.5-32b", 5120, 64, 1}, 40, 8, 128},
      {{"phi-3-medium", 5120, 40, 1}, 40, 10, 128},
      {{"llama3-8b", 4096, 32, 1}, 32, 8, 128},
  };
  return presets;
}

const ModelPreset* find_preset(const std::string& name) {
  for (const auto& p : model_presets()) {
    if (p.model.name == name) return &p;
  }
  return nullptr;
}

const std::vector<HardwareProfile>& hardware_profiles() {
  static const std::vector<HardwareProfile> profiles = {
      {"h100", 989e12, 450e9,
       "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16; NVLink 900 GB/s total, 450 GB/s each way"},
      {"h200", 989e12, 450e9,
       "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16; NVLink 900 GB/s total, 450 GB/s each way"},
      {"tpu-v7x", 2307e12, 600e9,
       "Google Ironwood (TPU v7) announcement, April 2025: 4,614 TFLOP/s FP8 per chip (BF16 taken as half), "
       "ICI "
       "1.2 TB/s bidirectional (600 GB/s each way); a TPU v7x-like approximation"},
  };
  return profiles;
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

// Tiles of one q head for the query tokens `q_positions` (local order) against the whole sequence.
std::int64_t count_tiles(const std::vector<std::int32_t>& q_positions,
                         const std::vector<std::int32_t>& q_segments,
                         const std::vector<std::int32_t>& kv_positions,
                         const std::vector<std::int32_t>& kv_segments, bool causal, std::int64_t block) {
  const auto qb =
      kernels::block_meta(q_positions, q_segments, 0, static_cast<std::int64_t>(q_positions.size()), block);
  const auto kb = kernels::block_meta(kv_positions, kv_segments, 0,
                                      static_cast<std::int64_t>(kv_positions.size()), block);
  std::int64_t n = 0;
  for (const auto& q : qb) {
    for (const auto& k : kb)
      n += kernels::classify_tile(q, k, causal, !q_segments.empty(), block) != kernels::TileKind::empty;
  }
  return n;
}

}  // namespace

std::vector<CollectiveRecord> attention_collectives(const AttentionSpec& a, const ParallelSpec& p, bool remat,
                                                    bool packed) {
  return scheduled_records(strategy_schedule(a, p, {remat, packed}), p.cp);
}

namespace {

// What one plan_strategy call works from: the request with the strategy's parallel spec and the sizes.
struct PlanContext {
  const PlanRequest& req;
  const AttentionSpec& a;
  ParallelSpec p;
  std::int64_t cp = 1, B = 1, S = 1, D = 1, sl = 1, hq = 1, hkv = 1, E = 4;
  bool packed = false;
};

// Reorders around a load-balanced layer whose neighbours need contiguous order: entry (contiguous -> dual
// chunk swap) and exit in forward, their transposes in backward, and the forward's again under remat.
void plan_reorder(const PlanContext& c, StrategyPlan& s) {
  if (!(c.p.load_balance && c.req.model.other_layers_need_contiguous_order())) return;
  const std::int64_t chunk = c.B * (c.S / (2 * c.cp)) * c.req.model.emb_dim;
  const auto entry = reorder_destinations(c.cp, ShardLayout::contiguous, ShardLayout::dual_chunk_swap);
  const auto exit = reorder_destinations(c.cp, ShardLayout::dual_chunk_swap, ShardLayout::contiguous);
  auto both = [&](const std::string& phase) {
    for (const auto* dests : {&entry, &exit}) {
      for (const auto& dest : *dests) {
        add_call(s.reorder, CollectiveKind::collective_permute, phase, chunk, c.E, static_cast<int>(c.cp),
                 &dest);
      }
    }
  };
  both("forward");
  if (c.req.remat) both("remat");
  both("backward");  // the transposes: exit's gradient enters, entry's leaves
}

// Tiles on the block grid, with the kernel's classification: per rank and q head (ulysses: over the whole
// sequence for each of its n_r heads; ring: per step against the visiting shard on that shard's own grid;
// all_gather: the rank's queries against the whole sequence).
void plan_tiles(const PlanContext& c, const UlyssesHeads& heads, StrategyPlan& s) {
  const std::vector<std::int32_t> natural = natural_positions(1, c.S);
  const std::vector<std::int32_t> segments = segment_ids_from_lengths(1, c.req.segments);
  auto rank_tokens = [&](std::int64_t r) {  // a rank's positions and (packed) segment ids
    const auto local = local_positions(c.p.effective_layout(), c.S, c.cp, r);
    std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> t{positions_as_int32(local), {}};
    for (auto x : local) {
      if (c.packed) t.second.push_back(segments[x]);
    }
    return t;
  };
  const Strategy strategy = c.p.strategy;
  for (std::int64_t r = 0; r < c.cp; ++r) {
    const std::int64_t local_heads = strategy == Strategy::ulysses ? heads.q[r].size() : c.hq;
    std::int64_t per_head = 0;
    if (strategy == Strategy::ulysses) {
      per_head = count_tiles(natural, segments, natural, segments, c.a.causal, c.req.block);
    } else if (strategy == Strategy::ring) {
      // The kernel's calls of a step (ring_strategy.cpp): whole shards, or chunk by chunk with load balance,
      // each on a grid of its own; calls the causal mask hides whole are skipped.
      const std::int64_t parts = c.p.load_balance ? 2 : 1, n = c.sl / parts;
      auto piece = [&](const std::vector<std::int32_t>& v, std::int64_t part) {
        return v.empty() ? v : std::vector<std::int32_t>(v.begin() + part * n, v.begin() + (part + 1) * n);
      };
      const auto [q_pos, q_seg] = rank_tokens(r);
      s.tiles_per_rank_per_step.emplace_back();
      for (std::int64_t step = 0; step < c.cp; ++step) {
        const auto [kv_pos, kv_seg] = rank_tokens((r - step + c.cp) % c.cp);
        std::int64_t tiles = 0;
        for (std::int64_t qa = 0; qa < parts; ++qa) {
          for (std::int64_t kb = 0; kb < parts; ++kb) {
            const auto qp = piece(q_pos, qa), kp = piece(kv_pos, kb);
            if (c.a.causal &&
                *std::max_element(qp.begin(), qp.end()) < *std::min_element(kp.begin(), kp.end()))
              continue;
            tiles += count_tiles(qp, piece(q_seg, qa), kp, piece(kv_seg, kb), c.a.causal, c.req.block);
          }
        }
        s.tiles_per_rank_per_step.back().push_back(tiles);
        per_head += tiles;
      }
    } else {
      const auto [q_pos, q_seg] = rank_tokens(r);
      per_head = count_tiles(q_pos, q_seg, natural, segments, c.a.causal, c.req.block);
    }
    s.tiles_per_rank_per_q_head.push_back(per_head);
    s.tiles_per_rank.push_back(per_head * local_heads * c.B);
  }
  const auto [mn, mx] = std::minmax_element(s.tiles_per_rank.begin(), s.tiles_per_rank.end());
  s.tiles_skew = *mn > 0 ? static_cast<double>(*mx) / static_cast<double>(*mn) : 1.0;
}

// Memory: what forward keeps for backward, and the K/V the kernel reads.
void plan_memory(const PlanContext& c, const UlyssesHeads& heads, StrategyPlan& s) {
  const std::int64_t B = c.B, S = c.S, D = c.D, E = c.E, sl = c.sl, hq = c.hq, hkv = c.hkv;
  const std::int64_t seg_bytes = c.packed ? B * sl * 4 + B * S * 4 : 0;
  if (c.p.strategy == Strategy::ulysses) {
    // Per rank (n_q q heads, n_kv kv heads; uneven when cp does not divide Hq): the largest.
    for (std::int64_t r = 0; r < c.cp; ++r) {
      const std::int64_t n_q = heads.q[r].size(), n_kv = heads.kv[r].size();
      const std::int64_t q_heads = B * S * n_q * D * E, kv_heads = 2 * B * S * n_kv * D * E;
      const std::int64_t inputs = c.req.remat ? B * sl * (hq + 2 * hkv) * D * E : q_heads + kv_heads;
      s.memory_bytes_per_rank = std::max(
          s.memory_bytes_per_rank, inputs + q_heads /* O */ + B * n_q * S * 4 + (c.packed ? B * S * 4 : 0));
      s.kv_buffer_bytes_per_rank = std::max(s.kv_buffer_bytes_per_rank, kv_heads);
    }
  } else if (c.p.strategy == Strategy::ring) {
    // Saved: q, O, LSE and the local K/V shard; in flight: the visiting K/V and the next one.
    const std::int64_t kv_shard = 2 * B * sl * hkv * D * E;
    s.memory_bytes_per_rank = 2 * B * sl * hq * D * E + B * hq * sl * 4 + kv_shard + seg_bytes;
    s.kv_buffer_bytes_per_rank = 2 * kv_shard;
  } else {
    const std::int64_t kv_full = 2 * B * S * hkv * D * E;
    s.memory_bytes_per_rank = 2 * B * sl * hq * D * E /* q, O */ + B * hq * sl * 4 +
                              (c.req.remat ? 2 * B * sl * hkv * D * E : kv_full) + seg_bytes;
    s.kv_buffer_bytes_per_rank = kv_full;
  }
}

// Ring's layer time, crediting the overlap the code has: step 0 computes while the K/V hop flies; a middle
// step while its K/V hop and the previous step's dK/dV hop fly; the last step while the previous dK/dV hop
// flies, then its own dK/dV hop home is exposed. The forward: each step but the last against its K/V hop.
double ring_layer_seconds(const PlanContext& c, const StrategyPlan& s, double tile_flops, double reorder) {
  const double kv_hop = static_cast<double>(2 * c.B * c.sl * c.hkv * c.D * c.E) / c.req.hardware.bandwidth;
  const double dkv_hop = static_cast<double>(2 * c.B * c.sl * c.hkv * c.D * 4) / c.req.hardware.bandwidth;
  const double per_tile = static_cast<double>(c.hq * c.B) * tile_flops / c.req.hardware.flops;
  double longest = 0;
  for (std::int64_t r = 0; r < c.cp; ++r) {
    double t = reorder;
    for (std::int64_t step = 0; step < c.cp; ++step) {
      const double fwd = static_cast<double>(s.tiles_per_rank_per_step[r][step]) * per_tile;
      const double bwd = fwd * kBackwardFlopsPerForward;
      const bool first = step == 0, last = step + 1 == c.cp;
      t += last ? fwd : std::max(fwd, kv_hop);
      if (c.cp == 1) {
        t += bwd;
      } else if (last) {
        t += std::max(bwd, dkv_hop) + dkv_hop;
      } else {
        t += std::max(bwd, first ? kv_hop : kv_hop + dkv_hop);
      }
    }
    longest = std::max(longest, t);
  }
  return longest;
}

// Time: tiles x a full tile's FLOPs, forward and backward (and the forward again under remat); communication
// at the profile's bandwidth, not overlapped except ring's hops.
void plan_time(const PlanContext& c, StrategyPlan& s) {
  const double tile_flops = attention_forward_flops(1, c.req.block, 1, c.D, false);
  const double passes = 1.0 + kBackwardFlopsPerForward + (c.req.remat ? 1.0 : 0.0);
  std::int64_t sent = 0, reorder_sent = 0;
  for (const auto& x : s.collectives) sent += x.bytes_sent_per_rank;
  for (const auto& x : s.reorder) reorder_sent += x.bytes_sent_per_rank;
  sent += reorder_sent;
  s.communication_seconds = static_cast<double>(sent) / c.req.hardware.bandwidth;
  double fastest = 1e300, slowest = 0;
  for (std::int64_t r = 0; r < c.cp; ++r) {
    const double t = static_cast<double>(s.tiles_per_rank[r]) * tile_flops * passes / c.req.hardware.flops;
    s.compute_seconds_per_rank.push_back(t);
    if (t > slowest) {
      slowest = t;
      s.straggler_rank = static_cast<int>(r);
    }
    fastest = std::min(fastest, t);
  }
  s.exposed_seconds = s.communication_seconds + (slowest - fastest);
  s.layer_seconds = slowest + s.communication_seconds;
  if (c.p.strategy == Strategy::ring) {
    s.layer_seconds =
        ring_layer_seconds(c, s, tile_flops, static_cast<double>(reorder_sent) / c.req.hardware.bandwidth);
    s.exposed_seconds = s.layer_seconds - fastest;
  }
  s.model_seconds = s.layer_seconds * static_cast<double>(c.req.model.attention_layers());
  s.model_bytes_sent_per_rank = sent * c.req.model.attention_layers();
}

StrategyPlan plan_strategy(const PlanRequest& req, const std::string& name, Strategy strategy,
                           bool load_balance) {
  PlanContext c{req, req.attention, req.parallel};
  c.p.strategy = strategy;
  c.p.load_balance = load_balance;
  c.p.layout.reset();
  StrategyPlan s;
  s.name = name;
  s.strategy = strategy;
  s.load_balance = load_balance;
  s.why_not = validation_errors(c.a, c.p);
  if (strategy == Strategy::ring && req.remat) {
    s.why_not.push_back(
        {{"remat"},
         "true",
         "remat means nothing for ring (its backward re-receives K/V); plan without --remat"});
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
  s.collectives = attention_collectives(c.a, c.p, req.remat, c.packed);
  plan_reorder(c, s);
  const UlyssesHeads heads =
      strategy == Strategy::ulysses ? ulysses_heads(c.hq, c.hkv, c.cp) : UlyssesHeads{};
  plan_tiles(c, heads, s);
  plan_memory(c, heads, s);
  plan_time(c, s);
  return s;
}

std::string fmt(double x) {
  std::ostringstream o;
  o.precision(3);
  o << x;
  return o.str();
}

}  // namespace

Plan make_plan(const PlanRequest& req) {
  if (req.block < 1) {
    throw Error(ErrorKind::invalid_config, "block", std::to_string(req.block),
                "block must be a positive tile size");
  }
  ParallelSpec general = req.parallel;
  general.strategy = Strategy::all_gather;
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
  Plan plan;
  for (Strategy strategy : kAllStrategies) {
    for (bool load_balance : {false, true}) {
      if (load_balance && strategy == Strategy::ulysses) continue;  // its work is already equal per head
      const std::string name = std::string(to_string(strategy)) + (load_balance ? "_load_balanced" : "");
      plan.strategies.push_back(plan_strategy(req, name, strategy, load_balance));
    }
  }

  const StrategyPlan* best = nullptr;
  for (const auto& s : plan.strategies) {
    if (s.possible && (best == nullptr || s.layer_seconds < best->layer_seconds)) best = &s;
  }
  std::ostringstream why;
  why << best->name << ": the shortest estimated attention layer (" << fmt(best->layer_seconds * 1e3)
      << " ms: " << fmt(best->communication_seconds * 1e3) << " ms of communication, tiles max/min "
      << fmt(best->tiles_skew) << ")";
  for (const auto& s : plan.strategies) {
    if (&s == best) continue;
    if (!s.possible) {
      why << "; " << s.name << " is impossible: " << s.why_not.front().message;
    } else {
      why << "; " << s.name << " " << fmt(s.layer_seconds * 1e3) << " ms (communication "
          << fmt(s.communication_seconds * 1e3) << " ms, tiles max/min " << fmt(s.tiles_skew) << ")";
    }
  }
  plan.recommendation = why.str();
  return plan;
}

}  // namespace cpattn
