// The parts of `cpattn run` (tools/cmd_run.cpp wires its flags to them):
//   batch.cpp    the batch source: a random document mix, --lengths or --npy-in -> check::Batch
//   check.cpp    the check: the single-process run of the whole batch and the comparison
//   report.cpp   the report: the JSON object and the table
//   cp_run.cpp   the distributed run: CP groups, the timed CP steps, gathering, the verdict
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/check/batch.hpp>
#include <cpattn/check/compare.hpp>
#include <cpattn/plan.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cpattn::cli::run_cmd {

struct RunArgs {
  std::vector<int64_t> lengths;
  int64_t seq_len = 4096;
  int heads = 8, kv_heads = 2, head_dim = 128, head_dim_qk = 0, head_dim_v = 0;
  std::string dtype = "fp32", mode = "runs", scheme = "allgather",  // scheme: a CpScheme's name or "all"
              mask = "causal", kernel_path = "automatic";  // canonical (vocab.hpp)
  std::string split = "padded";  // canonical (vocab.hpp)
  std::string overlap = "on";    // --overlap on|off (CpAttnConfig::overlap)
  std::string shared_memory = "on";  // --shared-memory on|off (CpAttnConfig::shared_memory)
  bool overlap_given = false, shared_memory_given = false;  // on the command line (the all-gather's flags)
  int threads = 1, repeats = 1;
  int cp = 0;  // 0: the MPI world size
  int cp_inner = 0;  // --cp-inner, --scheme hybrid only: all-to-all group size, dividing cp
  uint64_t seed = 1;
  float dropout = 0.0f;
  std::string window;   // --window LEFT,RIGHT (empty: unbounded)
  float softcap = 0.0f;  // --softcap (0: off)
  bool alibi = false;    // --alibi: slopes check::alibi_slopes(heads)
  std::optional<double> timeout;  // --timeout (unset: CPATTN_COMM_TIMEOUT_S, else 300 s)
  bool check_finite = true;       // --no-check-finite clears it
  double testing_stall_s = 0;     // hidden --testing-stall-s
  std::string npy_in, npy_out;
  bool json = false;
};

// ---- batch.cpp ----
// The global batch of the flags: --npy-in, else --lengths, else the mix of --seq-len from --seed;
// tensors from --seed.
check::Batch make_batch(const RunArgs& a);
// The batch's tokens and shape as the flags give them (without --npy-in), before it exists.
int64_t flag_tokens(const RunArgs& a);
check::BatchShape flag_shape(const RunArgs& a);
// The first non-finite element of q, k, v or dout is an error naming the tensor, its global
// token, head and dim (the default; --no-check-finite skips it).
void check_batch_finite(const check::Batch& b);

// ---- memory.cpp ----
struct RunMemory {  // bytes
  uint64_t batch = 0;      // every rank: the global q, k, v, dout
  uint64_t cp = 0;         // every rank: its local tensors and the CP layer (cp_memory_estimate)
  uint64_t results = 0;    // every rank: the results gathered in global order
  uint64_t reference = 0;  // rank 0: the single-process run of the whole batch
  uint64_t ranks_on_node = 1;
  uint64_t node_bytes() const;  // this node's ranks together, and rank 0's check
  std::string describe() const;
};
// `configs`: one per scheme run (--scheme all: several layers, each keeping its buffers, and
// each scheme's gathered results kept for the check); `longest`: the batch's longest document,
// whose queries size the single-process backward's per-task buffers.
RunMemory run_memory_estimate(int64_t tokens, int64_t longest, const check::BatchShape& s,
                              std::span<const CpAttnConfig> configs, int cp);
// cpattn::Error with both sizes when this node has less than run_memory_estimate's node_bytes().
void check_run_memory(int64_t tokens, int64_t longest, const check::BatchShape& s,
                      std::span<const CpAttnConfig> configs, int cp);

// ---- check.cpp ----
// A single-process run of the whole batch, made once for every scheme checked against it.
struct Reference {
  check::Results results;
  double seconds = 0;  // its wall time
};
Reference single_process_reference(const check::Batch& b, const AttnOptions& options);

struct RunCheck {
  std::vector<check::TensorReport> tensors;  // out, dq, dk, dv
  struct Worst {
    int64_t token = 0;  // global, of the real tokens
    int head = 0;
  };
  std::vector<Worst> worst;                 // per tensor: where its worst error (or first NaN) is
  double lse_max_abs = 0;                   // max |lse - ref| (lse is reported, not judged)
  bool pass = true;                         // every tensor passes its dtype's rule
  double worst_rel_l2() const;              // over the tensors
};
// The CP results `got` (fp32, global order) against the reference.
RunCheck check_against(const check::Batch& b, const Reference& ref, const check::Results& got);

// ---- report.cpp ----
struct RankFigures {  // medians over the timed steps, and memory
  // comm_s: exposed (waited); comm_total_s: in flight (CpStats::comm_total_s; 0: not measured)
  double compute_s = 0, comm_s = 0, comm_total_s = 0, step_s = 0, forward_s = 0, backward_s = 0, peak_rss_mb = 0, peak_buffer_mb = 0;
  double bytes_sent = 0, bytes_received = 0;  // CpStats (counted by the communicators), one forward+backward step
  // comm_s by part (CpStats::agree_s, first_kv_s, later_kv_s, dkv_s) and comm_s itself: means
  // over the steps (the parts add up to comm_mean_s)
  double agree_s = 0, first_kv_s = 0, later_kv_s = 0, dkv_s = 0, comm_mean_s = 0;
  // Of the last step's calls (a forward and a backward), those whose K/V or dK/dV went through
  // the node's shared memory (CpStats::shared_forwards + shared_backwards).
  double shared_calls = 0, calls = 0;
};
// One scheme's run: its check and every rank's figures.
struct SchemeResult {
  std::string scheme;  // to_string(CpScheme)
  RunCheck check;
  std::vector<RankFigures> ranks;
  std::string shared_memory_off;  // rank 0's CpStats::shared_memory_off: why shared memory was given up, or ""
};
struct RunReport {
  const RunArgs& args;
  std::string kernel_path;  // the path that ran
  int cp = 1, cp_groups = 1;
  double timeout_s = 0;  // the collectives' deadline in effect (--timeout, CPATTN_COMM_TIMEOUT_S or 300)
  const check::Batch& batch;
  BalanceReport balance;
  double single_process_s = 0;
  std::vector<SchemeResult> schemes;  // one, or every scheme for --scheme all
  bool pass() const;                  // every scheme passed its check
};
nlohmann::json report_json(const RunReport& r);
void print_report(const RunReport& r);  // the table, to stdout
// --npy-out: out, lse, dq, dk, dv (fp32, real tokens in global order) to `dir`.
void write_results(const std::string& dir, const check::Batch& b, const check::Results& got);

// ---- cp_run.cpp ----
// The whole command inside MPI: true when every CP group passed its check. Errors that every
// rank shares end the program with exit code 2 (ExitCode).
bool run_distributed(const RunArgs& a);

}  // namespace cpattn::cli::run_cmd
