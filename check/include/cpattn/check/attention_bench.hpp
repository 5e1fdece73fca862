// The attention benchmark behind `cpattn bench attention`: check one case against the float64
// reference (problem.hpp, tolerance.hpp), then time forward and backward and set them against
// this core's FMA peak measured in the same run. No MPI, no command line: tools/cmd_bench.cpp
// maps its flags onto AttnBenchOptions and prints AttnBenchResult.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace cpattn::check {

struct AttnBenchOptions {
  std::vector<int64_t> lengths{8192};  // document lengths (queries = keys per document)
  int heads = 16;                      // num_heads_q
  int kv_heads = 4;                    // num_heads_k
  int head_dim = 128;                  // head_dim_qk
  int head_dim_v = 0;                  // 0: same as head_dim
  DType dtype = DType::f32;
  int threads = 1;
  MaskType mask = MaskType::causal;
  int64_t window_left = -1, window_right = -1;  // AttnOptions' window (-1 = unbounded)
  float softcap = 0.0f;                         // 0 = off
  bool alibi = false;                           // slopes alibi_slopes(heads)
  int repeats = 3;  // timed runs of each direction (median reported), after one warm-up
  KernelPath path = KernelPath::automatic;
  bool fail_check_for_testing = false;  // corrupt one lse value before the check (tests exit codes)
};

// The result does not match the float64 reference (a failed check, not bad input: the
// command line exits 1 on it, 2 on any other cpattn::Error).
struct CheckFailed : Error {
  using Error::Error;
};

struct AttnBenchResult {
  AttnBenchOptions opt;
  std::string path;            // the path that ran
  std::string path_reason;     // why it ran (resolve_kernel_path's KernelChoice::reason)
  bool path_forced_by_env = false;
  double fwd_flops = 0, bwd_flops = 0;
  double fwd_seconds = 0, bwd_seconds = 0;  // medians
  double fwd_gflops = 0, bwd_gflops = 0;
  double fma_peak_gflops = 0;               // one core, fp32 FMA, measured in this run
  // The same per second of process CPU time (all threads): on a shared machine, where other
  // work takes turns on the cores, these ratios show the kernel's own efficiency.
  double fwd_cpu_seconds = 0, bwd_cpu_seconds = 0;
  double fwd_gflops_per_cpu_s = 0, bwd_gflops_per_cpu_s = 0, fma_peak_gflops_per_cpu_s = 0;
  std::optional<double> amx_peak_gflops;    // one core, bf16 tiles (TDPBF16PS); absent: see amx_absent_reason
  std::string amx_absent_reason;
  double check_max_rel_err = 0;  // worst ||diff||/||ref|| of the checked outputs
  std::string check_scope;       // what the check covered
};

// fp32 FMA peak of one core (12 independent accumulator chains on the widest vectors the CPU
// runs: zmm with AVX-512, ymm with AVX2 and FMA, else SSE mul + add; best of 5 runs);
// `per_cpu_s` gets the same per second of CPU time.
double measure_fma_peak_gflops(double* per_cpu_s = nullptr);
// bf16 AMX tile peak of one core (TDPBF16PS on six accumulator tiles, best of 5 runs), or
// nothing where the amx path cannot run.
std::optional<double> measure_amx_peak_gflops();

// Runs the benchmark; `log` gets a line about the check. Throws CheckFailed if the result
// fails its check, cpattn::Error on bad options.
AttnBenchResult run_attention_bench(const AttnBenchOptions& o, std::ostream* log = nullptr);

}  // namespace cpattn::check
