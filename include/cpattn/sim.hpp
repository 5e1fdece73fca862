// The calibrated simulator (docs/simulate.md): predicts, without running anything, what every CP
// scheme costs for a packed batch on a mesh and a machine. Pure functions, no MPI.
//
// Per-rank work comes from the planner (balance_report: the same per-rank visible-pair counts
// `cpattn plan` prints), and per-rank bytes from the schemes' exact transfer pattern
// (docs/cp.md): the simulator's bytes equal what CpStats::bytes_sent/bytes_received count
// (tests/sim/test_sim_bytes.cpp runs the real schemes to hold it). The time model is a
// latency + bytes / bandwidth cost per transfer on the link class it crosses, and per scheme
// the overlap the implementation has by default (the all-gather and all-to-all schemes overlap
// nothing unless SimInput::overlap; the ring and pass-Q overlap each step's transfer with its
// compute). SimInput::overlap models CpAttnConfig::overlap (the all-gather's KV-head groups
// and groups of documents, on by default as in CpAttnConfig): its time for the all-gather
// scheme, its buffers for the all-gather and the hybrid's outer all-gather (docs/simulate.md
// "Overlap").
//
//   cpattn::SimInput in{.cu_seqlens = cu, .model = {.num_heads_q = 32, .num_heads_k = 8},
//                       .mesh = {.cp = 8}, .profile = profile};
//   cpattn::SimReport rep = cpattn::simulate_step(in);   // one SchemePrediction per scheme
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/cp_scheme.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/pipeline.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {

// One link class between two ranks: intra-node (NVLink, shared memory) or inter-node (NIC).
struct SimLink {
  double bandwidth_gbs = 0;  // GB/s (1e9 bytes/s) one rank sends (and receives) at, > 0
  double latency_us = 0;     // microseconds per message, >= 0
};

// What a rank of the machine can do. Compute rates are of the attention kernels, counted as
// attention_flops() counts them, by direction and storage dtype (indexed by DType: f32, f16,
// bf16); 0 means unknown (the simulator then refuses that dtype, naming the field).
struct MachineProfile {
  std::string name;
  std::array<double, 3> fwd_gflops = {0, 0, 0};  // GFLOP/s per rank, forward kernel
  std::array<double, 3> bwd_gflops = {0, 0, 0};  // GFLOP/s per rank, backward kernel
  SimLink intra;                                 // between ranks of one node
  SimLink inter;                                 // between nodes
  int ranks_per_node = 1;                        // >= 1
  double memory_gb = 0;                          // per rank, > 0 (GB = 1e9 bytes)
  // The CP layer's own work beyond the kernels (copies into and out of the gathered buffers,
  // conversions, merges, fingerprints, smaller kernel tasks), as a fraction of the same call's
  // kernel time, by storage dtype (indexed by DType) and scheme (indexed by CpScheme, as
  // kCpSchemes): a call's compute_s = kernel time x (1 + overhead). cpattn calibrate measures
  // it (docs/simulate.md); 0, the default and what a profile leaving it out means, prices the
  // kernels alone. Finite and >= 0.
  std::array<std::array<double, 5>, 3> fwd_overhead = {};
  std::array<std::array<double, 5>, 3> bwd_overhead = {};
};
static_assert(std::size(kCpSchemes) == 5, "MachineProfile::*_overhead has one entry per scheme");
// Throws cpattn::Error naming the first bad field (profile.<field>) and the rule it breaks.
void check_machine_profile(const MachineProfile& p);

struct SimModel {
  int layers = 1;          // attention layers of the whole model, >= 1, a multiple of mesh.pp
  int num_heads_q = 8;     // Hq, a multiple of num_heads_k and of mesh.tp
  int num_heads_k = 2;     // Hkv, a multiple of mesh.tp
  int head_dim_qk = 128;   // Dqk
  int head_dim_v = 128;    // Dv
  int hidden = 0;          // model width for the pipeline's activations and TP's all-reduces; 0: Hq * Dv
  DType dtype = DType::bf16;
  MaskType mask = MaskType::causal;  // causal or none
  int experts = 0;         // MoE experts per layer (0: dense), a multiple of mesh.ep
  int top_k = 1;           // experts per token, 1 <= top_k <= experts
  double expert_skew = 0;  // router skew: expert e receives a share proportional to 1 / (e + 1)^skew
};

struct SimMesh {
  int tp = 1;        // tensor parallel: divides the heads; the fastest mesh axis (docs/mesh.md)
  int cp = 1;        // context parallel, 1 .. 65536
  int cp_inner = 0;  // hybrid's all-to-all group; 0: the largest divisor of cp within a node
  int dp = 1;        // data parallel replicas (identical: planned once)
  int pp = 1;        // pipeline stages
  int ep = 1;        // expert parallel (over the tp*cp*dp ranks of a stage)
  int micro = 1;     // micro-batches per step (each one the batch of cu_seqlens)
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  // Model chunks per stage (V) of the interleaved schedule, whose layers must divide into pp x V;
  // 0: 2 with interleaved (as `cpattn pipeline --virtual`), else 1. Only interleaved takes V > 1.
  int virtual_stages = 0;
  int world() const { return tp * cp * dp * pp; }
  int chunks() const { return virtual_stages > 0 ? virtual_stages : schedule == PipelineSchedule::interleaved ? 2 : 1; }
};
// Throws cpattn::Error naming the field (SimMesh::cp_inner, SimModel::num_heads_k, ...) and the
// rule (`cpattn simulate` names its flags instead).
void check_sim_mesh(const SimMesh& mesh, const SimModel& model);

// Bytes one rank sends and receives, by link class.
struct SimBytes {
  int64_t sent_intra = 0, sent_inter = 0;
  int64_t received_intra = 0, received_inter = 0;
  int64_t sent() const { return sent_intra + sent_inter; }
  int64_t received() const { return received_intra + received_inter; }
};

// One CP attention call (forward or backward) on one rank.
struct SimCall {
  double compute_s = 0;      // kernel time plus overhead_s
  double overhead_s = 0;     // of compute_s, the CP layer's own work (MachineProfile::*_overhead)
  double exposed_s = 0;      // communication the rank waits on
  double hidden_s = 0;       // communication overlapped with compute
  SimBytes payload;          // what CpStats::bytes_sent/bytes_received count for the call
  SimBytes agreement;        // the ranks' agreement all-gather before it (not in CpStats)
  double time_s() const { return compute_s + exposed_s; }
};

struct SchemePrediction {
  CpScheme scheme = CpScheme::allgather;
  int cp_inner = 0;       // hybrid: the all-to-all group used
  bool valid = true;      // false when the scheme cannot run this shape (heads, cp)
  std::string reason;     // why not, when !valid
  // Per CP rank (index = CP rank), one attention layer, one micro-batch, of the CP group whose
  // slowest rank is slowest (groups differ where their node boundaries fall differently, e.g.
  // cp 3 on nodes of 4 ranks): its CP index i is world rank cp_group_offset + tp i, modulo
  // ranks_per_node (the offset's residue is all that decides its links).
  std::vector<SimCall> forward, backward;
  std::int64_t cp_group_offset = 0;
  // The step: every layer of a stage, every micro-batch, the pipeline around them.
  double step_s = 0;          // predicted step time (the slowest rank, pipeline included)
  double compute_s = 0;       // of the step, on the slowest stage
  double exposed_comm_s = 0;  // CP, TP and EP communication waited on
  double hidden_comm_s = 0;   // communication overlapped with compute
  double bubble_s = 0;        // pipeline idle time on the busiest stage
  double bubble_fraction = 0; // pipeline simulate()'s bubble fraction
  double expert_imbalance = 1;  // max / mean tokens per EP rank (1 without experts)
  SimBytes step_bytes;        // per rank and step, CP + TP + EP + pipeline, of the busiest CP rank
                              // (the most bytes sent + received; not always the slowest one)
  double peak_memory_gb = 0;  // attention activations and buffers per rank (docs/simulate.md)
  bool fits_memory = true;    // peak_memory_gb <= profile.memory_gb
  // Where CP stops paying: the fastest power-of-two CP below mesh.cp when one is predicted
  // faster than mesh.cp (0: none), and the scale of every document length / of both links'
  // bandwidth at which cp / 2 and cp cost the same (below it the smaller CP is faster; 0 when
  // there is no crossing within 1/256..256, or cp is odd or 1). The length sweep stops below
  // 256 where the scaled documents' attention pairs would overflow int64 (very long documents).
  // Smaller CP sizes the mesh cannot take (check_sim_mesh, e.g. ep not dividing tp x cp x dp)
  // are never faster.
  int faster_smaller_cp = 0;
  double breakeven_length_scale = 0;
  double breakeven_bandwidth_scale = 0;
};

struct SimInput {
  std::span<const int64_t> cu_seqlens;  // one micro-batch of one CP group, real boundaries
  SimModel model;
  SimMesh mesh;
  MachineProfile profile;
  bool find_breakeven = true;  // the sweeps of SchemePrediction::breakeven_*
  // CpAttnConfig::overlap: the all-gather runs per group of KV heads (overlap_kv_groups of the
  // KV heads per TP rank), the forward's first and the backward's last also per group of
  // documents where the batch has a cut (overlap_document_cut), the later units' K/V and the
  // earlier units' dK/dV in flight under the kernel calls (docs/simulate.md). false: one
  // gather, one kernel call, one reduce-scatter.
  bool overlap = true;
};

struct SimReport {
  std::vector<SchemePrediction> schemes;  // in kCpSchemes' order
  CpScheme best = CpScheme::allgather;    // the valid scheme with the smallest step_s
  int64_t tokens = 0, padded_tokens = 0;
  double imbalance = 1;                   // the planner's max / mean visible pairs over CP ranks
  std::vector<int64_t> visible_pairs;     // [cp] the planner's per-rank work
};

// Every scheme's prediction. Throws cpattn::Error for a bad profile, mesh, model or batch.
SimReport simulate_step(const SimInput& in);
// One scheme (cp_inner for hybrid; 0 picks as SimMesh::cp_inner says).
SchemePrediction simulate_scheme(const SimInput& in, CpScheme scheme);

// FLOPs of attention over `pairs` visible (query, key) pairs and `heads` query heads:
// forward 2 * (Dqk + Dv) per pair and head (S = QK^T, O = PV); backward 2 * (3 Dqk + 2 Dv)
// (S again, dV, dP, dQ, dK). calibrate counts the same way.
double attention_flops(int64_t pairs, int heads, int head_dim_qk, int head_dim_v, bool backward);

// Named length distributions for --distribution: `count` documents (or until `tokens` are
// reached, the last one cut), deterministic in `seed`. fixed: all `mean`; uniform: [1, 2*mean-1];
// lognormal: exp(N(log(mean) - sigma^2/2, sigma)), at least 1. Returns cu_seqlens.
std::vector<int64_t> sim_lengths(std::string_view distribution, int64_t tokens, double mean, double sigma,
                                 uint64_t seed);
// About how many documents sim_lengths makes for `tokens` of mean length `mean`, before it runs
// (every distribution's mean length is `mean`; x 1.25 + 64 for the draw, at most `tokens`):
// for a memory budget. 1 for arguments sim_lengths refuses (its own error then names them).
int64_t sim_lengths_documents(int64_t tokens, double mean);
// What simulate_step allocates for a batch of `documents` documents at SimMesh::cp = `cp` (clamped to
// [1, 65536]), in bytes, an upper estimate: the planner's chunk table at the largest CP size
// (documents x 2cp chunks, each CP size planned in turn), the length sweep's scaled copies of
// the boundaries, the per-rank work of every CP size kept and the predictions' per-rank calls.
// The caller's cu_seqlens (documents + 1 int64) is not in it.
uint64_t sim_memory_bytes(int64_t documents, int cp);

}  // namespace cpattn
