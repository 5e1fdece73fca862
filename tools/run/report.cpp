// `cpattn run`'s report: one JSON object (--json) or the table, and --npy-out.
#include "run.hpp"

#include "../vocab.hpp"

#include <cpattn/check/tolerance.hpp>
#include <cpattn/file.hpp>
#include <cpattn/npy.hpp>

#include <algorithm>
#include <cstdio>
#include <string>

namespace cpattn::cli::run_cmd {
namespace {

// max/mean of the ranks' compute times.
double compute_imbalance(const std::vector<RankFigures>& ranks) {
  double cmax = 0, csum = 0;
  for (const RankFigures& f : ranks) {
    cmax = std::max(cmax, f.compute_s);
    csum += f.compute_s;
  }
  return csum > 0 ? cmax / (csum / static_cast<double>(ranks.size())) : 1.0;
}

// One scheme's figures: its check and the per-rank arrays.
nlohmann::json scheme_json(const SchemeResult& x) {
  nlohmann::json j;
  j["scheme"] = x.scheme;
  for (std::size_t i = 0; i < x.check.tensors.size(); ++i) {
    const check::TensorReport& t = x.check.tensors[i];
    j["worst"][t.name] = {{"token", x.check.worst[i].token}, {"head", x.check.worst[i].head}};
    j["max_abs_err"][t.name] = t.max_abs;
    j["max_rel_err"][t.name] = t.max_rel;
    j["rel_l2_err"][t.name] = t.rel_l2;
  }
  j["max_abs_err"]["lse"] = x.check.lse_max_abs;
  j["passed"] = x.check.pass;
  j["shared_memory_off"] = x.shared_memory_off;
  for (const RankFigures& f : x.ranks) {
    j["compute_s"].push_back(f.compute_s);
    j["comm_s"].push_back(f.comm_s);
    j["comm_total_s"].push_back(f.comm_total_s);
    j["step_s"].push_back(f.step_s);
    j["forward_s"].push_back(f.forward_s);
    j["backward_s"].push_back(f.backward_s);
    j["peak_rss_mb"].push_back(f.peak_rss_mb);
    j["peak_buffer_mb"].push_back(f.peak_buffer_mb);
    j["bytes_sent"].push_back(static_cast<int64_t>(f.bytes_sent));
    j["bytes_received"].push_back(static_cast<int64_t>(f.bytes_received));
    j["agree_s"].push_back(f.agree_s);
    j["first_kv_s"].push_back(f.first_kv_s);
    j["later_kv_s"].push_back(f.later_kv_s);
    j["dkv_s"].push_back(f.dkv_s);
    j["comm_mean_s"].push_back(f.comm_mean_s);
    j["shared_calls"].push_back(static_cast<int64_t>(f.shared_calls));
    j["calls"].push_back(static_cast<int64_t>(f.calls));
  }
  return j;
}

double max_over_ranks(const std::vector<RankFigures>& ranks, double RankFigures::*field) {
  double m = 0;
  for (const RankFigures& f : ranks) m = std::max(m, f.*field);
  return m;
}

// " (dq at token 5, head 1)": the first failing tensor and its worst row, or "" (a pass).
std::string first_failure(const RunCheck& c) {
  for (std::size_t i = 0; i < c.tensors.size(); ++i)
    if (!c.tensors[i].pass)
      return " (" + c.tensors[i].name + (c.tensors[i].finite ? "" : ", NaN/Inf,") + " at token " +
             std::to_string(c.worst[i].token) + ", head " + std::to_string(c.worst[i].head) + ")";
  return "";
}

// --scheme all: one row per scheme and rank.
void print_schemes(const RunReport& r) {
  std::printf("\nevery scheme on this batch (medians of %d steps; error: the worst rel_l2 of out, dq, dk, dv):\n",
              r.args.repeats);
  std::printf("  %-10s %-5s %11s %11s %12s %12s %14s %11s %s\n", "scheme", "rank", "forward_s", "backward_s",
              "bytes_sent", "bytes_recv", "peak_buffer_mb", "error", "check");
  for (const SchemeResult& x : r.schemes)
    for (std::size_t i = 0; i < x.ranks.size(); ++i) {
      const RankFigures& f = x.ranks[i];
      std::printf("  %-10s %-5d %11.4f %11.4f %12.0f %12.0f %14.1f", i == 0 ? x.scheme.c_str() : "",
                  static_cast<int>(i), f.forward_s, f.backward_s, f.bytes_sent, f.bytes_received, f.peak_buffer_mb);
      if (i == 0)
        std::printf(" %11.3e %s%s\n", x.check.worst_rel_l2(), x.check.pass ? "PASS" : "FAIL",
                    first_failure(x.check).c_str());
      else
        std::printf("\n");
    }
  std::printf("\nslowest rank (forward + backward, s):");
  for (const SchemeResult& x : r.schemes)
    std::printf(" %s %.4f", x.scheme.c_str(),
                max_over_ranks(x.ranks, &RankFigures::forward_s) + max_over_ranks(x.ranks, &RankFigures::backward_s));
  std::printf("\n");
  for (const SchemeResult& x : r.schemes)
    if (!x.shared_memory_off.empty())
      std::printf("%s: shared memory off, the message path taken: %s\n", x.scheme.c_str(), x.shared_memory_off.c_str());
}

}  // namespace

bool RunReport::pass() const {
  return std::all_of(schemes.begin(), schemes.end(), [](const SchemeResult& x) { return x.check.pass; });
}

nlohmann::json report_json(const RunReport& r) {
  const RunArgs& a = r.args;
  const check::Batch& b = r.batch;
  nlohmann::json report;
  report["cp"] = r.cp;
  report["cp_groups"] = r.cp_groups;
  report["dtype"] = a.dtype;
  report["mode"] = a.mode;
  report["scheme"] = a.scheme;  // a scheme's name, or "all"
  report["cp_inner"] = a.cp_inner;
  report["split"] = a.split;
  report["overlap"] = a.overlap == "on";
  report["shared_memory"] = a.shared_memory == "on";
  report["mask"] = a.mask;
  {
    const Window w = parse_window(a.window);
    report["window"] = {w.left, w.right};
  }
  report["softcap"] = a.softcap;
  report["alibi"] = a.alibi;
  report["kernel_path"] = r.kernel_path;
  report["threads"] = a.threads;  // per rank
  report["seq_len"] = b.tokens();
  report["padded_tokens"] = r.balance.padded_tokens;
  report["documents"] = b.cu_seqlens.size() - 1;
  std::vector<int64_t> lengths(b.cu_seqlens.size() - 1);
  for (std::size_t d = 0; d + 1 < b.cu_seqlens.size(); ++d) lengths[d] = b.cu_seqlens[d + 1] - b.cu_seqlens[d];
  report["lengths"] = lengths;
  report["heads"] = b.shape.heads_q;
  report["kv_heads"] = b.shape.heads_k;
  report["head_dim_qk"] = b.shape.head_dim_qk;
  report["head_dim_v"] = b.shape.head_dim_v;
  report["repeats"] = a.repeats;
  report["single_process_s"] = r.single_process_s;
  report["timeout_s"] = r.timeout_s;
  if (a.scheme != "all") {  // one scheme: its figures at the top level
    report.update(scheme_json(r.schemes[0]));
  } else {  // --scheme all: one object per scheme
    for (const SchemeResult& x : r.schemes) report["schemes"].push_back(scheme_json(x));
    report["passed"] = r.pass();
  }
  report["imbalance"] = {{"compute", compute_imbalance(r.schemes[0].ranks)},
                         {"balanced", r.balance.imbalance_balanced},
                         {"contiguous", r.balance.imbalance_contiguous}};
  return report;
}

void print_report(const RunReport& r) {
  const RunArgs& a = r.args;
  const check::Batch& b = r.batch;
  const std::string group_note =
      r.cp_groups > 1 ? " in each of " + std::to_string(r.cp_groups) + " CP groups (group 0 shown)" : "";
  std::printf("cpattn run: cp = %d%s, seq len %lld in %zu documents (padded to %lld), heads %d, kv heads %d, "
              "head dim qk/v %d/%d, %s, mode %s, mask %s, split %s, overlap %s, shared memory %s, %d thread(s) per rank, "
              "kernel path %s\n",
              r.cp, group_note.c_str(), static_cast<long long>(b.tokens()), b.cu_seqlens.size() - 1,
              static_cast<long long>(r.balance.padded_tokens), b.shape.heads_q, b.shape.heads_k,
              b.shape.head_dim_qk, b.shape.head_dim_v, a.dtype.c_str(), a.mode.c_str(), a.mask.c_str(),
              a.split.c_str(), a.overlap.c_str(), a.shared_memory.c_str(), a.threads, r.kernel_path.c_str());
  if (!a.window.empty() || a.softcap > 0.0f || a.alibi) {
    const Window w = parse_window(a.window);
    std::printf("masks: window %lld,%lld, softcap %g, alibi %s\n", static_cast<long long>(w.left),
                static_cast<long long>(w.right), static_cast<double>(a.softcap), a.alibi ? "on" : "off");
  }
  if (a.scheme == "all") {
    std::printf("checked against a single-process run of the whole batch (%.3f s)\n", r.single_process_s);
    print_schemes(r);
    std::printf("  result: %s (%s)\n", r.pass() ? "PASS" : "FAIL", std::string(check::tolerance(b.dtype).rule).c_str());
    return;
  }
  const RunCheck& result = r.schemes[0].check;
  const std::vector<RankFigures>& ranks = r.schemes[0].ranks;
  std::printf("scheme %s\n", r.schemes[0].scheme.c_str());
  std::printf("\ncheck against a single-process run of the whole batch (%.3f s):\n", r.single_process_s);
  std::printf("  %-6s %14s %14s %14s  %s\n", "tensor", "max_abs_err", "max_rel_err", "rel_l2_err",
              "worst at (token, head)");
  for (std::size_t i = 0; i < result.tensors.size(); ++i) {
    const check::TensorReport& t = result.tensors[i];
    std::printf("  %-6s %14.3e %14.3e %14.3e  (%lld, %d)%s\n", t.name.c_str(), t.max_abs, t.max_rel, t.rel_l2,
                static_cast<long long>(result.worst[i].token), result.worst[i].head,
                t.pass ? "" : t.finite ? "  FAIL" : "  FAIL (NaN/Inf)");
  }
  std::printf("  result: %s (%s)\n", result.pass ? "PASS" : "FAIL",
              std::string(check::tolerance(b.dtype).rule).c_str());
  std::printf("\nper rank (medians of %d forward+backward steps):\n", a.repeats);
  std::printf("  (comm_s: exposed communication, the time the rank waited; comm_total_s: the time its own data was "
              "in flight, overlapped or not; - where the scheme does not measure it)\n");
  std::printf("  %-5s %11s %11s %12s %11s %12s %14s %12s %12s\n", "rank", "compute_s", "comm_s", "comm_total_s",
              "step_s", "peak_rss_mb", "peak_buffer_mb", "bytes_sent", "bytes_recv");
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const RankFigures& f = ranks[i];
    char total[32] = "-";
    if (f.comm_total_s > 0) std::snprintf(total, sizeof total, "%.4f", f.comm_total_s);
    std::printf("  %-5d %11.4f %11.4f %12s %11.4f %12.1f %14.1f %12.0f %12.0f\n", static_cast<int>(i), f.compute_s,
                f.comm_s, total, f.step_s, f.peak_rss_mb, f.peak_buffer_mb, f.bytes_sent, f.bytes_received);
  }
  // (The all-gather scheme measures its parts; the others their agreement, and the rest is theirs.)
  const std::string& scheme = r.schemes[0].scheme;
  if (scheme == "allgather")
    std::printf("  comm_s by part, means over the steps: agreement (absorbs the ranks' skew), first K/V (the "
                "all-gather; overlapped: group 0's), later K/V (overlapped: the other groups, polls), dK/dV (the "
                "reduce-scatter):\n");
  else
    std::printf("  comm_s by part, means over the steps: agreement (absorbs the ranks' skew), the %s scheme's own "
                "transfers:\n", scheme.c_str());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const RankFigures& f = ranks[i];
    if (scheme == "allgather")
      std::printf("  %-5d agreement %.4f + first K/V %.4f + later K/V %.4f + dK/dV %.4f = %.4f\n", static_cast<int>(i),
                  f.agree_s, f.first_kv_s, f.later_kv_s, f.dkv_s, f.comm_mean_s);
    else
      std::printf("  %-5d agreement %.4f + %s %.4f = %.4f\n", static_cast<int>(i), f.agree_s, scheme.c_str(),
                  f.comm_mean_s - f.agree_s, f.comm_mean_s);
  }
  if (!ranks.empty() && ranks[0].shared_calls > 0)
    std::printf("  through shared memory (K/V, dK/dV; their waits above are then barriers): %.0f of the last step's %.0f "
                "calls\n",
                ranks[0].shared_calls, ranks[0].calls);
  if (!r.schemes[0].shared_memory_off.empty())
    std::printf("  shared memory off, the message path taken: %s\n", r.schemes[0].shared_memory_off.c_str());
  std::printf("\nimbalance (max/mean): compute %.3f; visible pairs: balanced %.3f, contiguous split %.3f\n",
              compute_imbalance(ranks), r.balance.imbalance_balanced, r.balance.imbalance_contiguous);
}

void write_results(const std::string& dir, const check::Batch& b, const check::Results& got) {
  const int64_t t = b.tokens();
  const check::BatchShape& s = b.shape;
  // One set: a failed write leaves every file of an earlier run as it was (not part new).
  const std::vector<std::byte> bytes[] = {
      format_npy(got.out, {t, s.heads_q, s.head_dim_v}), format_npy(got.lse, {t, s.heads_q}),
      format_npy(got.dq, {t, s.heads_q, s.head_dim_qk}), format_npy(got.dk, {t, s.heads_k, s.head_dim_qk}),
      format_npy(got.dv, {t, s.heads_k, s.head_dim_v})};
  const char* const names[] = {"out", "lse", "dq", "dk", "dv"};
  std::vector<FileBytes> files;
  for (std::size_t i = 0; i < std::size(names); ++i) files.push_back({dir + "/" + names[i] + ".npy", bytes[i]});
  write_files_atomically(files);
}

}  // namespace cpattn::cli::run_cmd
