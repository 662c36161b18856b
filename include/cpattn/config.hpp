// What a user asks for: the attention problem (AttentionSpec) and how it is split over ranks (ParallelSpec),
// and the rules that say whether the pair can run (validate). Every rule is in docs/design.md, "Validation".
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cpattn/error.hpp"
#include "cpattn/mask.hpp"
#include "cpattn/strategy.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn {

// How the caller's sequence shards are laid out (sequence_layout.hpp, SequenceLayout, has each as data):
// contiguous (rank r holds [r*S/cp, (r+1)*S/cp)), dual_chunk_swap (2*cp chunks; rank r holds chunks r and
// 2*cp-1-r), per_document (the dual chunk swap of every document of the packed row) or solver (chunks dealt
// to ranks by their cost under the mask). Each rank holds S/cp tokens in every layout.
enum class ShardLayout { contiguous, dual_chunk_swap, per_document, solver };

inline constexpr ShardLayout kShardLayouts[] = {ShardLayout::contiguous, ShardLayout::dual_chunk_swap,
                                                ShardLayout::per_document, ShardLayout::solver};

// The chunks of equal length a layout needs a row's length to be a multiple of at cp ranks: 2*cp (dual
// chunk swap), else cp (every rank holds S/cp tokens).
constexpr std::int64_t layout_chunks(ShardLayout layout, std::int64_t cp) {
  return layout == ShardLayout::dual_chunk_swap ? 2 * cp : cp;
}
// The solver layout's chunk (sequence_layout.hpp): the largest divisor of n = S/cp at most
// max(min(512, n/16), n/64), so that each rank deals 16 to 64 chunks where n allows, of 512 tokens where that
// is within them; 1 at the least. Validation refuses a solver layout whose chunk leaves a rank more than
// kMostSolverChunks of them (seq_len / cp without a divisor near that bound: each chunk may be a run of its
// own, and the ring calls the kernel for each pair of runs).
inline constexpr std::int64_t kMostSolverChunks = 128;
constexpr std::int64_t solver_chunk(std::int64_t seq_len, std::int64_t cp) {
  const std::int64_t n = cp > 0 ? seq_len / cp : 0;
  const std::int64_t small = n / 16 < 512 ? n / 16 : 512;
  const std::int64_t most = small > n / 64 ? small : n / 64;
  for (std::int64_t c = most; c > 1; --c) {
    if (n % c == 0) return c;
  }
  return 1;
}

// Whether the layout depends on the row's documents and mask (per_document, solver).
constexpr bool layout_reads_documents(ShardLayout layout) {
  return layout == ShardLayout::per_document || layout == ShardLayout::solver;
}

const char* to_string(Strategy strategy);
const char* to_string(ShardLayout layout);
Strategy parse_strategy(const std::string& text, const std::string& field = "strategy");
ShardLayout parse_layout(const std::string& text, const std::string& field = "layout");

// The largest head dim the kernels take (their accumulators live on the stack per row).
inline constexpr std::int64_t kMaxHeadDim = 512;
// The most q or kv heads a problem may have: far above any model (Qwen3.5-397B-A17B has 32), low enough that
// a placement, a plan or a head loop over them is bounded.
inline constexpr std::int64_t kMaxHeads = 65536;
// The most ranks in a group (cp, tp): far above any deployment, low enough that a placement or a plan with
// an entry per rank is bounded.
inline constexpr std::int64_t kMaxRanks = 65536;

// The softmax scales the kernels take: they hold the scale (times log2 e) in fp32, where 1e300 would be
// infinite and every output NaN; far wider than any model's (1/sqrt(head_dim), a soft-capped logit's).
inline constexpr double kMinScale = 1e-30;
inline constexpr double kMaxScale = 1e30;
// The widest side of a sliding window (--window LEFT,RIGHT): positions are int32, so a side of 2^31 - 1 or
// more sees the whole row.
inline constexpr std::int64_t kMaxWindowSide = (std::int64_t{1} << 31) - 1;
// The soft-caps the kernels take: finite and positive, from a cap that hides nearly every logit's difference
// (tanh saturates) to one past any logit (no effect); Gemma 2 uses 50 (attention) and 30 (final logits).
inline constexpr double kMinSoftcap = 1e-6;
inline constexpr double kMaxSoftcap = 1e30;
// The most kernel threads per rank (the program's --threads, Python's threads=): above any machine's cores,
// low enough that a pool of them can be made.
inline constexpr std::int64_t kMaxThreads = 1024;

struct AttentionSpec {
  std::int64_t batch = 1;
  std::int64_t seq_len = 0;  // S: tokens of one whole (packed) row, over all ranks
  std::int64_t num_q_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  bool causal = true;
  DType dtype = DType::f32;
  std::optional<double> softmax_scale;  // default 1/sqrt(head_dim)
  // Sliding window (flash-attention's window_size): a query at position p sees keys p - window_left ..
  // p + window_right, within its document; unset: no bound on that side. Causal attention takes window_left
  // only (its right side is 0): the YAML's sliding_window_size W is window_left = W - 1.
  std::optional<std::int64_t> window_left, window_right;
  // Logit soft-capping (Gemma 2): logits x become softcap * tanh(x / softcap) before the softmax; unset:
  // none. The YAML's attn_logits_soft_cap.
  std::optional<double> softcap;
  // Attention sinks (gpt-oss): one logit per q head in the softmax's denominator, with no value; their values
  // come with each forward (ContextParallelAttention::forward's `sinks`), their gradient with its backward.
  bool sinks = false;

  double scale() const;
  bool windowed() const { return window_left.has_value() || window_right.has_value(); }
  // The positions a query sees (causal and window together), and the mask over the given token metadata.
  PositionBand band() const;
  AttentionMask mask(std::span<const std::int32_t> q_positions, std::span<const std::int32_t> kv_positions,
                     std::span<const std::int32_t> q_segments,
                     std::span<const std::int32_t> kv_segments) const;
  std::int64_t group_size() const { return num_q_heads / num_kv_heads; }  // G = Hq / Hkv
};

struct ParallelSpec {
  std::int64_t cp = 1;
  Strategy strategy = Strategy::all_gather;
  bool load_balance = false;
  std::optional<ShardLayout> layout;  // default: dual_chunk_swap with load balance, else contiguous
  // The packed row's document lengths (summing to seq_len; empty: one document) that the per_document and
  // solver layouts cut the row by. The same on every rank; the other layouts do not read them. The segment
  // ids each forward takes are the masks'; documents only decide who holds which tokens.
  std::vector<std::int64_t> documents;
  // The band the solver layout costs its chunks by; unset: the attention's own. Layers whose windows differ
  // (a model's local and global layers) hold their tokens in one layout only if they cost it alike: give the
  // local layers the global layers' band here.
  std::optional<PositionBand> layout_band;
  std::int64_t tp = 1;  // tensor parallel degree over heads
  // hybrid: U, the size of each ulysses group (rank c = ring_rank * U + ulysses_rank); the ring has
  // R = cp / U ranks. 0 (unset) for the other strategies.
  std::int64_t ulysses_degree = 0;

  StrategyTraits traits() const { return strategy_traits(strategy); }
  // The rank decomposition, one source for every strategy: the heads are split over groups of
  // head_group_size() ranks (ulysses: cp; hybrid: U; 1 where no strategy splits them), rank c being
  // ulysses_rank(c) = c mod that in its group; K/V go round rings of ring_degree() ranks (ring: cp; hybrid:
  // R = cp / U; 1 where nothing goes round), rank c being ring_rank(c) = c / head_group_size() in its ring.
  std::int64_t head_group_size() const;
  std::int64_t ring_degree() const;
  std::int64_t ulysses_rank(std::int64_t rank) const { return rank % head_group_size(); }
  std::int64_t ring_rank(std::int64_t rank) const { return rank / head_group_size(); }
  ShardLayout effective_layout() const {
    return layout.value_or(load_balance ? ShardLayout::dual_chunk_swap : ShardLayout::contiguous);
  }
};

// The hybrid's sub-communicators, as schedules and reports name them.
inline constexpr const char* kUlyssesGroup = "ulysses";
inline constexpr const char* kRingGroup = "ring";

// remat with a strategy that has nothing to recompute (StrategyTraits::remat false): the error, naming the
// strategy; else none.
std::optional<ErrorItem> remat_refusal(Strategy strategy, bool remat);

// Every rule the pair breaks, all at once (empty when valid).
std::vector<ErrorItem> validation_errors(const AttentionSpec& attention, const ParallelSpec& parallel);
// Throws Error(invalid_config) with every broken rule.
void validate(const AttentionSpec& attention, const ParallelSpec& parallel);

}  // namespace cpattn
