// `cpattn bench attention`: check one attention case against the float64 reference, then time
// forward and backward against the FMA peak measured in the same run (the checking library's
// cpattn/check/attention_bench.hpp). This file maps flags to it and prints its result.
#include <cpattn/attention.hpp>
#include <cpattn/check/attention_bench.hpp>
#include <cpattn/error.hpp>
#include <cpattn/memory.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>

#include "commands.hpp"
#include "vocab.hpp"

namespace cpattn::cli {

// What the benchmark allocates, refused before it does when past the available memory: the
// inputs and outputs (check::Tensors: fp32 values plus fp16/bf16 storage), a reference run's
// outputs as many again, and the backward kernel's scratch.
void check_bench_memory(const check::AttnBenchOptions& o, const std::string& what) {
  uint64_t tokens = 0;
  int64_t longest = 0;  // the longest document's queries size the backward's per-task buffers
  for (const int64_t l : o.lengths) {
    tokens = saturating_add(tokens, static_cast<uint64_t>(l));
    longest = std::max(longest, l);
  }
  // (in 64 bits: --heads near INT_MAX made an int product wrap, and the check pass)
  const uint64_t per_token = 2 * (static_cast<uint64_t>(o.heads) + static_cast<uint64_t>(o.kv_heads)) *
                             (static_cast<uint64_t>(o.head_dim) + static_cast<uint64_t>(o.head_dim_v));
  const uint64_t tensor_bytes = 4 + (o.dtype == DType::f32 ? 0 : dtype_size(o.dtype));
  const auto rows = static_cast<int64_t>(std::min<uint64_t>(tokens, uint64_t{1} << 50));
  const AttnBwdParams p{.in = {.q = {nullptr, rows, o.heads, o.head_dim, o.dtype},
                               .k = {nullptr, rows, o.kv_heads, o.head_dim, o.dtype},
                               .v = {nullptr, rows, o.kv_heads, o.head_dim_v, o.dtype},
                               .options = {.num_threads = o.threads}}};
  const uint64_t tensors = saturating_mul(saturating_mul(tokens, per_token), 2 * tensor_bytes);
  const uint64_t scratch = attention_backward_scratch_bytes(p, longest);
  check_memory(saturating_add(tensors, scratch), what + " of " + std::to_string(tokens) + " tokens",
               "tensors and their reference " + format_bytes(tensors) + ", kernel scratch " + format_bytes(scratch));
}

namespace {

struct BenchAttnArgs {
  int64_t seq_len = 8192;
  std::vector<int64_t> lengths;
  int heads = 16, kv_heads = 4, head_dim = 128, head_dim_qk = 0, head_dim_v = 0, threads = 1, repeats = 3;
  std::string dtype = "fp32", kernel_path = "automatic", mask = "causal";  // canonical (vocab.hpp)
  std::string window;    // --window LEFT,RIGHT (empty: unbounded)
  float softcap = 0.0f;  // --softcap
  bool alibi = false;    // --alibi
  bool json = false;
  bool fail_check = false;  // hidden, for tests: corrupt the result so that its check fails
};

void run_bench_attention(const BenchAttnArgs& a) {
  check::AttnBenchOptions o;
  o.lengths = a.lengths.empty() ? std::vector<int64_t>{a.seq_len} : a.lengths;
  for (int64_t l : o.lengths) CPATTN_CHECK(l >= 1, "--lengths: every length must be >= 1, got ", l);
  CPATTN_CHECK(a.heads % a.kv_heads == 0, "--heads (", a.heads, ") must be a positive multiple of --kv-heads (",
               a.kv_heads, ")");
  o.heads = a.heads;
  o.kv_heads = a.kv_heads;
  o.head_dim = a.head_dim_qk > 0 ? a.head_dim_qk : a.head_dim;
  o.head_dim_v = a.head_dim_v > 0 ? a.head_dim_v : a.head_dim;
  o.dtype = parse_dtype(a.dtype);
  o.threads = a.threads;
  o.mask = parse_mask(a.mask);
  const Window w = parse_window(a.window);
  o.window_left = w.left;
  o.window_right = w.right;
  o.softcap = check_softcap(a.softcap);
  o.alibi = a.alibi;
  o.repeats = a.repeats;
  o.path = parse_kernel_path(a.kernel_path);
  check_kernel_path_supported(o.path);
  (void)resolve_kernel_path(o.path, o.dtype);  // a bad CPATTN_KERNEL_PATH is bad input (exit 2)
  o.fail_check_for_testing = a.fail_check;
  check_bench_memory(o, "cpattn bench attention");
  check::AttnBenchResult r;
  try {
    r = check::run_attention_bench(o, a.json ? nullptr : &std::cerr);
  } catch (const check::CheckFailed& e) {  // a failed check is exit code 1, not bad input
    std::fprintf(stderr, "cpattn: check failed: %s\n", e.message().c_str());
    throw ExitCode{1};
  }
  const int64_t seq_len = std::accumulate(o.lengths.begin(), o.lengths.end(), int64_t{0});
  // Why the path ran: the flag, the environment (CPATTN_KERNEL_PATH) or the automatic choice.
  const std::string path_reason =
      o.path != KernelPath::automatic ? "forced by --kernel-path " + a.kernel_path : r.path_reason;
  const double peak = r.fma_peak_gflops;
  if (a.json) {
    nlohmann::json j;
    j["fwd_gflops"] = r.fwd_gflops;
    j["bwd_gflops"] = r.bwd_gflops;
    j["fma_peak_gflops"] = peak;
    if (r.amx_peak_gflops) {
      j["amx_peak_gflops"] = *r.amx_peak_gflops;
      j["fwd_fraction_of_amx_peak"] = r.fwd_gflops / *r.amx_peak_gflops;
      j["bwd_fraction_of_amx_peak"] = r.bwd_gflops / *r.amx_peak_gflops;
    } else {
      j["amx_peak_gflops"] = nullptr;
      j["amx_peak_absent_reason"] = r.amx_absent_reason;
    }
    j["fwd_fraction_of_fma_peak"] = r.fwd_gflops / peak;
    j["bwd_fraction_of_fma_peak"] = r.bwd_gflops / peak;
    j["fwd_gflops_per_cpu_s"] = r.fwd_gflops_per_cpu_s;
    j["bwd_gflops_per_cpu_s"] = r.bwd_gflops_per_cpu_s;
    j["fma_peak_gflops_per_cpu_s"] = r.fma_peak_gflops_per_cpu_s;
    j["fwd_seconds"] = r.fwd_seconds;
    j["bwd_seconds"] = r.bwd_seconds;
    j["fwd_flops"] = r.fwd_flops;
    j["bwd_flops"] = r.bwd_flops;
    j["threads"] = o.threads;
    j["dtype"] = to_string(o.dtype);
    j["kernel_path"] = r.path;
    j["kernel_path_reason"] = path_reason;
    j["seq_len"] = seq_len;
    j["documents"] = o.lengths.size();
    j["lengths"] = o.lengths;
    j["heads"] = o.heads;
    j["kv_heads"] = o.kv_heads;
    j["head_dim_qk"] = o.head_dim;
    j["head_dim_v"] = o.head_dim_v;
    j["mask"] = mask_name(o.mask);
    j["window"] = {o.window_left, o.window_right};
    j["softcap"] = o.softcap;
    j["alibi"] = o.alibi;
    j["repeats"] = o.repeats;
    j["check_max_rel_err"] = r.check_max_rel_err;
    j["check_scope"] = r.check_scope;
    std::cout << j.dump() << "\n";
    return;
  }
  std::printf("attention %s, kernel path %s, %d thread(s), %zu document(s), seq len %lld, heads %d, kv heads %d, "
              "head dim qk/v %d/%d, mask %s\n",
              std::string(to_string(o.dtype)).c_str(), r.path.c_str(), o.threads, o.lengths.size(),
              static_cast<long long>(seq_len), o.heads, o.kv_heads, o.head_dim, o.head_dim_v,
              mask_name(o.mask).c_str());
  std::printf("  kernel path %s: %s\n", r.path.c_str(), path_reason.c_str());
  if (o.window_left >= 0 || o.window_right >= 0 || o.softcap > 0.0f || o.alibi)
    std::printf("  masks: window %lld,%lld, softcap %g, alibi %s\n", static_cast<long long>(o.window_left),
                static_cast<long long>(o.window_right), static_cast<double>(o.softcap), o.alibi ? "on" : "off");
  std::printf("  forward   %8.1f GFLOP/s  %6.1f%% of FMA peak  (%.3f s median of %d)\n",
              r.fwd_gflops, 100 * r.fwd_gflops / peak, r.fwd_seconds, o.repeats);
  std::printf("  backward  %8.1f GFLOP/s  %6.1f%% of FMA peak  (%.3f s median of %d)\n",
              r.bwd_gflops, 100 * r.bwd_gflops / peak, r.bwd_seconds, o.repeats);
  std::printf("  fma peak  %8.1f GFLOP/s (one core, fp32, measured now)\n", peak);
  std::printf("  per CPU-second (shared machine): forward %.1f, backward %.1f, fma peak %.1f "
              "GFLOP/s\n", r.fwd_gflops_per_cpu_s, r.bwd_gflops_per_cpu_s,
              r.fma_peak_gflops_per_cpu_s);
  if (r.amx_peak_gflops)
    std::printf("  amx peak  %8.1f GFLOP/s (one core, bf16 tiles, measured now): forward %.1f%%, backward %.1f%% of it\n",
                *r.amx_peak_gflops, 100 * r.fwd_gflops / *r.amx_peak_gflops, 100 * r.bwd_gflops / *r.amx_peak_gflops);
  else
    std::printf("  amx peak  n/a: %s\n", r.amx_absent_reason.c_str());
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that check their result first");
  bench->require_subcommand(1);
  auto args = std::make_shared<BenchAttnArgs>();
  CLI::App* at = bench->add_subcommand(
      "attention", "Fused attention forward/backward GFLOP/s against this core's FMA peak");
  at->add_option("--seq-len", args->seq_len, "One document of this many tokens")
      ->check(at_least_one())->capture_default_str();
  at->add_option("--lengths", args->lengths, "Document lengths of a packed batch (overrides --seq-len)")
      ->delimiter(',')->check(int64_value());
  at->add_option("--heads", args->heads, "Query heads")->check(at_least_one())->capture_default_str();
  at->add_option("--kv-heads", args->kv_heads, "Key/value heads (GQA when fewer than --heads)")
      ->check(at_least_one())->capture_default_str();
  at->add_option("--head-dim", args->head_dim, "Head dimension of q, k and v")->check(CLI::Range(1, 256))
      ->capture_default_str();
  at->add_option("--head-dim-qk", args->head_dim_qk, "Head dimension of q and k (MLA), overrides --head-dim")
      ->check(CLI::Range(1, 256));
  at->add_option("--head-dim-v", args->head_dim_v, "Head dimension of v (MLA), overrides --head-dim")
      ->check(CLI::Range(1, 256));
  at->add_option("--dtype", args->dtype, "Storage type: fp32, fp16 or bf16 (or float32, float16, bfloat16)")
      ->transform(dtype_transformer())->capture_default_str();
  at->add_option("--kernel-path", args->kernel_path, "Kernel path (automatic: the fastest this CPU runs, or CPATTN_KERNEL_PATH when set)")
      ->transform(kernel_path_transformer())->capture_default_str();
  at->add_option("--threads", args->threads, "Threads")->check(at_least_one())->capture_default_str();
  at->add_option("--mask", args->mask, "causal or none")->transform(mask_transformer())->capture_default_str();
  at->add_option("--window", args->window, "Sliding window LEFT,RIGHT (FlashAttention's window_size; -1 = "
                                           "unbounded on that side)");
  at->add_option("--softcap", args->softcap, "Logit soft cap (0 = off): scores become X * tanh(s / X)")
      ->capture_default_str();
  at->add_flag("--alibi", args->alibi, "ALiBi biases with the standard slopes 2^(-8 (h + 1) / heads)");
  at->add_option("--repeats", args->repeats, "Timed runs per direction (median)")
      ->check(at_least_one())->capture_default_str();
  at->add_flag("--json", args->json, "Print one JSON object");
  at->add_flag("--testing-fail-check", args->fail_check,
               "Testing only: corrupt the result before its check, which then fails (exit code 1)")
      ->group("");
  at->callback([args] { run_bench_attention(*args); });
}

}  // namespace cpattn::cli
