// The fp32 micro-kernel alone against the FMA peak (issue 14; docs/benchmarks.md): the
// library's gemm (MR x 4 vectors of accumulators on AVX-512, 6 x 4 at 16 floats; MR x 2 on
// AVX2) over 64 columns of B (four 16-column panels), with B in L1, streamed from L2 at 24 and
// 96 rows per call (the forward's sub-block, and a GQA set's four sub-blocks as gemm_groups
// runs them; A and C then stream from L2 too), and from beyond L2. It calls the widest fp32
// path this CPU runs (avx512, else avx2) through its KernelTable's gemm_f32, so that it times
// the library's compiled gemm itself (a copy compiled into this file with constant strides
// spilled its accumulators: 47% of the peak).
//
//   build/release/bench/fp32_tiles [--repeats 5]
//
// Prints one Markdown row per case: GFLOP/s (median of --repeats runs of about 0.1 s) and its
// share of the FMA peak measured in the same run (before and after the cases: the larger).
// Exits 0 with a message on a CPU without AVX2.
#include "blocking.hpp"  // PAD (src/kernels)
#include "common.hpp"    // KernelTable, path_table

#include <cpattn/attention.hpp>
#include <cpattn/check/attention_bench.hpp>

#include "gflops.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using cpattn::bench::gflops;

// `sets` operand sets of C[M x 64] += A[M x K] B[K x 64] (B in the packed operands' layout: PAD
// columns a panel, rows PAD apart), the library's gemm on each in turn, about 0.1 s a run.
double run_case(const cpattn::kernels::KernelTable& t, int repeats, int M, int K, int sets) {
  constexpr int N = 64, PAD = cpattn::kernels::PAD;
  // 64-byte aligned, as the kernels' scratch: 16 floats of slack, started on a line
  auto aligned = [](std::vector<float>& v) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) / 64 * 64);
  };
  std::vector<float> av(static_cast<size_t>(sets) * M * K + 16, 0.5f);
  std::vector<float> bv(static_cast<size_t>(sets) * K * N + 16, 0.25f);
  std::vector<float> cv(static_cast<size_t>(sets) * M * N + 16, 0.0f);
  float *a = aligned(av), *b = aligned(bv), *c = aligned(cv);
  const double per_call = 2.0 * M * N * K;
  const int calls = std::max(sets, static_cast<int>(2e10 / per_call / sets) * sets);
  return gflops(repeats, per_call * calls, [&] {
    for (int i = 0; i < calls; ++i) {
      const size_t j = static_cast<size_t>(i % sets);
      t.gemm_f32(false, M, N, K, a + j * M * K, K, 1, b + j * K * N, PAD, int64_t{K} * PAD, c + j * M * N, N);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--repeats") repeats = std::max(1, std::atoi(argv[i + 1]));
  using cpattn::KernelPath;
  const KernelPath path = cpattn::kernel_path_supported(KernelPath::avx512) ? KernelPath::avx512 : KernelPath::avx2;
  if (!cpattn::kernel_path_supported(path)) {
    std::puts("fp32_tiles: this CPU runs neither the avx512 nor the avx2 path; nothing to measure");
    return 0;
  }
  const cpattn::kernels::KernelTable& table = *cpattn::kernels::path_table(path);
  struct Case {
    const char* what;
    int m, k, sets;
  };
  // B is K x 64 floats: 24 KiB at K = 96 (with A and C, 39 KiB: under a 48 KiB L1), 32 KiB at
  // K = 128; 16 sets of A, B and C are 0.8 MiB at 24 rows and 1.6 MiB at 96 (under a 2 MiB L2),
  // 512 sets 25 and 52 MiB.
  const Case cases[] = {
      {"24 rows, K 96, one operand set (B in L1)", 24, 96, 1},
      {"24 rows, K 128, 16 sets in turn (B from L2)", 24, 128, 16},
      {"96 rows, K 128, 16 sets in turn (B from L2)", 96, 128, 16},
      {"24 rows, K 128, 512 sets in turn (B beyond L2)", 24, 128, 512},
      {"96 rows, K 128, 512 sets in turn (B beyond L2)", 96, 128, 512},
  };
  // The peak before and after the cases, the shares against the larger: the core's clock can
  // move under a benchmark (after AMX products at their peak it read 20% lower for a while).
  const double before = cpattn::check::measure_fma_peak_gflops();
  std::vector<double> gf;
  for (const Case& c : cases) gf.push_back(run_case(table, repeats, c.m, c.k, c.sets));
  const double after = cpattn::check::measure_fma_peak_gflops(), peak = std::max(before, after);
  std::printf("%s path; FMA peak %.1f GFLOP/s before the cases, %.1f after (one core)\n\n",
              path == KernelPath::avx512 ? "avx512" : "avx2", before, after);
  std::printf("| case | GFLOP/s | share of the larger FMA peak |\n|---|---|---|\n");
  for (size_t i = 0; i < gf.size(); ++i)
    std::printf("| %s | %.1f | %.0f%% |\n", cases[i].what, gf[i], 100.0 * gf[i] / peak);
  return 0;
}
