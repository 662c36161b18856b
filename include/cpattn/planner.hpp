// The planner: what each strategy moves, how balanced it is, what it holds and what it costs, computed from a
// model description without running anything. It shares its sources of truth with what runs: head placement
// (placement.hpp), sequence layouts (sequence_layout.hpp), the kernel's tile classification, the collective
// accounting (collective_cost) and the reorder's permutations.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpattn/collectives.hpp"
#include "cpattn/config.hpp"

namespace cpattn {

struct ModelShape {
  std::string name;
  std::int64_t emb_dim = 0;  // width of the activations the reorder moves
  std::int64_t num_layers = 1;
  std::int64_t attention_every = 1;  // full attention on every N-th layer (layers N-1, 2N-1, ...)
  // Sliding-window layers (Gemma 2 and 3, gpt-oss, Mistral): of the attention layers, every global_every-th
  // is global (the request's attention) and the others local, the request's attention with window_left =
  // local_window (and window_right too without the causal mask). Unset: every attention layer is global.
  std::optional<std::int64_t> local_window;
  std::int64_t global_every = 1;
  std::int64_t attention_layers() const { return num_layers / attention_every; }
  std::int64_t global_layers() const {
    return local_window ? attention_layers() / global_every : attention_layers();
  }
  std::int64_t local_layers() const { return attention_layers() - global_layers(); }
  // Other layers (GDN, ...) need contiguous order when not every layer is attention.
  bool other_layers_need_contiguous_order() const { return attention_every > 1; }
};

struct ModelPreset {
  ModelShape model;
  std::int64_t num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
};
const std::vector<ModelPreset>& model_presets();
const ModelPreset* find_preset(const std::string& name);
std::string model_preset_names();  // "llama3-8b, ...", for messages and --help

// One measured kernel rate: what the flash kernel achieves on calls of one shape, in FLOP/s counted as the
// planner counts them (computed tiles x 4·block²·D per q head, the profile's block), forward and backward
// (the backward's 2.5x FLOPs over its time). Per device, or per core where the profile's `cores` is set.
struct KernelRate {
  DType dtype = DType::bf16;
  std::int64_t head_dim = 0, q = 0, kv = 0;  // the call's extents: query rows, key rows
  bool causal = false;
  double forward = 0, backward = 0;
};

// Ranks sit on hosts of ranks_per_host consecutive ranks (rank r on host r / ranks_per_host): a rank sends to
// a rank of its own host at `bandwidth` and to another host's at `inter_bandwidth`, both links at once.
// Inside a host, devices may sit behind switches of ranks_per_switch consecutive ranks (PCIe): what leaves a
// switch for the rest of the host shares its uplink (`switch_bandwidth`) with the switch's other devices.
// Every message costs a latency (`latency`, `inter_latency` across hosts) on top of its bytes.
struct HardwareProfile {
  std::string name;
  double flops = 0;  // dense FLOP/s per device: the kernel's rate where `kernel` has no entry for the dtype
  double bandwidth = 0;  // bytes/s one device sends to its peers inside its host (each way)
  std::string source;
  std::int64_t ranks_per_host = 0;    // 0: every rank on one host
  double inter_bandwidth = 0;         // bytes/s one device sends to other hosts (each way)
  double latency = 0;                 // seconds per message inside a host
  double inter_latency = 0;           // seconds per message between hosts (0: `latency`)
  std::int64_t ranks_per_switch = 0;  // 0: every pair inside a host at `bandwidth` at once (NVLink switch)
  double switch_bandwidth = 0;        // bytes/s a switch's uplink carries each way, shared by its devices
  // bytes/s of an all-to-all's traffic across a switch's uplink (with switches), else one device's in an
  // all-to-all inside its host: NCCL's all-to-all over PCIe runs far below the links' rate (0: their rate)
  double all_to_all_bandwidth = 0;
  // A host's devices in sockets of ranks_per_socket consecutive ranks (each a CPU's PCIe root, its switches
  // below it): what a socket's devices send to the host's other sockets shares socket_bandwidth, an
  // all-to-all's share at socket_all_to_all_bandwidth (0: socket_bandwidth), each message to another socket
  // at socket_latency (0: `latency`).
  std::int64_t ranks_per_socket = 0;  // 0: one socket
  double socket_bandwidth = 0;
  double socket_all_to_all_bandwidth = 0;
  double socket_latency = 0;
  double ring_step_seconds = 0;  // a ring step's synchronisation: the wait for the hop, the next call
  // bytes/s of device memory (per core with `cores`) for the work a ring step does outside its kernel calls
  // (folding each call's output into the running one; in the backward summing dQ, dK and dV); 0: unpriced
  double memory_bandwidth = 0;
  double merge_bytes = 12;  // bytes moved per output element folded (cpattn: read the call's fp32 O, read
                            // and write the running fp32 O)
  double accumulate_bytes = 12;  // bytes moved per gradient element summed (dQ, dK, dV; cpattn: fp32 +=)
  double call_seconds = 0;       // a kernel call's fixed cost (launch, setup)
  // A logit soft-cap's kernel time as a multiple of the same call's without (a tanh per score; cpattn's CPU
  // kernel on the Zen 5 guest: fp32 1.20 forward, 1.13 backward; bf16 1.13, 1.07); 1: not priced.
  double softcap_forward = 1, softcap_backward = 1;
  std::int64_t cores = 0;          // ranks share this many cores (CPU; rates per core); 0: a device per rank
  std::int64_t block = 0;          // the tile size the rates count in (0: the request's)
  std::vector<KernelRate> kernel;  // measured rates by call shape (interpolated); empty: `flops`

  // The kernel's rate (FLOP/s, forward or backward) on a call of `dtype`, head dim, query and key extents:
  // among the entries of the dtype (and of the call's causality where there are both), those of one head dim
  // weighted by inverse squared distance in log2(q, kv) (an entry's own shape gets its rate), between two
  // head dims geometric in log2(head_dim), beyond them the nearest; `flops` where there is none.
  double kernel_rate(DType dtype, std::int64_t head_dim, std::int64_t q, std::int64_t kv, bool causal,
                     bool backward) const;
};
// The profiles compiled in: the YAML files of src/plan/profiles (a100, h100, h200, h800, l20-pcie, tpu-v7x),
// each figure with its source.
const std::vector<HardwareProfile>& hardware_profiles();
const HardwareProfile* find_hardware(const std::string& name);
std::string hardware_profile_names();  // "a100, h100, ..."
// A profile from YAML text (`where` names it in errors) or a file (`plan --profile FILE`): keys name, flops,
// bandwidth, source (required), ranks_per_host, inter_bandwidth (required where ranks_per_host > 0), latency,
// inter_latency, ranks_per_switch, switch_bandwidth (required with ranks_per_switch), all_to_all_bandwidth,
// ring_step_seconds, memory_bandwidth, merge_bytes, accumulate_bytes, softcap_forward, softcap_backward,
// call_seconds, cores, block, kernel (a list of {dtype, head_dim, q, kv, causal, forward, backward}); unknown
// or repeated keys and values out of range are Error(invalid_input) naming the file and the key.
// `profile_yaml` writes a profile that parse_hardware_profile reads back to the same figures.
HardwareProfile parse_hardware_profile(const std::string& text, const std::string& where);
HardwareProfile read_hardware_profile(const std::string& path);
std::string profile_yaml(const HardwareProfile& profile);

struct PlanRequest {
  AttentionSpec attention;
  ParallelSpec parallel;  // cp and tp are used; the strategies are all planned
  ModelShape model;
  std::int64_t block = 512;            // square tiles Bq = Bk
  std::vector<std::int64_t> segments;  // packed document lengths (sum S), empty: one document
  bool remat = false;
  // Prefill: the forward alone (its collectives and compute; nothing kept for a backward). Not with remat.
  bool forward_only = false;
  HardwareProfile hardware;
};

struct StrategyPlan {
  // all_gather, all_gather_load_balanced, ulysses, ring, ring_load_balanced, hybrid_u<U>_r<R>[_load_balanced]
  std::string name;
  Strategy strategy = Strategy::all_gather;
  bool load_balance = false;
  // The shards' layout: contiguous, dual_chunk_swap (load_balance), or on packed rows per_document and solver
  // (cut by the request's segments) for the strategies that shard the sequence.
  ShardLayout layout = ShardLayout::contiguous;
  // U and R: hybrid's; ulysses U = cp, R = 1; ring U = 1, R = cp; all_gather 0 and 0 (neither).
  std::int64_t ulysses_degree = 0, ring_degree = 0;
  bool possible = true;
  std::vector<ErrorItem> why_not;  // the validation errors when not possible
  // One attention layer, in the accounting of collectives.hpp (the strategy's schedule; hybrid: each field
  // the largest over ranks, whose rings move different kv heads when the heads split unevenly).
  std::vector<CollectiveRecord> collectives;
  // Of what one rank sends for one layer, the part that leaves its host (the largest over ranks).
  std::int64_t inter_host_bytes_sent_per_rank = 0;
  // The reorder permutes around one attention layer (load balance with contiguous-order neighbours).
  std::vector<CollectiveRecord> reorder;
  std::vector<std::int64_t> tiles_per_rank_per_q_head;  // per rank, one q head (ulysses: a local head)
  std::vector<std::vector<std::int64_t>> tiles_per_rank_per_step;  // ring: per rank, per step, one q head
  std::vector<std::int64_t> tiles_per_rank;                        // per rank, every local head and batch row
  double tiles_skew = 1.0;                                         // max / min over ranks
  std::int64_t memory_bytes_per_rank = 0;     // saved for backward by one attention layer
  std::int64_t kv_buffer_bytes_per_rank = 0;  // the K/V the kernel reads while it runs
  // Estimates for one attention layer (seconds). No overlap of communication with compute is assumed, except
  // for the ring's (ring, hybrid), whose next hop is in flight while a step computes: per step
  // max(compute, transfer). A collective takes max(bytes to its host / bandwidth, bytes to other hosts /
  // inter_bandwidth) on its slowest rank.
  std::vector<double> compute_seconds_per_rank;
  int straggler_rank = 0;
  double communication_seconds = 0;  // attention collectives + reorder
  double exposed_seconds = 0;        // communication + waiting for the straggler
  double layer_seconds = 0;          // straggler compute + communication
  // layer_seconds x global attention layers, plus the local layers' (local) where the model has them.
  double model_seconds = 0;
  std::int64_t model_bytes_sent_per_rank = 0;
  // The same strategy on the model's local (sliding-window) layers, planned as one of them; null where the
  // model has none.
  std::shared_ptr<const StrategyPlan> local;
};

// The name of hybrid's plan at U x R: hybrid_u<U>_r<R>, with _load_balanced.
std::string hybrid_name(std::int64_t ulysses_degree, std::int64_t ring_degree, bool load_balance);
// A plan's name for a strategy (hybrid: at U x R) in a layout: <strategy> for contiguous, with
// _load_balanced for dual_chunk_swap, _per_document or _solver for the layouts cut by documents.
std::string plan_name(Strategy strategy, std::int64_t ulysses_degree, std::int64_t ring_degree,
                      ShardLayout layout);

struct Plan {
  std::vector<StrategyPlan> strategies;
  std::string recommendation;
  std::size_t recommended = 0;  // the index in strategies of the shortest estimated layer
  // With local (sliding-window) layers: the shortest local layer's (each kind of layer runs the strategy that
  // suits it: every layer has its own ContextParallelAttention).
  std::optional<std::size_t> recommended_local;
};

// The collectives one attention layer issues (forward, remat, backward; `forward_only`: the forward's alone),
// aggregated by (kind, phase, group) in issue order, each field the largest over ranks; `documents`: the
// row's document lengths on a packed row (every batch row's; empty: one document, no segment ids): segment
// ids are exchanged too, and the all_gather moves each rank the key blocks of its documents; `block`: the
// kernel's kv block (a windowed or packed all_gather moves whole blocks of it).
std::vector<CollectiveRecord> attention_collectives(const AttentionSpec& attention,
                                                    const ParallelSpec& parallel, bool remat,
                                                    const std::vector<std::int64_t>& documents,
                                                    bool forward_only = false, std::int64_t block = 64);

// Validates the request's general rules first (Error(invalid_config), as validate does); a strategy whose own
// rules fail is planned as not possible, with the reasons.
Plan make_plan(const PlanRequest& request);

}  // namespace cpattn
