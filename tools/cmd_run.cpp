// `cpattn run`: the distributed CP attention forward and backward on one packed batch,
// checked against a single-process run of the whole batch. Launch with mpirun.
#include <cpattn/attention.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/npy.hpp>
#include <cpattn/plan.hpp>

#include <nlohmann/json.hpp>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "commands.hpp"
#include "vocab.hpp"

namespace cpattn::cli {

namespace {

struct RunArgs {
  std::vector<int64_t> lengths;
  int64_t seq_len = 4096;
  int heads = 8, kv_heads = 2, head_dim = 128, head_dim_qk = 0, head_dim_v = 0;
  std::string dtype = "fp32", mode = "runs", mask = "causal", kernel_path = "automatic";  // canonical (vocab.hpp)
  int threads = 1, repeats = 1;
  int cp = 0;  // 0: the MPI world size
  uint64_t seed = 1;
  float dropout = 0.0f;
  double timeout = 300.0;
  std::string npy_in, npy_out;
  bool json = false;
};

using Clock = std::chrono::steady_clock;

// A realistic mix: log-uniform lengths between 16 and 2048 tokens, the last one cut so that
// the batch holds exactly `tokens`.
std::vector<int64_t> document_mix(int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(16.0), std::log(2048.0));
  std::vector<int64_t> lengths;
  for (int64_t left = tokens; left > 0;) {
    const int64_t len = std::min<int64_t>(left, static_cast<int64_t>(std::exp(u(rng))));
    lengths.push_back(len);
    left -= len;
  }
  return lengths;
}

struct Batch {  // the global batch, as every rank holds it
  std::vector<int64_t> cu;
  int hq = 0, hkv = 0, dqk = 0, dv = 0;
  DType t = DType::f32;
  std::vector<std::byte> q, k, v, dout;  // storage type
  int64_t tokens() const { return cu.back(); }
};

std::vector<std::byte> to_storage(const std::vector<float>& f, DType t) {
  std::vector<std::byte> b(f.size() * dtype_size(t));
  from_float(f.data(), f.size(), t, b.data());
  return b;
}

std::vector<float> random_floats(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> f(n);
  for (float& x : f) x = d(rng);
  return f;
}

Batch make_batch(const RunArgs& a) {
  Batch b;
  b.t = parse_dtype(a.dtype);
  if (!a.npy_in.empty()) {
    const auto load = [&](const char* name) { return read_npy(a.npy_in + "/" + name); };
    const NpyArray q = load("q.npy"), k = load("k.npy"), v = load("v.npy"), dout = load("dout.npy");
    const NpyArray cu = load("cu_seqlens.npy");
    CPATTN_CHECK(cu.type == NpyType::i32 || cu.type == NpyType::i64,
                 "--npy-in: cu_seqlens.npy must hold int32 or int64");
    b.cu = cu.as_int64();
    const std::pair<const NpyArray*, const char*> inputs[] = {{&q, "q.npy"}, {&k, "k.npy"}, {&v, "v.npy"},
                                                              {&dout, "dout.npy"}};
    for (const auto& [arr, name] : inputs) {
      CPATTN_CHECK(arr->type == NpyType::f32 || arr->type == NpyType::f16, "--npy-in: ", name,
                   " must hold float32 or float16");
      CPATTN_CHECK(arr->shape.size() == 3, "--npy-in: ", name, " must be [tokens, heads, head_dim], got ",
                   arr->shape.size(), " dimensions");
    }
    check_cu_seqlens(b.cu, q.shape[0], "--npy-in cu_seqlens.npy");
    b.hq = static_cast<int>(q.shape[1]);
    b.dqk = static_cast<int>(q.shape[2]);
    b.hkv = static_cast<int>(k.shape[1]);
    b.dv = static_cast<int>(v.shape[2]);
    CPATTN_CHECK(k.shape[0] == q.shape[0] && v.shape[0] == q.shape[0] && dout.shape[0] == q.shape[0],
                 "--npy-in: q, k, v and dout must hold the same token count");
    CPATTN_CHECK(k.shape[2] == b.dqk && v.shape[1] == b.hkv, "--npy-in: k must be [T, Hkv, Dqk] and v [T, Hkv, Dv]");
    CPATTN_CHECK(dout.shape[1] == b.hq && dout.shape[2] == b.dv, "--npy-in: dout must be [T, Hq, Dv]");
    b.q = to_storage(q.as_float(), b.t);
    b.k = to_storage(k.as_float(), b.t);
    b.v = to_storage(v.as_float(), b.t);
    b.dout = to_storage(dout.as_float(), b.t);
    return b;
  }
  b.cu = a.lengths.empty() ? cu_seqlens_from_lengths(document_mix(a.seq_len, a.seed))
                           : cu_seqlens_from_lengths(a.lengths, "--lengths");
  b.hq = a.heads;
  b.hkv = a.kv_heads;
  b.dqk = a.head_dim_qk ? a.head_dim_qk : a.head_dim;
  b.dv = a.head_dim_v ? a.head_dim_v : a.head_dim;
  std::mt19937_64 rng(a.seed);
  const auto t = static_cast<std::size_t>(b.tokens());
  b.q = to_storage(random_floats(t * b.hq * b.dqk, rng), b.t);
  b.k = to_storage(random_floats(t * b.hkv * b.dqk, rng), b.t);
  b.v = to_storage(random_floats(t * b.hkv * b.dv, rng), b.t);
  b.dout = to_storage(random_floats(t * b.hq * b.dv, rng), b.t);
  return b;
}

struct Results {  // float32, global order, real tokens
  std::vector<float> out, lse, dq, dk, dv;
};

Results single_process(const Batch& b, const CpAttnConfig& c) {
  const int64_t n = b.tokens();
  const std::size_t es = dtype_size(b.t);
  std::vector<std::byte> out(n * b.hq * b.dv * es), dq(n * b.hq * b.dqk * es), dk(n * b.hkv * b.dqk * es),
      dv(n * b.hkv * b.dv * es);
  Results r;
  r.lse.resize(n * b.hq);
  const WorkList wl = varlen_worklist(b.cu, b.cu);
  const int64_t qr = b.hq * b.dqk, kr = b.hkv * b.dqk, vr = b.hkv * b.dv, orow = b.hq * b.dv;
  attention_forward({.q = b.q.data(), .q_row_stride = qr, .q_head_stride = b.dqk,
                     .k = b.k.data(), .k_row_stride = kr, .k_head_stride = b.dqk,
                     .v = b.v.data(), .v_row_stride = vr, .v_head_stride = b.dv,
                     .out = out.data(), .out_row_stride = orow, .out_head_stride = b.dv,
                     .lse = r.lse.data(), .total_q = n, .total_k = n, .num_heads_q = b.hq,
                     .num_heads_k = b.hkv, .head_dim_qk = b.dqk, .head_dim_v = b.dv, .dtype = b.t,
                     .mask = c.mask, .softmax_scale = c.softmax_scale, .dropout_p = c.dropout_p,
                     .seed = c.seed, .work = &wl, .num_threads = c.num_threads, .path = c.path});
  attention_backward({.q = b.q.data(), .q_row_stride = qr, .q_head_stride = b.dqk,
                      .k = b.k.data(), .k_row_stride = kr, .k_head_stride = b.dqk,
                      .v = b.v.data(), .v_row_stride = vr, .v_head_stride = b.dv,
                      .out = out.data(), .out_row_stride = orow, .out_head_stride = b.dv,
                      .lse = r.lse.data(), .dout = b.dout.data(), .dout_row_stride = orow,
                      .dout_head_stride = b.dv, .dq = dq.data(), .dq_row_stride = qr,
                      .dq_head_stride = b.dqk, .dk = dk.data(), .dk_row_stride = kr,
                      .dk_head_stride = b.dqk, .dv = dv.data(), .dv_row_stride = vr,
                      .dv_head_stride = b.dv, .total_q = n, .total_k = n, .num_heads_q = b.hq,
                      .num_heads_k = b.hkv, .head_dim_qk = b.dqk, .head_dim_v = b.dv, .dtype = b.t,
                      .mask = c.mask, .softmax_scale = c.softmax_scale, .dropout_p = c.dropout_p,
                      .seed = c.seed, .work = &wl, .num_threads = c.num_threads, .path = c.path});
  const auto as_float = [&](const std::vector<std::byte>& s) {
    std::vector<float> f(s.size() / es);
    to_float(s.data(), b.t, f.size(), f.data());
    return f;
  };
  r.out = as_float(out);
  r.dq = as_float(dq);
  r.dk = as_float(dk);
  r.dv = as_float(dv);
  return r;
}

// Every rank's real rows of a local tensor, all-gathered into global order (float32).
std::vector<float> gather_global(Communicator& comm, const RankPlan& p, const void* local, DType t,
                                 int64_t row) {
  std::vector<float> mine;
  std::vector<int64_t> idx;
  std::vector<float> tmp(row);
  for (int64_t i = 0; i < p.local_tokens; ++i) {
    if (p.real_token_index[i] < 0) continue;
    to_float(static_cast<const std::byte*>(local) + i * row * dtype_size(t), t, row, tmp.data());
    mine.insert(mine.end(), tmp.begin(), tmp.end());
    idx.push_back(p.real_token_index[i]);
  }
  const std::vector<int64_t> n_idx = comm.all_gather_counts(static_cast<int64_t>(idx.size()));
  std::vector<int64_t> n_val(n_idx.size()), all_idx(p.global_tokens);
  for (std::size_t r = 0; r < n_idx.size(); ++r) n_val[r] = n_idx[r] * row;
  std::vector<float> all_val(p.global_tokens * row), out(all_val.size());
  comm.all_gather_v<int64_t>(idx, n_idx, all_idx);
  comm.all_gather_v<float>(mine, n_val, all_val);
  for (int64_t i = 0; i < p.global_tokens; ++i)
    std::copy_n(all_val.begin() + i * row, row, out.begin() + all_idx[i] * row);
  return out;
}

struct Error3 {
  double max_abs = 0, max_rel = 0, rel_l2 = 0;
  bool pass = true;
};

// max_rel is max|diff| / max|ref|; the pass rule is the reference design's: fp32 relative L2
// within 1e-5, fp16 and bf16 elementwise |diff| <= tol + tol*|ref| (tol 5e-3, 2.5e-2).
Error3 compare(const std::vector<float>& got, const std::vector<float>& ref, DType t) {
  Error3 e;
  double d2 = 0, r2 = 0, ref_max = 0;
  const double tol = t == DType::f16 ? 5e-3 : 2.5e-2;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(double{got[i]} - ref[i]);
    if (!std::isfinite(got[i])) e.pass = false;
    e.max_abs = std::max(e.max_abs, d);
    ref_max = std::max(ref_max, std::abs(double{ref[i]}));
    d2 += d * d;
    r2 += double{ref[i]} * ref[i];
    if (t != DType::f32 && d > tol + tol * std::abs(double{ref[i]})) e.pass = false;
  }
  e.max_rel = ref_max > 0 ? e.max_abs / ref_max : e.max_abs;
  e.rel_l2 = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
  if (t == DType::f32 && e.rel_l2 > 1e-5) e.pass = false;
  return e;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

bool run_distributed(const RunArgs& a);
bool check_in_groups(Communicator& world, const RunArgs& a);

void run(const RunArgs& a) {
  const MpiSession mpi;  // finalizes only what it initialized
  if (!run_distributed(a)) throw ExitCode{1};
}

// The CP groups: world/cp groups of cp consecutive ranks, each running the whole check on
// the same batch (as data-parallel replicas would, each on its own batch).
struct Groups {
  Communicator& world;
  int cp = 1, count = 1, index = 0;  // set by split(), declared before comm: set once
  Communicator comm;                  // this rank's group
  Groups(Communicator& w, int cp_flag) : world(w), comm(split(cp_flag)) {}

 private:
  Communicator split(int cp_flag) {
    cp = cp_flag == 0 ? world.size() : cp_flag;
    // Agreed before the split: every rank is there, with the same cp.
    std::string error;
    Fingerprint fp;
    if (cp < 1 || world.size() % cp != 0)
      error = "--cp must divide the MPI world size " + std::to_string(world.size()) +
              " (the world runs world/cp CP groups side by side), got " + std::to_string(cp_flag);
    else
      fp.add("--cp", cp);
    agree(world, fp, "cpattn run", error);
    count = world.size() / cp;
    index = world.rank() / cp;
    return world.split(index, world.rank());
  }
};

// What a rank prepares on its own: the batch, its plan and its local rows. Errors here can
// differ between ranks (a file one node cannot read): they are shared before anything else.
struct Local {
  Batch b;
  CpAttnConfig cfg;
  RankPlan p;
  std::vector<std::byte> q, k, v, dout;
  std::unique_ptr<CpAttention> attn;  // its constructor checks the configuration locally
};

Local prepare(const RunArgs& a, Communicator& comm) {
  const int cp = comm.size(), rank = comm.rank();
  CPATTN_CHECK(a.threads >= 1, "--threads must be >= 1, got ", a.threads);
  CPATTN_CHECK(a.repeats >= 1, "--repeats must be >= 1, got ", a.repeats);
  CPATTN_CHECK(a.mode == "runs" || a.mode == "index", "--mode must be runs or index, got '", a.mode, "'");
  const MaskType mask = parse_mask(a.mask);
  const KernelPath path = parse_kernel_path(a.kernel_path);
  check_kernel_path_supported(path);
  CPATTN_CHECK(a.seq_len >= 1, "--seq-len must be >= 1, got ", a.seq_len);
  CPATTN_CHECK(a.dropout >= 0.0f && a.dropout < 1.0f, "--dropout must be in [0, 1), got ", a.dropout);
  if (a.npy_in.empty())  // the files' shapes are CpAttention's to check
    CPATTN_CHECK(a.heads >= 1 && a.kv_heads >= 1 && a.heads % a.kv_heads == 0, "--heads (", a.heads,
                 ") must be a positive multiple of --kv-heads (", a.kv_heads, ")");
  Local l;
  l.b = make_batch(a);
  const Batch& b = l.b;
  l.cfg = {.num_heads_q = b.hq, .num_heads_k = b.hkv, .head_dim_qk = b.dqk, .head_dim_v = b.dv, .dtype = b.t,
           .mask = mask, .dropout_p = a.dropout, .seed = a.seed,
           .kv_mode = a.mode == "runs" ? KvMode::runs : KvMode::index, .num_threads = a.threads, .path = path};
  l.p = get_thd_load_balanced_cp_metadata(b.cu, cp, rank);
  const std::size_t es = dtype_size(b.t);
  const auto local = [&](const std::vector<std::byte>& g, int64_t row) {
    std::vector<std::byte> out(l.p.local_tokens * row * es);
    take_local_rows(g.data(), row * static_cast<int64_t>(es), l.p, out.data());
    return out;
  };
  l.q = local(b.q, int64_t{b.hq} * b.dqk);
  l.k = local(b.k, int64_t{b.hkv} * b.dqk);
  l.v = local(b.v, int64_t{b.hkv} * b.dv);
  l.dout = local(b.dout, int64_t{b.hq} * b.dv);
  l.attn = std::make_unique<CpAttention>(comm, l.cfg);
  return l;
}

// True when every CP group passed its check. Every error reaching here is the same on every
// rank (agreed, or from the flags alone): rank 0 prints it, and the barrier keeps the
// launcher from ending rank 0 (once another rank has exited non-zero) before it has printed.
bool run_distributed(const RunArgs& a) {
  Communicator world(MPI_COMM_WORLD, {.timeout_s = a.timeout});
  try {
    return check_in_groups(world, a);
  } catch (const Error& e) {
    if (world.rank() == 0) std::fprintf(stderr, "cpattn: error: %s\n", e.message().c_str());
    std::fflush(stderr);
    world.barrier();
    throw ExitCode{2};
  }
}

// Runs the check in this rank's CP group; true when every group passed.
bool check_in_groups(Communicator& world, const RunArgs& a) {
  Groups groups(world, a.cp);
  Communicator& comm = groups.comm;
  const int cp = comm.size(), rank = comm.rank();
  std::optional<Local> prepared;
  std::string local_error;
  try {
    prepared = prepare(a, comm);
  } catch (const Error& e) {
    local_error = e.message();
  } catch (const std::exception& e) {
    local_error = std::string("unexpected error: ") + e.what();
  }
  agree(groups.world, {}, "cpattn run", local_error);  // the same error on every rank, or none
  Local& l = *prepared;
  const Batch& b = l.b;
  const CpAttnConfig& cfg = l.cfg;
  const RankPlan& p = l.p;
  CpAttention& attn = *l.attn;
  const std::size_t es = dtype_size(b.t);
  const int64_t qr = b.hq * b.dqk, kr = b.hkv * b.dqk, vr = b.hkv * b.dv, orow = b.hq * b.dv;
  const std::vector<std::byte>&q = l.q, &k = l.k, &v = l.v, &dout = l.dout;
  std::vector<std::byte> out(p.local_tokens * orow * es), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> lse(p.local_tokens * b.hq);

  std::vector<double> compute, communication, wall;
  for (int i = 0; i < a.repeats; ++i) {
    attn.reset_stats();
    comm.barrier();
    const auto t0 = Clock::now();
    attn.forward({.cu_seqlens = b.cu, .local_tokens = p.local_tokens, .q = q.data(), .k = k.data(),
                  .v = v.data(), .out = out.data(), .lse = lse.data()});
    attn.backward({.dout = dout.data(), .dq = dq.data(), .dk = dk.data(), .dv = dv.data()});
    wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    compute.push_back(attn.stats().compute_s);
    communication.push_back(attn.stats().comm_s);
  }

  Results got;
  got.out = gather_global(comm, p, out.data(), b.t, orow);
  got.lse = gather_global(comm, p, lse.data(), DType::f32, b.hq);
  got.dq = gather_global(comm, p, dq.data(), b.t, qr);
  got.dk = gather_global(comm, p, dk.data(), b.t, kr);
  got.dv = gather_global(comm, p, dv.data(), b.t, vr);

  // Per-rank figures, to every rank.
  std::vector<double> mine{median(compute), median(communication), median(wall), peak_rss_mb(),
                           static_cast<double>(attn.stats().peak_buffer_bytes) / (1 << 20)};
  std::vector<double> per_rank(mine.size() * cp);
  comm.all_gather<double>(mine, per_rank);

  // Rank 0 checks and reports; the others wait for its verdict. Whatever rank 0 meets
  // (a failed check, an exception) reaches every rank, so that none is left waiting.
  int64_t pass = 1;
  std::string rank0_error;
  nlohmann::json report;
  if (rank == 0) try {
    const auto t0 = Clock::now();
    const Results ref = single_process(b, cfg);
    const double ref_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const BalanceReport bal = balance_report(b.cu, cp);
    const std::string path_ran = kernel_path_name(cfg.path == KernelPath::automatic ? best_kernel_path() : cfg.path);
    report["cp"] = cp;
    report["cp_groups"] = groups.count;
    report["dtype"] = a.dtype;
    report["mode"] = a.mode;
    report["mask"] = a.mask;
    report["kernel_path"] = path_ran;
    report["threads"] = a.threads;  // per rank
    report["seq_len"] = b.tokens();
    report["padded_tokens"] = bal.padded_tokens;
    report["documents"] = b.cu.size() - 1;
    std::vector<int64_t> lengths(b.cu.size() - 1);
    for (std::size_t d = 0; d + 1 < b.cu.size(); ++d) lengths[d] = b.cu[d + 1] - b.cu[d];
    report["lengths"] = lengths;
    report["heads"] = b.hq;
    report["kv_heads"] = b.hkv;
    report["head_dim_qk"] = b.dqk;
    report["head_dim_v"] = b.dv;
    report["repeats"] = a.repeats;
    report["single_process_s"] = ref_s;
    const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>> tensors[] = {
        {"out", {&got.out, &ref.out}}, {"dq", {&got.dq, &ref.dq}}, {"dk", {&got.dk, &ref.dk}},
        {"dv", {&got.dv, &ref.dv}}};
    for (const auto& [name, pair] : tensors) {
      const Error3 e = compare(*pair.first, *pair.second, b.t);
      report["max_abs_err"][name] = e.max_abs;
      report["max_rel_err"][name] = e.max_rel;
      report["rel_l2_err"][name] = e.rel_l2;
      if (!e.pass) pass = 0;
    }
    double lse_err = 0;
    for (std::size_t i = 0; i < got.lse.size(); ++i) lse_err = std::max(lse_err, double{std::abs(got.lse[i] - ref.lse[i])});
    report["max_abs_err"]["lse"] = lse_err;
    report["passed"] = pass == 1;
    double cmax = 0, csum = 0;
    for (int r = 0; r < cp; ++r) {
      const double* f = &per_rank[r * mine.size()];
      report["compute_s"].push_back(f[0]);
      report["comm_s"].push_back(f[1]);
      report["step_s"].push_back(f[2]);
      report["peak_rss_mb"].push_back(f[3]);
      report["peak_buffer_mb"].push_back(f[4]);
      cmax = std::max(cmax, f[0]);
      csum += f[0];
    }
    report["imbalance"] = {{"compute", csum > 0 ? cmax / (csum / cp) : 1.0},
                           {"visible_pairs_balanced", bal.imbalance_balanced},
                           {"visible_pairs_contiguous", bal.imbalance_contiguous}};
    if (groups.world.rank() != 0) {
      // Another CP group's rank 0: it checked; world rank 0 reports.
    } else if (a.json) {
      std::cout << report.dump() << std::endl;
    } else {
      const std::string group_note =
          groups.count > 1 ? " in each of " + std::to_string(groups.count) + " CP groups (group 0 shown)" : "";
      std::printf("cpattn run: cp = %d%s, seq len %lld in %zu documents (padded to %lld), heads %d, kv heads %d, "
                  "head dim qk/v %d/%d, %s, mode %s, mask %s, %d thread(s) per rank, kernel path %s\n",
                  cp, group_note.c_str(), static_cast<long long>(b.tokens()), b.cu.size() - 1,
                  static_cast<long long>(bal.padded_tokens), b.hq, b.hkv, b.dqk, b.dv, a.dtype.c_str(),
                  a.mode.c_str(), a.mask.c_str(), a.threads, path_ran.c_str());
      std::printf("\ncheck against a single-process run of the whole batch (%.3f s):\n", ref_s);
      std::printf("  %-6s %14s %14s %14s\n", "tensor", "max_abs_err", "max_rel_err", "rel_l2_err");
      for (const char* name : {"out", "dq", "dk", "dv"})
        std::printf("  %-6s %14.3e %14.3e %14.3e\n", name, report["max_abs_err"][name].get<double>(),
                    report["max_rel_err"][name].get<double>(), report["rel_l2_err"][name].get<double>());
      std::printf("  result: %s (%s)\n", pass ? "PASS" : "FAIL",
                  b.t == DType::f32 ? "fp32: relative L2 error <= 1e-5"
                  : b.t == DType::f16 ? "fp16: |diff| <= 5e-3 + 5e-3*|ref|"
                                      : "bf16: |diff| <= 2.5e-2 + 2.5e-2*|ref|");
      std::printf("\nper rank (medians of %d forward+backward steps):\n", a.repeats);
      std::printf("  %-5s %11s %11s %11s %12s %14s\n", "rank", "compute_s", "comm_s", "step_s", "peak_rss_mb",
                  "peak_buffer_mb");
      for (int r = 0; r < cp; ++r) {
        const double* f = &per_rank[r * mine.size()];
        std::printf("  %-5d %11.4f %11.4f %11.4f %12.1f %14.1f\n", r, f[0], f[1], f[2], f[3], f[4]);
      }
      std::printf("\nimbalance (max/mean): compute %.3f; visible pairs: balanced %.3f, contiguous split %.3f\n",
                  report["imbalance"]["compute"].get<double>(), bal.imbalance_balanced, bal.imbalance_contiguous);
    }
    if (!a.npy_out.empty() && groups.world.rank() == 0) {
      const int64_t t = b.tokens();
      write_npy(a.npy_out + "/out.npy", got.out, {t, b.hq, b.dv});
      write_npy(a.npy_out + "/lse.npy", got.lse, {t, b.hq});
      write_npy(a.npy_out + "/dq.npy", got.dq, {t, b.hq, b.dqk});
      write_npy(a.npy_out + "/dk.npy", got.dk, {t, b.hkv, b.dqk});
      write_npy(a.npy_out + "/dv.npy", got.dv, {t, b.hkv, b.dv});
    }
  } catch (const Error& e) {
    rank0_error = e.message();
  } catch (const std::exception& e) {
    rank0_error = e.what();
  }
  // Each group's rank 0 verdict reaches every rank of every group; any error is agreed on.
  int64_t status[2] = {pass, static_cast<int64_t>(rank0_error.size())};
  comm.broadcast<int64_t>(status, 0);
  if (status[1] > 0) {
    rank0_error.resize(static_cast<std::size_t>(status[1]));
    comm.broadcast<std::byte>(std::as_writable_bytes(std::span(rank0_error)), 0);
  }
  agree(groups.world, {}, "cpattn run",
        status[1] > 0 ? "the check on rank 0 of CP group " + std::to_string(groups.index) + " failed: " + rank0_error
                      : std::string());
  std::vector<int64_t> passed(static_cast<std::size_t>(groups.world.size()));
  groups.world.all_gather<int64_t>(std::span<const int64_t>(&status[0], 1), passed);
  std::vector<int> failed;  // the groups whose check failed
  for (int g = 0; g < groups.count; ++g)
    if (passed[static_cast<std::size_t>(g) * groups.cp] == 0) failed.push_back(g);
  if (!failed.empty() && groups.count > 1 && groups.world.rank() == 0) {
    std::string list;
    for (const int g : failed) list += (list.empty() ? "" : ",") + std::to_string(g);
    std::fprintf(stderr, "cpattn run: the check failed in CP group(s) %s of %d (the report above is group 0's)\n",
                 list.c_str(), groups.count);
  }
  return failed.empty();
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Distributed CP attention, forward and backward, on one packed batch, checked against a "
      "single-process run. Launch as: mpirun -np N cpattn run [flags]. Exits 1 when the check fails.");
  auto* lengths = cmd->add_option("--lengths", a->lengths, "Document lengths, comma-separated (default: a "
                                                           "realistic mix drawn from --seed)")->delimiter(',');
  auto* seq_len = cmd->add_option("--seq-len", a->seq_len, "Tokens of the default document mix")->capture_default_str();
  auto* npy = cmd->add_option("--npy-in", a->npy_in,
                              "Read the global unpadded batch from DIR: q.npy, k.npy, v.npy, dout.npy (float32 "
                              "or float16, [T, H, D]) and cu_seqlens.npy (int32 or int64, leading 0)");
  npy->excludes(lengths, seq_len);
  cmd->add_option("--npy-out", a->npy_out, "Write out.npy, lse.npy ([T, Hq]), dq.npy, dk.npy, dv.npy (float32, "
                                           "real tokens in global order) to DIR");
  cmd->add_option("--heads", a->heads, "Query heads")->capture_default_str();
  cmd->add_option("--kv-heads", a->kv_heads, "Key/value heads (GQA when fewer than --heads)")->capture_default_str();
  cmd->add_option("--head-dim", a->head_dim, "Head dimension of q, k and v")->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--head-dim-qk", a->head_dim_qk, "Head dimension of q and k (MLA: e.g. 192), overrides --head-dim")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--head-dim-v", a->head_dim_v, "Head dimension of v (MLA: e.g. 128), overrides --head-dim")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--dtype", a->dtype, "Storage type: fp32, fp16 or bf16 (or float32, float16, bfloat16)")
      ->transform(dtype_transformer())->capture_default_str();
  cmd->add_option("--mask", a->mask, "causal or none")->transform(mask_transformer())->capture_default_str();
  cmd->add_option("--kernel-path", a->kernel_path, "Kernel path (automatic: the fastest this CPU runs)")
      ->transform(kernel_path_transformer())->capture_default_str();
  cmd->add_option("--dropout", a->dropout, "Attention dropout probability in [0, 1)")->capture_default_str();
  cmd->add_option("--threads", a->threads, "Kernel threads per rank")->capture_default_str();
  cmd->add_option("--cp", a->cp, "Context-parallel size, dividing the MPI world size: world/cp CP groups "
                                 "each run the check (default: the world size, one group)");
  cmd->add_option("--mode", a->mode, "How the kernel reads the gathered keys: runs (in place) or index "
                                     "(index_select copy, index_add_ in backward)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of the default batch's lengths and tensors, and of dropout")
      ->capture_default_str();
  cmd->add_option("--repeats", a->repeats, "Forward+backward steps to time (medians are reported)")
      ->capture_default_str();
  cmd->add_option("--timeout", a->timeout, "Deadline of each collective, seconds")->capture_default_str();
  cmd->add_flag("--json", a->json, "Print the report as one JSON object");
  cmd->callback([a] { run(*a); });
}

}  // namespace cpattn::cli
