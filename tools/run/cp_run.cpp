// `cpattn run`'s distributed run: the CP groups, each rank's batch, plan and local rows, the
// timed CP forward+backward steps, the results gathered into global order, and the verdict
// agreed by every rank. The check and the report are check.cpp and report.cpp.
#include "run.hpp"

#include <cpattn/check/cases.hpp>
#include <cpattn/file.hpp>
#include <cpattn/check/gather.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "../commands.hpp"
#include "../vocab.hpp"

namespace cpattn::cli::run_cmd {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The parts of comm_s are means: they add up to comm_s's mean over the steps (medians of
// parts that spike in different steps would not).
double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// The CP groups: world/cp groups of cp consecutive ranks, each running the whole check on
// the same batch (as data-parallel replicas would, each on its own batch).
struct Groups {
  Communicator& world;
  int cp = 1, count = 1, index = 0;  // set by split(), declared before comm: set once
  Communicator comm;                  // this rank's group
  Groups(Communicator& w, int cp_flag) : world(w), comm(split(cp_flag)) {}  // the world's deadline

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
  check::Batch b;
  std::vector<float> slopes;  // --alibi: cfg.options.alibi_slopes points here
  CpAttnConfig cfg;
  std::shared_ptr<const RankPlan> plan;  // from the layer's cache: lays out the inputs, then runs
  check::Tensor q, k, v, dout;
  // One layer per scheme run (--scheme all: every scheme); the constructors check the
  // configuration locally, before the ranks agree.
  std::vector<std::unique_ptr<CpAttention>> attns;
};

// The heads an all-to-all group of `inner` ranks splits, named by their flags (CpAttention
// checks the same rule in the configuration's names).
void check_heads_split(const check::BatchShape& s, int inner) {
  const char* group = inner == 0 ? "" : " (the CP size for --scheme a2a, --cp-inner for hybrid)";
  CPATTN_CHECK(inner == 0 || s.heads_q % inner == 0, "--heads (", s.heads_q,
               ") must be divisible by the all-to-all group size ", inner, group);
  CPATTN_CHECK(inner == 0 || s.heads_k % inner == 0 || inner % s.heads_k == 0, "--kv-heads (", s.heads_k,
               ") must be divisible by the all-to-all group size ", inner, " or divide it (replicated KV heads)",
               group);
}

// The schemes a run measures, each with its all-to-all group size (a2a: the CP size, hybrid:
// --cp-inner, the others 0): --scheme's one, with its flags checked, or for "all" every scheme
// of kCpSchemes the batch's heads allow (hybrid only with --cp-inner).
std::vector<std::pair<CpScheme, int>> schemes_of(const RunArgs& a, int cp, const check::BatchShape& shape) {
  const auto inner_of = [&](CpScheme s) { return s == CpScheme::a2a ? cp : s == CpScheme::hybrid ? a.cp_inner : 0; };
  if (a.cp_inner != 0)
    CPATTN_CHECK(a.cp_inner >= 1 && cp % a.cp_inner == 0, "--cp-inner must divide the CP size ", cp,
                 " (--scheme hybrid: cp = cp_inner x cp_outer), got ", a.cp_inner);
  std::vector<std::pair<CpScheme, int>> out;
  const std::pair<bool, const char*> allgather_flags[] = {{a.overlap_given, "--overlap"},
                                                          {a.shared_memory_given, "--shared-memory"}};
  for (const auto& [given, flag] : allgather_flags)  // (every scheme's run, --scheme all's too)
    CPATTN_CHECK(!given || parse_kv_mode(a.mode) == "runs", flag, " sets the all-gather in runs mode: --mode ", a.mode,
                 " would ignore it");
  if (a.scheme != "all") {
    const CpScheme s = parse_scheme(a.scheme);
    CPATTN_CHECK(s == CpScheme::hybrid || a.cp_inner == 0, "--cp-inner is for --scheme hybrid only, got --cp-inner ",
                 a.cp_inner, " with --scheme ", to_string(s));
    CPATTN_CHECK(s != CpScheme::hybrid || a.cp_inner >= 1, "--scheme hybrid needs --cp-inner N (N dividing the CP size ",
                 cp, ")");
    // (--overlap and --shared-memory set the all-gather in runs mode: elsewhere they would be ignored)
    for (const auto& [given, flag] : allgather_flags)
      CPATTN_CHECK(!given || s == CpScheme::allgather || s == CpScheme::hybrid, flag, " sets the all-gather's K/V "
                   "and dK/dV (--scheme allgather, or hybrid's outer all-gather): --scheme ", to_string(s),
                   " has none and would ignore it");
    check_heads_split(shape, inner_of(s));
    return {{s, inner_of(s)}};
  }
  for (const CpScheme s : kCpSchemes) {
    if (s == CpScheme::hybrid && a.cp_inner == 0) continue;
    try {
      check_heads_split(shape, inner_of(s));
    } catch (const Error&) {
      continue;  // this batch's heads do not split over the group
    }
    out.emplace_back(s, inner_of(s));
  }
  return out;
}

// The CP layer's configuration for the flags and the batch's shape (slopes: --alibi's, or null),
// without a scheme: configs_of sets it.
CpAttnConfig config_of(const RunArgs& a, const check::BatchShape& s, DType dtype, const float* slopes) {
  const Window window = parse_window(a.window);
  return {.num_heads_q = s.heads_q, .num_heads_k = s.heads_k, .head_dim_qk = s.head_dim_qk,
          .head_dim_v = s.head_dim_v, .dtype = dtype,
          .options = {.mask = parse_mask(a.mask), .dropout_p = a.dropout, .seed = a.seed, .num_threads = a.threads,
                      .path = parse_kernel_path(a.kernel_path), .window_size_left = window.left,
                      .window_size_right = window.right, .softcap = a.softcap, .alibi_slopes = slopes},
          .kv_mode = parse_kv_mode(a.mode) == "runs" ? KvMode::runs : KvMode::index,
          .split = parse_split(a.split),
          .overlap = a.overlap == "on",
          .shared_memory = a.shared_memory == "on"};
}

// One configuration per scheme the run measures (schemes_of), each a copy of `base`.
std::vector<CpAttnConfig> configs_of(const RunArgs& a, const CpAttnConfig& base, int cp,
                                     const check::BatchShape& shape) {
  std::vector<CpAttnConfig> out;
  for (const auto& [s, inner] : schemes_of(a, cp, shape)) {
    if (base.split == CpSplit::padding_free && s != CpScheme::allgather && a.scheme == "all") continue;
    CpAttnConfig c = base;
    c.scheme = s;
    c.cp_inner = s == CpScheme::hybrid ? inner : 0;
    if (a.scheme == "all" && s != CpScheme::allgather) c.kv_mode = KvMode::runs;  // --mode: the all-gather's
    out.push_back(c);
  }
  return out;
}

// The flags' request against this node's memory (`tokens`, `longest` document, `shape`: the
// flags', before the batch exists, or --npy-in's once read), for every scheme the run measures.
void check_memory_of(const RunArgs& a, int64_t tokens, int64_t longest, const check::BatchShape& shape, DType dtype,
                     int cp) {
  check_run_memory(tokens, longest, shape, configs_of(a, config_of(a, shape, dtype, nullptr), cp, shape), cp);
}

Local prepare(const RunArgs& a, Communicator& comm) {
  CPATTN_CHECK(a.threads >= 1, "--threads must be >= 1, got ", a.threads);
  CPATTN_CHECK(a.repeats >= 1, "--repeats must be >= 1, got ", a.repeats);
  parse_mask(a.mask);
  check_kernel_path_supported(parse_kernel_path(a.kernel_path));
  CPATTN_CHECK(a.seq_len >= 1, "--seq-len must be >= 1, got ", a.seq_len);
  CPATTN_CHECK(a.dropout >= 0.0f && a.dropout < 1.0f, "--dropout must be in [0, 1), got ", a.dropout);
  parse_window(a.window);
  check_softcap(a.softcap);
  if (a.npy_in.empty())  // the files' shapes are CpAttention's to check
    CPATTN_CHECK(a.heads >= 1 && a.kv_heads >= 1 && a.heads % a.kv_heads == 0, "--heads (", a.heads,
                 ") must be a positive multiple of --kv-heads (", a.kv_heads, ")");
  const DType dtype = parse_dtype(a.dtype);
  // --lengths' own rules first (a total past int64 read as a memory refusal of another total)
  if (a.npy_in.empty() && !a.lengths.empty()) (void)cu_seqlens_from_lengths(a.lengths, "--lengths");
  if (a.npy_in.empty())  // before the batch exists; --npy-in's files are checked once read
    check_memory_of(a, flag_tokens(a),
                    a.lengths.empty() ? std::min(a.seq_len, check::kDocumentMixLongest) : std::ranges::max(a.lengths),
                    flag_shape(a), dtype, comm.size());
  if (!a.npy_in.empty()) {  // from the files' headers, before their data is read
    const check::NpyBatchInfo info = check::npy_batch_info(a.npy_in, "--npy-in");
    int64_t longest = 0;
    for (std::size_t d = 1; d < info.cu_seqlens.size(); ++d)
      longest = std::max(longest, info.cu_seqlens[d] - info.cu_seqlens[d - 1]);
    check_memory_of(a, info.cu_seqlens.back(), longest, info.shape, dtype, comm.size());
  }
  Local l;
  l.b = make_batch(a);
  const check::Batch& b = l.b;
  if (a.check_finite) check_batch_finite(b);
  if (a.alibi) l.slopes = check::alibi_slopes(b.shape.heads_q);
  l.cfg = config_of(a, b.shape, b.dtype, a.alibi ? l.slopes.data() : nullptr);
  for (const CpAttnConfig& c : configs_of(a, l.cfg, comm.size(), b.shape))
    l.attns.push_back(std::make_unique<CpAttention>(comm, c));
  l.plan = l.attns.front()->plan(b.cu_seqlens);  // a plan serves every scheme
  l.q = check::local_rows(b.q, *l.plan);
  l.k = check::local_rows(b.k, *l.plan);
  l.v = check::local_rows(b.v, *l.plan);
  l.dout = check::local_rows(b.dout, *l.plan);
  return l;
}

// One scheme's timed steps on this rank's rows: its results gathered into the global order,
// and every rank's figures (medians over --repeats) on every rank.
struct Measured {
  check::Results got;
  std::vector<RankFigures> ranks;
  std::string shared_memory_off;  // this rank's CpStats::shared_memory_off (rank 0's is reported)
};
Measured measure(Communicator& comm, const RunArgs& a, const Local& l, CpAttention& attn) {
  const check::Batch& b = l.b;
  const RankPlan& p = *l.plan;
  const check::Tensor &q = l.q, &k = l.k, &v = l.v, &dout = l.dout;
  check::Tensor out(b.dtype, {p.local_tokens, b.shape.heads_q, b.shape.head_dim_v}), dq(b.dtype, q.shape),
      dk(b.dtype, k.shape), dv(b.dtype, v.shape);
  std::vector<float> lse(static_cast<std::size_t>(p.local_tokens * b.shape.heads_q));

  std::vector<double> compute, communication, comm_total, wall, forward, backward, agree, first_kv, later_kv, dkv;
  int64_t sent = 0, received = 0;  // by the last step (every step moves the same)
  for (int i = 0; i < a.repeats; ++i) {
    attn.reset_stats();
    comm.barrier();
    const auto t0 = Clock::now();
    CpContext ctx = attn.forward({.plan = l.plan, .q = q.view(), .k = k.view(), .v = v.view(),
                                  .out = out.view(), .lse = lse.data()});
    const auto t1 = Clock::now();
    attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(),
                        .dk = dk.view(), .dv = dv.view()});
    const auto t2 = Clock::now();
    forward.push_back(std::chrono::duration<double>(t1 - t0).count());
    backward.push_back(std::chrono::duration<double>(t2 - t1).count());
    wall.push_back(std::chrono::duration<double>(t2 - t0).count());
    sent = attn.stats().bytes_sent;  // over the layer's sub-groups too (a2a, hybrid)
    received = attn.stats().bytes_received;
    compute.push_back(attn.stats().compute_s);
    communication.push_back(attn.stats().comm_s);
    comm_total.push_back(attn.stats().comm_total_s);
    agree.push_back(attn.stats().agree_s);
    first_kv.push_back(attn.stats().first_kv_s);
    later_kv.push_back(attn.stats().later_kv_s);
    dkv.push_back(attn.stats().dkv_s);
  }

  Measured m;
  m.shared_memory_off = attn.stats().shared_memory_off;
  m.got = check::gather_results(
      comm, p, {.out = out.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .lse = lse.data()});
  const std::vector<double> mine{median(compute), median(communication), median(comm_total), median(wall), median(forward),
                                 median(backward), peak_rss_mb(),
                                 static_cast<double>(attn.stats().peak_buffer_bytes) / (1 << 20),
                                 static_cast<double>(sent), static_cast<double>(received), mean(agree),
                                 mean(first_kv), mean(later_kv), mean(dkv), mean(communication),
                                 static_cast<double>(attn.stats().shared_forwards + attn.stats().shared_backwards),
                                 2.0};  // the last step's forward and backward
  std::vector<double> per_rank(mine.size() * comm.size());
  comm.all_gather<double>(mine, per_rank);
  for (int r = 0; r < comm.size(); ++r) {
    const double* f = &per_rank[r * mine.size()];
    m.ranks.push_back(
        {f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], f[13], f[14], f[15], f[16]});
  }
  return m;
}

// The deadline of the wait for rank 0's serial check: the collectives' deadline plus 4 times
// the serial work's estimate. The single-process run does the work of all cp ranks of its
// group, with the same kernels and threads, so it takes about cp times the slowest rank's
// step (of any scheme measured; it runs once, and each scheme's comparison is cheap beside
// it); 4 is the margin (first-touch faults, the comparisons). The same on every rank (from
// the all-gathered figures).
double serial_check_deadline(double timeout_s, const std::vector<Measured>& measured) {
  double slowest = 0;
  std::size_t cp = 1;
  for (const Measured& m : measured) {
    cp = m.ranks.size();
    for (const RankFigures& f : m.ranks) slowest = std::max(slowest, f.step_s);
  }
  return std::min(timeout_s + 4.0 * static_cast<double>(cp) * slowest, 1e7);
}

// A duplicate of `comm` whose collectives wait up to `timeout_s` (collective).
Communicator with_deadline(const Communicator& comm, double timeout_s) {
  CommOptions o = comm.options();
  o.timeout_s = timeout_s;
  o.timeout_name += " plus the serial check's allowance";
  return Communicator(comm.mpi_comm(), o);
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
    if (!a.npy_out.empty() && world.rank() == 0)  // the writer: its outputs checked before the run
      for (const char* name : {"out", "lse", "dq", "dk", "dv"})
        check_output_path(a.npy_out + "/" + name + ".npy", "--npy-out");
  } catch (const Error& e) {
    local_error = e.message();
  } catch (const std::exception& e) {
    local_error = std::string("unexpected error: ") + e.what();
  }
  // The same error on every rank, or none; and the flags the library's agreements do not see
  // (a rank timing more steps would wait in a collective the others never reach).
  Fingerprint fp;
  fp.add("--repeats", a.repeats);
  // the layers run: --scheme's index in kCpSchemes, or -1 for all; the field's name lists them
  const bool all = a.scheme == "all";
  const CpScheme one = all ? kCpSchemes[0] : parse_scheme(a.scheme);
  std::string scheme_field = "--scheme (-1 all";
  int64_t scheme = -1;
  for (std::size_t i = 0; i < std::size(kCpSchemes); ++i) {
    (scheme_field += ", ") += std::to_string(i);
    (scheme_field += " ") += to_string(kCpSchemes[i]);
    if (!all && one == kCpSchemes[i]) scheme = static_cast<int64_t>(i);
  }
  fp.add(scheme_field + ")", scheme).add("--cp-inner", a.cp_inner);
  agree(groups.world, fp, "cpattn run", local_error);
  if (a.testing_stall_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(a.testing_stall_s));
  Local& l = *prepared;
  const check::Batch& b = l.b;
  // The layers' agreements are their CP group's: an error there (ranks of one group given other
  // batches) ends that group alone. Every rank of the world meets once more, so that every
  // rank has the message and none waits in a collective the others left.
  std::vector<Measured> measured;
  std::string measure_error;
  try {
    for (const std::unique_ptr<CpAttention>& attn : l.attns) measured.push_back(measure(comm, a, l, *attn));
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const Error*>(&e);
    measure_error = (groups.count > 1 ? "CP group " + std::to_string(groups.index) + ": " : std::string()) +
                    (error ? error->message() : std::string("unexpected error: ") + e.what());
  }
  agree(groups.world, {}, "cpattn run", measure_error);

  // Rank 0 of each group checks alone, while every other rank waits for its verdict: that
  // wait gets a deadline sized for the serial check (serial_check_deadline), not the
  // collectives' one, so that a long check cannot time the other ranks out.
  Communicator verdict = with_deadline(groups.world, serial_check_deadline(groups.world.timeout_s(), measured));

  // Rank 0 checks and reports; the others wait for its verdict. Whatever rank 0 meets
  // (a failed check, an exception) reaches every rank, so that none is left waiting.
  int64_t pass = 1;
  std::string rank0_error, write_error;
  if (rank == 0) try {
    const Reference ref = single_process_reference(b, l.cfg.options);  // once, for every scheme
    const KernelPath path = l.cfg.options.path;
    RunReport report{.args = a, .kernel_path = kernel_path_name(resolve_kernel_path(path, b.dtype).path),
                     .cp = cp, .cp_groups = groups.count, .timeout_s = groups.world.timeout_s(), .batch = b,
                     .balance = balance_report(b.cu_seqlens, cp, parse_split(a.split)),
                     .single_process_s = ref.seconds, .schemes = {}};
    for (std::size_t i = 0; i < measured.size(); ++i)
      report.schemes.push_back({.scheme = std::string(to_string(l.attns[i]->config().scheme)),
                                .check = check_against(b, ref, measured[i].got), .ranks = measured[i].ranks,
                                .shared_memory_off = measured[i].shared_memory_off});
    if (!report.pass()) pass = 0;
    if (groups.world.rank() != 0) {
      // Another CP group's rank 0: it checked; world rank 0 reports.
    } else if (a.json) {
      std::cout << report_json(report).dump() << std::endl;
    } else {
      print_report(report);
    }
    // --npy-out: the first scheme's results (every scheme's pass the same check), only when
    // they passed: a failed run leaves an earlier run's files as they were.
    if (!a.npy_out.empty() && groups.world.rank() == 0) {
      if (pass == 0) {
        std::fprintf(stderr, "cpattn run: --npy-out: nothing written, the check failed (the files in '%s' are as "
                     "they were)\n", a.npy_out.c_str());
      } else {
        try {
          write_results(a.npy_out, b, measured.front().got);
        } catch (const Error& e) {
          write_error = "--npy-out: " + e.message();
        }
      }
    }
  } catch (const Error& e) {
    rank0_error = e.message();
  } catch (const std::exception& e) {
    rank0_error = e.what();
  }
  // Each group's rank 0 verdict reaches every rank of every group (the agreement carries every
  // rank's error text; only the checkers have one).
  agree(verdict, {}, "cpattn run",
        rank0_error.empty() ? write_error
                            : "the check on rank 0 of CP group " + std::to_string(groups.index) + " failed: " + rank0_error);
  const int64_t status[1] = {pass};
  std::vector<int64_t> passed(static_cast<std::size_t>(groups.world.size()));
  verdict.all_gather<int64_t>(std::span<const int64_t>(status, 1), passed);
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

// Every error reaching here is the same on every rank (agreed, or from the flags alone):
// rank 0 prints it, and the barrier keeps the launcher from ending rank 0 (once another rank
// has exited non-zero) before it has printed.
bool run_distributed(const RunArgs& a) {
  Communicator world(MPI_COMM_WORLD, {.timeout_s = a.timeout, .timeout_name = "--timeout"});
  try {
    return check_in_groups(world, a);
  } catch (const Error& e) {
    if (world.rank() == 0) std::fprintf(stderr, "cpattn: error: %s\n", e.message().c_str());
    std::fflush(stderr);
    world.barrier();
    throw ExitCode{2};
  }
}

}  // namespace cpattn::cli::run_cmd
