// Attention kernels against the float64 reference, over the case table, every dtype and
// every kernel path this CPU runs; plus determinism, dropout, accumulation and bad arguments.
#include <cpattn/check/compare.hpp>
#include <cpattn/check/problem.hpp>
#include <cpattn/check/tolerance.hpp>

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>
#include <cpattn/reference.hpp>

#include "../src/kernels/blocking.hpp"  // GradShareLayout
#include "../src/kernels/common.hpp"  // KernelTable::bf16_dot, tile_dot, tile_gemm and gemm_f32: the products' steps
#include "error_of.hpp"
#include "sanitize.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <barrier>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>

namespace cpattn::testing {
namespace {

using namespace cpattn::check;

const std::vector<AttnCase>& cases() {
  static const std::vector<AttnCase> c = attention_cases();
  return c;
}

// Ground truth (f64 on the dtype-rounded inputs, computed in f32 storage so nothing is
// rounded but the fp32 result) and the naive same-precision baseline, cached per case/dtype.
struct Truth {
  Results ref;    // float64 reference
  Results naive;  // float32 accumulation, outputs in the storage dtype
  Tensor out_d;   // the reference's out rounded to the dtype: every backward's input
};

const Truth& truth(size_t ci, DType dt) {
  static std::map<std::pair<size_t, int>, Truth> cache;
  auto key = std::make_pair(ci, static_cast<int>(dt));
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const Problem pb(cases()[ci], dt, 1234 + ci);
  Truth t;
  // the f64 forward alone first, to get the dtype-rounded out every backward differentiates
  {
    const Results f = run_reference(pb, DType::f32, RefAccum::f64);
    t.out_d = Tensor::from(dt, pb.out_shape(), f.out);
  }
  t.ref = run_reference(pb, DType::f32, RefAccum::f64, &t.out_d);
  t.naive = run_reference(pb, dt, RefAccum::f32, &t.out_d, &t.ref.lse);
  return cache.emplace(key, std::move(t)).first->second;
}

using TableParam = std::tuple<size_t, DType, KernelPath>;

class kernel_table : public ::testing::TestWithParam<TableParam> {};

void expect_close(const char* what, const std::vector<float>& got, const std::vector<float>& ref,
                  const std::vector<float>& naive, DType dt) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  EXPECT_TRUE(all_finite(got) || std::string(what) == "lse") << what << " has NaN/Inf";
  const Tolerance tol = tolerance(dt);
  const double err = rel_norm_error(got, ref);
  if (dt == DType::f32 || std::string(what) == "lse") {
    EXPECT_LE(err, dt == DType::f32 ? tol.rel_norm : kLseRelNorm) << what << ": ||diff||/||ref|| = " << err;
    return;
  }
  const double excess = allclose_excess(got, ref, tol.atol, tol.rtol);
  EXPECT_LE(excess, 0.0) << what << ": some element exceeds atol + rtol |ref| by " << excess;
  const double naive_err = rel_norm_error(naive, ref);
  EXPECT_LE(err, tol.naive_factor * naive_err + 1e-6)
      << what << ": error " << err << " vs naive same-precision error " << naive_err;
}

// The awkward cases: 1-token documents, head dims 16, 59, 111, MLA, GQA, cross-attention,
// dropout. The emulated fp16 rows run these alone (below), and so do, under a sanitizer, the
// emulated paths' rows where the CPU has their native path.
constexpr std::string_view kAwkwardCases[] = {"one_token_docs", "seqlen_1_dim16",   "fewer_queries_gqa8",
                                              "mla_192_128",    "no_mask_dim59",    "no_mask_more_queries",
                                              "win_none_mla_gqa_dropout"};

// The case table's indices of `names`; a name the table lacks throws (a renamed case must not
// drop out of a list silently).
std::vector<size_t> cases_named(std::span<const std::string_view> names) {
  std::vector<size_t> idx;
  for (const std::string_view n : names) {
    for (size_t i = 0; i < cases().size(); ++i)
      if (cases()[i].name == n) idx.push_back(i);
    if (idx.empty() || cases()[idx.back()].name != n)
      throw std::invalid_argument("cases_named: the case table has no case named " + std::string(n));
  }
  return idx;
}

// Under a sanitizer (tests/sanitize.hpp) the emulated paths' scalar products are most of the
// kernel tests' time (70 s of the asan build's case table, amx_emulated's bf16 rows above all).
// bf16_emulated beside avx512_bf16: the native rows run the same kernel template under the
// sanitizer (at their own vector width) and kernel_bf16_dot the emulated product's own code, so
// the emulated rows run the awkward cases alone and the tests that loop over every path
// (scratch, grad_share, kv_pack_share) leave it out. amx_emulated beside amx keeps more: the
// native tiles load, store and multiply in inline assembly, which no sanitizer sees, so the
// emulated tiles' memcpy are the only check of how far tile reads and writes reach (and its
// scalar K/V packing is its own code); it runs the awkward cases and those whose keys span
// several 256-key pieces or many documents, and stays in the loops. The optimized build, and a
// CPU without the native path, run every row.
constexpr std::string_view kTileReachCases[] = {"mha_short_queries_long_keys", "seqlen_1025", "many_docs"};
// The loops over every path: bf16_emulated beside avx512_bf16 is left out under a sanitizer.
bool loop_skips_under_sanitizer(KernelPath path) {
  return test::kSanitize && path == KernelPath::bf16_emulated && kernel_path_supported(KernelPath::avx512_bf16);
}
// The case table's rows: case `ci` on `path`. Both lists are looked up in every build, so a
// renamed case fails the optimized build's rows too.
bool skipped_under_sanitizer(size_t ci, KernelPath path) {
  static const std::vector<size_t> awkward = cases_named(kAwkwardCases), tile_reach = cases_named(kTileReachCases);
  const auto in = [ci](const std::vector<size_t>& v) { return std::ranges::find(v, ci) != v.end(); };
  if (!test::kSanitize || in(awkward)) return false;
  if (path == KernelPath::amx_emulated) return kernel_path_supported(KernelPath::amx) && !in(tile_reach);
  return loop_skips_under_sanitizer(path);
}

TEST_P(kernel_table, MatchesReference) {
  const auto [ci, dt, path] = GetParam();
  if (!kernel_path_supported(path))
    GTEST_SKIP() << "kernel path " << to_string(path) << " is not supported by this CPU"
                 << (path == KernelPath::amx ? " (it needs AVX-512, AVX512_BF16, AMX-TILE, AMX-BF16 and Linux's "
                                               "permission for "
                                               "tile data; amx_emulated runs its algorithm here)"
                                             : "");
  if (skipped_under_sanitizer(ci, path))
    GTEST_SKIP() << "under a sanitizer, " << to_string(path) << " runs a few cases where the CPU has its native "
                 << "path (the optimized build runs this row)";
  const Truth& t = truth(ci, dt);
  const Problem pb(cases()[ci], dt, 1234 + ci);
  const Results fwd_only = run_kernels(pb, dt, path, 2);
  const Results r = run_kernels(pb, dt, path, 2, &t.out_d, &t.ref.lse);
  expect_close("out", fwd_only.out, t.ref.out, t.naive.out, dt);
  expect_close("lse", fwd_only.lse, t.ref.lse, t.naive.lse, dt);
  expect_close("dq", r.dq, t.ref.dq, t.naive.dq, dt);
  expect_close("dk", r.dk, t.ref.dk, t.naive.dk, dt);
  expect_close("dv", r.dv, t.ref.dv, t.naive.dv, dt);
}

std::string table_name(const ::testing::TestParamInfo<TableParam>& info) {
  const auto [ci, dt, path] = info.param;
  return cases()[ci].name + "_" + std::string(to_string(dt)) + "_" + std::string(to_string(path));
}

INSTANTIATE_TEST_SUITE_P(
    kernels, kernel_table,
    ::testing::Combine(::testing::Range<size_t>(0, attention_cases().size()),
                       ::testing::Values(DType::f32, DType::f16, DType::bf16),
                       ::testing::Values(KernelPath::portable, KernelPath::avx2,
                                         KernelPath::avx512)),
    table_name);

// The bf16 paths differ from their base paths only for bf16 storage: their rows of the case
// table run bf16 alone (avx512_bf16 where the CPU has AVX512_BF16, bf16_emulated on AVX2).
INSTANTIATE_TEST_SUITE_P(
    kernels_bf16_dot, kernel_table,
    ::testing::Combine(::testing::Range<size_t>(0, attention_cases().size()), ::testing::Values(DType::bf16),
                       ::testing::Values(KernelPath::avx512_bf16, KernelPath::bf16_emulated)),
    table_name);

// The amx paths differ from their base paths only for bf16 and fp16 storage: their rows run
// those (amx where the CPU has AMX and the OS grants tile data, amx_emulated on AVX2). The
// emulated fp16 rows differ from the bf16 ones only in the 16-bit format (the tiling is the
// same code), so they run on the awkward cases alone (kAwkwardCases), keeping the emulator's
// share of the suite small.
INSTANTIATE_TEST_SUITE_P(
    kernels_amx, kernel_table,
    ::testing::Combine(::testing::Range<size_t>(0, attention_cases().size()),
                       ::testing::Values(DType::f16, DType::bf16), ::testing::Values(KernelPath::amx)),
    table_name);
INSTANTIATE_TEST_SUITE_P(
    kernels_amx_emulated, kernel_table,
    ::testing::Combine(::testing::Range<size_t>(0, attention_cases().size()), ::testing::Values(DType::bf16),
                       ::testing::Values(KernelPath::amx_emulated)),
    table_name);
INSTANTIATE_TEST_SUITE_P(
    kernels_amx_emulated_fp16, kernel_table,
    ::testing::Combine(::testing::ValuesIn(cases_named(kAwkwardCases)),
                       ::testing::Values(DType::f16), ::testing::Values(KernelPath::amx_emulated)),
    table_name);

// ---- large scores ---------------------------------------------------------------------------
TEST(kernel_attention, LargeMagnitudeScoresStayFinite) {
  const AttnCase c{"large", {97, 40}, {97, 40}, 2, 1, 64, 64, MaskType::causal};
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const Problem pb(c, dt, 7, 30.0f);  // |q.k| * scale reaches the thousands
    const Results ref = run_reference(pb, DType::f32, RefAccum::f64);
    const Results got = run_kernels(pb, dt, KernelPath::automatic, 2, nullptr, &ref.lse);
    for (const auto* v : {&got.out, &got.lse, &got.dq, &got.dk, &got.dv})
      EXPECT_TRUE(all_finite(*v)) << to_string(dt);
    EXPECT_LE(rel_norm_error(got.lse, ref.lse), kLseRelNorm) << to_string(dt);
    EXPECT_LE(rel_norm_error(got.out, ref.out), dt == DType::f32 ? 1e-3 : 5e-2) << to_string(dt);
  }
}

// dP = dO . V reaches ~1e5 with |dO|, |V| <= 300: on 2-key documents dS = P (dP - delta) ~
// (dP_1 - dP_2) / 4 is past fp16's range (65504) in its fp32 form while dQ, dK (one term per
// query or key, times the softmax scale) and dV stay inside it; a path that rounded dS to
// fp16 for the dK and dQ products (the fp16 tiles did) gives inf where the reference is
// finite. Every path this CPU runs, fp16 storage.
TEST(kernel_attention, LargeGradientsStayFiniteInFp16OnEveryPath) {
  const AttnCase c{"large_grad", {2, 2, 2, 2, 2, 2, 2, 2}, {2, 2, 2, 2, 2, 2, 2, 2}, 2, 1, 128, 128, MaskType::none};
  Problem pb(c, DType::f32, 11);
  for (float& x : pb.v.f) x *= 300.0f;
  for (float& x : pb.dout.f) x *= 300.0f;
  const Results ref = run_reference(pb, DType::f32, RefAccum::f64);
  for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::amx,
                          KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path)) continue;
    const Results got = run_kernels(pb, DType::f16, path, 1, nullptr, &ref.lse);
    for (const auto* v : {&got.dq, &got.dk, &got.dv}) EXPECT_TRUE(all_finite(*v)) << to_string(path);
    EXPECT_LE(rel_norm_error(got.dk, ref.dk), 2e-2) << to_string(path);
    EXPECT_LE(rel_norm_error(got.dq, ref.dq), 2e-2) << to_string(path);
    EXPECT_LE(rel_norm_error(got.dv, ref.dv), 2e-2) << to_string(path);
  }
}

// Logits of ~1e9 (fp16 q, k up to +-60000): the backward recomputes P = exp(S - lse) with S's
// products in another order than the forward's, and fp32 rounding of S is then several
// hundreds, so S - lse can come out > 0 where it is <= 0 exactly. P is a probability: the
// backward clamps it at 1 (before, dV came out inf on every vector and tile path). With P <= 1,
// |dV[j][d]| <= sum over the query rows and heads that see key j of |dO[i][h][d]|: checked
// on every path this CPU runs, for one document without a mask and one causal.
TEST(kernel_attention, RecomputedProbabilitiesStayAtMostOneInTheBackward) {
  for (MaskType mask : {MaskType::none, MaskType::causal}) {
    const AttnCase c{"huge_logits", {61}, {61}, 4, 2, 64, 64, mask};
    const Problem pb(c, DType::f16, 5, 60000.0f);
    const int group = c.num_heads_q / c.num_heads_k, d = c.head_dim_v;
    for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                            KernelPath::amx, KernelPath::amx_emulated}) {
      if (!kernel_path_supported(path)) continue;
      const Results got = run_kernels(pb, DType::f16, path, 1);
      double worst = 0;  // max over dV elements of |dV| / bound
      for (int64_t j = 0; j < c.total_k(); ++j)
        for (int hk = 0; hk < c.num_heads_k; ++hk)
          for (int e = 0; e < d; ++e) {
            double bound = 0;
            for (int64_t i = mask == MaskType::causal ? j : 0; i < c.total_q(); ++i)
              for (int h = hk * group; h < (hk + 1) * group; ++h)
                bound += std::abs(pb.dout.f[static_cast<size_t>((i * c.num_heads_q + h) * d + e)]);
            const double dv = got.dv[static_cast<size_t>((j * c.num_heads_k + hk) * d + e)];
            worst = std::max(worst, std::isfinite(dv) ? std::abs(dv) / (bound * 1.01 + 1e-3) : HUGE_VAL);
          }
      EXPECT_LE(worst, 1.0) << to_string(path) << " mask " << static_cast<int>(mask);
      // (dQ and dK, scale x dS x K or Q with |K|, |Q| near 2000... 60000, may pass fp16's range.)
      for (const auto* v : {&got.out, &got.lse, &got.dv})
        EXPECT_TRUE(all_finite(*v)) << to_string(path) << " mask " << static_cast<int>(mask);
    }
  }
}

// A dropout that keeps fewer than 1 in 65504 (p = 0.99999: a kept P / (1 - p) up to 1e5): the
// fp16 tiles (amx_emulated, amx with AMX-FP16) rounded that operand to fp16, inf, and out and
// dV with it; they now run such calls on the FMA code. A 1-token document (P = 1) and a seed
// that keeps its one entry, V and dO of 0.1 (out = 1e4, within fp16), every path against the
// reference.
TEST(kernel_attention, ADropoutThatKeepsAlmostNothingStaysFiniteInFp16) {
  constexpr float p = 0.99999f;
  uint64_t seed = 1;
  while (!dropout_keep(seed, 0, 0, 0, 0, p)) ++seed;  // (about 1e5 tries)
  const AttnCase c{"keep_one", {1}, {1}, 1, 1, 16, 16, MaskType::none};
  Problem pb(c, DType::f16, 7);
  for (std::size_t i = 0; i < pb.v.f.size(); ++i) pb.v.set(i, 0.1f);
  for (std::size_t i = 0; i < pb.dout.f.size(); ++i) pb.dout.set(i, 0.1f);
  for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::amx,
                          KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path)) continue;
    auto go = [&](bool ref) {
      Tensor out(DType::f16, pb.out_shape()), dq(DType::f16, pb.q_shape()), dk(DType::f32, pb.k_shape()),
          dv(DType::f32, pb.v_shape());
      std::vector<float> lse(pb.lse_size());
      AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 1, &pb.work);
      fp.in.options.dropout_p = p;
      fp.in.options.seed = seed;
      ref ? attention_forward_reference(fp) : attention_forward(fp);
      AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, path, 1, &pb.work);
      bp.in.options.dropout_p = p;
      bp.in.options.seed = seed;
      ref ? attention_backward_reference(bp) : attention_backward(bp);
      return Results{out.values(), lse, dq.values(), dk.f, dv.f};
    };
    const Results got = go(false), want = go(true);
    ASSERT_GT(want.out[0], 5000.0f) << "the entry was not kept (seed " << seed << ")";
    for (auto m : {&Results::out, &Results::dv}) {
      EXPECT_TRUE(all_finite(got.*m)) << to_string(path);
      EXPECT_LE(rel_norm_error(got.*m, want.*m), tolerance(DType::f16).rel_norm) << to_string(path);
    }
  }
}

// ---- determinism ----------------------------------------------------------------------------
TEST(kernel_attention, BackwardIsBitwiseReproducibleAndThreadCountIndependent) {
  const AttnCase c{"det", {150, 1, 77, 200}, {150, 1, 77, 200}, 4, 2, 64, 64, MaskType::causal};
  for (DType dt : {DType::f32, DType::bf16}) {
    const Problem pb(c, dt, 99);
    const Results first = run_kernels(pb, dt, KernelPath::automatic, 2);
    for (int rep = 0; rep < 20; ++rep) {
      const int threads = rep % 3 + 1;  // 1, 2, 3 threads
      const Results r = run_kernels(pb, dt, KernelPath::automatic, threads);
      ASSERT_EQ(r.out, first.out) << "rep " << rep;
      ASSERT_EQ(r.lse, first.lse) << "rep " << rep;
      ASSERT_EQ(r.dq, first.dq) << "rep " << rep << " threads " << threads;
      ASSERT_EQ(r.dk, first.dk) << "rep " << rep << " threads " << threads;
      ASSERT_EQ(r.dv, first.dv) << "rep " << rep << " threads " << threads;
    }
  }
}

// The forward hands its units to whichever thread is free (parallel_for_dynamic), so which
// thread runs a unit changes from call to call: on every path this CPU runs, every thread count
// gives one thread's results bitwise, call after call, in fp32, fp16 and bf16. Two cases: GQA
// of two kv heads of five query heads (forward sets of 4 and 1) with MLA-like head dims, a
// window and ALiBi; and 64-dim heads (the tiles' S = Q K^T job) with softcap and dropout.
TEST(kernel_attention, EveryPathIsBitwiseOneThreadForAnyThreadCount) {
  AttnCase gqa{"det_gqa", {150, 1, 77, 200}, {150, 1, 77, 200}, 10, 2, 40, 24, MaskType::causal};
  gqa.window_left = 90;
  gqa.alibi = true;
  AttnCase soft{"det_soft", {130, 3, 96}, {130, 3, 96}, 4, 2, 64, 64, MaskType::causal};
  soft.softcap = 20.0f;
  soft.dropout_p = 0.2f;
  for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                          KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path) || loop_skips_under_sanitizer(path)) continue;
    for (const AttnCase* c : {&gqa, &soft})
      for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
        const Problem pb(*c, dt, 7);
        const Results one = run_kernels(pb, dt, path, 1);
        for (int rep = 0; rep < (test::kSanitize ? 3 : 6); ++rep) {  // (each count once under a sanitizer)
          const int threads = rep % 3 + 2;  // 2, 3, 4 threads
          const Results r = run_kernels(pb, dt, path, threads);
          const std::string at = c->name + " " + std::string(to_string(path)) + " " + std::string(to_string(dt)) +
                                 " threads " + std::to_string(threads);
          ASSERT_EQ(r.out, one.out) << at;
          ASSERT_EQ(r.lse, one.lse) << at;
          ASSERT_EQ(r.dq, one.dq) << at;
          ASSERT_EQ(r.dk, one.dk) << at;
          ASSERT_EQ(r.dv, one.dv) << at;
        }
      }
  }
}

// AttnInputs::progress: called during a call that runs long enough, on the calling thread alone
// (whatever the thread count), with results bitwise those of a call without it; what it throws
// ends the call and comes out of it. Every path the CPU runs, fp32 and bf16 (the tiles' forward
// has a loop of its own around the pieces).
TEST(kernel_attention, ProgressRunsOnTheCallingThreadAndChangesNothing) {
  // A forward of 0.7 GFLOP (a few ms on three threads of the vector paths), on the AMX
  // instructions 11 GFLOP (their ~1 TFLOP/s per core would run the small one in ~0.2 ms): each
  // call's loop runs several intervals on any CPU.
  const AttnCase small{"progress", {1000, 1, 600}, {1000, 1, 600}, 4, 2, 64, 64, MaskType::causal};
  const AttnCase large{"progress_amx", {4000, 1, 2400}, {4000, 1, 2400}, 4, 2, 64, 64, MaskType::causal};
  for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                          KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path) || loop_skips_under_sanitizer(path)) continue;
    const AttnCase& c = path == KernelPath::amx ? large : small;
    for (DType dt : {DType::f32, DType::bf16}) {
      const Problem pb(c, dt, 11);
      const Tensor Q = pb.q.as(dt), K = pb.k.as(dt), V = pb.v.as(dt), dO = pb.dout.as(dt);
      for (int threads : {1, 3}) {
        const std::string at = std::string(to_string(path)) + " " + std::string(to_string(dt)) + " threads " +
                               std::to_string(threads);
        const Results plain = run_kernels(pb, dt, path, threads);
        int calls = 0, elsewhere = 0;
        double shortest_gap = 1e9;  // from the end of one call to the start of the next, seconds
        std::chrono::steady_clock::time_point last_end{};
        const std::thread::id caller = std::this_thread::get_id();
        const std::function<void()> count = [&] {
          const auto start = std::chrono::steady_clock::now();
          ++calls;  // (only the caller may call: elsewhere counts the calls that did not)
          if (std::this_thread::get_id() != caller) ++elsewhere;
          if (last_end != std::chrono::steady_clock::time_point{})
            shortest_gap = std::min(shortest_gap, std::chrono::duration<double>(start - last_end).count());
          // (a callback that takes time, as a transfer's copy does)
          const auto until = start + std::chrono::microseconds(50);
          while (std::chrono::steady_clock::now() < until) {
          }
          last_end = std::chrono::steady_clock::now();
        };
        Tensor out(dt, pb.out_shape()), dq(dt, pb.q_shape()), dk(dt, pb.k_shape()), dv(dt, pb.v_shape());
        std::vector<float> lse(pb.lse_size());
        AttnFwdParams fp = pb.fwd(Q, K, V, out, lse.data(), path, threads);
        fp.in.progress = &count;
        attention_forward(fp);
        const int fwd_calls = calls;
        AttnBwdParams bp = pb.bwd(Q, K, V, out, lse.data(), dO, dq, dk, dv, path, threads);
        bp.in.progress = &count;
        last_end = {};  // (the interval restarts with each call)
        attention_backward(bp);
        ASSERT_GE(fwd_calls, 2) << at;  // (so that the gaps below are measured)
        ASSERT_GE(calls - fwd_calls, 2) << at;
        EXPECT_EQ(elsewhere, 0) << at;
        EXPECT_GE(shortest_gap, kProgressInterval) << at;  // throttled
        ASSERT_EQ(out.values(), plain.out) << at;
        ASSERT_EQ(lse, plain.lse) << at;
        ASSERT_EQ(dq.values(), plain.dq) << at;
        ASSERT_EQ(dk.values(), plain.dk) << at;
        ASSERT_EQ(dv.values(), plain.dv) << at;

        const std::function<void()> fail = [] { throw std::runtime_error("from progress"); };
        fp.in.progress = &fail;
        bp.in.progress = &fail;
        // (the first call comes an interval into each call's loop, which runs several)
        const auto thrown = [](auto&& call) -> std::string {
          try {
            call();
          } catch (const std::exception& e) {
            return e.what();
          }
          return "nothing thrown";
        };
        EXPECT_EQ(thrown([&] { attention_forward(fp); }), "from progress") << at;
        EXPECT_EQ(thrown([&] { attention_backward(bp); }), "from progress") << at;
      }
    }
  }
}

// attention_backward_scratch_bytes(p, longest): the per-task buffers of a call whose longest task
// has that many query rows, as the work list's longest task counts them; clamped to the rows.
TEST(kernel_attention, ScratchBytesForTheLongestTask) {
  for (const DType dt : {DType::f32, DType::bf16})
    for (const KernelPath path : {KernelPath::portable, KernelPath::avx512, KernelPath::amx_emulated}) {
      if (!kernel_path_supported(path)) continue;  // (amx_emulated: the tiles' scratch, on any AVX2 CPU)
      SCOPED_TRACE(std::string(to_string(dt)) + " " + std::string(to_string(path)));
      const int64_t rows = 10000;
      AttnBwdParams p{.in = {.q = {nullptr, rows, 16, 128, dt},
                             .k = {nullptr, rows, 4, 128, dt},
                             .v = {nullptr, rows, 4, 128, dt},
                             .options = {.num_threads = 2, .path = path}}};
      for (const int64_t longest : {int64_t{0}, int64_t{1}, int64_t{300}, int64_t{4097}, rows}) {
        WorkList work;
        work.tasks.push_back({.q_len = 7});
        work.tasks.push_back({.q_len = longest});
        p.in.work = &work;
        const size_t listed = attention_backward_scratch_bytes(p);
        p.in.work = nullptr;
        EXPECT_EQ(attention_backward_scratch_bytes(p, std::max<int64_t>(longest, 7)), listed) << longest;
      }
      EXPECT_LT(attention_backward_scratch_bytes(p, 1), attention_backward_scratch_bytes(p, rows));
      EXPECT_EQ(attention_backward_scratch_bytes(p, -5), attention_backward_scratch_bytes(p, 0));
      EXPECT_EQ(attention_backward_scratch_bytes(p, rows * 4), attention_backward_scratch_bytes(p, rows));
      EXPECT_EQ(attention_backward_scratch_bytes(p, 0), attention_backward_scratch_bytes(p));  // no work list
    }
  // A shape-only request past size_t saturates: 2^50 key rows of 64 KV heads of dim 256 are
  // ~5.5e19 floats of packed K/V alone, which wrapped to a small size.
  const AttnBwdParams huge{.in = {.q = {nullptr, 1, 64, 256, DType::f32},
                                  .k = {nullptr, int64_t{1} << 50, 64, 256, DType::f32},
                                  .v = {nullptr, int64_t{1} << 50, 64, 256, DType::f32}}};
  EXPECT_EQ(attention_backward_scratch_bytes(huge, 1), std::numeric_limits<size_t>::max());
}

// The kernels keep their large scratch blocks between calls (src/kernels/scratch.cpp): a call
// that follows calls of other shapes, whose data the kept blocks still hold, gives bitwise what
// it gives on blocks fresh from the allocator, on every path this CPU runs; the cache holds
// blocks after a call and none after release_kernel_scratch.
TEST(kernel_attention, ScratchKeptBetweenCallsLeavesNoTrace) {
  // big: several forward and backward pieces per document (FBK = BBK = 128 keys, FBK_TILES = 256),
  // more packed K/V and longer tasks than small
  const AttnCase big{"big", {400, 1, 130, 333}, {400, 1, 130, 333}, 8, 2, 72, 72, MaskType::causal};
  const AttnCase small{"small", {5, 120, 64}, {5, 120, 64}, 4, 4, 128, 128, MaskType::causal};
  for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                                KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path) || loop_skips_under_sanitizer(path)) continue;
    for (const DType dt : {DType::f32, DType::bf16}) {
      // fp32 on the bf16 and tile paths runs their base path's code (kernel_bf16_dot and
      // kernel_amx_tiles' *Fp32TheBasePath tests), which the loop runs itself
      if (dt == DType::f32 && !(path == KernelPath::portable || path == KernelPath::avx2 || path == KernelPath::avx512))
        continue;
      SCOPED_TRACE(std::string(to_string(path)) + " " + std::string(to_string(dt)));
      const Problem pb(big, dt, 7), ps(small, dt, 8);
      release_kernel_scratch();
      ASSERT_EQ(kernel_scratch_cached_bytes(), 0u);
      const Results small_fresh = run_kernels(ps, dt, path, 2);
      EXPECT_GT(kernel_scratch_cached_bytes(), 0u) << "the call's blocks are kept";
      release_kernel_scratch();
      const Results big_fresh = run_kernels(pb, dt, path, 2);
      const Results small_after = run_kernels(ps, dt, path, 2);
      const Results big_after = run_kernels(pb, dt, path, 2);
      for (const auto& [what, a, b] : {std::tuple{"small out", &small_after.out, &small_fresh.out},
                                       {"small dq", &small_after.dq, &small_fresh.dq},
                                       {"small dk", &small_after.dk, &small_fresh.dk},
                                       {"small dv", &small_after.dv, &small_fresh.dv},
                                       {"big out", &big_after.out, &big_fresh.out},
                                       {"big lse", &big_after.lse, &big_fresh.lse},
                                       {"big dq", &big_after.dq, &big_fresh.dq},
                                       {"big dk", &big_after.dk, &big_fresh.dk},
                                       {"big dv", &big_after.dv, &big_fresh.dv}})
        EXPECT_EQ(*a, *b) << what;
      // Same shapes, so the same blocks: a call that reaches every key block (no mask) leaves
      // its gradients in them; a windowed call with fewer queries than keys reaches only the
      // last keys of each document, so the blocks it never reaches must read as unwritten
      // (zero gradients), not as the call before's.
      const AttnCase all{"all", {64, 40}, {1000, 700}, 8, 2, 72, 72, MaskType::none};
      AttnCase win = all;
      win.name = "win";
      win.mask = MaskType::causal;
      win.window_left = 32;
      win.window_right = 0;
      const Problem pa(all, dt, 9), pw(win, dt, 9);
      release_kernel_scratch();
      const Results win_fresh = run_kernels(pw, dt, path, 2);
      release_kernel_scratch();
      const Results all_first = run_kernels(pa, dt, path, 2);
      const Results win_after = run_kernels(pw, dt, path, 2);
      EXPECT_EQ(win_after.dk, win_fresh.dk) << "win dk";
      EXPECT_EQ(win_after.dv, win_fresh.dv) << "win dv";
      EXPECT_EQ(win_after.dq, win_fresh.dq) << "win dq";
      // Doc 0's query i sits at key 936 + i (causal, aligned to the end of its 1000 keys) and
      // sees keys from 904 + i: keys 0..903 are seen by no query. dK rows are Hkv * Dqk floats.
      const size_t unseen = static_cast<size_t>(904) * 2 * 72;
      ASSERT_GE(win_after.dk.size(), unseen);
      EXPECT_TRUE(std::all_of(win_after.dk.begin(), win_after.dk.begin() + unseen, [](float x) { return x == 0.0f; }));
      EXPECT_TRUE(std::any_of(all_first.dk.begin(), all_first.dk.begin() + unseen, [](float x) { return x != 0.0f; }))
          << "the unmasked call wrote those rows";
      release_kernel_scratch();
      EXPECT_EQ(kernel_scratch_cached_bytes(), 0u);
    }
  }
}

// ---- CP-style work lists ----------------------------------------------------------------------
// Each document cut in `chunks` query tasks; task j sees chunks 0..j as separate key runs, read
// from a rank-major-like permuted key buffer: k_perm row perm[r] holds key row r.
struct Chunked {
  WorkList w;
};
WorkList chunked_worklist(const AttnCase& c, int chunks) {
  WorkList w;
  const auto cq = c.cu_seqlens_q();
  for (size_t d = 0; d < c.q_lens.size(); ++d) {
    const int64_t len = c.q_lens[d];
    const int64_t csz = (len + chunks - 1) / chunks;
    for (int64_t s = 0; s < len; s += csz) {
      const int64_t e = std::min(len, s + csz);
      AttnTask t{.q_row = cq[d] + s, .q_len = e - s, .q_pos = s, .doc = static_cast<int64_t>(d),
                 .run_begin = static_cast<int64_t>(w.runs.size()), .run_end = 0};
      for (int64_t ks = 0; ks < e; ks += csz)
        w.runs.push_back({.row = cq[d] + ks, .len = std::min(e, ks + csz) - ks, .pos = ks});
      t.run_end = static_cast<int64_t>(w.runs.size());
      w.tasks.push_back(t);
    }
  }
  return w;
}

TEST(kernel_attention, DropoutSameForAnyTaskSplitAndMatchesReference) {
  const AttnCase c{"drop", {97, 64, 130}, {97, 64, 130}, 2, 1, 32, 32, MaskType::causal};
  const Problem pb(c, DType::f32, 5);
  const WorkList chunks = chunked_worklist(c, 4);
  ASSERT_GT(chunks.tasks.size(), pb.work.tasks.size());
  auto go = [&](const WorkList& w, bool ref, float p) {
    Tensor out(DType::f32, pb.out_shape()), dq(DType::f32, pb.q_shape()),
        dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
    std::vector<float> lse(pb.lse_size());
    AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 2, &w);
    fp.in.options.dropout_p = p;
    fp.in.options.seed = 42;
    ref ? attention_forward_reference(fp) : attention_forward(fp);
    AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv,
                              KernelPath::automatic, 2, &w);
    bp.in.options.dropout_p = p;
    bp.in.options.seed = 42;
    ref ? attention_backward_reference(bp) : attention_backward(bp);
    return Results{out.f, lse, dq.f, dk.f, dv.f};
  };
  const Results ref_docs = go(pb.work, true, 0.3f);
  const Results ref_chunks = go(chunks, true, 0.3f);
  const Results fast_docs = go(pb.work, false, 0.3f);
  const Results fast_chunks = go(chunks, false, 0.3f);
  const Results no_drop = go(pb.work, false, 0.0f);
  for (auto m : {&Results::out, &Results::lse, &Results::dq, &Results::dk, &Results::dv}) {
    EXPECT_LE(rel_norm_error(ref_chunks.*m, ref_docs.*m), 1e-12);
    EXPECT_LE(rel_norm_error(fast_docs.*m, ref_docs.*m), tolerance(DType::f32).rel_norm);
    EXPECT_LE(rel_norm_error(fast_chunks.*m, ref_docs.*m), tolerance(DType::f32).rel_norm);
  }
  EXPECT_GT(rel_norm_error(no_drop.out, fast_docs.out), 1e-2) << "dropout changed nothing";
}

// The backward's units are (kv head, set of query heads) with the sets fixed by the shape
// (blocking.hpp's bwd_set_heads; fp32 here, whose sets do not depend on task lengths): Hq =
// 40, Hkv = 4 gives sets of 4, 4 and 2 heads per kv head, Hq = 3, Hkv = 1 (MQA) sets of 2 and 1. With CP-style tasks that share key rows, the
// gradients match the float64 reference and are bitwise the same for 1 to 4 threads.
TEST(kernel_attention, BackwardHeadSetsMatchReferenceForAnyThreadCount) {
  for (const AttnCase& c : {AttnCase{"sets", {130, 1, 300}, {130, 1, 300}, 40, 4, 40, 24, MaskType::causal},
                            AttnCase{"mqa", {97, 1, 200}, {97, 1, 200}, 3, 1, 59, 59, MaskType::causal}}) {
    const Problem pb(c, DType::f32, 21);
    const WorkList chunks = chunked_worklist(c, 3);  // tasks share key rows
    ASSERT_GT(chunks.tasks.size(), pb.work.tasks.size());
    auto go = [&](bool ref, int threads) {
      Tensor out(DType::f32, pb.out_shape()), dq(DType::f32, pb.q_shape()),
          dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
      std::vector<float> lse(pb.lse_size());
      AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, threads, &chunks);
      ref ? attention_forward_reference(fp) : attention_forward(fp);
      AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv,
                                KernelPath::automatic, threads, &chunks);
      ref ? attention_backward_reference(bp) : attention_backward(bp);
      return Results{out.f, lse, dq.f, dk.f, dv.f};
    };
    const Results ref = go(true, 1);
    const Results one = go(false, 1);
    for (auto m : {&Results::dq, &Results::dk, &Results::dv})
      EXPECT_LE(rel_norm_error(one.*m, ref.*m), tolerance(DType::f32).rel_norm) << c.name;
    for (int threads = 2; threads <= 4; ++threads) {
      const Results r = go(false, threads);
      EXPECT_EQ(r.dq, one.dq) << c.name << " threads " << threads;
      EXPECT_EQ(r.dk, one.dk) << c.name << " threads " << threads;
      EXPECT_EQ(r.dv, one.dv) << c.name << " threads " << threads;
    }
  }
}

// The same in bf16 on the best path (bf16 tiles where the CPU has AMX): a group of 4 query
// heads runs as one set when no task has more than BWD_LONG_TASK = 4096 rows, and as 2 sets of
// 2 with a task of 4200 rows. Both match the float64 reference and are bitwise the same for 1
// to 3 threads.
TEST(kernel_attention, Bf16BackwardHeadSetsOfShortAndLongTasksMatchReference) {
  for (const AttnCase& c : {AttnCase{"short", {130, 1, 300}, {130, 1, 300}, 4, 1, 8, 8, MaskType::causal},
                            AttnCase{"long", {37, 4200}, {37, 4200}, 4, 1, 8, 8, MaskType::causal}}) {
    const Problem pb(c, DType::bf16, 23);
    const Results ref = run_reference(pb, DType::f32, RefAccum::f64);
    const Results one = run_kernels(pb, DType::bf16, KernelPath::automatic, 1, nullptr, &ref.lse);
    const Tolerance tol = tolerance(DType::bf16);  // elementwise: |diff| <= atol + rtol |ref|
    for (auto m : {&Results::dq, &Results::dk, &Results::dv}) {
      ASSERT_EQ((one.*m).size(), (ref.*m).size());
      size_t bad = 0;
      for (size_t i = 0; i < (ref.*m).size(); ++i)
        bad += std::abs((one.*m)[i] - (ref.*m)[i]) > tol.atol + tol.rtol * std::abs((ref.*m)[i]);
      EXPECT_EQ(bad, 0u) << c.name;
    }
    for (int threads = 2; threads <= 3; ++threads) {
      const Results r = run_kernels(pb, DType::bf16, KernelPath::automatic, threads, nullptr, &ref.lse);
      EXPECT_EQ(r.dq, one.dq) << c.name << " threads " << threads;
      EXPECT_EQ(r.dk, one.dk) << c.name << " threads " << threads;
      EXPECT_EQ(r.dv, one.dv) << c.name << " threads " << threads;
    }
  }
}

// Heads [h0, h0 + n) of a contiguous [rows, heads, dim] view (const or not).
template <class View>
View head_slice(View view, int h0, int n) {
  View s = view;
  s.data = static_cast<std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(view.data)>>,
                                          const std::byte*, std::byte*>>(view.data) +
           static_cast<std::size_t>(h0) * view.dim * dtype_size(view.dtype);
  s.heads = n;
  s.row_stride = int64_t{view.heads} * view.dim;
  s.head_stride = view.dim;
  return s;
}

// One call per kv head (its query heads as strided views, its lse columns) gives bitwise what
// the whole call gives: the backward's head sets depend on the group size (and on bf16 tiles
// the longest task) alone, never on the call's kv heads (what the overlapped CP backward's
// per-group calls rely on). Groups of 5 (sets of 3 and 2 heads) and 8 (2 sets of 4), tasks
// sharing key rows, fp32 and bf16.
TEST(kernel_attention, OneCallPerKvHeadIsBitwiseTheWholeCall) {
  for (const AttnCase& c : {AttnCase{"g5", {130, 1, 300}, {130, 1, 300}, 10, 2, 40, 24, MaskType::causal},
                            AttnCase{"g8", {97, 1, 200}, {97, 1, 200}, 16, 2, 32, 32, MaskType::causal}})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(c.name + std::string(" ") + std::string(to_string(dt)));
      const Problem pb(c, dt, 31);
      const WorkList chunks = chunked_worklist(c, 3);
      const int g = c.num_heads_q / c.num_heads_k;
      const int64_t tq = c.total_q();
      Tensor out(dt, pb.out_shape()), dq(dt, pb.q_shape()), dk(dt, pb.k_shape()), dv(dt, pb.v_shape());
      std::vector<float> lse(pb.lse_size());
      attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 2, &chunks));
      attention_backward(pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 2, &chunks));
      Tensor out_s(dt, pb.out_shape()), dq_s(dt, pb.q_shape()), dk_s(dt, pb.k_shape()), dv_s(dt, pb.v_shape());
      std::vector<float> lse_s(pb.lse_size()), lse_h(static_cast<std::size_t>(tq * g));
      for (int hk = 0; hk < c.num_heads_k; ++hk) {
        const AttnInputs in{.q = head_slice(pb.q.view(), hk * g, g), .k = head_slice(pb.k.view(), hk, 1),
                            .v = head_slice(pb.v.view(), hk, 1), .work = &chunks,
                            .options = pb.options(KernelPath::automatic, 2)};
        attention_forward({.in = in, .out = head_slice(out_s.view(), hk * g, g), .lse = lse_h.data()});
        for (int64_t i = 0; i < tq; ++i)
          std::copy_n(lse_h.begin() + i * g, g, lse_s.begin() + i * c.num_heads_q + hk * g);
        attention_backward({.in = in, .out = head_slice(out.view(), hk * g, g), .lse = lse_h.data(),
                            .dout = head_slice(pb.dout.view(), hk * g, g), .dq = head_slice(dq_s.view(), hk * g, g),
                            .dk = head_slice(dk_s.view(), hk, 1), .dv = head_slice(dv_s.view(), hk, 1)});
      }
      EXPECT_EQ(out_s.values(), out.values());
      EXPECT_EQ(lse_s, lse);
      EXPECT_EQ(dq_s.values(), dq.values());
      EXPECT_EQ(dk_s.values(), dk.values());
      EXPECT_EQ(dv_s.values(), dv.values());
    }
}

// With fp32 products on AVX-512 the forward runs a set's heads' sub-blocks of the same rows as
// one grouped product (kernel_impl.hpp, gemm_groups), which must give each element the sum a
// call of that head alone gives (no group: a sub-block at a time): one call per query head
// against the whole call, out and lse bit for bit, with GQA sets of 4 + 2 and 4 heads, on every
// path this CPU has (the grouped ones: avx512, and fp32 / fp16 storage on avx512_bf16 and amx).
TEST(kernel_attention, ForwardOfOneCallPerQueryHeadIsBitwiseTheWholeCall) {
  for (const AttnCase& c : {AttnCase{"g6", {130, 1, 300}, {130, 1, 300}, 12, 2, 40, 24, MaskType::causal},
                            AttnCase{"g4", {97, 33, 200}, {97, 33, 200}, 8, 2, 64, 64, MaskType::none}})
    for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                            KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated})
      for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
        if (!kernel_path_supported(path)) continue;
        SCOPED_TRACE(c.name + std::string(" ") + std::string(to_string(path)) + " " + std::string(to_string(dt)));
        const Problem pb(c, dt, 37);
        const WorkList chunks = chunked_worklist(c, 3);
        const int g = c.num_heads_q / c.num_heads_k;
        const int64_t tq = c.total_q();
        Tensor out(dt, pb.out_shape()), out_s(dt, pb.out_shape());
        std::vector<float> lse(pb.lse_size()), lse_s(pb.lse_size()), lse_h(static_cast<std::size_t>(tq));
        attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 1, &chunks));
        for (int h = 0; h < c.num_heads_q; ++h) {
          const AttnInputs in{.q = head_slice(pb.q.view(), h, 1), .k = head_slice(pb.k.view(), h / g, 1),
                              .v = head_slice(pb.v.view(), h / g, 1), .work = &chunks, .options = pb.options(path, 1)};
          attention_forward({.in = in, .out = head_slice(out_s.view(), h, 1), .lse = lse_h.data()});
          for (int64_t i = 0; i < tq; ++i) lse_s[static_cast<std::size_t>(i * c.num_heads_q + h)] = lse_h[i];
        }
        EXPECT_EQ(out_s.values(), out.values());
        EXPECT_EQ(lse_s, lse);
      }
}

// A call's tasks split by documents over calls into the same outputs (the overlapped CP
// forward and backward: docs/cp.md "Overlap"): each call reads only the K/V rows its tasks'
// runs name (the others hold NaN during it: a block shared with the other call's documents
// included) and, with named_rows_only and the whole call's longest_task, writes only those
// dK/dV rows; together the calls give bitwise the whole call, and rows that no run names (a
// document left out of every task) keep what they held. Every path this CPU runs, every
// dtype, GQA, a 1-token document.
TEST(kernel_attention, CallsOverDocumentsReadAndWriteOnlyTheirRowsAndAreBitwiseTheWholeCall) {
  const AttnCase c{"split", {300, 1, 45, 700, 9}, {300, 1, 45, 700, 9}, 4, 2, 40, 24, MaskType::causal};
  for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                          KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated})
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      if (!kernel_path_supported(path) || loop_skips_under_sanitizer(path)) continue;
      if (test::kSanitize && path == KernelPath::amx_emulated && dt != DType::bf16) continue;  // (slow; bf16 is its own)
      SCOPED_TRACE(std::string(to_string(path)) + " " + std::string(to_string(dt)));
      const Problem pb(c, dt, 41);
      WorkList whole = pb.work;  // every document's tasks but the last document's: its rows named by none
      const int64_t last_doc = static_cast<int64_t>(c.q_lens.size()) - 1;
      std::erase_if(whole.tasks, [&](const AttnTask& t) { return t.doc == last_doc; });
      WorkList part_a = whole, part_b = whole;  // documents 0..2, and 3 (the longest task)
      std::erase_if(part_a.tasks, [](const AttnTask& t) { return t.doc >= 3; });
      std::erase_if(part_b.tasks, [](const AttnTask& t) { return t.doc < 3; });
      ASSERT_FALSE(part_a.tasks.empty());
      ASSERT_FALSE(part_b.tasks.empty());
      const auto named_by = [&](const WorkList& w) {
        std::vector<char> named(static_cast<std::size_t>(c.total_k()), 0);
        for (const AttnTask& t : w.tasks)
          for (int64_t r = t.run_begin; r < t.run_end; ++r)
            std::fill_n(named.begin() + w.runs[r].row, w.runs[r].len, char{1});
        return named;
      };
      // K and V with the rows `w` does not name as NaN
      const auto poisoned = [&](const Tensor& x, const WorkList& w) {
        Tensor y = x;
        const std::vector<char> named = named_by(w);
        const auto row = static_cast<std::size_t>(x.shape.heads) * x.shape.dim;
        for (std::size_t r = 0; r < named.size(); ++r)
          if (!named[r])
            for (std::size_t i = 0; i < row; ++i) y.set(r * row + i, std::numeric_limits<float>::quiet_NaN());
        return y;
      };
      Tensor out(dt, pb.out_shape()), dq(dt, pb.q_shape()), dk(dt, pb.k_shape()), dv(dt, pb.v_shape());
      std::vector<float> lse(pb.lse_size());
      attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 2, &whole));
      attention_backward(pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, path, 2, &whole));

      Tensor out_p(dt, pb.out_shape()), dq_p(dt, pb.q_shape()), dk_p(dt, pb.k_shape()), dv_p(dt, pb.v_shape());
      std::vector<float> lse_p(pb.lse_size());
      for (std::size_t i = 0; i < dk_p.size(); ++i) dk_p.set(i, 3.0f);  // what no run's rows may lose
      for (std::size_t i = 0; i < dv_p.size(); ++i) dv_p.set(i, -5.0f);
      for (const WorkList* w : {&part_a, &part_b}) {
        const Tensor k = poisoned(pb.k, *w), v = poisoned(pb.v, *w);
        attention_forward(pb.fwd(pb.q, k, v, out_p, lse_p.data(), path, 2, w));
        AttnBwdParams bp = pb.bwd(pb.q, k, v, out, lse.data(), pb.dout, dq_p, dk_p, dv_p, path, 2, w);
        bp.named_rows_only = true;
        bp.longest_task = 700;
        attention_backward(bp);
      }
      EXPECT_EQ(out_p.values(), out.values());
      EXPECT_EQ(lse_p, lse);
      EXPECT_EQ(dq_p.values(), dq.values());
      const std::vector<char> named = named_by(whole);
      const std::vector<float> dk_w = dk.values(), dv_w = dv.values(), dk_s = dk_p.values(), dv_s = dv_p.values();
      int64_t unnamed = 0;
      for (int64_t r = 0; r < c.total_k(); ++r) {
        const auto rk = static_cast<std::size_t>(c.num_heads_k * c.head_dim_qk), rv = static_cast<std::size_t>(c.num_heads_k * c.head_dim_v);
        const auto at = static_cast<std::size_t>(r);
        const std::vector<float> k_part(dk_s.begin() + at * rk, dk_s.begin() + (at + 1) * rk),
            v_part(dv_s.begin() + at * rv, dv_s.begin() + (at + 1) * rv);
        if (named[at]) {
          EXPECT_EQ(k_part, std::vector<float>(dk_w.begin() + at * rk, dk_w.begin() + (at + 1) * rk)) << "dk row " << r;
          EXPECT_EQ(v_part, std::vector<float>(dv_w.begin() + at * rv, dv_w.begin() + (at + 1) * rv)) << "dv row " << r;
        } else {
          ++unnamed;
          EXPECT_EQ(k_part, std::vector<float>(rk, 3.0f)) << "dk row " << r << " (no run names it)";
          EXPECT_EQ(v_part, std::vector<float>(rv, -5.0f)) << "dv row " << r << " (no run names it)";
        }
        if (HasFailure()) return;
      }
      EXPECT_EQ(unnamed, c.k_lens.back());
      // longest_task below a task of the call's own is refused
      AttnBwdParams bad = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq_p, dk_p, dv_p, path, 1, &part_b);
      bad.longest_task = 699;
      EXPECT_NE(error_of([&] { attention_backward(bad); }).find("longest_task must be 0 or between"), std::string::npos);
    }
}

TEST(kernel_attention, DropoutKeptFractionAndScaling) {
  // kept fraction over many pairs
  const float p = 0.25f;
  int64_t kept = 0, total = 0;
  for (int64_t qp = 0; qp < 300; ++qp)
    for (int64_t kp = 0; kp <= qp; ++kp, ++total) kept += dropout_keep(11, 3, 2, qp, kp, p);
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(total), 1.0 - p, 0.01);
  // scaling: equal scores (k = 0) and v = 1 give out = (#kept / n) / (1 - p) exactly in math
  const int64_t n = 200;
  AttnCase c{"scale", {1}, {n}, 1, 1, 16, 16, MaskType::none};
  Problem pb(c, DType::f32, 3);
  for (size_t i = 0; i < pb.k.size(); ++i) pb.k.set(i, 0.0f);
  for (size_t i = 0; i < pb.v.size(); ++i) pb.v.set(i, 1.0f);
  Tensor out(DType::f32, pb.out_shape());
  std::vector<float> lse(1);
  AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1);
  fp.in.options.dropout_p = p;
  fp.in.options.seed = 77;
  attention_forward(fp);
  int64_t k2 = 0;
  for (int64_t kp = 0; kp < n; ++kp) k2 += dropout_keep(77, 0, 0, n - 1, kp, p);
  const double expect = static_cast<double>(k2) / static_cast<double>(n) / (1.0 - p);
  for (float x : out.f) EXPECT_NEAR(x, expect, 1e-5);
  EXPECT_NEAR(lse[0], std::log(static_cast<double>(n)), 1e-5);  // lse ignores dropout
}

// ---- accumulation mode ----------------------------------------------------------------------
// The paths the accumulation tests run on for a storage dtype, each with the relative L2 error
// its products allow: the best path whose products are fp32 (fp32's rule, whatever the
// storage), and for bf16 storage the path whose P.V and dS products are bf16 dot products
// (avx512_bf16 where the CPU has AVX512_BF16, else bf16_emulated: the same dot step bitwise, on
// 8-lane instead of 16-lane vectors, so row sums may round differently).
// That path rounds P and dS to bf16 (relative error <= 2^-9 each, as GPU flash kernels do), so
// a sum of such products is allowed 2^-7 in norm, a margin taken from measurement (Zen 4's
// avx512_bf16: at most 2.3e-3, on out), not derived; a lost or doubled key piece is off by O(1).
struct AccPath {
  KernelPath path;
  double rel_norm;
};
std::vector<AccPath> accumulation_paths(DType dt) {
  const KernelPath fp32_products = best_kernel_path(DType::f32);
  // fp32's best path has no bf16 dot step, so bf16 storage runs on fp32 products there
  if (kernels::path_table(fp32_products)->bf16_dot != nullptr)
    ADD_FAILURE() << to_string(fp32_products) << " rounds bf16 products: the fp32 rule does not apply to it";
  std::vector<AccPath> paths{{fp32_products, tolerance(DType::f32).rel_norm}};
  if (dt == DType::bf16) {
    const KernelPath dot = kernel_path_supported(KernelPath::avx512_bf16) ? KernelPath::avx512_bf16 : KernelPath::bf16_emulated;
    if (kernel_path_supported(dot)) paths.push_back({dot, 0x1p-7});
    else std::cout << "[ SKIPPED  ] the bf16 dot-product paths: this CPU runs neither avx512_bf16 nor bf16_emulated (AVX2)\n";
  }
  return paths;
}

TEST(kernel_attention, AccumulateAddsIntoExistingBuffersAndSharesKeyRows) {
  for (const auto& [path, tol] : accumulation_paths(DType::bf16)) {
    SCOPED_TRACE(std::string(to_string(path)));
    const AttnCase c{"acc", {97, 130}, {97, 130}, 4, 2, 48, 32, MaskType::causal};
    const Problem pb(c, DType::bf16, 8);
    const WorkList chunks = chunked_worklist(c, 3);  // tasks share key rows
    Tensor out(DType::bf16, pb.out_shape()), dq(DType::bf16, pb.q_shape()),
        dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
    std::vector<float> lse(pb.lse_size());
    attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 2, &chunks));
    // fp32 accumulation views of [total_k, Hkv, Dqk] and [total_k, Hkv, Dv] buffers
    const auto dk_view = [&](std::vector<float>& x) {
      return contiguous(x.data(), c.total_k(), c.num_heads_k, c.head_dim_qk);
    };
    const auto dv_view = [&](std::vector<float>& x) {
      return contiguous(x.data(), c.total_k(), c.num_heads_k, c.head_dim_v);
    };
    std::vector<float> dk_acc(pb.dk_size()), dv_acc(pb.dv_size());
    for (size_t i = 0; i < dk_acc.size(); ++i) dk_acc[i] = 0.5f * static_cast<float>(i % 7);
    for (size_t i = 0; i < dv_acc.size(); ++i) dv_acc[i] = -0.25f * static_cast<float>(i % 5);
    const std::vector<float> dk0 = dk_acc, dv0 = dv_acc;
    AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv,
                              path, 2, &chunks);
    bp.grad_mode = GradMode::accumulate;
    bp.dk = dk_view(dk_acc);
    bp.dv = dv_view(dv_acc);
    attention_backward(bp);
    // reference in accumulate mode on the same buffers' initial contents
    std::vector<float> rk = dk0, rv = dv0;
    bp.dk = dk_view(rk);
    bp.dv = dv_view(rv);
    Tensor dq_ref(DType::bf16, pb.q_shape());
    bp.dq = dq_ref.view();
    attention_backward_reference(bp);
    EXPECT_LE(rel_norm_error(dk_acc, rk), tol);
    EXPECT_LE(rel_norm_error(dv_acc, rv), tol);
    // and it is "existing + the gradient": subtracting the start gives the one-task-per-doc
    // gradient of the same function
    std::vector<float> g(dk_acc.size()), g_ref(dk_acc.size());
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = dk_acc[i] - dk0[i];
      g_ref[i] = rk[i] - dk0[i];
    }
    EXPECT_LE(rel_norm_error(g, g_ref), std::max(1e-4, tol));
    // accumulating twice adds twice, bitwise the same increment
    std::vector<float> twice = dk_acc;
    bp.dk = dk_view(twice);
    std::vector<float> vv = dv_acc;
    bp.dv = dv_view(vv);
    bp.dq = dq.view();
    attention_backward(bp);
    for (size_t i = 0; i < twice.size(); i += 97) EXPECT_NEAR(twice[i] - dk_acc[i], g[i], 1e-5);
  }
}

// ---- a key set split over calls: OutMode::accumulate and GradMode::accumulate_all ----------
// Each task's key run cut in two at `at` of its length: the first parts and the second parts,
// two work lists whose union is `w` (what the ring CP scheme's steps are to one call).
std::pair<WorkList, WorkList> split_keys(const WorkList& w, double at) {
  std::pair<WorkList, WorkList> parts;
  for (const AttnTask& t : w.tasks)
    for (int64_t r = t.run_begin; r < t.run_end; ++r) {
      const KeyRun& k = w.runs[r];
      const int64_t n1 = std::max<int64_t>(1, static_cast<int64_t>(at * static_cast<double>(k.len)));
      const KeyRun pieces[2] = {{.row = k.row, .len = n1, .pos = k.pos},
                                {.row = k.row + n1, .len = k.len - n1, .pos = k.pos + n1}};
      for (int i = 0; i < 2; ++i) {
        if (pieces[i].len == 0) continue;
        WorkList& part = i == 0 ? parts.first : parts.second;
        AttnTask nt = t;
        nt.run_begin = static_cast<int64_t>(part.runs.size());
        part.runs.push_back(pieces[i]);
        nt.run_end = nt.run_begin + 1;
        part.tasks.push_back(nt);
      }
    }
  return parts;
}

// Documents of 1, 37 and 130 tokens, GQA, odd head dims, dropout: the forward over the two
// halves of every key run, accumulated into fp32 out and lse from "nothing yet", equals the
// float64 reference over the whole key set (fp32 and bf16 storage, read as stored).
TEST(kernel_attention, OutModeAccumulateOverASplitKeySetIsTheWholeForward) {
  for (const MaskType mask : {MaskType::causal, MaskType::none})
    for (const DType dt : {DType::f32, DType::bf16})
      for (const auto& [path, tol] : accumulation_paths(dt)) {
      SCOPED_TRACE(std::string(to_string(dt)) + (mask == MaskType::causal ? " causal " : " no mask ") +
                   std::string(to_string(path)));
      AttnCase c{"split", {1, 37, 130}, {1, 37, 130}, 4, 2, 33, 17, mask};
      c.dropout_p = 0.15f;
      const Problem pb(c, dt, 21);
      const auto [w1, w2] = split_keys(pb.work, 0.4);
      const float inf = std::numeric_limits<float>::infinity();
      // The two halves accumulated into fp32 out and lse from "nothing yet".
      const auto split_forward = [&](bool reference, int threads) {
        std::pair<Tensor, std::vector<float>> r{Tensor(DType::f32, pb.out_shape()),
                                                std::vector<float>(pb.lse_size(), -inf)};
        for (const WorkList* w : {&w1, &w2}) {
          AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, r.first, r.second.data(), path, threads, w);
          fp.out_mode = OutMode::accumulate;
          reference ? attention_forward_reference(fp) : attention_forward(fp);
        }
        return r;
      };
      const auto [out, lse] = split_forward(false, 2);
      Tensor ref(DType::f32, pb.out_shape());
      std::vector<float> ref_lse(pb.lse_size(), -inf);
      AttnFwdParams whole = pb.fwd(pb.q, pb.k, pb.v, ref, ref_lse.data(), KernelPath::automatic, 1);
      whole.out_mode = OutMode::accumulate;  // fp32 out from nothing: the whole result in fp32
      attention_forward_reference(whole);
      EXPECT_LE(rel_norm_error(out.f, ref.f), tol);
      EXPECT_LE(rel_norm_error(lse, ref_lse), 1e-6);
      // The reference's accumulation agrees with itself split the same way.
      EXPECT_LE(rel_norm_error(split_forward(true, 1).first.f, ref.f), 1e-6);
      // Repeated (one thread): bitwise the same.
      const auto [again, again_lse] = split_forward(false, 1);
      EXPECT_EQ(again.f, out.f);
      EXPECT_EQ(again_lse, lse);
    }
}

// Rows of no task keep what they held; a row whose earlier part saw nothing (lse -inf) takes
// the new part alone.
TEST(kernel_attention, OutModeAccumulateLeavesRowsOfNoTaskAlone) {
  const AttnCase c{"rows", {8}, {8}, 2, 1, 16, 16, MaskType::causal};
  const Problem pb(c, DType::f32, 5);
  WorkList w;  // queries 4..7 only
  w.runs.push_back({.row = 0, .len = 8, .pos = 0});
  w.tasks.push_back({.q_row = 4, .q_len = 4, .q_pos = 4, .doc = 0, .run_begin = 0, .run_end = 1});
  Tensor out(DType::f32, pb.out_shape());
  for (std::size_t i = 0; i < out.f.size(); ++i) out.f[i] = 0.125f * static_cast<float>(i % 9);
  std::vector<float> lse(pb.lse_size(), 3.0f);
  for (std::size_t i = 8; i < lse.size(); ++i) lse[i] = -std::numeric_limits<float>::infinity();  // rows 4..7
  const Tensor before = out;
  AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1, &w);
  fp.out_mode = OutMode::accumulate;
  attention_forward(fp);
  const std::size_t row = static_cast<std::size_t>(c.num_heads_q * c.head_dim_v);
  for (std::size_t i = 0; i < 4 * row; ++i) EXPECT_EQ(out.f[i], before.f[i]);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(lse[i], 3.0f);
  // Rows 4..7 started empty: the ordinary forward of the task.
  Tensor plain(DType::f32, pb.out_shape());
  std::vector<float> plain_lse(pb.lse_size());
  attention_forward(pb.fwd(pb.q, pb.k, pb.v, plain, plain_lse.data(), KernelPath::automatic, 1, &w));
  EXPECT_LE(rel_norm_error(std::vector<float>(out.f.begin() + 4 * row, out.f.end()),
                           std::vector<float>(plain.f.begin() + 4 * row, plain.f.end())), 1e-6);
}

// A row of a task that sees none of this call's keys (the causal mask or the window hides
// them all) keeps out and lse bit for bit; the other rows of the same task merge as the
// float64 reference's accumulation does. One document of 8 tokens, queries 0..7, this call's
// keys positions 4..7 (causal: rows 0..3 see none) or 0..3 under a window of 1 on the left
// (rows 5..7 see none); the earlier result is an arbitrary (out, lse) whose lse values do not
// all survive the trip through the online softmax's log2 state (checked, so that the
// assertion can fail).
TEST(kernel_attention, OutModeAccumulateKeepsRowsThatSeeNoKeyBitForBit) {
  struct Sub {
    const char* name;
    int64_t key_pos, window_left;
    std::vector<int64_t> blind;  // the rows that see no key of this call
  };
  for (const Sub& sub : {Sub{"causal", 4, -1, {0, 1, 2, 3}}, Sub{"window", 0, 1, {5, 6, 7}}})
    for (const DType dt : {DType::f32, DType::bf16})
      for (const auto& [path, tol] : accumulation_paths(dt)) {
      SCOPED_TRACE(std::string(sub.name) + " " + std::string(to_string(dt)) + " " + std::string(to_string(path)));
      AttnCase c{"blind", {8}, {8}, 2, 1, 17, 17, MaskType::causal};
      c.window_left = sub.window_left;
      const Problem pb(c, dt, 9);
      WorkList w;
      w.runs.push_back({.row = sub.key_pos, .len = 4, .pos = sub.key_pos});
      w.tasks.push_back({.q_row = 0, .q_len = 8, .q_pos = 0, .doc = 0, .run_begin = 0, .run_end = 1});
      Tensor out(DType::f32, pb.out_shape());
      for (std::size_t i = 0; i < out.f.size(); ++i) out.f[i] = 0.37f * static_cast<float>(i % 13) - 2.0f;
      std::vector<float> lse(pb.lse_size());
      int changed_by_trip = 0;  // lse values that (lse log2 e) ln 2 does not give back
      for (std::size_t i = 0; i < lse.size(); ++i) {
        lse[i] = 0.731f * static_cast<float>(i) + 0.113f;
        const float trip = lse[i] * 1.4426950408889634f * 0.6931471805599453f;
        changed_by_trip += trip != lse[i];
      }
      ASSERT_GT(changed_by_trip, 0);
      Tensor ref_out = out;
      std::vector<float> ref_lse = lse;
      const Tensor before = out;
      const std::vector<float> lse_before = lse;
      AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 1, &w);
      fp.out_mode = OutMode::accumulate;
      attention_forward(fp);
      AttnFwdParams rp = pb.fwd(pb.q, pb.k, pb.v, ref_out, ref_lse.data(), KernelPath::automatic, 1, &w);
      rp.out_mode = OutMode::accumulate;
      attention_forward_reference(rp);
      const auto hq = static_cast<std::size_t>(c.num_heads_q), row = hq * static_cast<std::size_t>(c.head_dim_v);
      for (const int64_t r : sub.blind) {
        const auto i = static_cast<std::size_t>(r);
        for (std::size_t e = i * row; e < (i + 1) * row; ++e) EXPECT_EQ(out.f[e], before.f[e]) << "row " << r;
        for (std::size_t h = 0; h < hq; ++h) EXPECT_EQ(lse[i * hq + h], lse_before[i * hq + h]) << "row " << r;
      }
      EXPECT_LE(rel_norm_error(out.f, ref_out.f), tol);
      EXPECT_LE(rel_norm_error(lse, ref_lse), 1e-6);
      EXPECT_NE(out.f, before.f);  // the rows that see keys did merge
    }
}

// dQ, dK and dV over the two halves of every key run, accumulated into fp32 buffers that
// already hold values, with the whole forward's out and lse: the start plus the whole
// backward's gradients (float64 reference), storage read as stored.
TEST(kernel_attention, GradModeAccumulateAllOverASplitKeySetIsTheWholeBackward) {
  for (const DType dt : {DType::f32, DType::bf16})
    for (const auto& [path, tol] : accumulation_paths(dt)) {
    SCOPED_TRACE(std::string(to_string(dt)) + " " + std::string(to_string(path)));
    AttnCase c{"split", {1, 37, 130}, {1, 37, 130}, 4, 2, 33, 17, MaskType::causal};
    c.dropout_p = 0.15f;
    const Problem pb(c, dt, 22);
    const auto [w1, w2] = split_keys(pb.work, 0.6);
    Tensor out(dt, pb.out_shape());
    std::vector<float> lse(pb.lse_size());
    attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 1));
    std::vector<float> dq(pb.q.size()), dk(pb.dk_size()), dv(pb.dv_size());
    for (std::size_t i = 0; i < dq.size(); ++i) dq[i] = 0.01f * static_cast<float>(i % 11);
    for (std::size_t i = 0; i < dk.size(); ++i) dk[i] = -0.02f * static_cast<float>(i % 7);
    const std::vector<float> dq0 = dq, dk0 = dk, dv0 = dv;
    Tensor dq_t(dt, pb.q_shape()), dk_t(dt, pb.k_shape()), dv_t(dt, pb.v_shape());
    for (const WorkList* w : {&w1, &w2}) {
      AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq_t, dk_t, dv_t, path, 2, w);
      bp.grad_mode = GradMode::accumulate_all;
      bp.dq = contiguous(dq.data(), c.total_q(), c.num_heads_q, c.head_dim_qk);
      bp.dk = contiguous(dk.data(), c.total_k(), c.num_heads_k, c.head_dim_qk);
      bp.dv = contiguous(dv.data(), c.total_k(), c.num_heads_k, c.head_dim_v);
      attention_backward(bp);
    }
    // The whole backward in float64, into fp32 buffers holding the same start.
    std::vector<float> rq = dq0, rk = dk0, rv = dv0;
    AttnBwdParams whole = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq_t, dk_t, dv_t, KernelPath::automatic, 1);
    whole.grad_mode = GradMode::accumulate_all;
    whole.dq = contiguous(rq.data(), c.total_q(), c.num_heads_q, c.head_dim_qk);
    whole.dk = contiguous(rk.data(), c.total_k(), c.num_heads_k, c.head_dim_qk);
    whole.dv = contiguous(rv.data(), c.total_k(), c.num_heads_k, c.head_dim_v);
    attention_backward_reference(whole);
    const auto minus = [](std::vector<float> a, const std::vector<float>& b) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
      return a;
    };
    EXPECT_LE(rel_norm_error(minus(dq, dq0), minus(rq, dq0)), std::max(1e-5, tol));
    EXPECT_LE(rel_norm_error(minus(dk, dk0), minus(rk, dk0)), std::max(1e-5, tol));
    EXPECT_LE(rel_norm_error(minus(dv, dv0), minus(rv, dv0)), std::max(1e-5, tol));
  }
}

TEST(kernel_attention, AccumulateModesRefuseOutputsTheyCannotAddInto) {
  const AttnCase c{"bad", {5}, {5}, 2, 1, 8, 8, MaskType::causal};
  const Problem pb(c, DType::bf16, 3);
  Tensor out(DType::bf16, pb.out_shape());
  std::vector<float> lse(pb.lse_size());
  AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1);
  fp.out_mode = OutMode::accumulate;  // a bf16 out cannot hold the running result
  EXPECT_NE(error_of([&] { attention_forward(fp); }).find("out_mode accumulate needs an fp32 out"), std::string::npos);
  Tensor out32(DType::f32, pb.out_shape());
  fp.out = out32.view();
  fp.lse = nullptr;
  EXPECT_NE(error_of([&] { attention_forward(fp); }).find("and no lse"), std::string::npos);
  attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1));
  Tensor dq(DType::bf16, pb.q_shape()), dk(DType::bf16, pb.k_shape()), dv(DType::bf16, pb.v_shape());
  std::vector<float> dk32(pb.dk_size()), dv32(pb.dv_size());
  AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1);
  bp.grad_mode = GradMode::accumulate_all;
  bp.dk = contiguous(dk32.data(), c.total_k(), c.num_heads_k, c.head_dim_qk);
  bp.dv = contiguous(dv32.data(), c.total_k(), c.num_heads_k, c.head_dim_v);
  EXPECT_NE(error_of([&] { attention_backward(bp); }).find("grad_mode accumulate_all needs an fp32 dq"), std::string::npos);
}

// ---- tasks whose queries see no key --------------------------------------------------------
TEST(kernel_attention, QueryWithNoVisibleKeyGivesZeroAndMinusInf) {
  const AttnCase c{"empty", {4}, {4}, 1, 1, 16, 16, MaskType::causal};
  const Problem pb(c, DType::f32, 2);
  WorkList w;
  w.runs.push_back({.row = 0, .len = 4, .pos = 10});  // keys after every query: invisible
  w.tasks.push_back({.q_row = 0, .q_len = 4, .q_pos = 0, .doc = 0, .run_begin = 0, .run_end = 1});
  Tensor out(DType::f32, pb.out_shape());
  std::vector<float> lse(pb.lse_size());
  attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1, &w));
  for (float x : out.f) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  Tensor dq(DType::f32, pb.q_shape()), dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
  attention_backward(pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv,
                            KernelPath::automatic, 1, &w));
  for (const auto* v : {&dq.f, &dk.f, &dv.f})
    for (float x : *v) EXPECT_EQ(x, 0.0f);
}

// A query that sees exactly one key (window 0: itself) has the softmax weight exp2(0) / 1 = 1
// and its masked keys exp2(-inf) = 0, so its out row is that key's v row bit for bit, on every
// path, with fp32 storage (the forward's exp2 gives p(0) = 1 exactly and -inf exactly 0).
// Documents of 1, 130 and 200 tokens at unaligned rows, so that the queries span several
// row sub-blocks and key pieces; GQA 2 and an odd head dim.
TEST(kernel_attention, QueryThatSeesOneKeyGetsItsValueRowExactly) {
  AttnCase c{"one_key", {1, 130, 200}, {1, 130, 200}, 4, 2, 59, 59, MaskType::causal};
  c.window_left = 0;
  const Problem pb(c, DType::f32, 5);
  const int64_t rows = 331;
  for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                          KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path)) continue;
    const Results got = run_kernels(pb, DType::f32, path, 1);
    ASSERT_EQ(got.out.size(), static_cast<size_t>(rows * 4 * 59));
    int64_t differ = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < 4; ++h)
        for (int d = 0; d < 59; ++d)
          differ += got.out[(r * 4 + h) * 59 + d] != pb.v.f[(r * 2 + h / 2) * 59 + d];
    EXPECT_EQ(differ, 0) << to_string(path) << ": out elements that are not their key's v";
  }
}

// ---- key_rows: the keys read (and dK/dV written) through a row map ---------------------------
// K and V stored with key row r at row perm[r] (a random permutation), read through
// AttnInputs::key_rows: out, lse and dq bitwise those of the same call on K, V in key order, and
// dK, dV bitwise at the permuted rows; in write mode into storage-dtype and fp32 views and in
// accumulate mode; the float64 reference likewise. Documents of 1, 37, 130 and 64 tokens,
// GQA of 4 (backward head sets of 2; one set of 4 on bf16 tiles), odd head dims, a window, every path this CPU runs, fp32
// and bf16.
TEST(kernel_attention, KeyRowsReadAndWriteThePermutedRowsBitwise) {
  AttnCase c{"key_rows", {1, 37, 130, 64}, {1, 37, 130, 64}, 8, 2, 72, 40, MaskType::causal};  // sets of 2 heads (bf16 tiles: one of 4)
  c.window_left = 50;
  const int64_t tk = c.total_k();
  std::vector<int64_t> perm(static_cast<size_t>(tk));
  for (int64_t r = 0; r < tk; ++r) perm[static_cast<size_t>(r)] = r;
  std::mt19937_64 rng(5);
  std::shuffle(perm.begin(), perm.end(), rng);
  // x's rows moved to their stored places: stored row perm[r] = row r.
  const auto scatter = [&](const std::vector<float>& x, int64_t row) {
    std::vector<float> y(x.size());
    for (int64_t r = 0; r < tk; ++r)
      std::copy_n(x.begin() + r * row, row, y.begin() + perm[static_cast<size_t>(r)] * row);
    return y;
  };
  const int64_t krow = int64_t{c.num_heads_k} * c.head_dim_qk, vrow = int64_t{c.num_heads_k} * c.head_dim_v;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Problem pb(c, dt, 21);
    const Tensor ks = Tensor::from(dt, pb.k_shape(), scatter(pb.k.f, krow));
    const Tensor vs = Tensor::from(dt, pb.v_shape(), scatter(pb.v.f, vrow));
    for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                            KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
      if (!kernel_path_supported(path)) continue;
      SCOPED_TRACE(std::string(to_string(path)) + " " + std::string(to_string(dt)));
      Tensor out(dt, pb.out_shape()), out_p(dt, pb.out_shape());
      std::vector<float> lse(pb.lse_size()), lse_p(pb.lse_size());
      attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 2));
      AttnFwdParams fp = pb.fwd(pb.q, ks, vs, out_p, lse_p.data(), path, 2);
      fp.in.key_rows = perm.data();
      attention_forward(fp);
      EXPECT_EQ(out_p.values(), out.values());
      EXPECT_EQ(lse_p, lse);
      for (const DType gt : {dt, DType::f32}) {  // write mode: the storage dtype, then fp32
        Tensor dq(dt, pb.q_shape()), dk(gt, pb.k_shape()), dv(gt, pb.v_shape());
        Tensor dq_p(dt, pb.q_shape()), dk_p(gt, pb.k_shape()), dv_p(gt, pb.v_shape());
        attention_backward(pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, path, 2));
        AttnBwdParams bp = pb.bwd(pb.q, ks, vs, out, lse.data(), pb.dout, dq_p, dk_p, dv_p, path, 2);
        bp.in.key_rows = perm.data();
        attention_backward(bp);
        EXPECT_EQ(dq_p.values(), dq.values());
        EXPECT_EQ(dk_p.values(), scatter(dk.values(), krow)) << "dk in " << to_string(gt);
        EXPECT_EQ(dv_p.values(), scatter(dv.values(), vrow)) << "dv in " << to_string(gt);
        if (gt != DType::f32) continue;
        // accumulate: added at the permuted rows, what the call in key order adds at its rows
        std::vector<float> ak(pb.dk_size()), av(pb.dv_size());
        for (size_t i = 0; i < ak.size(); ++i) ak[i] = 0.5f * static_cast<float>(i % 7);
        for (size_t i = 0; i < av.size(); ++i) av[i] = -0.25f * static_cast<float>(i % 5);
        std::vector<float> ak_p = scatter(ak, krow), av_p = scatter(av, vrow);
        AttnBwdParams ba = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, path, 2);
        ba.grad_mode = bp.grad_mode = GradMode::accumulate;
        ba.dk = contiguous(ak.data(), tk, c.num_heads_k, c.head_dim_qk);
        ba.dv = contiguous(av.data(), tk, c.num_heads_k, c.head_dim_v);
        bp.dk = contiguous(ak_p.data(), tk, c.num_heads_k, c.head_dim_qk);
        bp.dv = contiguous(av_p.data(), tk, c.num_heads_k, c.head_dim_v);
        attention_backward(ba);
        attention_backward(bp);
        EXPECT_EQ(ak_p, scatter(ak, krow));
        EXPECT_EQ(av_p, scatter(av, vrow));
      }
    }
    // The float64 reference through the map: the same values at the permuted rows.
    Tensor out(dt, pb.out_shape()), out_p(dt, pb.out_shape());
    std::vector<float> lse(pb.lse_size()), lse_p(pb.lse_size());
    attention_forward_reference(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1));
    AttnFwdParams fp = pb.fwd(pb.q, ks, vs, out_p, lse_p.data(), KernelPath::automatic, 1);
    fp.in.key_rows = perm.data();
    attention_forward_reference(fp);
    EXPECT_EQ(out_p.values(), out.values());
    Tensor dq(dt, pb.q_shape()), dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
    Tensor dq_p(dt, pb.q_shape()), dk_p(DType::f32, pb.k_shape()), dv_p(DType::f32, pb.v_shape());
    attention_backward_reference(pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1));
    AttnBwdParams bp = pb.bwd(pb.q, ks, vs, out, lse.data(), pb.dout, dq_p, dk_p, dv_p, KernelPath::automatic, 1);
    bp.in.key_rows = perm.data();
    attention_backward_reference(bp);
    EXPECT_EQ(dk_p.values(), scatter(dk.values(), krow));
    EXPECT_EQ(dv_p.values(), scatter(dv.values(), vrow));
  }
}

// Sets CPATTN_KERNEL_PATH for one scope and restores what was there.
class EnvPath {
 public:
  explicit EnvPath(const char* value) {
    if (const char* v = std::getenv("CPATTN_KERNEL_PATH")) old_ = v;
    setenv("CPATTN_KERNEL_PATH", value, 1);
  }
  ~EnvPath() { old_ ? setenv("CPATTN_KERNEL_PATH", old_->c_str(), 1) : unsetenv("CPATTN_KERNEL_PATH"); }
  EnvPath(const EnvPath&) = delete;
  EnvPath& operator=(const EnvPath&) = delete;

 private:
  std::optional<std::string> old_;
};

// ---- KvGradShare: the partial sums left for another process --------------------------------
// attention_grad_share_rows over the buffer a backward with grad_share left: every row
// bitwise what the same call writes into fp32 views in write mode (at the stored row, through
// key_rows when given), read in uneven pieces (1, 15, 16, 17, 100 rows: the 16-row groups and
// BBK blocks cut anywhere). Cases: GQA of 4 with odd head dims (two head sets on the fp32 and
// bf16-pair paths, one on bf16 tiles), GQA of 8 (two sets of 4 on every path, bf16 tiles and
// amx_emulated included), keys no query reaches (a 300-key document seen by one
// query through a 10-key window: blocks that no piece touched), MHA; fp32, fp16, bf16, every
// path this CPU runs, with and without a row map; and on amx a task past BWD_LONG_TASK (two
// head sets on bf16 tiles).
TEST(kernel_grad_share, RowsAreBitwiseTheFp32WriteOfTheSameCall) {
  AttnCase gqa{"gqa", {1, 37, 130, 64}, {1, 37, 130, 64}, 8, 2, 72, 40, MaskType::causal};
  gqa.window_left = 50;
  AttnCase unseen{"unseen", {1, 37}, {300, 37}, 4, 4, 32, 32, MaskType::causal};
  unseen.window_left = 10;
  AttnCase wide{"gqa8", {19, 140}, {19, 140}, 16, 2, 16, 48, MaskType::causal};  // two sets of 4 also on tiles
  AttnCase long_task{"long", {4200}, {4200}, 4, 1, 16, 16, MaskType::causal};
  int ran = 0;
  for (const AttnCase* c : {&gqa, &unseen, &wide, &long_task})
    for (DType dt : {DType::f32, DType::f16, DType::bf16})
      for (KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                              KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
        if (!kernel_path_supported(path) || loop_skips_under_sanitizer(path)) continue;
        if (c == &long_task && !(path == KernelPath::amx && dt == DType::bf16)) continue;  // (slow elsewhere)
        const int64_t tk = c->total_k();
        std::vector<int64_t> perm(static_cast<size_t>(tk));
        for (int64_t r = 0; r < tk; ++r) perm[static_cast<size_t>(r)] = r;
        std::mt19937_64 rng(9);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (const bool mapped : {false, true}) {
          SCOPED_TRACE(c->name + " " + std::string(to_string(dt)) + " " + std::string(to_string(path)) +
                       (mapped ? " key_rows" : ""));
          const Problem pb(*c, dt, 31);
          Tensor out(dt, pb.out_shape());
          std::vector<float> lse(pb.lse_size());
          AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 2);
          if (mapped) fp.in.key_rows = perm.data();
          attention_forward(fp);
          Tensor dq(dt, pb.q_shape()), dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
          Tensor dq_s(dt, pb.q_shape()), none_k(DType::f32, pb.k_shape()), none_v(DType::f32, pb.v_shape());
          AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, path, 2);
          if (mapped) bp.in.key_rows = perm.data();
          attention_backward(bp);
          AttnBwdParams sp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq_s, none_k, none_v, path, 2);
          if (mapped) sp.in.key_rows = perm.data();
          sp.dk = {};
          sp.dv = {};
          const std::size_t bytes = attention_grad_share_bytes(sp);
          std::vector<std::byte> raw(bytes + 64);
          auto* buf = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) / 64 * 64);
          const KvGradShare share{.buffer = buf, .bytes = bytes};
          sp.grad_share = &share;
          EXPECT_LT(attention_backward_scratch_bytes(sp), attention_backward_scratch_bytes(bp));
          attention_backward(sp);
          EXPECT_EQ(dq_s.values(), dq.values());
          const int64_t krow = int64_t{c->num_heads_k} * c->head_dim_qk, vrow = int64_t{c->num_heads_k} * c->head_dim_v;
          // row r of the reader is stored row perm[r] of the write
          std::vector<float> want_k(static_cast<size_t>(tk * krow)), want_v(static_cast<size_t>(tk * vrow));
          const std::vector<float> dkw = dk.values(), dvw = dv.values();
          for (int64_t r = 0; r < tk; ++r) {
            const int64_t sr = mapped ? perm[static_cast<size_t>(r)] : r;
            std::copy_n(dkw.begin() + sr * krow, krow, want_k.begin() + r * krow);
            std::copy_n(dvw.begin() + sr * vrow, vrow, want_v.begin() + r * vrow);
          }
          // The reader runs on the path automatic picks (or CPATTN_KERNEL_PATH's): each one
          // this CPU has reads what this path wrote.
          for (const char* reader : {"portable", "avx2", "avx512"}) {
            if (!kernel_path_supported(parse_kernel_path(reader))) continue;
            const EnvPath env(reader);
            std::vector<float> gk(want_k.size(), -1.0f), gv(want_v.size(), -1.0f);
            const int64_t steps[] = {1, 15, 16, 17, 100};
            for (int64_t r0 = 0, i = 0; r0 < tk; ++i) {
              const int64_t n = std::min(steps[i % 5], tk - r0);
              attention_grad_share_rows(buf, bytes, sp.in.shape(), r0, n, gk.data() + r0 * krow,
                                        gv.data() + r0 * vrow);
              r0 += n;
            }
            EXPECT_EQ(0, std::memcmp(gk.data(), want_k.data(), gk.size() * sizeof(float))) << "dk, read on " << reader;
            EXPECT_EQ(0, std::memcmp(gv.data(), want_v.data(), gv.size() * sizeof(float))) << "dv, read on " << reader;
          }
          ++ran;
          if (HasFailure()) return;
        }
      }
  EXPECT_GT(ran, 0);
}

// Bad uses of a KvGradShare, each refused naming what is wrong: a buffer too small, unaligned,
// or with grad_mode accumulate; a reader on a buffer no backward filled, or rows past the keys.
TEST(kernel_grad_share, BadUsesAreRefused) {
  const AttnCase c{"small", {5, 3}, {5, 3}, 2, 1, 8, 8, MaskType::causal};
  const Problem pb(c, DType::f32, 3);
  Tensor out(DType::f32, pb.out_shape()), dq(DType::f32, pb.q_shape()), dk(DType::f32, pb.k_shape()),
      dv(DType::f32, pb.v_shape());
  std::vector<float> lse(pb.lse_size());
  attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1));
  AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1);
  const std::size_t bytes = attention_grad_share_bytes(bp);
  const AttnShape shape = bp.in.shape();
  std::vector<std::byte> raw(bytes + 128);
  auto* buf = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) / 64 * 64);
  KvGradShare share{.buffer = buf, .bytes = bytes - 1};
  bp.grad_share = &share;
  EXPECT_NE(error_of([&] { attention_backward(bp); }).find("grad_share.bytes is"), std::string::npos);
  share = {.buffer = buf + 4, .bytes = bytes};
  EXPECT_NE(error_of([&] { attention_backward(bp); }).find("grad_share.buffer must be a 64-byte aligned"),
            std::string::npos);
  share = {.buffer = buf, .bytes = bytes};
  bp.grad_mode = GradMode::accumulate;
  EXPECT_NE(error_of([&] { attention_backward(bp); }).find("grad_share needs grad_mode write, got accumulate"), std::string::npos);
  std::vector<float> rk(8 * 8), rv(8 * 8);
  EXPECT_NE(error_of([&] { attention_grad_share_rows(buf, bytes, shape, 0, 1, rk.data(), rv.data()); })
                .find("holds no backward's partial sums"),
            std::string::npos);
  bp.grad_mode = GradMode::write;
  // The reference writes dk and dv itself: refused (with empty dk/dv, as grad_share allows, it
  // stored through null pointers).
  AttnBwdParams ref = bp;
  ref.dk = {};
  ref.dv = {};
  EXPECT_NE(error_of([&] { attention_backward_reference(ref); }).find("grad_share is the kernels'"), std::string::npos);
  // Nor does it pack a KvPackShare: its peers waited at the share's barrier for ever.
  KvPackShare pack{.buffer = buf, .bytes = bytes, .part = 0, .parts = 2, .sync = [] {}};
  ref = bp;
  ref.grad_share = nullptr;
  ref.in.kv_pack_share = &pack;
  EXPECT_NE(error_of([&] { attention_backward_reference(ref); }).find("kv_pack_share is the kernels'"),
            std::string::npos);
  AttnFwdParams fwd_ref = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1);
  fwd_ref.in.kv_pack_share = &pack;
  EXPECT_NE(error_of([&] { attention_forward_reference(fwd_ref); }).find("kv_pack_share is the kernels'"),
            std::string::npos);
  attention_backward(bp);
  EXPECT_NO_THROW(attention_grad_share_rows(buf, bytes, shape, 0, 8, rk.data(), rv.data()));
  EXPECT_NE(error_of([&] { attention_grad_share_rows(buf, bytes, shape, 5, 4, rk.data(), rv.data()); })
                .find("rows [5, 9) are not within the call's 8 key rows"),
            std::string::npos);
  EXPECT_NE(error_of([&] { attention_grad_share_rows(buf, bytes - 1, shape, 0, 8, rk.data(), rv.data()); })
                .find("the layout in its header needs " + std::to_string(bytes)),
            std::string::npos);
  AttnShape other = shape;  // rows of another width than the buffer's backward wrote
  other.head_dim_v = 9;
  EXPECT_NE(error_of([&] { attention_grad_share_rows(buf, bytes, other, 0, 8, rk.data(), rv.data()); })
                .find("the caller's num_heads_k, head_dim_qk, head_dim_v are 1, 8, 9; the buffer's backward had 1, 8, 8"),
            std::string::npos);
  // Headers that a stray write changed: refused, not followed. A head dim past 256 (whose
  // padded dims are consistent and whose bytes fit: only the dims' bound stops it), a block
  // count, a row count and a layout flag that do not follow from total_k.
  for (const auto& [field, value] : {std::pair{offsetof(kernels::GradShareLayout, dqk), 496},
                                     {offsetof(kernels::GradShareLayout, nbb), 7},
                                     {offsetof(kernels::GradShareLayout, transposed), 2}}) {
    std::vector<std::byte> copy(raw);
    auto* bad = copy.data() + (buf - raw.data());
    kernels::GradShareLayout L;
    std::memcpy(&L, bad, sizeof L);
    if (field == offsetof(kernels::GradShareLayout, dqk)) {
      L.dqk = L.dp = value;
      L.dv = L.dvp = 16;
      L.hkv = L.sets = 1;
      L.total_k = L.nbb = L.g_rows = 1;
      L.transposed = 0;
      ASSERT_LE(L.bytes(), bytes);
    } else if (field == offsetof(kernels::GradShareLayout, nbb)) {
      L.nbb = value;
    } else {
      L.transposed = value;
    }
    std::memcpy(bad, &L, sizeof L);
    const AttnShape as{.num_heads_k = L.hkv, .head_dim_qk = L.dqk, .head_dim_v = L.dv};
    EXPECT_NE(error_of([&] { attention_grad_share_rows(bad, bytes, as, 0, 1, rk.data(), rv.data()); })
                  .find("holds no backward's partial sums"),
              std::string::npos)
        << "field at " << field;
  }
}

// The sums over head sets, against their formula worked independently here: a hand-made
// buffer (GradShareLayout) of 4 KV heads whose sets reached a block 0, 1, 2 and 3 times (set 0
// alone, sets 0 and 2, all three), values whose sum depends on the order (+-1e8 and small
// ones), -0.0 and a denormal; 40 keys, a partial last block. Transposed (the tiles' blocks, [dp][128]
// per set): (s_0 + s_1 + ...) + 0.0f, zeros where no set reached; rows (the other paths):
// 0.0f + s_0 + s_1 + ...; dK times the scale. Read on every vector width this CPU has: the
// one code of the reader and of the backward's own final sum (sum_sets_rows16, sum_sets_row).
TEST(kernel_grad_share, SetSumsFollowTheirFormula) {
  const float smalls[] = {1.0f, 0.5f, 1.0e-40f, 3.0f, -0.0f};
  for (const int transposed : {1, 0}) {
    kernels::GradShareLayout L;
    L.total_k = 40;
    L.nbb = 1;
    L.g_rows = transposed ? 128 : 40;
    L.hkv = 4;
    L.sets = 3;
    L.dqk = 16;
    L.dv = 13;
    L.dp = L.dvp = 16;
    L.transposed = transposed;
    L.scale = 0.25f;
    const std::size_t bytes = L.bytes();
    std::vector<std::byte> raw(bytes + 64);
    auto* buf = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) / 64 * 64);
    std::memcpy(buf, &L, sizeof L);
    auto* gk = reinterpret_cast<float*>(buf + kernels::GradShareLayout::kHeader);
    auto* gv = reinterpret_cast<float*>(buf + L.gv_offset());
    auto* touched = reinterpret_cast<char*>(buf + L.touched_offset());
    const std::vector<std::vector<int>> reached = {{}, {0}, {0, 2}, {0, 1, 2}};
    // Set st's value at (key row r, dim d) of dK (k) or dV: set 0 a big B = +-1e8 (or -0.0),
    // set 1 -B (-0.0 for -0.0), set 2 small: (B - B) + s = s, where another order loses s
    // to B; a set alone of -0.0 gives +0.0 only through the transposed sum's + 0.0f.
    const auto value = [&](bool k, int hk, int st, int64_t r, int d) {
      const int64_t i = r * 16 + d + (k ? 0 : 3) + hk;
      const float big = i % 5 == 0 ? -0.0f : (i % 2 ? 1e8f : -1e8f);
      return st == 0 ? big : st == 1 ? (big == 0.0f ? -0.0f : -big) : smalls[static_cast<size_t>(i % 5)];
    };
    for (int hk = 0; hk < L.hkv; ++hk)
      for (int st = 0; st < L.sets; ++st) {
        const int64_t u = int64_t{hk} * L.sets + st;
        touched[u] = std::find(reached[hk].begin(), reached[hk].end(), st) != reached[hk].end() ? 1 : 0;
        for (const bool k : {true, false}) {
          float* g = (k ? gk : gv) + u * L.g_rows * 16;
          for (int64_t r = 0; r < L.g_rows; ++r)
            for (int d = 0; d < 16; ++d)
              (transposed ? g[d * 128 + r] : g[r * 16 + d]) = touched[u] ? value(k, hk, st, r, d) : std::nanf("");
        }
      }
    const AttnShape shape{.num_heads_k = L.hkv, .head_dim_qk = L.dqk, .head_dim_v = L.dv};
    std::vector<float> want_k(static_cast<size_t>(40 * 4 * 16)), want_v(static_cast<size_t>(40 * 4 * 13));
    for (int64_t r = 0; r < 40; ++r)
      for (int hk = 0; hk < 4; ++hk)
        for (const bool k : {true, false}) {
          const int dim = k ? 16 : 13;
          for (int d = 0; d < dim; ++d) {
            float sum = 0.0f;
            if (transposed && !reached[hk].empty()) {
              sum = value(k, hk, reached[hk][0], r, d);
              for (size_t i = 1; i < reached[hk].size(); ++i) sum += value(k, hk, reached[hk][i], r, d);
              sum += 0.0f;
            } else {
              for (const int st : reached[hk]) sum += value(k, hk, st, r, d);
            }
            (k ? want_k : want_v)[static_cast<size_t>((r * 4 + hk) * dim + d)] = sum * (k ? 0.25f : 1.0f);
          }
        }
    for (const char* reader : {"portable", "avx2", "avx512"}) {
      if (!kernel_path_supported(parse_kernel_path(reader))) continue;
      SCOPED_TRACE(std::string(transposed ? "transposed" : "rows") + ", read on " + reader);
      const EnvPath env(reader);
      std::vector<float> dk(want_k.size(), -7.0f), dv(want_v.size(), -7.0f);
      for (int64_t r0 = 0; r0 < 40; r0 += 13) {  // groups and pieces cut anywhere
        const int64_t n = std::min<int64_t>(13, 40 - r0);
        attention_grad_share_rows(buf, bytes, shape, r0, n, dk.data() + r0 * 64, dv.data() + r0 * 52);
      }
      // (bit for bit: a zero's sign included)
      EXPECT_EQ(0, std::memcmp(dk.data(), want_k.data(), dk.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(dv.data(), want_v.data(), dv.size() * sizeof(float)));
    }
  }
}

TEST(kernel_attention, KeyRowsAndWriteModeDtypesAreChecked) {
  const AttnCase c{"bad_rows", {5, 3}, {5, 3}, 2, 1, 8, 8, MaskType::causal};
  const Problem pb(c, DType::bf16, 3);
  Tensor out(DType::bf16, pb.out_shape());
  std::vector<float> lse(pb.lse_size());
  AttnFwdParams fp = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1);
  std::vector<int64_t> rows{0, 1, 2, 3, 4, 5, 6, 8};
  fp.in.key_rows = rows.data();
  EXPECT_NE(error_of([&] { attention_forward(fp); }).find("key_rows[7] = 8 is outside k's rows [0, 8)"),
            std::string::npos);
  rows[7] = 2;
  EXPECT_NE(error_of([&] { attention_forward(fp); })
                .find("key_rows must be a permutation of [0, total_k = 8), row 2 appears twice (again at key_rows[7])"),
            std::string::npos);
  rows[7] = 7;
  attention_forward(fp);
  Tensor dq(DType::bf16, pb.q_shape()), dk(DType::f16, pb.k_shape()), dv(DType::f16, pb.v_shape());
  AttnBwdParams bp = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1);
  EXPECT_NE(error_of([&] { attention_backward(bp); })
                .find("grad_mode write needs dk and dv both of the inputs' dtype bf16 or both fp32, got dk fp16, dv fp16"),
            std::string::npos);
  Tensor dk32(DType::f32, pb.k_shape());
  bp.dk = dk32.view();
  EXPECT_NE(error_of([&] { attention_backward(bp); }).find("got dk fp32, dv fp16"), std::string::npos);
}

// ---- 64-bit offsets ----------------------------------------------------------------------------
// Rows 2^31 elements apart, so that the rows start at 0, 2^31 and 2^32 elements (16 GiB):
// past what signed and unsigned 32-bit arithmetic hold. The tensors are columns of one reserved, mostly untouched mapping
// (only the pages holding rows are ever touched). Every path, forward and backward, must
// match the reference run on compact copies of the same values.
TEST(kernel_attention, OffsetsPast2To31ElementsUse64BitArithmetic) {
  constexpr int64_t T = 3, D = 24, kCols = 8, stride = int64_t{1} << 31;
  const std::size_t bytes = static_cast<std::size_t>((T - 1) * stride + kCols * D) * sizeof(float);
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  float* base = static_cast<float*>(m);
  enum Col { cq, ck, cv, cout, cdout, cdq, cdk, cdv };
  const auto col = [&](Col c) { return base + c * D; };  // row r of column c: col(c) + r * stride

  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(T * D), k(T * D), v(T * D), dout(T * D);
  for (auto* t : {&q, &k, &v, &dout})
    for (float& x : *t) x = nd(rng);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t e = 0; e < D; ++e) {
      col(cq)[r * stride + e] = q[r * D + e];
      col(ck)[r * stride + e] = k[r * D + e];
      col(cv)[r * stride + e] = v[r * D + e];
      col(cdout)[r * stride + e] = dout[r * D + e];
    }
  const std::vector<int64_t> cu{0, T};
  const WorkList wl = varlen_worklist(cu, cu);
  // One set of tensors: pointers and their row stride (head stride D, one head).
  struct Set {
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
    int64_t rs;
  };
  // [T, 1, D] fp32 views, rows `rs` elements apart.
  const auto view = [&](float* p, int64_t rs) {
    return TensorView{.data = p, .rows = T, .heads = 1, .dim = D, .dtype = DType::f32, .row_stride = rs};
  };
  const auto inputs = [&](const Set& t, KernelPath path) {
    return AttnInputs{.q = view(t.q, t.rs), .k = view(t.k, t.rs), .v = view(t.v, t.rs), .work = &wl,
                      .options = {.mask = MaskType::causal, .path = path}};
  };
  const auto fwd = [&](const Set& t, KernelPath path) {
    return AttnFwdParams{.in = inputs(t, path), .out = view(t.out, t.rs), .lse = t.lse};
  };
  const auto bwd = [&](const Set& t, KernelPath path) {
    return AttnBwdParams{.in = inputs(t, path), .out = view(t.out, t.rs), .lse = t.lse,
                         .dout = view(t.dout, t.rs), .dq = view(t.dq, t.rs), .dk = view(t.dk, t.rs),
                         .dv = view(t.dv, t.rs)};
  };

  // The reference, on compact copies.
  std::vector<float> out(T * D), lse(T), dq(T * D), dk(T * D), dv(T * D);
  const Set compact{q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(), dv.data(), D};
  attention_forward_reference(fwd(compact, KernelPath::automatic));
  attention_backward_reference(bwd(compact, KernelPath::automatic));

  for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512}) {
    if (!kernel_path_supported(path)) continue;
    SCOPED_TRACE(std::string(to_string(path)));
    std::vector<float> got_lse(T);
    const Set wide{col(cq), col(ck), col(cv), col(cout), got_lse.data(), col(cdout), col(cdq), col(cdk), col(cdv), stride};
    attention_forward(fwd(wide, path));
    attention_backward(bwd(wide, path));
    const auto rows = [&](Col c) {
      std::vector<float> f(T * D);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t e = 0; e < D; ++e) f[r * D + e] = col(c)[r * stride + e];
      return f;
    };
    const double tol = tolerance(DType::f32).rel_norm;
    EXPECT_LE(rel_norm_error(rows(cout), out), tol);
    EXPECT_LE(rel_norm_error(got_lse, lse), kLseRelNorm);
    EXPECT_LE(rel_norm_error(rows(cdq), dq), tol);
    EXPECT_LE(rel_norm_error(rows(cdk), dk), tol);
    EXPECT_LE(rel_norm_error(rows(cdv), dv), tol);
  }
  munmap(m, bytes);
}

// ---- bad parameters ----------------------------------------------------------------------------
class kernel_bad_params : public ::testing::Test {
 protected:
  AttnCase c{"bad", {8, 8}, {8, 8}, 4, 2, 16, 16, MaskType::causal};
  Problem pb{c, DType::f32, 1};
  Tensor out{DType::f32, pb.out_shape()};
  std::vector<float> lse = std::vector<float>(pb.lse_size(), 123.0f);

  AttnFwdParams good() { return pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1); }
  void expect_error(const AttnFwdParams& p, const std::string& needle) {
    for (auto& x : out.f) x = 7.0f;
    try {
      attention_forward(p);
      ADD_FAILURE() << "no error, expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    for (float x : out.f) ASSERT_EQ(x, 7.0f) << "output written before the error";
    for (float x : lse) ASSERT_EQ(x, 123.0f) << "lse written before the error";
  }
};

TEST_F(kernel_bad_params, Raise) {
  EXPECT_NO_THROW(attention_forward(good()));
  for (float& x : lse) x = 123.0f;
  auto p = good();
  p.in.q.data = nullptr;
  expect_error(p, "q must not be null");
  p = good();
  p.in.k.heads = p.in.v.heads = 3;  // num_heads_k
  expect_error(p, "multiple of num_heads_k");
  p = good();
  p.in.q.dim = p.in.k.dim = 0;  // head_dim_qk
  expect_error(p, "head_dim_qk (q.dim) must be in [1, 256]");
  p = good();
  p.in.v.dim = p.out.dim = 257;  // head_dim_v
  expect_error(p, "head_dim_v (v.dim) must be in [1, 256]");
  p = good();
  p.in.options.dropout_p = 1.0f;
  expect_error(p, "dropout_p must be in [0, 1)");
  p = good();
  p.in.options.mask = static_cast<MaskType>(7);  // (ran as none)
  expect_error(p, "mask must be none or causal, got 7");
  p = good();
  p.in.q.dtype = p.in.k.dtype = p.in.v.dtype = p.out.dtype = static_cast<DType>(9);  // (wrote no output)
  expect_error(p, "q's dtype must be fp32, fp16 or bf16, got 9");
  p = good();
  p.in.options.window_size_left = -2;
  expect_error(p, "window_size_left and window_size_right must be >= -1");
  p = good();
  p.in.options.softcap = -1.0f;
  expect_error(p, "softcap must be finite and >= 0");
  p = good();
  const float bad_slopes[4] = {0.5f, std::numeric_limits<float>::quiet_NaN(), 0.1f, 0.1f};
  p.in.options.alibi_slopes = bad_slopes;
  expect_error(p, "alibi_slopes[1] must be finite");
  p = good();
  p.in.options.num_threads = 0;
  expect_error(p, "num_threads");
  // head + dropout_head_offset is an int: an offset near INT_MAX overflowed it
  p = good();
  p.in.options.dropout_head_offset = std::numeric_limits<int>::max() - 3;  // 4 query heads
  expect_error(p, "dropout_head_offset must be in [0, INT_MAX - num_heads_q]");
  // strides whose offsets pass int64 (2^62 x 3 heads wrapped the row check's sum and passed it)
  p = good();
  p.in.q.head_stride = int64_t{1} << 62;
  expect_error(p, "q.head_stride 4611686018427387904 puts the last of 4 heads past int64's offsets");
  p = good();
  p.in.q.row_stride = int64_t{1} << 61;
  expect_error(p, "q.row_stride 2305843009213693952 puts the last of 16 rows past int64's offsets");
  p = good();
  p.in.q.row_stride = 10;
  expect_error(p, "q.row_stride");
  p = good();
  for (const KernelPath path : {KernelPath::avx512, KernelPath::avx512_bf16, KernelPath::amx})
    if (!kernel_path_supported(path)) {
      p = good();
      p.in.options.path = path;
      expect_error(p, "kernel path " + std::string(to_string(path)) + " is not supported by this CPU");
    }
  WorkList w = pb.work;
  w.tasks[1].q_row = 10;  // 10 + 8 > 16
  p = good();
  p.in.work = &w;
  expect_error(p, "outside q's rows");
  w = pb.work;
  w.tasks[1].q_row = 4;  // overlaps task 0
  p.in.work = &w;
  expect_error(p, "must not overlap");
  w = pb.work;
  w.runs[1].row = 12;  // 12 + 8 > 16
  p.in.work = &w;
  expect_error(p, "outside k's rows");
  w = pb.work;
  w.runs = {{.row = 0, .len = 4, .pos = 4}, {.row = 4, .len = 4, .pos = 0}, w.runs[1]};
  w.tasks[0].run_end = 2;
  w.tasks[1].run_begin = w.tasks[1].run_end = 2;
  w.tasks[1].run_end = 3;
  p.in.work = &w;
  expect_error(p, "increasing position order");
  w = pb.work;
  w.tasks[0].run_end = 5;
  p.in.work = &w;
  expect_error(p, "run_end <= runs.size()");
  // Positions past 2^48 (q_pos + q_len overflowed int64 near its top: rows came out 0).
  w = pb.work;
  w.tasks[0].q_pos = std::numeric_limits<int64_t>::max() - 2;
  p.in.work = &w;
  expect_error(p, "task 0 positions [");
  w = pb.work;
  w.runs[0].pos = (int64_t{1} << 48);
  p.in.work = &w;
  expect_error(p, "run 0 positions [");
  p = good();
  p.in.work = nullptr;
  expect_error(p, "work must not be null");
}

TEST_F(kernel_bad_params, BackwardRaises) {
  Tensor dq(DType::f32, pb.q_shape()), dk(DType::f32, pb.k_shape()), dv(DType::f32, pb.v_shape());
  auto b = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1);
  b.dout.data = nullptr;
  EXPECT_THROW(attention_backward(b), Error);
  b = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1);
  b.grad_mode = GradMode::accumulate;
  b.dk.data = b.dv.data = nullptr;
  EXPECT_THROW(attention_backward(b), Error);  // no fp32 buffers to accumulate into
  b = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, 1);
  b.in.q.dim = b.in.k.dim = 300;  // head_dim_qk
  EXPECT_THROW(attention_backward(b), Error);
}

// The shared packing's buffer: K^T, K (or V) and V^T rows of every kv head, key rows rounded
// up to 64 and head dims to 16, four bytes each (fp32 panels) or two (the tiles' bf16 pairs),
// none alone; worked by hand. Sizes whose bytes would wrap size_t, and negative ones, are
// refused naming the arguments.
TEST(kernel_kv_pack_bytes, AreThePackedOperandsAndRefuseSizesThatWrap) {
  for (const auto& [layout, bytes] : {std::pair{KvPackLayout::bf16_tiles, size_t{2}}, {KvPackLayout::fp32, size_t{4}}}) {
    EXPECT_EQ(attention_kv_pack_bytes(65, 2, 48, 40, layout), size_t{128} * 2 * (48 + 48 + 48) * bytes);
    EXPECT_EQ(attention_kv_pack_bytes(64, 1, 128, 128, layout), size_t{64} * 1 * (3 * 128) * bytes);
    EXPECT_EQ(attention_kv_pack_bytes(0, 4, 128, 128, layout), size_t{0});
    EXPECT_EQ(attention_kv_pack_bytes(1, 1, 1, 1, layout), size_t{64} * 48 * bytes);
  }
  EXPECT_EQ(attention_kv_pack_bytes(64, 1, 128, 128, KvPackLayout::alone), size_t{0});
  for (const KvPackLayout layout : {KvPackLayout::alone, KvPackLayout::fp32, KvPackLayout::bf16_tiles}) {
    const std::string negative = error_of([layout] { (void)attention_kv_pack_bytes(-1, 4, 128, 128, layout); });
    EXPECT_NE(negative.find("total_k, num_heads_k, head_dim_qk and head_dim_v must be >= 0"), std::string::npos)
        << negative;
  }
  for (const int64_t keys : {std::numeric_limits<int64_t>::max(), int64_t{1} << 40}) {
    const std::string wraps =
        error_of([keys] { (void)attention_kv_pack_bytes(keys, 1 << 20, 256, 256, KvPackLayout::fp32); });
    EXPECT_NE(wraps.find("need more bytes than size_t holds"), std::string::npos) << keys << ": " << wraps;
  }
}

// Which layout each path packs a KvPackShare in, by storage dtype: the tiles' pairs for bf16
// on the tile paths, none for bf16 on the bf16 dot-product paths, fp32 panels otherwise.
TEST(kernel_kv_pack_layout, FollowsEachPathsProducts) {
  for (const DType dt : {DType::f32, DType::f16}) {
    for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                                  KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated})
      EXPECT_EQ(attention_kv_pack_layout(path, dt), KvPackLayout::fp32) << to_string(path) << " " << to_string(dt);
  }
  const DType bf = DType::bf16;
  for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512})
    EXPECT_EQ(attention_kv_pack_layout(path, bf), KvPackLayout::fp32) << to_string(path);
  for (const KernelPath path : {KernelPath::avx512_bf16, KernelPath::bf16_emulated})
    EXPECT_EQ(attention_kv_pack_layout(path, bf), KvPackLayout::alone) << to_string(path);
  for (const KernelPath path : {KernelPath::amx, KernelPath::amx_emulated})
    EXPECT_EQ(attention_kv_pack_layout(path, bf), KvPackLayout::bf16_tiles) << to_string(path);
}

// Callers that pack K/V together (KvPackShare: each packs its part of the units into one
// buffer, then a barrier, then all read every part) get bitwise what one call packing alone
// gets, forward and backward, on every path this CPU has and every storage dtype (the layouts
// fp32 and bf16_tiles, and alone, where the call only keeps the barrier), 2 and 3 callers of 2
// threads each, with a key_rows map, GQA and head dims that pad (72/40). The buffer is all NaN
// words before each call: a part no caller packed would show in the results, and where the
// layout is not alone every word the call packs is written (K^T and V: the forward's first
// nb (dp + dvp) elements; the backward's K^T, K and V^T: all of them).
TEST(kernel_kv_pack_share, CallersPackingTogetherGetBitwiseACallAlone) {
  AttnCase c{"gqa-72-40", {1, 37, 130, 64}, {1, 37, 130, 64}, 8, 2, 72, 40, MaskType::causal};
  int ran = 0;
  for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                                KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path) || loop_skips_under_sanitizer(path)) continue;
    for (const DType dt : {DType::f32, DType::f16, DType::bf16}) {
      const Problem pb(c, dt, 41);
      const int64_t tk = c.total_k();
      std::vector<int64_t> perm(static_cast<size_t>(tk));
      for (int64_t r = 0; r < tk; ++r) perm[static_cast<size_t>(r)] = (r * 7 + 3) % tk;  // 7 is prime to 232
      Tensor out(dt, pb.out_shape()), dq(dt, pb.q_shape()), dk(dt, pb.k_shape()), dv(dt, pb.v_shape());
      std::vector<float> lse(pb.lse_size());
      AttnFwdParams f = pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 1);
      f.in.key_rows = perm.data();
      attention_forward(f);
      AttnBwdParams b = pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, path, 1);
      b.in.key_rows = perm.data();
      attention_backward(b);
      const KvPackLayout layout = attention_kv_pack_layout(path, dt);
      const std::size_t bytes = attention_kv_pack_bytes(tk, c.num_heads_k, c.head_dim_qk, c.head_dim_v, layout);
      for (const int parts : {2, 3}) {
        SCOPED_TRACE(std::string(to_string(path)) + " " + std::string(to_string(dt)) + " parts " +
                     std::to_string(parts));
        std::vector<uint32_t> raw(bytes / 4 + 16, 0xffffffffu);
        auto* buf = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) / 64 * 64);
        auto* words = reinterpret_cast<uint32_t*>(buf);
        const auto unpacked = [&](size_t n) { return std::count(words, words + n, 0xffffffffu); };
        // the words of K^T and V a forward packs, of the backward's K^T, K and V^T (head dims padded to 16)
        const size_t dp = (c.head_dim_qk + 15) / 16 * 16, dvp = (c.head_dim_v + 15) / 16 * 16;
        const size_t fwd_words = bytes / 4 / (2 * dp + dvp) * (dp + dvp);
        int64_t forward_unpacked = -1;
        std::barrier sync(parts);
        struct Caller {
          Tensor out, dq, dk, dv;
          std::vector<float> lse;
          KvPackShare share;
          std::string error;
        };
        std::vector<Caller> callers;
        for (int i = 0; i < parts; ++i)
          callers.push_back({Tensor(dt, pb.out_shape()), Tensor(dt, pb.q_shape()), Tensor(dt, pb.k_shape()),
                             Tensor(dt, pb.v_shape()), std::vector<float>(pb.lse_size()),
                             {.buffer = buf, .bytes = bytes, .part = i, .parts = parts,
                              .sync = [&sync] { sync.arrive_and_wait(); }},
                             {}});
        std::vector<std::thread> threads;
        for (Caller& k : callers)
          threads.emplace_back([&] {
            try {
              AttnFwdParams fk = pb.fwd(pb.q, pb.k, pb.v, k.out, k.lse.data(), path, 2);
              fk.in.key_rows = perm.data();
              fk.in.kv_pack_share = &k.share;
              attention_forward(fk);
              sync.arrive_and_wait();  // every caller has read the forward's packing
              if (k.share.part == 0) {
                forward_unpacked = unpacked(fwd_words);
                std::fill(words, words + bytes / 4, 0xffffffffu);
              }
              sync.arrive_and_wait();
              AttnBwdParams bk = pb.bwd(pb.q, pb.k, pb.v, k.out, k.lse.data(), pb.dout, k.dq, k.dk, k.dv, path, 2);
              bk.in.key_rows = perm.data();
              bk.in.kv_pack_share = &k.share;
              attention_backward(bk);
            } catch (const std::exception& e) {
              k.error = e.what();
              sync.arrive_and_drop();
            }
          });
        for (std::thread& t : threads) t.join();
        for (const Caller& k : callers) {
          ASSERT_EQ(k.error, "");
          EXPECT_EQ(k.out.values(), out.values());
          EXPECT_EQ(k.lse, lse);
          EXPECT_EQ(k.dq.values(), dq.values());
          EXPECT_EQ(k.dk.values(), dk.values());
          EXPECT_EQ(k.dv.values(), dv.values());
        }
        EXPECT_EQ(forward_unpacked, 0) << "words of the forward's share no caller packed";
        EXPECT_EQ(unpacked(bytes / 4), 0) << "words of the backward's share no caller packed";
        EXPECT_EQ(bytes == 0, layout == KvPackLayout::alone);
        ++ran;
      }
    }
  }
  EXPECT_GT(ran, 0);
}

TEST(kernel_varlen_worklist, BuildsBottomRightTasksAndRejectsBadBoundaries) {
  const std::vector<int64_t> cq{0, 2, 5}, ck{0, 4, 7};
  const WorkList w = varlen_worklist(cq, ck);
  ASSERT_EQ(w.tasks.size(), 2u);
  EXPECT_EQ(w.tasks[0].q_pos, 2);
  EXPECT_EQ(w.tasks[1].q_row, 2);
  EXPECT_EQ(w.tasks[1].q_pos, 0);
  EXPECT_EQ(w.runs[1].row, 4);
  EXPECT_EQ(w.runs[1].len, 3);
  const std::vector<int64_t> bad0{1, 2}, short1{0}, flat{0, 2, 2}, big_q{0, 5}, down{0, 3, 2};
  const std::vector<int64_t> k2{0, 2}, k3{0, 4, 7}, small_k{0, 3};
  EXPECT_THROW(varlen_worklist(bad0, k2), Error);
  EXPECT_THROW(varlen_worklist(short1, short1), Error);
  EXPECT_NE(error_of([&] { (void)varlen_worklist(flat, k3); })
                .find("document 1 has q_len 0 and kv_len 3: a document is empty on both sides or on neither"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)varlen_worklist(down, k3); }).find("cu_seqlens must not decrease, document 1 has q_len -1"),
            std::string::npos);
  EXPECT_THROW(varlen_worklist(k2, k3), Error);
  // Causal with more queries than keys (refused before): FlashAttention 2.1's bottom-right
  // rule, the keys at position q_len - kv_len (CausalWithMoreQueriesThanKeysFollowsFlashAttention)
  const WorkList more = varlen_worklist(big_q, small_k);
  ASSERT_EQ(more.tasks.size(), 1u);
  EXPECT_EQ(more.tasks[0].q_pos, 0);
  EXPECT_EQ(more.runs[0].pos, 2);
  // A document empty on both sides (a padded batch's): no task, the next one's doc index kept
  const std::vector<int64_t> pq{0, 2, 2, 5}, pk{0, 4, 4, 7};
  const WorkList padded = varlen_worklist(pq, pk);
  ASSERT_EQ(padded.tasks.size(), 2u);
  EXPECT_EQ(padded.tasks[1].doc, 2);
  EXPECT_EQ(padded.tasks[1].q_row, 2);
  EXPECT_EQ(padded.tasks[1].run_begin, 1);
  EXPECT_EQ(padded.runs[1].row, 4);
  // Without a mask any lengths go (cross-attention): more queries than keys start at 0 and
  // the keys at q_len - kv_len, so query i - key j = i + kv_len - q_len - j, FlashAttention's
  // bottom-right difference, which windows and ALiBi read (before: keys at 0, so a window
  // or ALiBi measured from the top-left corner).
  const WorkList x = varlen_worklist(big_q, small_k, MaskType::none);
  ASSERT_EQ(x.tasks.size(), 1u);
  EXPECT_EQ(x.tasks[0].q_len, 5);
  EXPECT_EQ(x.tasks[0].q_pos, 0);
  EXPECT_EQ(x.runs[0].len, 3);
  EXPECT_EQ(x.runs[0].pos, 2);
  EXPECT_EQ(w.runs[0].pos, 0);
  // int32 boundaries (what PyTorch users hold) give the same list.
  const std::vector<int32_t> cq32{0, 2, 5}, ck32{0, 4, 7};
  const WorkList w32 = varlen_worklist(cq32, ck32);
  ASSERT_EQ(w32.tasks.size(), w.tasks.size());
  for (std::size_t t = 0; t < w.tasks.size(); ++t) {
    EXPECT_EQ(w32.tasks[t].q_row, w.tasks[t].q_row);
    EXPECT_EQ(w32.tasks[t].q_pos, w.tasks[t].q_pos);
    EXPECT_EQ(w32.runs[t].row, w.runs[t].row);
    EXPECT_EQ(w32.runs[t].len, w.runs[t].len);
  }
}

// Causal with more queries than keys, as FlashAttention 2.1 and later take it (bottom-right:
// query i sees key j iff j <= i - (q_len - kv_len)): the first q_len - kv_len rows see no key
// (out 0, lse -inf, dq 0) and the others are their softmax over the keys they see, against a
// float64 computation of that rule written here (not the reference's visibility), forward and
// backward, on every path this CPU runs, in fp32, fp16 and bf16 storage (the bf16 pairs and
// tiles); a document empty on both sides between changes nothing. The second case has 260 such
// rows: whole query blocks (64 rows, 128 on the tiles) that see no key.
TEST(kernel_varlen_worklist, CausalWithMoreQueriesThanKeysFollowsFlashAttention) {
  const int hq = 2, d = 8;
  const AttnCase few{"more_queries", {9, 0, 3}, {4, 0, 3}, hq, 1, d, d, MaskType::causal};
  const AttnCase blocks{"blocks_see_no_key", {300, 0, 3}, {40, 0, 3}, hq, 1, d, d, MaskType::causal};
  const double scale = 1.0 / std::sqrt(double{d});
  const auto at = [](int64_t row, int heads, int h, int e) { return static_cast<std::size_t>((row * heads + h) * d + e); };
  for (const AttnCase* c : {&few, &blocks})
    for (const DType dt : {DType::f32, DType::f16, DType::bf16}) {
      SCOPED_TRACE(c->name + " " + std::string(to_string(dt)));
      const Problem pb(*c, dt, 77);
      const std::vector<float> q = pb.q.values(), k = pb.k.values(), v = pb.v.values(), dout = pb.dout.values();
      // float64: out, lse, dq, dk, dv of the rule, document by document
      std::vector<double> out(q.size(), 0.0), lse(static_cast<std::size_t>(c->total_q() * hq), -INFINITY),
          dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
      int64_t q0 = 0, k0 = 0, unseen = 0;
      for (std::size_t doc = 0; doc < c->q_lens.size(); q0 += c->q_lens[doc], k0 += c->k_lens[doc], ++doc) {
        const int64_t ql = c->q_lens[doc], kl = c->k_lens[doc];
        if (doc == 0) unseen = ql - kl;
        for (int h = 0; h < hq; ++h)
          for (int64_t i = 0; i < ql; ++i) {
            const int64_t seen = i - (ql - kl) + 1;  // keys 0 .. seen - 1
            if (seen <= 0) continue;
            const int64_t qr = q0 + i;
            std::vector<double> p(static_cast<std::size_t>(seen));
            double m = -INFINITY, sum = 0;
            for (int64_t j = 0; j < seen; ++j) {
              double sdot = 0;
              for (int e = 0; e < d; ++e) sdot += double{q[at(qr, hq, h, e)]} * k[at(k0 + j, 1, 0, e)];
              p[static_cast<std::size_t>(j)] = sdot * scale;
              m = std::max(m, p[static_cast<std::size_t>(j)]);
            }
            for (double& x : p) sum += x = std::exp(x - m);
            for (double& x : p) x /= sum;
            lse[static_cast<std::size_t>(qr * hq + h)] = m + std::log(sum);
            for (int e = 0; e < d; ++e)
              for (int64_t j = 0; j < seen; ++j) out[at(qr, hq, h, e)] += p[static_cast<std::size_t>(j)] * v[at(k0 + j, 1, 0, e)];
            double delta = 0;
            for (int e = 0; e < d; ++e) delta += double{dout[at(qr, hq, h, e)]} * out[at(qr, hq, h, e)];
            for (int64_t j = 0; j < seen; ++j) {
              double dp = 0;
              for (int e = 0; e < d; ++e) dp += double{dout[at(qr, hq, h, e)]} * v[at(k0 + j, 1, 0, e)];
              const double pj = p[static_cast<std::size_t>(j)], ds = pj * (dp - delta);
              for (int e = 0; e < d; ++e) {
                dq[at(qr, hq, h, e)] += scale * ds * k[at(k0 + j, 1, 0, e)];
                dk[at(k0 + j, 1, 0, e)] += scale * ds * q[at(qr, hq, h, e)];
                dv[at(k0 + j, 1, 0, e)] += pj * dout[at(qr, hq, h, e)];
              }
            }
          }
      }
      // relative L2 within fp32's rule, or the 16-bit dtype's rtol (the products' rounding); lse
      // is fp32 in every dtype
      const auto close = [](const std::vector<float>& got, const std::vector<double>& want, const char* what,
                            double tol) {
        double num = 0, den = 0;
        for (std::size_t i = 0; i < want.size(); ++i) {
          if (std::isinf(want[i])) {
            EXPECT_EQ(got[i], static_cast<float>(want[i])) << what << " " << i;
            continue;
          }
          num += (got[i] - want[i]) * (got[i] - want[i]);
          den += want[i] * want[i];
        }
        EXPECT_LE(std::sqrt(num / den), tol) << what;
      };
      const double tol = dt == DType::f32 ? tolerance(dt).rel_norm : tolerance(dt).rtol;
      for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                                    KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
        if (!kernel_path_supported(path)) continue;
        SCOPED_TRACE(std::string(to_string(path)));
        Tensor o(dt, pb.out_shape()), gq(dt, pb.q_shape()), gk(dt, pb.k_shape()), gv(dt, pb.v_shape());
        std::vector<float> l(pb.lse_size());
        attention_forward(pb.fwd(pb.q, pb.k, pb.v, o, l.data(), path, 2));
        attention_backward(pb.bwd(pb.q, pb.k, pb.v, o, l.data(), pb.dout, gq, gk, gv, path, 2));
        const std::vector<float> ov = o.values(), gqv = gq.values();
        for (int64_t r = 0; r < unseen; ++r)  // the rows that see no key: exactly zero
          for (int e = 0; e < hq * d; ++e) {
            ASSERT_EQ(ov[static_cast<std::size_t>(r * hq * d + e)], 0.0f) << r;
            ASSERT_EQ(gqv[static_cast<std::size_t>(r * hq * d + e)], 0.0f) << r;
          }
        close(ov, out, "out", tol);
        close(l, lse, "lse", kLseRelNorm);
        close(gqv, dq, "dq", tol);
        close(gk.values(), dk, "dk", tol);
        close(gv.values(), dv, "dv", tol);
      }
    }
}

TEST(kernel_paths, DispatchTable) {
  EXPECT_TRUE(kernel_path_supported(KernelPath::portable));
  EXPECT_TRUE(kernel_path_supported(KernelPath::automatic));
  EXPECT_TRUE(kernel_path_supported(best_kernel_path()));
  EXPECT_NE(best_kernel_path(), KernelPath::automatic);
  for (const KernelPath p : {KernelPath::automatic, KernelPath::portable, KernelPath::avx2, KernelPath::avx512,
                             KernelPath::avx512_bf16, KernelPath::bf16_emulated, KernelPath::amx,
                             KernelPath::amx_emulated})
    EXPECT_EQ(parse_kernel_path(to_string(p)), p);
  EXPECT_THROW(parse_kernel_path("fast"), Error);
}

// The first value of a /proc/cpuinfo field (its words after the colon, one space apart), as
// the kernel reports it, independent of the library's CPUID code; empty when unreadable.
std::string cpuinfo_field(const std::string& name) {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(name, 0) == 0 && line.find(':') != std::string::npos) {
      std::istringstream is(line.substr(line.find(':') + 1));
      std::string value;
      for (std::string w; is >> w;) value += (value.empty() ? "" : " ") + w;
      return value;
    }
  return {};
}

// The CPU's feature flags (/proc/cpuinfo's flags); empty when unreadable.
std::set<std::string> cpuinfo_flags() {
  std::istringstream is(cpuinfo_field("flags"));
  std::set<std::string> flags;
  for (std::string w; is >> w;) flags.insert(w);
  return flags;
}

// The dispatch's choice on the running CPU, derived from its flags and vendor and the
// documented order (docs/kernels.md): bf16 amx > avx512_bf16 > avx512 > avx2 > portable (on
// Intel CPUs amx > avx512 > avx512_bf16 > ...), fp16 and fp32 avx512 > avx2 > portable. The kernel lists amx_tile and amx_bf16 only where XCR0 has the tile state,
// and Linux 5.16+ (which lists them) grants tile data.
TEST(kernel_paths, AutomaticPicksTheFastestPathTheCpuHasByTheDocumentedOrder) {
  const std::set<std::string> f = cpuinfo_flags();
  if (f.empty()) GTEST_SKIP() << "/proc/cpuinfo has no flags line: cannot derive the CPU's features";
  const auto has = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (!f.contains(n)) return false;
    return true;
  };
  const bool avx2 = has({"avx2", "fma", "f16c"});
  const bool avx512 = avx2 && has({"avx512f", "avx512bw", "avx512dq", "avx512vl"});
  const bool bf16 = avx512 && has({"avx512_bf16"});
  const bool amx = bf16 && has({"amx_tile", "amx_bf16"});
  EXPECT_EQ(kernel_path_supported(KernelPath::avx2), avx2);
  EXPECT_EQ(kernel_path_supported(KernelPath::bf16_emulated), avx2);
  EXPECT_EQ(kernel_path_supported(KernelPath::amx_emulated), avx2);
  EXPECT_EQ(kernel_path_supported(KernelPath::avx512), avx512);
  EXPECT_EQ(kernel_path_supported(KernelPath::avx512_bf16), bf16);
  EXPECT_EQ(kernel_path_supported(KernelPath::amx), amx);
  const KernelPath want = avx512 ? KernelPath::avx512 : avx2 ? KernelPath::avx2 : KernelPath::portable;
  // bf16: avx512_bf16 before avx512 except on Intel CPUs (vdpbf16ps at half the FMA rate there)
  const bool intel = cpuinfo_field("vendor_id") == "GenuineIntel";
  const KernelPath want_bf16 = amx ? KernelPath::amx : bf16 && !intel ? KernelPath::avx512_bf16 : want;
  const KernelPath want_f16 = want;
  EXPECT_EQ(best_kernel_path(), want);
  EXPECT_EQ(best_kernel_path(DType::f32), want);
  EXPECT_EQ(best_kernel_path(DType::f16), want_f16);
  EXPECT_EQ(best_kernel_path(DType::bf16), want_bf16);
  if (std::getenv("CPATTN_KERNEL_PATH") != nullptr) return;  // the override is tested below
  for (const DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const KernelChoice c = resolve_kernel_path(KernelPath::automatic, dt);
    EXPECT_EQ(c.path, dt == DType::bf16 ? want_bf16 : dt == DType::f16 ? want_f16 : want) << to_string(dt);
    EXPECT_FALSE(c.forced_by_env);
    EXPECT_EQ(c.reason.rfind("chosen automatically: " + std::string(to_string(c.path)), 0), 0u) << c.reason;
    const char* order = dt != DType::bf16 ? "avx512 > avx2 > portable"
                        : intel          ? "bf16 storage on Intel CPUs, amx > avx512 > avx512_bf16 > avx2 > portable"
                                         : "bf16 storage on non-Intel CPUs, amx > avx512_bf16 > avx512 > avx2 > portable";
    EXPECT_NE(c.reason.find(order), std::string::npos) << c.reason;
    if (dt != DType::bf16) {
      EXPECT_EQ(c.reason.find("amx"), std::string::npos) << c.reason;
    } else if (!amx) {
      EXPECT_NE(c.reason.find("amx (needs"), std::string::npos) << c.reason;
    }
    if (c.path != KernelPath::avx512 && c.path != KernelPath::avx512_bf16 && c.path != KernelPath::amx) {
      EXPECT_NE(c.reason.find("avx512 (needs"), std::string::npos) << "names what the CPU lacks: " << c.reason;
    }
  }
  EXPECT_EQ(resolve_kernel_path(KernelPath::portable, DType::bf16).path, KernelPath::portable);
  EXPECT_EQ(resolve_kernel_path(KernelPath::portable, DType::bf16).reason, "forced by AttnOptions::path");
}

TEST(kernel_paths, EnvironmentOverridesAutomaticAndIsValidated) {
  const AttnCase c{"env", {33, 1, 20}, {33, 1, 20}, 2, 1, 24, 24, MaskType::causal};
  const Problem pb(c, DType::bf16, 5);
  const auto forward = [&](KernelPath path) {
    Tensor out(DType::bf16, pb.out_shape());
    std::vector<float> lse(pb.lse_size());
    attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), path, 1));
    return out.values();
  };
  const std::vector<float> portable = forward(KernelPath::portable);
  {
    const EnvPath env("portable");
    const KernelChoice ch = resolve_kernel_path(KernelPath::automatic, DType::bf16);
    EXPECT_EQ(ch.path, KernelPath::portable);
    EXPECT_TRUE(ch.forced_by_env);
    EXPECT_NE(ch.reason.find("CPATTN_KERNEL_PATH=portable"), std::string::npos) << ch.reason;
    EXPECT_EQ(forward(KernelPath::automatic), portable) << "automatic did not run the portable path";
    // an explicit path is not overridden
    EXPECT_EQ(resolve_kernel_path(KernelPath::avx2, DType::bf16).path, KernelPath::avx2);
  }
  {
    const EnvPath env("automatic");  // no override
    EXPECT_EQ(resolve_kernel_path(KernelPath::automatic, DType::bf16).path, best_kernel_path(DType::bf16));
  }
  // A path this CPU cannot run (amx, where the CPU lacks it) and a name that is no path: the
  // call fails before any work, naming the variable.
  std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {"fast", {"CPATTN_KERNEL_PATH must be one of automatic, portable, avx2"}}};
  if (!kernel_path_supported(KernelPath::amx)) {
    std::string picks = "(automatic picks ";
    picks += to_string(best_kernel_path(DType::f32));
    (picks += " for fp32, ") += to_string(best_kernel_path(DType::bf16));
    (picks += " for bf16, ") += to_string(best_kernel_path(DType::f16));
    bad.push_back({"amx", {"CPATTN_KERNEL_PATH=amx cannot run on this CPU (the amx path needs AVX-512F/BW/DQ/VL, "
                           "AVX512_BF16, AMX-TILE and AMX-BF16",
                           picks + " for fp16)"}});
  }
  for (const auto& [value, needles] : bad) {
    const EnvPath env(value.c_str());
    Tensor out(DType::bf16, pb.out_shape());
    for (size_t i = 0; i < out.size(); ++i) out.set(i, 7.0f);
    std::vector<float> lse(pb.lse_size(), 123.0f);
    try {
      attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1));
      ADD_FAILURE() << "CPATTN_KERNEL_PATH=" << value << ": no error";
    } catch (const Error& e) {
      for (const std::string& needle : needles) EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("attention_forward"), std::string::npos) << e.what();
    }
    for (float x : out.values()) ASSERT_EQ(x, 7.0f) << "output written before the error";
    for (float x : lse) ASSERT_EQ(x, 123.0f) << "lse written before the error";
    EXPECT_THROW(check_attention_config(AttnShape{.num_heads_q = 2, .num_heads_k = 1, .head_dim_qk = 8, .head_dim_v = 8},
                                        AttnOptions{}, "CpAttention"),
                 Error);
    // an explicit path does not read the variable
    EXPECT_NO_THROW(attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::portable, 1)));
  }
}

// ---- the bf16 dot-product step (vdpbf16ps's documented semantics) --------------------------
uint16_t bf(float x) {  // x must be a bf16 value
  const uint32_t u = std::bit_cast<uint32_t>(x);
  EXPECT_EQ(u & 0xffffu, 0u) << x << " is not a bf16 value";
  return static_cast<uint16_t>(u >> 16);
}
uint32_t pair(uint16_t even, uint16_t odd) { return uint32_t{even} | uint32_t{odd} << 16; }

struct DotLane {
  const char* what;
  float acc;
  uint32_t a, b;
  float want;
};

// Worked by hand from Intel's description: acc += a_odd b_odd, then acc += a_even b_even, each
// rounded to nearest even in fp32; denormal inputs read as 0, denormal results flushed to 0.
std::vector<DotLane> dot_lanes() {
  const float p12 = std::ldexp(1.0f, -12), p15 = std::ldexp(1.0f, -15), p30 = std::ldexp(1.0f, -30);
  const uint16_t denormal = 0x0001, two127 = bf(std::ldexp(1.0f, 127)), p64 = bf(std::ldexp(1.0f, -64));
  return {
      {"plain", 0.5f, pair(bf(1.5f), bf(-2.0f)), pair(bf(2.0f), bf(0.25f)), 3.0f},
      // 1 + 2^-24 is a tie: rounds to 1 (even) twice; a fused sum would give 1 + 2^-23
      {"two roundings", 1.0f, pair(bf(p12), bf(p12)), pair(bf(p12), bf(p12)), 1.0f},
      // odd first: (1 - 1) + 2^-30 = 2^-30; even first would give (1 + 2^-30) - 1 = 0
      {"odd before even", 1.0f, pair(bf(p15), bf(1.0f)), pair(bf(p15), bf(-1.0f)), p30},
      // 1 + 1.5 * 2^-24 is above the tie: rounds up to 1 + 2^-23 (nearest, not truncation)
      {"round to nearest", 1.0f, pair(0, bf(3 * p12)), pair(0, bf(std::ldexp(1.0f, -13))),
       1.0f + std::ldexp(1.0f, -23)},
      // a denormal bf16 input reads as 0: 2^-133 * 2^127 = 2^-6 is not added
      {"denormal input", 1.0f, pair(denormal, 0), pair(two127, 0), 1.0f},
      // 2^-64 * 2^-64 = 2^-128 is an fp32 denormal: flushed to 0
      {"denormal result", 0.0f, pair(p64, 0), pair(p64, 0), 0.0f},
      // a denormal accumulator reads as 0
      {"denormal accumulator", std::ldexp(1.0f, -130), pair(0, 0), pair(0, 0), 0.0f},
      {"exact products", -3.0f, pair(bf(0.75f), bf(1.25f)), pair(bf(-4.0f), bf(8.0f)), 4.0f},
  };
}

void expect_dot_lanes(KernelPath path) {
  const kernels::KernelTable* t = kernels::path_table(path);
  ASSERT_NE(t, nullptr);
  ASSERT_NE(t->bf16_dot, nullptr);
  const std::vector<DotLane> lanes = dot_lanes();
  constexpr int n = 32;  // two 16-lane steps, four 8-lane ones
  std::vector<float> acc(n);
  std::vector<uint32_t> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    const DotLane& l = lanes[static_cast<size_t>(i) % lanes.size()];
    acc[i] = l.acc;
    a[i] = l.a;
    b[i] = l.b;
  }
  t->bf16_dot(acc.data(), a.data(), b.data(), n);
  for (int i = 0; i < n; ++i) {
    const DotLane& l = lanes[static_cast<size_t>(i) % lanes.size()];
    EXPECT_EQ(std::bit_cast<uint32_t>(acc[i]), std::bit_cast<uint32_t>(l.want))
        << to_string(path) << " lane " << i << " (" << l.what << "): got " << acc[i] << ", want " << l.want;
  }
}

TEST(kernel_bf16_dot, EmulationFollowsTheDocumentedSemantics) {
  if (!kernel_path_supported(KernelPath::bf16_emulated))
    GTEST_SKIP() << "kernel path bf16_emulated needs AVX2, FMA and F16C, which this CPU lacks";
  expect_dot_lanes(KernelPath::bf16_emulated);
}

TEST(kernel_bf16_dot, InstructionFollowsTheDocumentedSemantics) {
  if (!kernel_path_supported(KernelPath::avx512_bf16))
    GTEST_SKIP() << "kernel path avx512_bf16 is not supported by this CPU (it needs AVX-512 and AVX512_BF16)";
  expect_dot_lanes(KernelPath::avx512_bf16);
}

// Where the CPU has the instruction: the emulation is bitwise the instruction, on random
// pairs over a wide exponent range, with zeros, denormals and signs mixed in.
TEST(kernel_bf16_dot, EmulationIsBitwiseTheInstruction) {
  if (!kernel_path_supported(KernelPath::avx512_bf16) || !kernel_path_supported(KernelPath::bf16_emulated))
    GTEST_SKIP() << "kernel path avx512_bf16 is not supported by this CPU (it needs AVX-512 and AVX512_BF16): "
                    "the emulation is checked against the worked examples alone";
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> expo(-70, 60), kind(0, 15);
  std::uniform_int_distribution<uint32_t> man(0, 127), sign(0, 1);
  const auto value = [&]() -> uint16_t {
    const int k = kind(rng);
    if (k == 0) return 0;
    if (k == 1) return static_cast<uint16_t>(man(rng) | sign(rng) << 15);  // denormal
    return static_cast<uint16_t>(sign(rng) << 15 | static_cast<uint32_t>(expo(rng) + 127) << 7 | man(rng));
  };
  constexpr int n = 4096;
  std::vector<float> acc(n);
  std::vector<uint32_t> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    acc[i] = std::bit_cast<float>(uint32_t{value()} << 16 | man(rng) << 9);
    a[i] = pair(value(), value());
    b[i] = pair(value(), value());
  }
  std::vector<float> native = acc, emulated = acc;
  kernels::path_table(KernelPath::avx512_bf16)->bf16_dot(native.data(), a.data(), b.data(), n);
  kernels::path_table(KernelPath::bf16_emulated)->bf16_dot(emulated.data(), a.data(), b.data(), n);
  for (int i = 0; i < n; ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(native[i]), std::bit_cast<uint32_t>(emulated[i]))
        << "lane " << i << ": acc " << acc[i] << " a " << std::hex << a[i] << " b " << b[i];
}

// The rounding of fp32 operands (P, dS, and Q, dO per product) to pairs: VCVTNE2PS2BF16's
// semantics on every bf16 path, worked by hand: round to nearest even on the 16 bits dropped,
// NaN kept NaN (quiet), and a denormal input to a zero of its sign, even where rounding its
// bits would have given bf16's smallest normal (0x0080).
struct PackCase {
  uint32_t in;
  uint16_t want;
  const char* what;
};
const PackCase kPackCases[] = {
    {0x3f800000u, 0x3f80, "1 (exact)"},
    {0x3f808000u, 0x3f80, "1 + 2^-8: a tie, to the even 1"},
    {0x3f818000u, 0x3f82, "a tie with odd lower bits: up to even"},
    {0x3f808001u, 0x3f81, "just above the tie: up"},
    {0xbf807fffu, 0xbf80, "just below the tie, negative: down"},
    {0x7f7fffffu, 0x7f80, "the largest float: rounds to inf"},
    {0xff800000u, 0xff80, "-inf"},
    {0x7fc00001u, 0x7fc0, "a quiet NaN"},
    {0x7f800001u, 0x7fc0, "a signalling NaN whose payload is below bit 16: quiet NaN"},
    {0x007fffffu, 0x0000, "the largest denormal: zero (it would round to 0x0080)"},
    {0x80000001u, 0x8000, "the smallest negative denormal: -0"},
    {0x00800000u, 0x0080, "the smallest normal"},
    {0x80000000u, 0x8000, "-0"},
};

void expect_pack_lanes(KernelPath path) {
  const kernels::KernelTable* t = kernels::path_table(path);
  ASSERT_NE(t->bf16_pack, nullptr) << to_string(path) << " has no bf16_pack";
  constexpr int n = 64;
  std::vector<float> x(n);
  constexpr int nc = static_cast<int>(std::size(kPackCases));
  for (int i = 0; i < n; ++i) x[i] = std::bit_cast<float>(kPackCases[(i * 7) % nc].in);
  const auto want = [&](int i) { return kPackCases[(i * 7) % nc].want; };
  std::vector<uint32_t> words(n / 2), rows(n / 2);
  t->bf16_pack(x.data(), n, words.data(), rows.data());
  for (int j = 0; j < n / 2; ++j) {
    EXPECT_EQ(words[j], pair(want(2 * j), want(2 * j + 1))) << to_string(path) << " word " << j;
    const int k = j / 16, c = j % 16;
    EXPECT_EQ(rows[j], pair(want(32 * k + c), want(32 * k + 16 + c))) << to_string(path) << " row word " << j;
  }
}

TEST(kernel_bf16_dot, EmulatedRoundingFollowsTheInstructionsSemantics) {
  if (!kernel_path_supported(KernelPath::bf16_emulated)) GTEST_SKIP() << "bf16_emulated needs AVX2, FMA and F16C";
  expect_pack_lanes(KernelPath::bf16_emulated);
}

TEST(kernel_bf16_dot, InstructionRoundingFollowsTheDocumentedSemantics) {
  if (!kernel_path_supported(KernelPath::avx512_bf16))
    GTEST_SKIP() << "kernel path avx512_bf16 is not supported by this CPU (it needs AVX-512 and AVX512_BF16)";
  expect_pack_lanes(KernelPath::avx512_bf16);
}

// Where the CPU has the instruction: the emulated rounding is bitwise vcvtne2ps2bf16 on random
// floats over fp32's whole range, denormals, zeros, infinities and NaNs among them.
TEST(kernel_bf16_dot, EmulatedRoundingIsBitwiseTheInstruction) {
  if (!kernel_path_supported(KernelPath::avx512_bf16) || !kernel_path_supported(KernelPath::bf16_emulated))
    GTEST_SKIP() << "kernel path avx512_bf16 is not supported by this CPU (it needs AVX-512 and AVX512_BF16): "
                    "the emulated rounding is checked against the worked examples alone";
  std::mt19937 rng(23);
  constexpr int n = 1 << 14;
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (i % 5 == 0) u &= 0x807fffffu;             // denormals and zeros
    if (i % 11 == 0) u |= 0x7f800000u;            // infinities and NaNs
    if (i % 13 == 0) u = (u & 0xffff0000u) | 0x8000u;  // ties
    x[i] = std::bit_cast<float>(u);
  }
  std::vector<uint32_t> nw(n / 2), nr(n / 2), ew(n / 2), er(n / 2);
  kernels::path_table(KernelPath::avx512_bf16)->bf16_pack(x.data(), n, nw.data(), nr.data());
  kernels::path_table(KernelPath::bf16_emulated)->bf16_pack(x.data(), n, ew.data(), er.data());
  for (int j = 0; j < n / 2; ++j) {
    ASSERT_EQ(nw[j], ew[j]) << "word " << j << ": x " << std::hex << std::bit_cast<uint32_t>(x[2 * j]) << " "
                            << std::bit_cast<uint32_t>(x[2 * j + 1]);
    ASSERT_EQ(nr[j], er[j]) << "row word " << j;
  }
}

// `path` runs its own products for the storage types `own` (results not the avx2 path's, which
// converts to fp32 and rounds neither P nor dS) and avx2's FMA code for fp32 (bitwise avx2's).
void expect_own_products_only_for(KernelPath path, std::initializer_list<DType> own) {
  const AttnCase c{"own_products", {70, 1, 33}, {70, 1, 33}, 2, 1, 40, 40, MaskType::causal};
  std::vector<DType> dtypes(own);
  dtypes.push_back(DType::f32);
  for (const DType dt : dtypes) {
    const Problem pb(c, dt, 21);
    const Results avx2 = run_kernels(pb, dt, KernelPath::avx2, 1);
    const Results got = run_kernels(pb, dt, path, 1);
    if (dt == DType::f32) {
      EXPECT_EQ(got.out, avx2.out) << to_string(path);
      EXPECT_EQ(got.dq, avx2.dq) << to_string(path);
      EXPECT_EQ(got.dk, avx2.dk) << to_string(path);
    } else {
      EXPECT_NE(got.out, avx2.out) << to_string(dt) << " storage on " << to_string(path) << " ran the fp32 products";
      EXPECT_NE(got.dk, avx2.dk) << to_string(dt) << " storage on " << to_string(path) << " ran the fp32 products";
    }
  }
}

// The bf16 paths run bf16 dot products for bf16 storage and the FMA code for fp32.
TEST(kernel_bf16_dot, Bf16StorageRunsTheDotProductsAndFp32TheBasePath) {
  if (!kernel_path_supported(KernelPath::bf16_emulated)) GTEST_SKIP() << "bf16_emulated needs AVX2, FMA and F16C";
  expect_own_products_only_for(KernelPath::bf16_emulated, {DType::bf16});
}


// ---- the AMX tile product (TDPBF16PS / TDPFP16PS's documented semantics) --------------------
uint16_t hf(float x) {  // x must be an fp16 value
  const uint16_t h = f32_to_f16(x);
  EXPECT_EQ(f16_to_f32(h), x) << x << " is not an fp16 value";
  return h;
}

// One row, one column: C(0, 0) += sum over the k2 pairs of A(0, 2k) B(2k, 0) + A(0, 2k+1) B(2k+1, 0).
struct TileCase {
  const char* what;
  bool fp16;
  float c;
  std::vector<uint16_t> a, b;  // A's row, B's column (both 2 k2 elements, even k first)
  float want;
};

// Worked by hand from Intel's pseudo-code (SDM, TDPBF16PS and TDPFP16PS): per instruction the
// even and the odd elements of the pairs go to two fp32 partial sums starting at 0, each step an
// FMA rounded to nearest even, denormal results flushed; then C += (even + odd), each sum
// rounded and flushed. bf16 denormal inputs read as 0, fp16 ones are exact; a denormal C reads
// as 0.
std::vector<TileCase> tile_cases() {
  const float p12 = std::ldexp(1.0f, -12), p13 = std::ldexp(1.0f, -13), p15 = std::ldexp(1.0f, -15);
  const float p23 = std::ldexp(1.0f, -23);
  const uint16_t denormal = 0x0001, two127 = bf(std::ldexp(1.0f, 127)), p64 = bf(std::ldexp(1.0f, -64));
  return {
      {"plain", false, 0.5f, {bf(1.5f), bf(-2.0f)}, {bf(2.0f), bf(0.25f)}, 3.0f},
      // even 2^-24, odd 2^-24, their sum 2^-23 is added to C once: 1 + 2^-23 (vdpbf16ps, which
      // adds each product to C in turn, rounds 1 + 2^-24 to 1 twice)
      {"pair sums before C", false, 1.0f, {bf(p12), bf(p12)}, {bf(p12), bf(p12)}, 1.0f + p23},
      // C is added last: (-1 + 2^-30) rounds to -1, then 1 + -1 = 0 (C + even + odd in turn
      // would give 2^-30)
      {"C added last", false, 1.0f, {bf(1.0f), bf(p15)}, {bf(-1.0f), bf(p15)}, 0.0f},
      // the even partial sum is rounded at each step: 1 + 2^-24 is a tie, rounds to 1 (even)
      {"each step rounded", false, 0.0f, {bf(1.0f), 0, bf(p12), 0}, {bf(1.0f), 0, bf(p12), 0}, 1.0f},
      // 1 + 1.5 * 2^-24 is above the tie: rounds up to 1 + 2^-23 (nearest, not truncation)
      {"round to nearest", false, 0.0f, {bf(1.0f), 0, bf(3 * p12), 0}, {bf(1.0f), 0, bf(p13), 0}, 1.0f + p23},
      // a denormal bf16 input reads as 0: 2^-133 * 2^127 = 2^-6 is not added
      {"bf16 denormal input", false, 1.0f, {denormal, 0}, {two127, 0}, 1.0f},
      // 2^-64 * 2^-64 = 2^-128 is an fp32 denormal: flushed to 0
      {"denormal result", false, 0.0f, {p64, 0}, {p64, 0}, 0.0f},
      // a denormal C reads as 0
      {"denormal C", false, std::ldexp(1.0f, -130), {0, 0}, {0, 0}, 0.0f},
      // fp16: a denormal input is converted exactly: 2^-24 * 2^10 = 2^-14
      {"fp16 denormal input", true, 0.0f, {denormal, 0}, {hf(1024.0f), 0}, std::ldexp(1.0f, -14)},
      {"fp16 plain", true, -3.0f, {hf(0.75f), hf(1.25f)}, {hf(-4.0f), hf(8.0f)}, 4.0f},
      {"fp16 pair sums before C", true, 1.0f, {hf(p12), hf(p12)}, {hf(p12), hf(p12)}, 1.0f + p23},
  };
}

void expect_tile_cases(KernelPath path, bool with_fp16) {
  const kernels::KernelTable* t = kernels::path_table(path);
  ASSERT_NE(t, nullptr);
  ASSERT_NE(t->tile_dot, nullptr);
  for (const TileCase& tc : tile_cases()) {
    if (tc.fp16 && !with_fp16) continue;
    float c = tc.c;
    const int k2 = static_cast<int>(tc.a.size() / 2);
    std::vector<uint16_t> b(tc.b);  // one column: the VNNI layout is the column itself
    t->tile_dot(&c, tc.a.data(), b.data(), 1, k2, 1, tc.fp16);
    EXPECT_EQ(std::bit_cast<uint32_t>(c), std::bit_cast<uint32_t>(tc.want))
        << to_string(path) << " (" << tc.what << "): got " << c << ", want " << tc.want;
  }
}

// C[m x n] += A[m x 2 k2] B on tiles of the call's shapes against float64, on values whose
// products and partial sums stay far from denormals: each element within 20 fp32 roundings of
// the sum of |terms| (an instruction rounds 16 + 2 times), so that any slip of the VNNI layout,
// the pair order or the shapes (an O(1) error) fails.
void expect_tile_product(KernelPath path, int m, int k2, int n, bool fp16) {
  const kernels::KernelTable* t = kernels::path_table(path);
  ASSERT_NE(t, nullptr);
  ASSERT_NE(t->tile_dot, nullptr);
  std::mt19937 rng(static_cast<unsigned>(m * 1000 + k2 * 10 + n));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const auto round16 = [&](float x) { return fp16 ? f32_to_f16(x) : f32_to_bf16(x); };
  const auto widen = [&](uint16_t h) { return fp16 ? f16_to_f32(h) : bf16_to_f32(h); };
  const int kk = 2 * k2;
  std::vector<uint16_t> a(static_cast<size_t>(m) * kk), bk(static_cast<size_t>(kk) * n), b(bk.size());
  for (auto& x : a) x = round16(u(rng));
  for (auto& x : bk) x = round16(u(rng));  // B(k, j) at bk[k * n + j]
  for (int k = 0; k < kk; ++k)
    for (int j = 0; j < n; ++j) b[static_cast<size_t>((k / 2) * 2 * n + 2 * j + k % 2)] = bk[static_cast<size_t>(k * n + j)];
  std::vector<float> c(static_cast<size_t>(m) * n);
  for (auto& x : c) x = u(rng);
  std::vector<float> got = c;
  t->tile_dot(got.data(), a.data(), b.data(), m, k2, n, fp16);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double ref = c[static_cast<size_t>(i * n + j)], mag = std::fabs(ref);
      for (int k = 0; k < kk; ++k) {
        const double term = double{widen(a[static_cast<size_t>(i * kk + k)])} * widen(bk[static_cast<size_t>(k * n + j)]);
        ref += term;
        mag += std::fabs(term);
      }
      EXPECT_LE(std::fabs(got[static_cast<size_t>(i * n + j)] - ref), 20.0 * std::ldexp(1.0, -24) * mag)
          << to_string(path) << (fp16 ? " fp16" : " bf16") << " C(" << i << ", " << j << ") of " << m << " x "
          << 2 * k2 << " x " << n << ": got " << got[static_cast<size_t>(i * n + j)] << ", float64 " << ref;
    }
}

TEST(kernel_amx_tiles, EmulatorFollowsTheDocumentedSemantics) {
  if (!kernel_path_supported(KernelPath::amx_emulated))
    GTEST_SKIP() << "kernel path amx_emulated needs AVX2, FMA and F16C, which this CPU lacks";
  expect_tile_cases(KernelPath::amx_emulated, true);
}

TEST(kernel_amx_tiles, InstructionsFollowTheDocumentedSemantics) {
  if (!kernel_path_supported(KernelPath::amx))
    GTEST_SKIP() << "kernel path amx is not supported by this CPU (it needs AVX512_BF16, AMX-TILE, AMX-BF16 and Linux's "
                    "permission for tile data): the emulator is checked against the worked examples alone";
  expect_tile_cases(KernelPath::amx, kernels::cpu_has_amx_fp16());  // the fp16 cases need AMX-FP16
}

TEST(kernel_amx_tiles, ProductsMatchFloat64OnFullAndPartialTiles) {
  for (const KernelPath path : {KernelPath::amx_emulated, KernelPath::amx}) {
    if (!kernel_path_supported(path)) continue;  // amx: see InstructionsFollowTheDocumentedSemantics
    const bool fp16 = path == KernelPath::amx_emulated || kernels::cpu_has_amx_fp16();
    for (const bool f : {false, true}) {
      if (f && !fp16) continue;
      expect_tile_product(path, 16, 16, 16, f);  // a full 16 x 32 x 16 tile product
      expect_tile_product(path, 3, 5, 7, f);     // configured shapes below the full ones
      expect_tile_product(path, 1, 1, 1, f);
    }
  }
}

// The fp32 micro-kernel (KernelTable::gemm_f32, the gemm that bench/fp32_tiles times) on
// every path this CPU runs, against a float64 product: rows that leave a partial tile of 6 (1,
// 5, 7, 13) and whole tiles (6, 24), one to five 16-column panels, k of 1, 7 and 33, A
// row-major and transposed (read through its column stride), B's rows PAD and PAD + 16 floats
// apart, C written and added to, at strides wider than the shapes; C's columns past n and its
// rows past m are left alone.
TEST(kernel_gemm, Fp32ProductMatchesFloat64OnEveryPath) {
  constexpr int PAD = kernels::PAD;
  int paths = 0;
  for (const KernelPath path : {KernelPath::portable, KernelPath::avx2, KernelPath::avx512, KernelPath::avx512_bf16,
                                KernelPath::bf16_emulated, KernelPath::amx, KernelPath::amx_emulated}) {
    if (!kernel_path_supported(path)) continue;
    const kernels::KernelTable* t = kernels::path_table(path);
    ASSERT_NE(t, nullptr);
    ASSERT_NE(t->gemm_f32, nullptr);
    ++paths;
    for (const int m : {1, 5, 6, 7, 13, 24})
      for (const int n : {16, 48, 80})
        for (const int k : {1, 7, 33})
          for (const bool transposed : {false, true})
            for (const int64_t ldb : {int64_t{PAD}, int64_t{PAD} + 16})
              for (const bool zero : {true, false}) {
                SCOPED_TRACE(::testing::Message() << to_string(path) << " m " << m << " n " << n << " k " << k
                                                  << (transposed ? " A transposed" : "") << " ldb " << ldb
                                                  << (zero ? " written" : " added to"));
                std::mt19937 rng(static_cast<unsigned>(m * 10000 + n * 100 + k * 4 + transposed * 2 + zero + ldb));
                std::uniform_real_distribution<float> u(-1.0f, 1.0f);
                const int64_t ars = transposed ? 1 : k + 3, acs = transposed ? m + 5 : 1;
                const int64_t bps = k * ldb + 32, ldc = n + 8, guard = 2;  // rows of C past m
                std::vector<float> a(static_cast<size_t>(transposed ? k * acs : m * ars));
                std::vector<float> b(static_cast<size_t>(n / PAD * bps));
                for (auto& x : a) x = u(rng);
                for (auto& x : b) x = u(rng);
                std::vector<float> c(static_cast<size_t>((m + guard) * ldc));
                for (auto& x : c) x = u(rng);
                const std::vector<float> c0 = c;
                t->gemm_f32(zero, m, n, k, a.data(), ars, acs, b.data(), ldb, bps, c.data(), ldc);
                for (int r = 0; r < m + guard; ++r)
                  for (int j = 0; j < ldc; ++j) {
                    const size_t ci = static_cast<size_t>(r * ldc + j);
                    if (r >= m || j >= n) {  // not C's: left alone
                      ASSERT_EQ(std::bit_cast<uint32_t>(c[ci]), std::bit_cast<uint32_t>(c0[ci]))
                          << "row " << r << " column " << j;
                      continue;
                    }
                    double ref = zero ? 0.0 : c0[ci], mag = std::abs(ref);
                    for (int kk = 0; kk < k; ++kk) {
                      const double p = double{a[static_cast<size_t>(r * ars + kk * acs)]} *
                                       b[static_cast<size_t>(j / PAD * bps + kk * ldb + j % PAD)];
                      ref += p;
                      mag += std::abs(p);
                    }
                    ASSERT_NEAR(c[ci], ref, 4.0 * (k + 1) * std::numeric_limits<float>::epsilon() * mag)
                        << "row " << r << " column " << j;
                  }
              }
  }
  EXPECT_GE(paths, 1);  // portable runs everywhere
}

// A TileJob (the forward's products step by step, between the softmax's rows) gives bitwise
// gemm_tiles16's C (the products in one go) in the valid rows: written (zero) and added to,
// one and two rows of tiles (m <= 16, <= 32, partial ones), 16 to 128 columns (a last panel of
// 16 alone), k a multiple of 32 and an odd multiple of 16 (the last step's B staged: B's pairs
// past k are NaN), operands at strides wider than their shapes. Inputs include large and small magnitudes, so that
// another order of the pair sums or of the k steps would change some bits.
TEST(kernel_amx_tiles, AStepByStepJobIsBitwiseTheProductInOneGo) {
  if (!kernel_path_supported(KernelPath::amx_emulated)) GTEST_SKIP() << "amx_emulated needs AVX2, FMA and F16C";
  for (const KernelPath path : {KernelPath::amx_emulated, KernelPath::amx}) {
    if (!kernel_path_supported(path)) continue;  // amx: see InstructionsFollowTheDocumentedSemantics
    const kernels::KernelTable* t = kernels::path_table(path);
    ASSERT_NE(t, nullptr);
    ASSERT_NE(t->tile_gemm, nullptr);
    int cases = 0;
    for (const int m : {1, 16, 17, 32})
      for (const int n : {16, 48, 128})
        for (const int k : {16, 32, 48, 128})
          for (const bool zero : {true, false}) {
            SCOPED_TRACE(::testing::Message() << to_string(path) << " m " << m << " n " << n << " k " << k
                                              << (zero ? " written" : " added to"));
            std::mt19937 rng(static_cast<unsigned>(m * 100000 + n * 1000 + k * 10 + zero));
            std::uniform_real_distribution<float> u(-2.0f, 2.0f);
            std::uniform_int_distribution<int> e(-12, 12);
            const auto value = [&] { return std::ldexp(u(rng), e(rng)); };
            const int kp = (k + 31) / 32 * 32, lda = kp + 32, k2 = (k + 1) / 2;
            const int64_t b_ld = n + 16, b_panel = 16, ldc = n + 8;  // B: pair kp of panel j at j * 16 + kp * b_ld
            std::vector<uint16_t> a(static_cast<size_t>(32) * lda, 0);
            for (int r = 0; r < m; ++r)
              for (int c = 0; c < k; ++c) a[static_cast<size_t>(r * lda + c)] = f32_to_bf16(value());
            // Pairs past k are NaN: a product that read them would spoil C (A's zero columns
            // must never meet them).
            std::vector<uint32_t> b(static_cast<size_t>(k2 + 16) * b_ld, 0x7fc07fc0u);
            for (size_t i = 0; i < static_cast<size_t>(k2) * b_ld; ++i)
              b[i] = uint32_t{f32_to_bf16(value())} | uint32_t{f32_to_bf16(value())} << 16;
            std::vector<float> c0(static_cast<size_t>(32) * ldc);
            for (auto& x : c0) x = value();
            std::vector<float> one = c0, job = c0;
            t->tile_gemm(false, zero, m, n, k, a.data(), lda, b.data(), b_ld, b_panel, one.data(), ldc);
            t->tile_gemm(true, zero, m, n, k, a.data(), lda, b.data(), b_ld, b_panel, job.data(), ldc);
            int differ = 0;
            for (int r = 0; r < m; ++r)
              for (int c = 0; c < n; ++c) {
                const size_t i = static_cast<size_t>(r * ldc + c);
                differ += std::bit_cast<uint32_t>(one[i]) != std::bit_cast<uint32_t>(job[i]);
              }
            EXPECT_EQ(differ, 0);
            // Not equal by doing nothing: the product changed C.
            EXPECT_NE(std::memcmp(one.data(), c0.data(), static_cast<size_t>(n) * sizeof(float)), 0);
            ++cases;
          }
    EXPECT_EQ(cases, 96);
  }
}

// The amx paths run tile products for bf16 and fp16 storage and the FMA code for fp32.
// (Against bf16_emulated, which sums the same products in another order, the outputs rounded
// to bf16 agree.)
TEST(kernel_amx_tiles, Bf16AndFp16StorageRunTheTilesAndFp32TheBasePath) {
  if (!kernel_path_supported(KernelPath::amx_emulated)) GTEST_SKIP() << "amx_emulated needs AVX2, FMA and F16C";
  expect_own_products_only_for(KernelPath::amx_emulated, {DType::bf16, DType::f16});
}

// Where the CPU has AMX: the emulator is bitwise the instructions, on random full tiles over a
// wide exponent range with zeros, denormals and signs mixed in.
TEST(kernel_amx_tiles, EmulatorIsBitwiseTheInstructions) {
  if (!kernel_path_supported(KernelPath::amx))
    GTEST_SKIP() << "kernel path amx is not supported by this CPU (it needs AVX512_BF16, AMX-TILE, AMX-BF16 and Linux's "
                    "permission for tile data): the emulator is checked against the worked examples alone";
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> kind(0, 15), expo(-20, 20);
  std::uniform_int_distribution<uint32_t> man(0, 127), sign(0, 1);
  for (const bool fp16 : {false, true}) {
    if (fp16 && !kernels::cpu_has_amx_fp16()) continue;
    const auto value = [&]() -> uint16_t {
      const int k = kind(rng);
      if (k == 0) return 0;
      if (k == 1) return static_cast<uint16_t>(man(rng) | sign(rng) << 15);  // denormal in both formats
      const float x = std::ldexp(1.0f + static_cast<float>(man(rng)) / 128.0f, expo(rng) / (fp16 ? 2 : 1));
      return fp16 ? f32_to_f16(sign(rng) ? -x : x) : f32_to_bf16(sign(rng) ? -x : x);
    };
    for (int rep = 0; rep < 8; ++rep) {
      std::vector<uint16_t> a(16 * 32), b(16 * 32);
      for (auto& x : a) x = value();
      for (auto& x : b) x = value();
      std::vector<float> c(16 * 16);
      for (auto& x : c) x = std::ldexp(static_cast<float>(man(rng)) - 64.0f, expo(rng));
      std::vector<float> hw = c, emu = c;
      kernels::path_table(KernelPath::amx)->tile_dot(hw.data(), a.data(), b.data(), 16, 16, 16, fp16);
      kernels::path_table(KernelPath::amx_emulated)->tile_dot(emu.data(), a.data(), b.data(), 16, 16, 16, fp16);
      for (int i = 0; i < 256; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(hw[i]), std::bit_cast<uint32_t>(emu[i]))
            << (fp16 ? "fp16" : "bf16") << " tile " << rep << " C(" << i / 16 << ", " << i % 16 << "): instruction "
            << hw[i] << ", emulator " << emu[i];
    }
  }
}

}  // namespace
}  // namespace cpattn::testing
