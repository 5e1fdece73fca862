// What the all-gather CP scheme adds to the compute it splits (issue 15, item 1): each rank
// times, alternately in one loop, three ways of doing its share of a packed batch's causal
// forward + backward:
//
//   cp        CpAttention's compute (CpStats::compute_s: everything but the collectives),
//   in place  the kernel calls as CpAttention made them before it put the gathered K/V in
//             document order: keys read in place from the rank-major gathered buffer, each
//             task's keys up to 2 cp runs cut at chunk boundaries, dK/dV accumulated in fp32,
//   one       one process doing the same work: the rank's query chunks against the keys they
//             see, read as one run of the global batch in document order (what
//             attention_forward/backward are given without CP), dK/dV written.
//
//   document order  (thread CPU time only) the kernel calls over the gathered K/V in document
//             order, one key run per task, dK/dV accumulated in fp32: what CpAttention ran
//             until 2026-12-04 (a copy into that order; it now reads the rank-major buffer in
//             that order through AttnInputs::key_rows, the same kernel work without the copy).
//
// cp / one - 1 is the CP overhead on the compute (target: within 3%); in place / one - 1 what
// the split key runs cost the kernel. The kernel phases are also timed in thread CPU seconds,
// steadier on a shared machine (they make no MPI call; the CP phase's CPU time would count
// MPI's busy waits, so it has wall-clock time only).
//
//   mpirun -np 2 --bind-to core build/release/bench/cp_overhead [--seq-len 8192] [--dtype fp32|bf16]
//          [--repeats 5] [--heads 16] [--kv-heads 4] [--head-dim 128] [--seed 1] [--only-cp 1]
//
// The batch is `cpattn run`'s default mix (check::document_mix, --seed). Every rank checks that
// cp, document order and one give the same out and dq to rounding (dK/dV: the CP tests'),
// then rank 0 prints one Markdown row per rank (medians of --repeats after one untimed round).
// --only-cp 1 times CpAttention alone (for a profiler).
#include "gflops.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/check/batch.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace cpattn;
using cpattn::bench::median;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// This thread's CPU seconds: the kernel-only phases timed so do not count the time the shared
// machine gave to other processes.
double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Args {
  int64_t seq_len = 8192;
  DType dtype = DType::f32;
  int repeats = 5, heads = 16, kv_heads = 4, head_dim = 128;
  uint64_t seed = 1;
  bool only_cp = false;  // --only-cp 1: time CpAttention alone (for a profiler)
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--seq-len") a.seq_len = std::stoll(v);
    else if (f == "--dtype") a.dtype = v == "fp32" ? DType::f32 : v == "bf16" ? DType::bf16 : DType::f16;
    else if (f == "--repeats") a.repeats = std::stoi(v);
    else if (f == "--heads") a.heads = std::stoi(v);
    else if (f == "--kv-heads") a.kv_heads = std::stoi(v);
    else if (f == "--head-dim") a.head_dim = std::stoi(v);
    else if (f == "--seed") a.seed = std::stoull(v);
    else if (f == "--only-cp") a.only_cp = v == "1";
    else {
      std::fprintf(stderr, "cp_overhead: unknown flag %s\n", f.c_str());
      std::exit(2);
    }
  }
  if (a.repeats < 1) {
    std::fprintf(stderr, "cp_overhead: --repeats must be at least 1\n");
    std::exit(2);
  }
  return a;
}

// The largest |a - b| over two tensors' values (fp32 views of any dtype, contiguous).
float max_diff(ConstTensorView a, ConstTensorView b) {
  const auto n = static_cast<std::size_t>(a.rows * a.heads * a.dim);
  std::vector<float> x(n), y(n);
  to_float(a.data, a.dtype, n, x.data());
  to_float(b.data, b.dtype, n, y.data());
  float m = 0;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i] - y[i]));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const MpiSession mpi(argc, argv);
  const Args a = parse(argc, argv);
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = 600.0});
  const int cp = comm.size(), rank = comm.rank();
  const check::BatchShape shape{.heads_q = a.heads, .heads_k = a.kv_heads, .head_dim_qk = a.head_dim,
                                .head_dim_v = a.head_dim};
  const check::Batch b =
      check::random_batch(cu_seqlens_from_lengths(check::document_mix(a.seq_len, a.seed)), shape, a.dtype, a.seed);
  const CpAttnConfig cfg{.num_heads_q = a.heads, .num_heads_k = a.kv_heads, .head_dim_qk = a.head_dim,
                         .head_dim_v = a.head_dim, .dtype = a.dtype};
  CpAttention attn(comm, cfg);
  const std::shared_ptr<const RankPlan> plan = attn.plan(b.cu_seqlens);
  const RankPlan& p = *plan;
  const int64_t t = p.local_tokens, t_all = p.layout.rank_begin.back();
  const check::Tensor q = check::local_rows(b.q, p), k = check::local_rows(b.k, p), v = check::local_rows(b.v, p),
                      dout = check::local_rows(b.dout, p);

  // The gathered K/V as CpAttention's all-gather leaves them: every rank's local rows, rank-major.
  const std::size_t es = dtype_size(a.dtype);
  const auto k_row = static_cast<std::size_t>(a.kv_heads) * a.head_dim * es;
  std::vector<std::byte> k_all(static_cast<std::size_t>(t_all) * k_row), v_all(k_all.size());
  for (int r = 0; r < cp; ++r) {
    const RankPlan pr = get_thd_load_balanced_cp_metadata(b.cu_seqlens, cp, r);
    const auto at = static_cast<std::size_t>(p.layout.rank_begin[r]) * k_row;
    take_local_rows(b.k.data(), static_cast<int64_t>(k_row), pr, k_all.data() + at);
    take_local_rows(b.v.data(), static_cast<int64_t>(k_row), pr, v_all.data() + at);
  }
  const WorkList cp_work = without_padding(p, p.work);
  // One process: each task's keys are its document's first q_pos + q_len tokens, one run of
  // the global batch.
  WorkList one_work = cp_work;
  one_work.runs.clear();
  for (AttnTask& task : one_work.tasks) {
    const int64_t begin = p.docs[task.doc].begin;
    task.run_begin = static_cast<int64_t>(one_work.runs.size());
    one_work.runs.push_back({.row = begin, .len = task.q_pos + task.q_len, .pos = 0});
    task.run_end = task.run_begin + 1;
  }

  // The kernel calls over the gathered K/V copied into document order (CpAttention's until
  // 2026-12-04; it now reads them in that order through key_rows)
  // (document d's rows at docs[d].padded_begin, padding rows zero), one key run per task, dK/dV
  // accumulated in fp32 over all t_all rows.
  std::vector<std::byte> k_doc(k_all.size()), v_doc(v_all.size());
  for (const DocSplit& d : p.docs) {
    std::memcpy(k_doc.data() + static_cast<std::size_t>(d.padded_begin) * k_row,
                static_cast<const std::byte*>(b.k.data()) + static_cast<std::size_t>(d.begin) * k_row,
                static_cast<std::size_t>(d.len) * k_row);
    std::memcpy(v_doc.data() + static_cast<std::size_t>(d.padded_begin) * k_row,
                static_cast<const std::byte*>(b.v.data()) + static_cast<std::size_t>(d.begin) * k_row,
                static_cast<std::size_t>(d.len) * k_row);
  }
  WorkList doc_work = one_work;
  for (std::size_t i = 0; i < doc_work.runs.size(); ++i)
    doc_work.runs[i].row = p.docs[doc_work.tasks[i].doc].padded_begin;

  const auto view = [&](void* d, int64_t rows, int heads, DType dt) {
    return contiguous(d, rows, heads, a.head_dim, dt);
  };
  check::Tensor out_cp(a.dtype, {t, a.heads, a.head_dim}), dq_cp = out_cp, dk_cp(a.dtype, k.shape), dv_cp = dk_cp;
  check::Tensor out_k = out_cp, dq_k = out_cp, out_1 = out_cp, dq_1 = out_cp;
  check::Tensor dk_1(a.dtype, b.k.shape), dv_1 = dk_1;
  std::vector<float> lse_cp(static_cast<std::size_t>(t * a.heads)), lse_k(lse_cp.size()), lse_1(lse_cp.size());
  std::vector<float> dk_acc(static_cast<std::size_t>(t_all) * a.kv_heads * a.head_dim), dv_acc(dk_acc.size());
  const auto inf = -std::numeric_limits<float>::infinity();

  std::vector<double> t_cp, t_kernel, t_one, c_kernel, c_one, c_doc;
  for (int i = 0; i < a.repeats + 1; ++i) {  // the first round warms up, untimed
    attn.reset_stats();
    comm.barrier();
    CpContext ctx = attn.forward({.plan = plan, .q = q.view(), .k = k.view(), .v = v.view(), .out = out_cp.view(),
                                  .lse = lse_cp.data()});
    attn.backward(ctx, {.q = q.view(), .out = out_cp.view(), .dout = dout.view(), .dq = dq_cp.view(),
                        .dk = dk_cp.view(), .dv = dv_cp.view()});
    if (i > 0) t_cp.push_back(attn.stats().compute_s);
    if (a.only_cp) continue;

    // CpAttention's kernel calls over kb/vb (the rank-major buffer or its document order): lse
    // from -inf, dK/dV accumulated into zeroed fp32 rows.
    const auto cp_kernel_calls = [&](const std::vector<std::byte>& kb, const std::vector<std::byte>& vb,
                                     const WorkList& w) {
      const AttnInputs in{.q = q.view(), .k = contiguous(kb.data(), t_all, a.kv_heads, a.head_dim, a.dtype),
                          .v = contiguous(vb.data(), t_all, a.kv_heads, a.head_dim, a.dtype), .work = &w};
      std::fill(lse_k.begin(), lse_k.end(), inf);
      attention_forward({.in = in, .out = out_k.view(), .lse = lse_k.data()});
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
      attention_backward({.in = in, .out = out_k.view(), .lse = lse_k.data(), .dout = dout.view(),
                          .dq = dq_k.view(), .dk = view(dk_acc.data(), t_all, a.kv_heads, DType::f32),
                          .dv = view(dv_acc.data(), t_all, a.kv_heads, DType::f32),
                          .grad_mode = GradMode::accumulate});
    };
    comm.barrier();
    auto t0 = Clock::now();
    double c0 = thread_cpu_s();
    cp_kernel_calls(k_all, v_all, cp_work);
    if (i > 0) t_kernel.push_back(since(t0));
    if (i > 0) c_kernel.push_back(thread_cpu_s() - c0);

    comm.barrier();
    c0 = thread_cpu_s();
    cp_kernel_calls(k_doc, v_doc, doc_work);
    if (i > 0) c_doc.push_back(thread_cpu_s() - c0);

    comm.barrier();
    const AttnInputs in_1{.q = q.view(), .k = b.k.view(), .v = b.v.view(), .work = &one_work};
    t0 = Clock::now();
    c0 = thread_cpu_s();
    attention_forward({.in = in_1, .out = out_1.view(), .lse = lse_1.data()});
    attention_backward({.in = in_1, .out = out_1.view(), .lse = lse_1.data(), .dout = dout.view(),
                        .dq = dq_1.view(), .dk = dk_1.view(), .dv = dv_1.view()});
    if (i > 0) t_one.push_back(since(t0));
    if (i > 0) c_one.push_back(thread_cpu_s() - c0);
  }

  if (a.only_cp) {
    std::printf("rank %d: cp compute %.3f s (median of %d)\n", rank, median(t_cp), a.repeats);
    return 0;
  }
  // They compute the same function: out and dq agree to rounding (the key runs differ in how
  // they are blocked, so not bitwise). out_k/dq_k hold the document-order phase's results (it
  // runs after the in-place one, into the same buffers), so cp, document order and one are
  // compared.
  const float d_out = std::max(max_diff(out_cp.view(), out_k.view()), max_diff(out_cp.view(), out_1.view()));
  const float d_dq = std::max(max_diff(dq_cp.view(), dq_k.view()), max_diff(dq_cp.view(), dq_1.view()));
  const float tol = a.dtype == DType::f32 ? 1e-4f : 5e-2f;
  const bool ok = d_out <= tol && d_dq <= tol;

  const std::vector<double> mine{median(t_cp), median(t_kernel), median(t_one), ok ? 1.0 : 0.0, d_out, d_dq,
                                 median(c_kernel), median(c_one), median(c_doc)};
  std::vector<double> all(mine.size() * cp);
  comm.all_gather<double>(mine, all);
  if (rank == 0) {
    std::printf("| dtype | rank | cp compute s | in place s | one process, same work s | "
                "cp / one | in place / one | CPU s: in place, document order, one | in place / one, CPU | "
                "document order / one, CPU | check (max |diff| out, dq) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < cp; ++r) {
      const double* f = &all[r * mine.size()];
      std::printf("| %s | %d | %.3f | %.3f | %.3f | %+.1f%% | %+.1f%% | %.3f, %.3f, %.3f | %+.1f%% | %+.1f%% | "
                  "%s (%.1e, %.1e) |\n",
                  std::string(to_string(a.dtype)).c_str(), r, f[0], f[1], f[2], 100 * (f[0] / f[2] - 1),
                  100 * (f[1] / f[2] - 1), f[6], f[8], f[7], 100 * (f[6] / f[7] - 1), 100 * (f[8] / f[7] - 1),
                  f[3] > 0 ? "ok" : "FAILED", f[4], f[5]);
    }
  }
  return ok ? 0 : 1;
}
