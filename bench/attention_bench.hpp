// `cpattn bench attention`: check one attention case against the float64 reference, then time
// forward and backward and set them against this core's FMA peak measured in the same run.
// Header-only so that the CLI (tools/cmd_bench.cpp) and bench/bench_attention.cpp share it;
// shapes come from the kernel tests' case table (tests/kernels/attention_cases.hpp).
#pragma once

#include "../tests/kernels/attention_harness.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>
#include <cpattn/reference.hpp>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdint>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cpattn::bench {

struct AttnBenchOptions {
  std::vector<int64_t> lengths{8192};  // document lengths (queries = keys per document)
  int heads = 16;                      // num_heads_q
  int kv_heads = 4;                    // num_heads_k
  int head_dim = 128;                  // head_dim_qk
  int head_dim_v = 0;                  // 0: same as head_dim
  DType dtype = DType::f32;
  int threads = 1;
  MaskType mask = MaskType::causal;
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
  double fwd_flops = 0, bwd_flops = 0;
  double fwd_seconds = 0, bwd_seconds = 0;  // medians
  double fwd_gflops = 0, bwd_gflops = 0;
  double fma_peak_gflops = 0;               // one core, fp32 FMA, measured in this run
  // The same per second of process CPU time (all threads): on a shared machine, where other
  // work takes turns on the cores, these ratios show the kernel's own efficiency.
  double fwd_cpu_seconds = 0, bwd_cpu_seconds = 0;
  double fwd_gflops_per_cpu_s = 0, bwd_gflops_per_cpu_s = 0, fma_peak_gflops_per_cpu_s = 0;
  std::optional<double> amx_peak_gflops;    // absent: see amx_absent_reason
  std::string amx_absent_reason;
  double check_max_rel_err = 0;  // worst ||diff||/||ref|| of the checked outputs
  std::string check_scope;       // what the check covered
};

inline volatile float fma_sink = 0.0f;

// fp32 FMA peak of one core: 12 independent accumulator chains, best of a few runs.
__attribute__((target("avx2,fma"))) inline double fma_peak_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 1; i < 12; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  fma_sink = _mm256_cvtss_f32(acc[0]);  // keeps the chains alive
  return 2.0 * 8 * 12 * static_cast<double>(iters) / s / 1e9;
}

inline double fma_peak_sse(int64_t iters) {  // baseline x86-64: mul + add, 4 lanes
  __m128 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m128 a = _mm_set1_ps(0.999999f), b = _mm_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm_add_ps(_mm_mul_ps(acc[i], a), b);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 1; i < 12; ++i) acc[0] = _mm_add_ps(acc[0], acc[i]);
  fma_sink = _mm_cvtss_f32(acc[0]);
  return 2.0 * 4 * 12 * static_cast<double>(iters) / s / 1e9;
}

inline double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Best of 5 runs; `per_cpu_s` gets the same per second of CPU time.
inline double measure_fma_peak_gflops(double* per_cpu_s = nullptr) {
  const bool avx2 = kernel_path_supported(KernelPath::avx2);
  double best = 0, best_cpu = 0;
  const int64_t iters = 20'000'000;
  for (int rep = 0; rep < 5; ++rep) {
    const double c0 = cpu_seconds();
    best = std::max(best, avx2 ? fma_peak_avx2(iters) : fma_peak_sse(iters));
    const double flops = 2.0 * (avx2 ? 8 : 4) * 12 * static_cast<double>(iters);
    best_cpu = std::max(best_cpu, flops / (cpu_seconds() - c0) / 1e9);
  }
  if (per_cpu_s) *per_cpu_s = best_cpu;
  return best;
}

namespace detail {
// Median wall seconds of `repeats` runs after a warm-up; *cpu gets the median CPU seconds.
template <class F>
double median_seconds(int repeats, double* cpu, F&& f) {
  f();  // warm-up
  std::vector<double> t, c;
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    const double c0 = cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    c.push_back(cpu_seconds() - c0);
  }
  std::sort(t.begin(), t.end());
  std::sort(c.begin(), c.end());
  *cpu = c[c.size() / 2];
  return t[t.size() / 2];
}

// Query rows to check: the first and last `n` rows of every document (bounded in total),
// as a work list over the same keys.
inline WorkList sample_worklist(const WorkList& full, int64_t n) {
  WorkList w;
  w.runs = full.runs;
  for (const AttnTask& t : full.tasks) {
    AttnTask a = t;
    a.q_len = std::min(n, t.q_len);
    w.tasks.push_back(a);
    if (t.q_len > 2 * n) {
      AttnTask b = t;
      b.q_row = t.q_row + t.q_len - n;
      b.q_pos = t.q_pos + t.q_len - n;
      b.q_len = n;
      w.tasks.push_back(b);
    } else if (t.q_len > n) {
      AttnTask b = t;
      b.q_row = t.q_row + n;
      b.q_pos = t.q_pos + n;
      b.q_len = t.q_len - n;
      w.tasks.push_back(b);
    }
    if (w.tasks.size() > 64) break;
  }
  return w;
}

inline std::vector<float> rows_of(const std::vector<float>& x, const WorkList& w, int64_t row_elems) {
  std::vector<float> r;
  for (const AttnTask& t : w.tasks)
    r.insert(r.end(), x.begin() + t.q_row * row_elems, x.begin() + (t.q_row + t.q_len) * row_elems);
  return r;
}
}  // namespace detail

// Runs the benchmark. Throws CheckFailed if the result fails its check, cpattn::Error on bad
// options.
inline AttnBenchResult run_attention_bench(const AttnBenchOptions& o, std::ostream* log = nullptr) {
  using namespace cpattn::testing;
  CPATTN_CHECK(!o.lengths.empty(), "bench attention: need at least one document length");
  CPATTN_CHECK(o.repeats >= 1, "bench attention: --repeats must be >= 1, got ", o.repeats);
  AttnBenchResult res;
  res.opt = o;
  const int dv = o.head_dim_v > 0 ? o.head_dim_v : o.head_dim;
  const AttnCase c = bench_case(o.lengths, o.heads, o.kv_heads, o.head_dim, dv, o.mask);
  const KernelPath path = o.path == KernelPath::automatic ? best_kernel_path() : o.path;
  res.path = std::string(to_string(path));
  res.fwd_flops = c.fwd_flops();
  res.bwd_flops = c.bwd_flops();
  const DType dt = o.dtype;
  const Problem pb(c, dt, 2024);
  Tensor out(dt, pb.out_size()), dq(dt, pb.q.size()), dk(dt, pb.dk_size()), dvt(dt, pb.dv_size());
  std::vector<float> lse(pb.lse_size());
  const AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), dt, path, o.threads);
  const AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dvt, dt, path, o.threads);

  // 1. check: forward and dq on sampled rows (all rows when small), dk/dv when small.
  attention_forward(fp);
  attention_backward(bp);
  const bool small = static_cast<double>(c.visible_pairs()) * c.num_heads_q < 3e6;
  const WorkList sample = small ? pb.work : detail::sample_worklist(pb.work, 16);
  {
    const int64_t hq = c.num_heads_q;
    Tensor r_out(DType::f32, pb.out_size()), r_dq(DType::f32, pb.q.size()),
        r_dk(DType::f32, pb.dk_size()), r_dv(DType::f32, pb.dv_size());
    std::vector<float> r_lse(pb.lse_size());
    const Tensor Q = Tensor::from(DType::f32, pb.q.f), K = Tensor::from(DType::f32, pb.k.f),
                 V = Tensor::from(DType::f32, pb.v.f), dO = Tensor::from(DType::f32, pb.dout.f),
                 O = Tensor::from(DType::f32, out.values());
    attention_forward_reference(pb.fwd(Q, K, V, r_out, r_lse.data(), DType::f32, path, 1, &sample));
    attention_backward_reference(pb.bwd(Q, K, V, O, lse.data(), dO, r_dq, r_dk, r_dv, DType::f32,
                                        path, 1, &sample));
    const Tolerance tol = tolerance(dt);
    auto check = [&](const char* what, const std::vector<float>& got, const std::vector<float>& ref) {
      const double e = rel_norm_error(got, ref);
      res.check_max_rel_err = std::max(res.check_max_rel_err, e);
      const double limit = dt == DType::f32 ? tol.rel_norm : tol.rtol;
      if (e <= limit && all_finite(got)) return;
      std::ostringstream msg;
      msg << "bench attention: " << what << " does not match the float64 reference: ||diff||/||ref|| = " << e
          << " > " << limit;
      throw CheckFailed(msg.str());
    };
    if (o.fail_check_for_testing) lse[0] += 1.0f;
    check("out", detail::rows_of(out.values(), sample, hq * dv), detail::rows_of(r_out.f, sample, hq * dv));
    check("lse", detail::rows_of(lse, sample, hq), detail::rows_of(r_lse, sample, hq));
    check("dq", detail::rows_of(dq.values(), sample, hq * c.head_dim_qk),
          detail::rows_of(r_dq.f, sample, hq * c.head_dim_qk));
    if (small) {
      check("dk", dk.values(), r_dk.f);
      check("dv", dvt.values(), r_dv.f);
      res.check_scope = "out, lse, dq, dk, dv on every row";
    } else {
      res.check_scope = "out, lse, dq on the first and last 16 rows of up to 32 documents "
                        "(dk/dv need every query; covered by the kernel tests)";
    }
    if (log) *log << "check passed (" << res.check_scope << "), worst relative error "
                  << res.check_max_rel_err << "\n";
  }

  // 2. time
  res.fwd_seconds = detail::median_seconds(o.repeats, &res.fwd_cpu_seconds, [&] { attention_forward(fp); });
  res.bwd_seconds = detail::median_seconds(o.repeats, &res.bwd_cpu_seconds, [&] { attention_backward(bp); });
  res.fwd_gflops = res.fwd_flops / res.fwd_seconds / 1e9;
  res.bwd_gflops = res.bwd_flops / res.bwd_seconds / 1e9;
  res.fwd_gflops_per_cpu_s = res.fwd_flops / res.fwd_cpu_seconds / 1e9;
  res.bwd_gflops_per_cpu_s = res.bwd_flops / res.bwd_cpu_seconds / 1e9;
  res.fma_peak_gflops = measure_fma_peak_gflops(&res.fma_peak_gflops_per_cpu_s);
  res.amx_absent_reason = "no AMX path is built (this CPU has no AMX; see docs/kernels.md)";
  return res;
}

}  // namespace cpattn::bench
