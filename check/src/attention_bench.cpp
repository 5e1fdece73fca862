#include <cpattn/check/attention_bench.hpp>
#include <cpattn/check/compare.hpp>
#include <cpattn/check/problem.hpp>
#include <cpattn/check/tolerance.hpp>

#include <cpattn/error.hpp>
#include <cpattn/reference.hpp>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <ctime>
#include <sstream>

namespace cpattn::check {
namespace {

volatile float fma_sink = 0.0f;

// fp32 FMA peak of one core: 12 independent accumulator chains of L-float vectors (12 cover two
// FMA ports of 4-cycle latency), compiled for each width by the target of the function it is
// inlined into: one vector FMA per step where the target has FMA (GNU C++ contracts a * b + c),
// a multiply and an add on the x86-64 baseline. Not instrumented by ASan: it touches no memory
// but its accumulators, which instrumented it keeps on the stack (16x slower, most of every
// sanitized `cpattn bench` run); the template itself is marked too (instrumented code inlined
// into the uninstrumented callers reported its own clock variable out of scope).
template <int L>
struct Lanes;
template <>
struct Lanes<4> {
  typedef float v __attribute__((vector_size(16)));
};
template <>
struct Lanes<8> {
  typedef float v __attribute__((vector_size(32)));
};
template <>
struct Lanes<16> {
  typedef float v __attribute__((vector_size(64)));
};
template <int L>
[[gnu::always_inline, gnu::no_sanitize_address]] inline double fma_chains(int64_t iters) {
  using v = typename Lanes<L>::v;
  v acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = v{} + static_cast<float>(i) * 1e-3f;
  const v a = v{} + 0.999999f, b = v{} + 1e-7f;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * a + b;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 1; i < 12; ++i) acc[0] += acc[i];
  fma_sink = acc[0][0];  // keeps the chains alive
  return 2.0 * L * 12 * static_cast<double>(iters) / s / 1e9;
}
// zmm where the CPU has AVX-512 (Intel's server cores have two 512-bit FMA ports, twice the ymm
// loop's flops per cycle; Zen 4 runs a zmm FMA as two ymm halves, the same peak either way),
// ymm with AVX2 and FMA, else SSE.
__attribute__((target("avx512f"), no_sanitize_address)) double fma_peak_avx512(int64_t iters) {
  return fma_chains<16>(iters);
}
__attribute__((target("avx2,fma"), no_sanitize_address)) double fma_peak_avx2(int64_t iters) {
  return fma_chains<8>(iters);
}
__attribute__((no_sanitize_address)) double fma_peak_sse(int64_t iters) { return fma_chains<4>(iters); }

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

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
WorkList sample_worklist(const WorkList& full, int64_t n) {
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

std::vector<float> rows_of(const std::vector<float>& x, const WorkList& w, int64_t row_elems) {
  std::vector<float> r;
  for (const AttnTask& t : w.tasks)
    r.insert(r.end(), x.begin() + t.q_row * row_elems, x.begin() + (t.q_row + t.q_len) * row_elems);
  return r;
}

#if defined(__x86_64__) && !defined(__clang__)
// bf16 tile peak of one core: TDPBF16PS on six independent accumulator tiles (the instruction's
// latency is a few times its issue interval), the same A and B tiles, all tiles 16 rows x 64
// bytes: 16 x 16 x 32 multiply-adds (16384 flops) per instruction. Only where the amx path runs
// (kernel_path_supported asked Linux for the tile-data permission). GCC only, as the amx path.
double amx_peak_bf16(int64_t iters) {
  struct alignas(64) Config {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  alignas(64) static uint16_t operand[16 * 32];
  for (uint16_t& x : operand) x = 0x3a83;  // bf16 1.0e-3
  const int64_t stride = 64;
  asm volatile("ldtilecfg %0" ::"m"(cfg));
  asm volatile("tileloadd (%0,%1,1), %%tmm6\n\ttileloadd (%0,%1,1), %%tmm7" ::"r"(operand), "r"(stride) : "memory");
  asm volatile("tilezero %tmm0\n\ttilezero %tmm1\n\ttilezero %tmm2\n\ttilezero %tmm3\n\ttilezero %tmm4\n\ttilezero %tmm5");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iters; ++n)
    asm volatile(
        "tdpbf16ps %tmm7, %tmm6, %tmm0\n\ttdpbf16ps %tmm7, %tmm6, %tmm1\n\ttdpbf16ps %tmm7, %tmm6, %tmm2\n\t"
        "tdpbf16ps %tmm7, %tmm6, %tmm3\n\ttdpbf16ps %tmm7, %tmm6, %tmm4\n\ttdpbf16ps %tmm7, %tmm6, %tmm5");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  asm volatile("tilerelease" ::: "memory");
  return 6.0 * 16384 * static_cast<double>(iters) / s / 1e9;
}
#endif

}  // namespace

std::optional<double> measure_amx_peak_gflops() {
#if defined(__x86_64__) && !defined(__clang__)
  if (!kernel_path_supported(KernelPath::amx)) return std::nullopt;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) best = std::max(best, amx_peak_bf16(500'000));
  return best;
#else
  return std::nullopt;
#endif
}

double measure_fma_peak_gflops(double* per_cpu_s) {
  const bool avx2 = kernel_path_supported(KernelPath::avx2), avx512 = kernel_path_supported(KernelPath::avx512);
  double best = 0, best_cpu = 0;
  const int64_t iters = avx512 ? 10'000'000 : 20'000'000;
  const int lanes = avx512 ? 16 : avx2 ? 8 : 4;
  for (int rep = 0; rep < 5; ++rep) {
    const double c0 = cpu_seconds();
    best = std::max(best, avx512 ? fma_peak_avx512(iters) : avx2 ? fma_peak_avx2(iters) : fma_peak_sse(iters));
    const double flops = 2.0 * lanes * 12 * static_cast<double>(iters);
    best_cpu = std::max(best_cpu, flops / (cpu_seconds() - c0) / 1e9);
  }
  if (per_cpu_s) *per_cpu_s = best_cpu;
  return best;
}

AttnBenchResult run_attention_bench(const AttnBenchOptions& o, std::ostream* log) {
  CPATTN_CHECK(!o.lengths.empty(), "bench attention: need at least one document length");
  CPATTN_CHECK(o.repeats >= 1, "run_attention_bench: AttnBenchOptions::repeats must be >= 1, got ", o.repeats);
  AttnBenchResult res;
  res.opt = o;
  const int dv = o.head_dim_v > 0 ? o.head_dim_v : o.head_dim;
  AttnCase c = bench_case(o.lengths, o.heads, o.kv_heads, o.head_dim, dv, o.mask);
  c.window_left = o.window_left;
  c.window_right = o.window_right;
  c.softcap = o.softcap;
  c.alibi = o.alibi;
  const KernelChoice choice = resolve_kernel_path(o.path, o.dtype);
  const KernelPath path = choice.path;
  res.path = std::string(to_string(path));
  res.path_reason = choice.reason;
  res.path_forced_by_env = choice.forced_by_env;
  res.fwd_flops = c.fwd_flops();
  res.bwd_flops = c.bwd_flops();
  const DType dt = o.dtype;
  const Problem pb(c, dt, 2024);
  Tensor out(dt, pb.out_shape()), dq(dt, pb.q_shape()), dk(dt, pb.k_shape()), dvt(dt, pb.v_shape());
  std::vector<float> lse(pb.lse_size());
  const AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, o.threads);
  const AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dvt, path, o.threads);

  // 1. check: forward and dq on sampled rows (all rows when small), dk/dv when small.
  attention_forward(fp);
  attention_backward(bp);
  const bool small = static_cast<double>(c.visible_pairs()) * c.num_heads_q < 3e6;
  const WorkList sample = small ? pb.work : sample_worklist(pb.work, 16);
  {
    const int64_t hq = c.num_heads_q;
    Tensor r_out(DType::f32, pb.out_shape()), r_dq(DType::f32, pb.q_shape()),
        r_dk(DType::f32, pb.k_shape()), r_dv(DType::f32, pb.v_shape());
    std::vector<float> r_lse(pb.lse_size());
    const Tensor Q = pb.q.as(DType::f32), K = pb.k.as(DType::f32), V = pb.v.as(DType::f32),
                 dO = pb.dout.as(DType::f32), O = out.as(DType::f32);
    attention_forward_reference(pb.fwd(Q, K, V, r_out, r_lse.data(), path, 1, &sample));
    attention_backward_reference(pb.bwd(Q, K, V, O, lse.data(), dO, r_dq, r_dk, r_dv, path, 1, &sample));
    const Tolerance tol = tolerance(dt);
    // ||diff|| <= limit max(||ref||, 0.1 sqrt(n)): relative, but against a floor where the
    // reference is (near) zero (a window that shows each query only itself: dq = dk = 0 exactly,
    // and the kernel's rounding noise is all there is). The inputs are uniform in [-1, 1]: the
    // floor is the norm of elements of a tenth of unit scale, so a tensor of larger elements is
    // held to the relative bound alone.
    auto check = [&](const char* what, const std::vector<float>& got, const std::vector<float>& ref) {
      res.check_max_rel_err = std::max(res.check_max_rel_err, rel_norm_error(got, ref));
      const double limit = dt == DType::f32 ? tol.rel_norm : tol.rtol;
      double diff2 = 0, ref2 = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        const double d = double{got[i]} - ref[i];
        diff2 += d * d;
        ref2 += double{ref[i]} * ref[i];
      }
      const double scale = std::max(std::sqrt(ref2), 0.1 * std::sqrt(static_cast<double>(ref.size())));
      if (std::sqrt(diff2) <= limit * scale && all_finite(got)) return;
      std::ostringstream msg;
      msg << "bench attention: " << what << " does not match the float64 reference: ||diff|| = " << std::sqrt(diff2)
          << " > " << limit << " x max(||ref|| = " << std::sqrt(ref2) << ", 0.1 sqrt(n) = "
          << 0.1 * std::sqrt(static_cast<double>(ref.size())) << ")";
      throw CheckFailed(msg.str());
    };
    if (o.fail_check_for_testing) lse[0] += 1.0f;
    check("out", rows_of(out.values(), sample, hq * dv), rows_of(r_out.f, sample, hq * dv));
    check("lse", rows_of(lse, sample, hq), rows_of(r_lse, sample, hq));
    check("dq", rows_of(dq.values(), sample, hq * c.head_dim_qk),
          rows_of(r_dq.f, sample, hq * c.head_dim_qk));
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
  res.fwd_seconds = median_seconds(o.repeats, &res.fwd_cpu_seconds, [&] { attention_forward(fp); });
  res.bwd_seconds = median_seconds(o.repeats, &res.bwd_cpu_seconds, [&] { attention_backward(bp); });
  res.fwd_gflops = res.fwd_flops / res.fwd_seconds / 1e9;
  res.bwd_gflops = res.bwd_flops / res.bwd_seconds / 1e9;
  res.fwd_gflops_per_cpu_s = res.fwd_flops / res.fwd_cpu_seconds / 1e9;
  res.bwd_gflops_per_cpu_s = res.bwd_flops / res.bwd_cpu_seconds / 1e9;
  res.fma_peak_gflops = measure_fma_peak_gflops(&res.fma_peak_gflops_per_cpu_s);
  res.amx_peak_gflops = measure_amx_peak_gflops();
  if (!res.amx_peak_gflops)
    res.amx_absent_reason = "this CPU cannot run the amx path (no AMX-TILE/AMX-BF16/AVX512_BF16, or Linux denied "
                            "tile data; see docs/kernels.md)";
  return res;
}

}  // namespace cpattn::check
