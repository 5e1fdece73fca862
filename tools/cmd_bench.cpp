// `cpattn bench attention`: check one attention case against the float64 reference, then time
// forward and backward against the FMA peak measured in the same run (the checking library's
// cpattn/check/attention_bench.hpp). This file maps flags to it and prints its result.
#include <cpattn/attention.hpp>
#include <cpattn/check/attention_bench.hpp>
#include <cpattn/error.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <string>

#include "commands.hpp"

namespace cpattn::cli {
namespace {

struct BenchAttnArgs {
  int64_t seqlen = 8192;
  std::vector<int64_t> lengths;
  int heads = 16, kv_heads = 4, head_dim = 128, head_dim_v = 0, threads = 1, repeats = 3;
  std::string dtype = "f32", path = "automatic";
  bool causal = true, json = false;
};

void run_bench_attention(const BenchAttnArgs& a) {
  static const std::map<std::string, DType> dtypes{
      {"f32", DType::f32}, {"f16", DType::f16}, {"bf16", DType::bf16}};
  static const std::map<std::string, KernelPath> paths{
      {"automatic", KernelPath::automatic}, {"portable", KernelPath::portable},
      {"avx2", KernelPath::avx2}, {"avx512", KernelPath::avx512}, {"amx", KernelPath::amx}};
  check::AttnBenchOptions o;
  o.lengths = a.lengths.empty() ? std::vector<int64_t>{a.seqlen} : a.lengths;
  for (int64_t l : o.lengths) CPATTN_CHECK(l >= 1, "--lengths: every length must be >= 1, got ", l);
  o.heads = a.heads;
  o.kv_heads = a.kv_heads;
  o.head_dim = a.head_dim;
  o.head_dim_v = a.head_dim_v;
  o.dtype = dtypes.at(a.dtype);
  o.threads = a.threads;
  o.mask = a.causal ? MaskType::causal : MaskType::none;
  o.repeats = a.repeats;
  o.path = paths.at(a.path);
  const check::AttnBenchResult r = check::run_attention_bench(o, a.json ? nullptr : &std::cerr);
  const double peak = r.fma_peak_gflops;
  if (a.json) {
    nlohmann::json j;
    j["fwd_gflops"] = r.fwd_gflops;
    j["bwd_gflops"] = r.bwd_gflops;
    j["fma_peak_gflops"] = peak;
    j["amx_peak_gflops"] = nullptr;
    j["amx_peak_absent_reason"] = r.amx_absent_reason;
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
    j["dtype"] = a.dtype;
    j["path"] = r.path;
    j["lengths"] = o.lengths;
    j["heads"] = o.heads;
    j["kv_heads"] = o.kv_heads;
    j["head_dim"] = o.head_dim;
    j["head_dim_v"] = o.head_dim_v > 0 ? o.head_dim_v : o.head_dim;
    j["causal"] = o.mask == MaskType::causal;
    j["repeats"] = o.repeats;
    j["check_max_rel_err"] = r.check_max_rel_err;
    j["check_scope"] = r.check_scope;
    std::cout << j.dump() << "\n";
    return;
  }
  std::printf("attention %s, path %s, %d thread(s), %zu document(s), %lld tokens, Hq %d, Hkv %d, "
              "D %d/%d, %s\n",
              a.dtype.c_str(), r.path.c_str(), o.threads, o.lengths.size(),
              static_cast<long long>(std::accumulate(o.lengths.begin(), o.lengths.end(), int64_t{0})),
              o.heads, o.kv_heads, o.head_dim, o.head_dim_v > 0 ? o.head_dim_v : o.head_dim,
              o.mask == MaskType::causal ? "causal" : "no mask");
  std::printf("  forward   %8.1f GFLOP/s  %6.1f%% of FMA peak  (%.3f s median of %d)\n",
              r.fwd_gflops, 100 * r.fwd_gflops / peak, r.fwd_seconds, o.repeats);
  std::printf("  backward  %8.1f GFLOP/s  %6.1f%% of FMA peak  (%.3f s median of %d)\n",
              r.bwd_gflops, 100 * r.bwd_gflops / peak, r.bwd_seconds, o.repeats);
  std::printf("  fma peak  %8.1f GFLOP/s (one core, fp32, measured now)\n", peak);
  std::printf("  per CPU-second (shared machine): forward %.1f, backward %.1f, fma peak %.1f "
              "GFLOP/s\n", r.fwd_gflops_per_cpu_s, r.bwd_gflops_per_cpu_s,
              r.fma_peak_gflops_per_cpu_s);
  std::printf("  amx peak  n/a: %s\n", r.amx_absent_reason.c_str());
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that check their result first");
  bench->require_subcommand(1);
  auto args = std::make_shared<BenchAttnArgs>();
  CLI::App* at = bench->add_subcommand(
      "attention", "Fused attention forward/backward GFLOP/s against this core's FMA peak");
  at->add_option("--seqlen", args->seqlen, "One document of this many tokens")
      ->check(CLI::PositiveNumber);
  at->add_option("--lengths", args->lengths, "Document lengths of a packed batch (overrides --seqlen)")
      ->delimiter(',');
  at->add_option("--heads", args->heads, "Query heads")->check(CLI::PositiveNumber);
  at->add_option("--kv-heads", args->kv_heads, "Key/value heads")->check(CLI::PositiveNumber);
  at->add_option("--head-dim", args->head_dim, "Head dim of q and k")->check(CLI::Range(1, 256));
  at->add_option("--head-dim-v", args->head_dim_v, "Head dim of v (default: --head-dim)")
      ->check(CLI::Range(1, 256));
  at->add_option("--dtype", args->dtype, "Storage type")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  at->add_option("--path", args->path, "Kernel path")
      ->check(CLI::IsMember({"automatic", "portable", "avx2", "avx512", "amx"}));
  at->add_option("--threads", args->threads, "Threads")->check(CLI::PositiveNumber);
  at->add_flag("--causal,!--no-causal", args->causal, "Causal mask (default) or none");
  at->add_option("--repeats", args->repeats, "Timed runs per direction (median)")
      ->check(CLI::PositiveNumber);
  at->add_flag("--json", args->json, "Print one JSON object");
  at->callback([args] { run_bench_attention(*args); });
}

}  // namespace cpattn::cli
