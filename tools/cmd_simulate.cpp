// `cpattn simulate`: every CP scheme's predicted step on a mesh and a machine profile
// (cpattn/sim.hpp, docs/simulate.md); `cpattn calibrate`: this machine's profile, measured.
#include <cpattn/check/attention_bench.hpp>
#include <cpattn/check/batch.hpp>
#include <cpattn/check/cases.hpp>
#include <cpattn/check/problem.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/error.hpp>
#include <cpattn/file.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/sim.hpp>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "sim_profile.hpp"
#include "vocab.hpp"

namespace cpattn::cli {
namespace {

// ---- simulate ----------------------------------------------------------------------------------

struct SimulateArgs {
  std::string lengths_file;
  std::vector<int64_t> lengths;
  std::string distribution;
  int64_t tokens = 1 << 20;
  double mean_length = 8192, sigma = 1.0;
  uint64_t seed = 1;
  int cp = 0, cp_inner = 0, tp = 1, dp = 1, pp = 1, ep = 1, micro = 1;
  std::string schedule = "1f1b";
  std::optional<int> virtual_stages;  // --virtual (unset: 2 with interleaved, else 1)
  int layers = 1, heads = 8, kv_heads = 2, head_dim = 128, head_dim_qk = 0, head_dim_v = 0, hidden = 0;
  int experts = 0, top_k = 1;
  double expert_skew = 0;
  std::string dtype = "bf16", mask = "causal";
  std::string profile;
  std::string svg;
  std::string overlap = "on";  // --overlap on|off (SimInput::overlap, CpAttnConfig::overlap)
  bool json = false, no_breakeven = false;
};

// The library names SimMesh / SimModel fields and sim_lengths' arguments; the command line
// names the flags that set them. Longer names first (SimMesh::cp_inner before SimMesh::cp).
std::string flag_names(std::string msg) {
  static const std::pair<const char*, const char*> kFlags[] = {
      {"SimMesh::cp_inner", "--cp-inner"},     {"SimMesh::schedule", "--schedule"},
      {"SimMesh::virtual_stages", "--virtual"},
      {"SimMesh::micro", "--micro-batches"},   {"SimMesh::tp", "--tp"},
      {"SimMesh::cp", "--cp"},                 {"SimMesh::dp", "--dp"},
      {"SimMesh::pp", "--pp"},                 {"SimMesh::ep", "--ep"},
      {"SimModel::layers", "--layers"},        {"SimModel::num_heads_q", "--heads"},
      {"SimModel::num_heads_k", "--kv-heads"}, {"SimModel::head_dim_qk", "--head-dim-qk"},
      {"SimModel::head_dim_v", "--head-dim-v"}, {"SimModel::hidden", "--hidden"},
      {"SimModel::mask", "--mask"},            {"SimModel::expert_skew", "--expert-skew"},
      {"SimModel::experts", "--experts"},      {"SimModel::top_k", "--top-k"},
      {"sim_lengths: tokens", "--tokens"},     {"sim_lengths: mean", "--mean-length"},
      {"sim_lengths: sigma", "--sigma"},       {"sim_lengths: distribution", "--distribution"}};
  for (const auto& [field, flag] : kFlags)
    for (std::size_t at = msg.find(field); at != std::string::npos; at = msg.find(field, at))
      msg.replace(at, std::string_view(field).size(), flag);
  return msg;
}

// Runs `f`; a cpattn::Error from the simulator gets its field names replaced by the flags.
template <class F>
decltype(auto) with_flags(F&& f) {
  return rewrite_errors(f, flag_names);
}

nlohmann::json bytes_json(const SimBytes& b) {
  return {{"sent_intra", b.sent_intra}, {"sent_inter", b.sent_inter},
          {"received_intra", b.received_intra}, {"received_inter", b.received_inter}};
}

nlohmann::json call_json(const std::vector<SimCall>& calls) {
  nlohmann::json j = {{"compute_s", nlohmann::json::array()}, {"overhead_s", nlohmann::json::array()}, {"exposed_s", nlohmann::json::array()},
                      {"hidden_s", nlohmann::json::array()}, {"bytes_sent", nlohmann::json::array()},
                      {"bytes_received", nlohmann::json::array()}, {"agreement_bytes_sent", nlohmann::json::array()}};
  for (const SimCall& c : calls) {
    j["compute_s"].push_back(c.compute_s);
    j["overhead_s"].push_back(c.overhead_s);
    j["exposed_s"].push_back(c.exposed_s);
    j["hidden_s"].push_back(c.hidden_s);
    j["bytes_sent"].push_back(c.payload.sent());
    j["bytes_received"].push_back(c.payload.received());
    j["agreement_bytes_sent"].push_back(c.agreement.sent());
  }
  return j;
}

// Predicted step time against CP size (powers of two up to `max_cp`), one line per scheme.
void write_svg(const std::string& path, const SimInput& in, int max_cp) {
  std::vector<int> sizes;
  for (int c = 1; c <= max_cp; c *= 2) sizes.push_back(c);
  if (sizes.back() != max_cp) sizes.push_back(max_cp);
  std::vector<std::vector<double>> t;  // [scheme][size], <= 0: not valid
  double lo = 1e300, hi = 0;
  for (const CpScheme s : kCpSchemes) {
    t.emplace_back();
    for (const int c : sizes) {
      SimInput v = in;
      v.mesh.cp = c;
      v.mesh.cp_inner = in.mesh.cp_inner > 0 ? std::gcd(in.mesh.cp_inner, c) : 0;
      v.find_breakeven = false;
      double x = 0;
      try {
        const SchemePrediction p = simulate_scheme(v, s);
        x = p.valid ? p.step_s : 0;
      } catch (const Error&) {
        x = 0;  // a size this mesh cannot take (e.g. --ep not dividing it)
      }
      t.back().push_back(x);
      if (x > 0) {
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
    }
  }
  CPATTN_CHECK(hi > 0, "--svg: no scheme is valid at any CP size up to ", max_cp);
  const double W = 720, H = 440, L = 80, R = 160, T = 30, B = 50;
  const double ly0 = std::floor(std::log10(lo)), ly1 = std::max(ly0 + 1, std::ceil(std::log10(hi)));
  const auto xs = [&](std::size_t i) {
    return L + (sizes.size() == 1 ? 0 : (W - L - R) * static_cast<double>(i) / static_cast<double>(sizes.size() - 1));
  };
  const auto ys = [&](double v) { return T + (H - T - B) * (ly1 - std::log10(v)) / (ly1 - ly0); };
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"};
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << L << "\" y=\"18\">cpattn simulate: predicted step time (s, log) against CP size, profile "
    << in.profile.name << "</text>\n";
  for (double e = ly0; e <= ly1; e += 1) {
    o << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << ys(std::pow(10, e)) << "\" y2=\""
      << ys(std::pow(10, e)) << "\" stroke=\"#ddd\"/>\n<text x=\"" << L - 8 << "\" y=\"" << ys(std::pow(10, e)) + 4
      << "\" text-anchor=\"end\">1e" << e << "</text>\n";
  }
  for (std::size_t i = 0; i < sizes.size(); ++i)
    o << "<text x=\"" << xs(i) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">" << sizes[i] << "</text>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">CP size</text>\n";
  for (std::size_t s = 0; s < t.size(); ++s) {
    std::ostringstream pts;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      if (t[s][i] > 0) pts << xs(i) << ',' << ys(t[s][i]) << ' ';
    o << "<polyline fill=\"none\" stroke=\"" << colors[s] << "\" stroke-width=\"2\" points=\"" << pts.str()
      << "\"/>\n<text x=\"" << W - R + 10 << "\" y=\"" << T + 20 + 18 * static_cast<double>(s) << "\" fill=\""
      << colors[s] << "\">" << to_string(kCpSchemes[s]) << "</text>\n";
  }
  o << "</svg>\n";
  const std::string text = o.str();  // written whole or not at all (a full disk: an error, not half a drawing)
  with_flag("--svg", [&] { write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size()))); });
}

// An output's path, before any work: writable, and not one of the command's inputs (the
// output would replace it).
void check_output_beside_inputs(const std::string& path, const char* flag,
                                std::initializer_list<std::pair<const char*, const std::string*>> inputs) {
  check_output_path(path, flag);
  for (const auto& [input_flag, input] : inputs)
    CPATTN_CHECK(input->empty() || !same_file(path, *input), flag, " '", path, "' is the file of ", input_flag, " '",
                 *input, "': the output would replace its input");
}

void run_simulate(const SimulateArgs& a) {
  std::vector<int64_t> cu;
  const int sources = !a.lengths_file.empty() + !a.lengths.empty() + !a.distribution.empty();
  CPATTN_CHECK(sources == 1, "give the batch once: --lengths-file FILE, --lengths L1,L2,... or --distribution "
               "NAME (with --tokens, --mean-length, --sigma, --seed)");
  if (!a.svg.empty())  // before any work
    check_output_beside_inputs(a.svg, "--svg", {{"--lengths-file", &a.lengths_file}, {"--profile", &a.profile}});
  if (!a.lengths_file.empty()) cu = cu_seqlens_from_lengths(read_lengths_file(a.lengths_file), "--lengths-file");
  if (!a.lengths.empty()) cu = cu_seqlens_from_lengths(a.lengths, "--lengths");
  if (!a.distribution.empty()) {
    // Before the lengths exist: the boundaries sim_lengths grows (up to twice their size while
    // growing) and the simulation's own (sim_memory_bytes) for the documents --tokens makes.
    const int64_t docs = sim_lengths_documents(a.tokens, a.mean_length);
    const uint64_t lengths = saturating_mul(static_cast<uint64_t>(docs) + 1, 2 * sizeof(int64_t));
    const uint64_t sim = sim_memory_bytes(docs, a.cp);
    std::ostringstream mean;
    mean << a.mean_length;
    check_memory(saturating_add(lengths, sim),
                 "cpattn simulate --distribution " + a.distribution + " --tokens " + std::to_string(a.tokens) +
                     " (about " + std::to_string(docs) + " documents of --mean-length " + mean.str() +
                     ") at --cp " + std::to_string(a.cp),
                 "lengths " + format_bytes(lengths) + ", planner and predictions " + format_bytes(sim));
    cu = with_flags([&] { return sim_lengths(a.distribution, a.tokens, a.mean_length, a.sigma, a.seed); });
  } else {
    const auto docs = static_cast<int64_t>(cu.size()) - 1;
    const uint64_t sim = sim_memory_bytes(docs, a.cp);
    check_memory(sim, "cpattn simulate of " + std::to_string(docs) + " documents (" +
                          (a.lengths_file.empty() ? "--lengths" : "--lengths-file " + a.lengths_file) + ") at --cp " +
                          std::to_string(a.cp),
                 "planner and predictions " + format_bytes(sim));
  }
  const auto kind = parse_pipeline_schedule(a.schedule);
  CPATTN_CHECK(kind.has_value(), "--schedule must be one of gpipe, 1f1b, interleaved, zb-h1, got '",
               a.schedule, "'");
  // (fill-drain runs forwards only: its step would be a forward's time beside a training
  // step's bytes; cpattn train refuses it too)
  CPATTN_CHECK(*kind != PipelineSchedule::fill_drain, "--schedule fill-drain runs forwards only; cpattn "
               "simulate predicts a training step (forward and backward): use gpipe, 1f1b, interleaved or zb-h1");
  SimInput in{.cu_seqlens = cu,
              .model = {.layers = a.layers,
                        .num_heads_q = a.heads,
                        .num_heads_k = a.kv_heads,
                        .head_dim_qk = a.head_dim_qk > 0 ? a.head_dim_qk : a.head_dim,
                        .head_dim_v = a.head_dim_v > 0 ? a.head_dim_v : a.head_dim,
                        .hidden = a.hidden,
                        .dtype = parse_dtype(a.dtype),
                        .mask = parse_mask(a.mask),
                        .experts = a.experts,
                        .top_k = a.top_k,
                        .expert_skew = a.expert_skew},
              .mesh = {.tp = a.tp, .cp = a.cp, .cp_inner = a.cp_inner, .dp = a.dp, .pp = a.pp, .ep = a.ep,
                       .micro = a.micro, .schedule = *kind,
                       .virtual_stages = a.virtual_stages.value_or(0)},
              .profile = a.profile.empty() ? default_profile() : read_profile(a.profile),
              .find_breakeven = !a.no_breakeven,
              .overlap = a.overlap == "on"};
  const auto t0 = std::chrono::steady_clock::now();
  const SimReport rep = with_flags([&] { return simulate_step(in); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!a.svg.empty()) with_flags([&] { write_svg(a.svg, in, a.cp); });
  const int64_t world = int64_t{a.tp} * a.cp * a.dp * a.pp;
  if (a.json) {
    nlohmann::json j;
    j["profile"] = in.profile.name;
    j["tokens"] = rep.tokens;
    j["padded_tokens"] = rep.padded_tokens;
    j["documents"] = cu.size() - 1;
    j["mesh"] = {{"tp", a.tp}, {"cp", a.cp}, {"cp_inner", a.cp_inner}, {"dp", a.dp}, {"pp", a.pp}, {"ep", a.ep},
                 {"micro_batches", a.micro}, {"schedule", a.schedule},
                 {"virtual_stages", in.mesh.chunks()}, {"world", world}};
    j["overlap"] = in.overlap;
    j["model"] = {{"layers", a.layers}, {"heads", in.model.num_heads_q}, {"kv_heads", in.model.num_heads_k},
                  {"head_dim_qk", in.model.head_dim_qk}, {"head_dim_v", in.model.head_dim_v},
                  {"hidden", in.model.hidden}, {"dtype", a.dtype}, {"mask", a.mask}, {"experts", a.experts},
                  {"top_k", a.top_k}};
    j["visible_pairs"] = rep.visible_pairs;
    j["imbalance"] = rep.imbalance;
    j["best"] = to_string(rep.best);
    j["simulate_seconds"] = seconds;
    j["schemes"] = nlohmann::json::array();
    for (const SchemePrediction& p : rep.schemes) {
      nlohmann::json s = {{"scheme", to_string(p.scheme)}, {"valid", p.valid}};
      if (!p.valid) {
        s["reason"] = flag_names(p.reason);
        j["schemes"].push_back(s);
        continue;
      }
      if (p.scheme == CpScheme::hybrid) s["cp_inner"] = p.cp_inner;
      s["step_s"] = p.step_s;
      s["compute_s"] = p.compute_s;
      s["exposed_comm_s"] = p.exposed_comm_s;
      s["hidden_comm_s"] = p.hidden_comm_s;
      s["bubble_s"] = p.bubble_s;
      s["bubble_fraction"] = p.bubble_fraction;
      s["expert_imbalance"] = p.expert_imbalance;
      s["step_bytes"] = bytes_json(p.step_bytes);
      s["peak_memory_gb"] = p.peak_memory_gb;
      s["fits_memory"] = p.fits_memory;
      s["faster_smaller_cp"] = p.faster_smaller_cp;
      s["breakeven_length_scale"] = p.breakeven_length_scale;
      s["breakeven_bandwidth_scale"] = p.breakeven_bandwidth_scale;
      s["cp_group_offset"] = p.cp_group_offset;
      s["forward"] = call_json(p.forward);
      s["backward"] = call_json(p.backward);
      j["schemes"].push_back(s);
    }
    std::cout << j.dump() << '\n';
    return;
  }
  std::printf("cpattn simulate: %lld tokens (%lld padded) in %zu documents, profile %s\n",
              static_cast<long long>(rep.tokens), static_cast<long long>(rep.padded_tokens), cu.size() - 1,
              in.profile.name.c_str());
  const std::string chunks =
      in.mesh.chunks() > 1 ? " (" + std::to_string(in.mesh.chunks()) + " chunks per stage)" : "";
  std::printf("mesh tp %d x cp %d x dp %d x pp %d = %lld ranks, ep %d, %d micro-batch(es), schedule %s%s; planner "
              "imbalance %.4f; all-gather overlap %s\n",
              a.tp, a.cp, a.dp, a.pp, static_cast<long long>(world), a.ep, a.micro, a.schedule.c_str(), chunks.c_str(),
              rep.imbalance, a.overlap.c_str());
  std::printf("%-10s %11s %11s %11s %11s %11s %9s %9s %8s %7s %7s %7s\n", "scheme", "step ms", "compute", "exposed",
              "hidden", "bubble", "intra GB", "inter GB", "mem GB", "cp<", "len x", "bw x");
  for (const SchemePrediction& p : rep.schemes) {
    if (!p.valid) {
      std::printf("%-10s not valid: %s\n", std::string(to_string(p.scheme)).c_str(), flag_names(p.reason).c_str());
      continue;
    }
    std::string name(to_string(p.scheme));
    if (p.scheme == CpScheme::hybrid) name += "/" + std::to_string(p.cp_inner);
    std::printf("%-10s %11.4f %11.4f %11.4f %11.4f %11.4f %9.4f %9.4f %7.2f%s %7d %7.3g %7.3g\n", name.c_str(),
                1e3 * p.step_s, 1e3 * p.compute_s, 1e3 * p.exposed_comm_s, 1e3 * p.hidden_comm_s, 1e3 * p.bubble_s,
                static_cast<double>(p.step_bytes.sent_intra) / 1e9, static_cast<double>(p.step_bytes.sent_inter) / 1e9,
                p.peak_memory_gb, p.fits_memory ? " " : "!", p.faster_smaller_cp, p.breakeven_length_scale,
                p.breakeven_bandwidth_scale);
  }
  std::printf("best: %s. Times per step in ms on the slowest rank; GB sent per rank and step; mem: attention state "
              "per rank (! over the profile's memory); cp<: the fastest smaller power-of-two CP when one beats --cp (0: none); "
              "len x / bw x: the scale of the documents' lengths / of the links' bandwidth below which cp/2 is "
              "faster (0: no crossing within 1/256..256). Simulated in %.3f s.\n",
              std::string(to_string(rep.best)).c_str(), seconds);
}

// ---- calibrate ---------------------------------------------------------------------------------

struct CalibrateArgs {
  std::string out;
  int64_t seq_len = 2048;
  int heads = 8, kv_heads = 2, head_dim = 128, threads = 1, repeats = 3;
  std::vector<std::string> dtypes{"fp32", "fp16", "bf16"};
  std::vector<int64_t> sizes{8, 4096, 65536, 1 << 20, 2 << 20};
  std::vector<int64_t> lengths;  // the kernel case's documents (default: one of seq_len)
  int iters = 20;
  std::string name = "this-machine";
  bool json = false;
  std::optional<double> timeout;  // --timeout (unset: CPATTN_COMM_TIMEOUT_S, else 300 s)
  int64_t overhead_tokens = 2048;  // per rank, of the CP overhead's own batch; 0: not measured
  uint64_t overhead_seed = 2;      // its document mix (check::document_mix)
};

// The CP overhead's measurement (docs/simulate.md, "cpattn calibrate"): every scheme's real
// forward and backward on every rank at once (cp = the world size), on a batch of its own
// (document_mix of overhead_tokens per rank), against the simulator's prediction for the same
// batch and scheme priced at the bare kernels' rates on that batch and the links just measured.
// The bare kernels run right before each CP call, in the same repeat, so that a machine whose
// load changes between schemes (a shared one) loads both alike.
struct OverheadRun {
  check::Problem pb;  // the batch's whole documents: the bare kernels' case, and the CP layer's global tensors
  check::Tensor out, dq, dk, dv;
  std::vector<float> lse;
  AttnFwdParams fp;
  AttnBwdParams bp;
  OverheadRun(const check::AttnCase& c, DType t, uint64_t seed, int threads)
      : pb(c, t, seed), out(t, pb.out_shape()), dq(t, pb.q_shape()), dk(t, pb.k_shape()), dv(t, pb.v_shape()),
        lse(pb.lse_size()),
        fp(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, threads)),
        bp(pb.bwd(pb.q, pb.k, pb.v, out, lse.data(), pb.dout, dq, dk, dv, KernelPath::automatic, threads)) {}
};

struct OverheadTimes {  // the slowest rank's medians, seconds
  double kernel_fwd = 0, kernel_bwd = 0, cp_fwd = 0, cp_bwd = 0;
};

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `repeats` times (after a warm-up): the bare kernels on the whole batch, then `attn`'s forward
// and backward on this rank's rows of it.
OverheadTimes time_overhead(Communicator& comm, CpAttention& attn, const OverheadRun& o, int repeats) {
  using Clock = std::chrono::steady_clock;
  const std::vector<int64_t> cu = o.pb.c.cu_seqlens_q();
  const std::shared_ptr<const RankPlan> plan = attn.plan(cu);
  const check::Tensor q = check::local_rows(o.pb.q, *plan), k = check::local_rows(o.pb.k, *plan),
                      v = check::local_rows(o.pb.v, *plan), dout = check::local_rows(o.pb.dout, *plan);
  check::Tensor out(o.pb.dtype, {plan->local_tokens, o.pb.c.num_heads_q, o.pb.c.head_dim_v}), dq(o.pb.dtype, q.shape),
      dk(o.pb.dtype, k.shape), dv(o.pb.dtype, v.shape);
  const auto secs = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  std::vector<double> kf, kb, cf, cb;
  for (int i = 0; i <= repeats; ++i) {  // the first one warms up (plan cache, buffers)
    comm.barrier();
    const auto t0 = Clock::now();
    attention_forward(o.fp);
    const auto t1 = Clock::now();
    attention_backward(o.bp);
    const auto t2 = Clock::now();
    comm.barrier();
    const auto t3 = Clock::now();
    CpContext ctx = attn.forward({.plan = plan, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
    const auto t4 = Clock::now();
    attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                        .dv = dv.view()});
    const auto t5 = Clock::now();
    if (i == 0) continue;
    kf.push_back(secs(t0, t1));
    kb.push_back(secs(t1, t2));
    cf.push_back(secs(t3, t4));
    cb.push_back(secs(t4, t5));
  }
  std::vector<double> med{median_of(kf), median_of(kb), median_of(cf), median_of(cb)};
  comm.all_reduce<double>(med, ReduceOp::max);
  return {med[0], med[1], med[2], med[3]};
}

// The smallest overhead x >= 0 (bisection to 1e-4 of the kernel time, relative above 1) at
// which the model's call (`predict_at(x)`: the slowest rank's forward or backward) reaches
// `measured`; 0 when the model without overhead already does. The model's call grows with x
// (the kernel time times 1 + x), so doubling finds an upper end.
template <class F>
double fit_overhead(F&& predict_at, double measured) {
  if (predict_at(0.0) >= measured) return 0.0;
  double lo = 0, hi = 1;
  for (int i = 0; i < 64 && predict_at(hi) < measured; ++i) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1e-4 * std::max(1.0, lo)) {
    const double mid = (lo + hi) / 2;
    (predict_at(mid) < measured ? lo : hi) = mid;
  }
  return hi;
}

// Seconds of one ring shift of `bytes` (every rank sends to the next, receives from the
// previous) over `iters` shifts after a warm-up: the fastest and the median, each the slowest
// rank's.
struct ShiftSeconds {
  double fastest, median;
};
ShiftSeconds shift_seconds(Communicator& comm, int64_t bytes, int iters) {
  std::vector<std::byte> send(static_cast<std::size_t>(bytes)), recv(send.size());
  const int p = comm.size(), r = comm.rank();
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    CommRequest req = comm.start_shift<std::byte>(send, (r + 1) % p, recv, (r + p - 1) % p);
    comm.wait(req);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  std::vector<double> both{t.front(), t[t.size() / 2]};
  comm.all_reduce<double>(both, ReduceOp::max);
  return {.fastest = both[0], .median = both[1]};
}

void run_calibrate(const CalibrateArgs& a) {
  CPATTN_CHECK(a.iters >= 1, "--iters must be >= 1, got ", a.iters);
  CPATTN_CHECK(!a.sizes.empty(), "--sizes: give at least one message size");
  for (const int64_t l : a.lengths) CPATTN_CHECK(l >= 1, "--lengths: every length must be >= 1, got ", l);
  for (const int64_t s : a.sizes)
    CPATTN_CHECK(s >= 1 && s <= (int64_t{1} << 30), "--sizes: every message size must be in [1, 2^30] bytes, got ", s);
  if (!a.out.empty()) check_output_path(a.out, "--out");  // before the calibration (it failed only at its end)
  std::vector<DType> dtypes;
  for (const std::string& name : a.dtypes) dtypes.push_back(with_flag("--dtypes", [&] { return parse_dtype(name); }));
  const auto kernel_case = [&a](DType t) {
    check::AttnBenchOptions o;
    o.lengths = a.lengths.empty() ? std::vector<int64_t>{a.seq_len} : a.lengths;
    o.heads = a.heads;
    o.kv_heads = a.kv_heads;
    o.head_dim = a.head_dim;
    o.dtype = t;
    o.threads = a.threads;
    o.repeats = a.repeats;
    return o;
  };
  // Before MPI starts: a case past memory is refused on every rank alike.
  for (const DType t : dtypes)
    check_bench_memory(kernel_case(t), "cpattn calibrate's " + std::string(to_string(t)) + " kernel case");
  const MpiSession mpi;  // finalizes only what it initialized
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = a.timeout, .timeout_name = "--timeout"});
  // Before the kernels are timed (from the flags and the world size: every rank alike). With one
  // size the bandwidth divided by max(0, 1e-12): 65536 GB/s was written, and accepted.
  CPATTN_CHECK(comm.size() == 1 || *std::ranges::min_element(a.sizes) < *std::ranges::max_element(a.sizes),
               "--sizes: give at least two different message sizes under mpirun (latency from the smallest, "
               "bandwidth from the largest less it), got only ", a.sizes.front());
  MachineProfile p;
  p.name = a.name;
  std::ostringstream src;
  src << "cpattn calibrate on " << comm.size() << " rank(s): attention kernels ";
  // Kernel rates: every rank runs the same case at once (as the ranks of a CP run do); the
  // slowest rank's rate.
  nlohmann::json kernels = nlohmann::json::array();
  for (const DType t : dtypes) {
    const std::string name(to_string(t));
    comm.barrier();
    const check::AttnBenchResult r = check::run_attention_bench(kernel_case(t), nullptr);
    std::vector<double> rate{r.fwd_gflops, r.bwd_gflops};
    std::vector<double> neg{-rate[0], -rate[1]};
    comm.all_reduce<double>(neg, ReduceOp::max);  // the minimum rate
    p.fwd_gflops[static_cast<std::size_t>(t)] = -neg[0];
    p.bwd_gflops[static_cast<std::size_t>(t)] = -neg[1];
    kernels.push_back({{"dtype", name}, {"fwd_gflops", -neg[0]}, {"bwd_gflops", -neg[1]}, {"path", r.path}});
  }
  if (a.lengths.empty())
    src << "(one " << a.seq_len << "-token causal document, ";
  else
    src << "(" << a.lengths.size() << " causal documents of " << std::accumulate(a.lengths.begin(), a.lengths.end(), int64_t{0})
        << " tokens, ";
  src << a.heads << "/" << a.kv_heads << " heads, dim "
      << a.head_dim << ", " << a.threads << " thread(s), median of " << a.repeats << ", slowest rank); ";
  // Links: ring shifts by message size. Latency: the smallest message's fastest shift (what a
  // rank waits besides the bytes; a descheduled rank only adds to it, and on a loaded machine
  // the median of a few 8-byte shifts once took longer than a 1 MiB one); bandwidth: the
  // largest message's median, less that latency.
  nlohmann::json links = nlohmann::json::array();
  std::vector<int64_t> sizes = a.sizes;
  std::sort(sizes.begin(), sizes.end());
  double lat = 0, bw = 0;
  if (comm.size() > 1) {
    std::vector<ShiftSeconds> secs;
    for (const int64_t s : sizes) {
      secs.push_back(shift_seconds(comm, s, a.iters));
      links.push_back({{"bytes", s}, {"seconds", secs.back().median}, {"fastest_seconds", secs.back().fastest},
                       {"gbs", static_cast<double>(s) / secs.back().median / 1e9}});
    }
    lat = secs.front().fastest;
    // (The slowest rank's times: the same on every rank.)
    CPATTN_CHECK(secs.back().median > lat, "--sizes: the ", sizes.back(), "-byte shift (median ",
                 secs.back().median, " s) took no longer than the fastest ", sizes.front(), "-byte one (", lat,
                 " s): no bandwidth can be read from them; give sizes further apart, or more --iters");
    bw = static_cast<double>(sizes.back()) / (secs.back().median - lat) / 1e9;
    src << "links: ring shifts between the " << comm.size() << " ranks of one node (" << a.iters
        << " each; latency = the fastest " << sizes.front() << "-byte shift, bandwidth = the median "
        << sizes.back() << "-byte one less that latency); inter_node = intra_node (one node: not measured)";
  } else {
    // One rank: no peer to measure. A memcpy bounds what a shared-memory transport moves.
    std::vector<std::byte> x(static_cast<std::size_t>(sizes.back())), y(x.size());
    double best = 1e300;
    for (int i = 0; i < a.iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::copy(x.begin(), x.end(), y.begin());
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    bw = static_cast<double>(x.size()) / best / 1e9;
    lat = 1e-6;
    src << "links: NOT measured (one rank; run under mpirun -np 2): bandwidth = a " << sizes.back()
        << "-byte memcpy, latency 1 us assumed; inter_node = intra_node";
  }
  p.intra = {.bandwidth_gbs = bw, .latency_us = lat * 1e6};
  p.inter = p.intra;
  p.ranks_per_node = comm.size();
  const double ram = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  p.memory_gb = ram / 1e9 / comm.size();
  check_machine_profile(p);
  nlohmann::json overheads = nlohmann::json::array();
  std::vector<int64_t> overhead_lengths;  // the overhead's batch
  if (a.overhead_tokens > 0) {
    const int cp = comm.size();
    overhead_lengths = check::document_mix(a.overhead_tokens * cp, a.overhead_seed);
    const std::vector<int64_t> cu = cu_seqlens_from_lengths(overhead_lengths);
    // The bare kernel on the same documents, every rank at once: the rates the model prices them at.
    const auto overhead_case = [&](DType t) {
      check::AttnBenchOptions kc = kernel_case(t);
      kc.lengths = overhead_lengths;
      return kc;
    };
    // Its size needs the world's: checked here, agreed so that every rank refuses alike.
    std::string too_big;
    try {
      for (const DType t : dtypes)
        check_bench_memory(overhead_case(t), "cpattn calibrate's " + std::string(to_string(t)) + " CP overhead case "
                           "(--overhead-tokens x " + std::to_string(cp) + " ranks)");
    } catch (const Error& e) {
      too_big = e.message();
    }
    agree(comm, {}, "cpattn calibrate", too_big);
    const check::AttnCase c =
        check::bench_case(overhead_lengths, a.heads, a.kv_heads, a.head_dim, a.head_dim, MaskType::causal);
    for (const DType t : dtypes) {
      const auto di = static_cast<std::size_t>(t);
      const OverheadRun o(c, t, a.overhead_seed, a.threads);
      for (const CpScheme s : kCpSchemes) {
        // a2a over the whole world, the hybrid over the largest group the heads split over
        // (the world on this one node); a scheme the heads cannot run keeps 0.
        int inner = 0;
        if (s == CpScheme::a2a && !head_split_error(a.heads, a.kv_heads, cp).empty()) continue;
        if (s == CpScheme::hybrid)
          for (int i = 1; i <= cp; ++i)
            if (cp % i == 0 && head_split_error(a.heads, a.kv_heads, i).empty()) inner = i;
        CpAttention attn(comm, {.num_heads_q = a.heads, .num_heads_k = a.kv_heads, .head_dim_qk = a.head_dim,
                                .head_dim_v = a.head_dim, .dtype = t, .options = {.num_threads = a.threads},
                                .scheme = s, .cp_inner = inner});
        const OverheadTimes tm = time_overhead(comm, attn, o, a.repeats);
        SimInput in{.cu_seqlens = cu,
                    .model = {.num_heads_q = a.heads, .num_heads_k = a.kv_heads, .head_dim_qk = a.head_dim,
                              .head_dim_v = a.head_dim, .dtype = t},
                    .mesh = {.cp = cp, .cp_inner = inner},
                    .profile = p,
                    .find_breakeven = false};
        in.profile.fwd_gflops[di] = c.fwd_flops() / tm.kernel_fwd / 1e9;  // the bare kernels' rates, this repeat's
        in.profile.bwd_gflops[di] = c.bwd_flops() / tm.kernel_bwd / 1e9;
        const auto call_at = [&](double x, bool backward) {
          (backward ? in.profile.bwd_overhead : in.profile.fwd_overhead)[di][static_cast<std::size_t>(s)] = x;
          const SchemePrediction pr = simulate_scheme(in, s);
          double slowest = 0;
          for (const SimCall& call : backward ? pr.backward : pr.forward) slowest = std::max(slowest, call.time_s());
          return slowest;
        };
        const double model_fwd = call_at(0, false), model_bwd = call_at(0, true);
        const double fo = fit_overhead([&](double x) { return call_at(x, false); }, tm.cp_fwd);
        const double bo = fit_overhead([&](double x) { return call_at(x, true); }, tm.cp_bwd);
        p.fwd_overhead[di][static_cast<std::size_t>(s)] = fo;
        p.bwd_overhead[di][static_cast<std::size_t>(s)] = bo;
        overheads.push_back({{"dtype", to_string(t)}, {"scheme", to_string(s)}, {"cp_inner", inner},
                             {"measured_fwd_s", tm.cp_fwd}, {"measured_bwd_s", tm.cp_bwd}, {"model_fwd_s", model_fwd},
                             {"model_bwd_s", model_bwd}, {"fwd", fo}, {"bwd", bo},
                             {"kernel_fwd_gflops", in.profile.fwd_gflops[di]},
                             {"kernel_bwd_gflops", in.profile.bwd_gflops[di]}});
      }
    }
    src << "; cp_overhead: every scheme's forward and backward at cp " << cp << " (hybrid: its largest group the "
        << "heads split over) on its own batch (" << cu.size() - 1 << " documents, " << cu.back()
        << " tokens, document mix seed " << a.overhead_seed << "; median of " << a.repeats << ", slowest rank) "
        << "against the model at the bare kernels' rates on that batch, timed in the same repeats: the fraction of the kernel time that "
        << "meets the measured call (0 when the model is not below it)";
  } else {
    src << "; cp_overhead: not measured (--overhead-tokens 0)";
  }
  check_machine_profile(p);
  if (comm.rank() != 0) return;
  nlohmann::json j = profile_json(p, src.str());
  j["measured"] = {{"kernels", kernels}, {"shifts", links}, {"cp_overhead", overheads}};
  if (!overhead_lengths.empty()) j["measured"]["cp_overhead_lengths"] = overhead_lengths;
  if (!a.out.empty()) {  // whole or not at all
    const std::string text = j.dump(2) + '\n';
    with_flag("--out", [&] { write_file_atomically(a.out, std::as_bytes(std::span(text.data(), text.size()))); });
  }
  if (a.json) {
    std::cout << j.dump() << '\n';
    return;
  }
  std::printf("cpattn calibrate: %s\n", src.str().c_str());
  for (const auto& k : kernels)
    std::printf("  %-5s forward %8.2f GFLOP/s, backward %8.2f GFLOP/s (%s)\n", k["dtype"].get<std::string>().c_str(),
                k["fwd_gflops"].get<double>(), k["bwd_gflops"].get<double>(), k["path"].get<std::string>().c_str());
  for (const auto& o : overheads)
    std::printf("  %-5s %-9s forward %.3f s (model %.3f s): overhead %.3f; backward %.3f s (model %.3f s): %.3f\n",
                o["dtype"].get<std::string>().c_str(), o["scheme"].get<std::string>().c_str(),
                o["measured_fwd_s"].get<double>(), o["model_fwd_s"].get<double>(), o["fwd"].get<double>(),
                o["measured_bwd_s"].get<double>(), o["model_bwd_s"].get<double>(), o["bwd"].get<double>());
  for (const auto& l : links)
    std::printf("  shift %10lld bytes: %10.2f us, %8.3f GB/s\n", static_cast<long long>(l["bytes"].get<int64_t>()),
                l["seconds"].get<double>() * 1e6, l["gbs"].get<double>());
  std::printf("  profile: latency %.2f us, bandwidth %.3f GB/s, %d rank(s) per node, %.1f GB per rank%s%s\n",
              p.intra.latency_us, p.intra.bandwidth_gbs, p.ranks_per_node, p.memory_gb,
              a.out.empty() ? "" : "; written to ", a.out.c_str());
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto a = std::make_shared<SimulateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "simulate", "Predict every CP scheme's step (compute, exposed and hidden communication, pipeline bubble, "
                  "bytes per link class, memory) for a batch on a mesh and a machine profile. See docs/simulate.md.");
  cmd->add_option("--lengths-file", a->lengths_file, "One document length per line ('#' comments)")->check(path_flag());
  cmd->add_option("--lengths", a->lengths, "Document lengths, comma-separated")->delimiter(',')->check(int64_value());
  cmd->add_option("--distribution", a->distribution, "A named length distribution: fixed, uniform or lognormal");
  cmd->add_option("--tokens", a->tokens, "--distribution: tokens of the batch")->capture_default_str();
  cmd->add_option("--mean-length", a->mean_length, "--distribution: mean document length")->capture_default_str();
  cmd->add_option("--sigma", a->sigma, "--distribution lognormal: sigma of log(length)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "--distribution: seed")->capture_default_str();
  cmd->add_option("--cp", a->cp, "Context-parallel size")->required();
  cmd->add_option("--cp-inner", a->cp_inner, "The hybrid's all-to-all group, dividing --cp (default: the largest "
                                             "divisor whose tp x group ranks fit a node)");
  cmd->add_option("--tp", a->tp, "Tensor-parallel size (divides the heads)")->capture_default_str();
  cmd->add_option("--dp", a->dp, "Data-parallel size (identical replicas)")->capture_default_str();
  cmd->add_option("--pp", a->pp, "Pipeline stages")->capture_default_str();
  cmd->add_option("--ep", a->ep, "Expert-parallel size (needs --experts)")->capture_default_str();
  cmd->add_option("--micro-batches", a->micro, "Micro-batches per step, each the given batch")->capture_default_str();
  cmd->add_option("--schedule", a->schedule, "Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1")
      ->capture_default_str();
  cmd->add_option("--virtual", a->virtual_stages,
                  "Model chunks per stage V for --schedule interleaved (default 2; --layers a multiple of --pp x V)")
      ->check(at_least_one());  // (0 is SimMesh's "the default", which the flag must not mean)
  cmd->add_option("--layers", a->layers, "Attention layers of the model (a multiple of --pp, and of --pp x "
                                         "--virtual with interleaved)")->capture_default_str();
  cmd->add_option("--heads", a->heads, "Query heads")->check(at_least_one())->capture_default_str();
  cmd->add_option("--kv-heads", a->kv_heads, "Key/value heads (GQA when fewer than --heads)")
      ->check(at_least_one())->capture_default_str();
  // (each by its own flag: a bad --head-dim-qk was ignored for --head-dim, and a bad --head-dim
  // was named as --head-dim-qk and --head-dim-v)
  cmd->add_option("--head-dim", a->head_dim, "Head dimension of q, k and v")->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--head-dim-qk", a->head_dim_qk, "Head dimension of q and k (MLA), overrides --head-dim")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--head-dim-v", a->head_dim_v, "Head dimension of v (MLA), overrides --head-dim")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--hidden", a->hidden, "Model width (pipeline activations, TP all-reduces, EP tokens; default "
                                         "heads x head-dim-v)");
  cmd->add_option("--dtype", a->dtype, "Storage type: fp32, fp16 or bf16 (or float32, float16, bfloat16)")
      ->transform(dtype_transformer())->capture_default_str();
  cmd->add_option("--mask", a->mask, "causal or none")->transform(mask_transformer())->capture_default_str();
  cmd->add_option("--experts", a->experts, "MoE experts per layer (0: dense)")->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "Experts per token")->capture_default_str();
  cmd->add_option("--expert-skew", a->expert_skew, "Router skew s: expert e gets a share 1/(e+1)^s")
      ->capture_default_str();
  cmd->add_option("--profile", a->profile, "Machine profile JSON (cpattn calibrate, examples/profiles/; default: "
                                           "the nominal gpu-8x-nvlink-400g)")->check(path_flag());
  cmd->add_option("--overlap", a->overlap, "All-gather scheme: on models its overlap by KV-head groups (cpattn "
                                         "run's default), off one all-gather, one kernel call, one reduce-scatter")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--svg", a->svg, "Write a plot of predicted step time against CP size, per scheme")->check(path_flag());
  cmd->add_flag("--no-breakeven", a->no_breakeven, "Skip the sweeps for where CP stops paying");
  cmd->add_flag("--json", a->json, "Print one JSON object");
  cmd->callback([a] { run_simulate(*a); });
}

void add_calibrate_command(CLI::App& app) {
  auto a = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate", "Measure this machine into a profile for simulate: attention kernel GFLOP/s by dtype, and (under "
                   "mpirun -np 2 or more) ring-shift latency and bandwidth by message size. See docs/simulate.md.");
  cmd->add_option("--out", a->out, "Write the profile JSON here")->check(path_flag());
  cmd->add_option("--name", a->name, "The profile's name")->capture_default_str();
  cmd->add_option("--seq-len", a->seq_len, "Kernel case: one causal document of this many tokens")
      ->check(at_least_one())->capture_default_str();
  cmd->add_option("--lengths", a->lengths, "Kernel case: these document lengths instead (e.g. a batch to predict)")
      ->delimiter(',')->check(int64_value());
  cmd->add_option("--heads", a->heads, "Kernel case: query heads")->check(at_least_one())->capture_default_str();
  cmd->add_option("--kv-heads", a->kv_heads, "Kernel case: key/value heads")->check(at_least_one())
      ->capture_default_str();
  cmd->add_option("--head-dim", a->head_dim, "Kernel case: head dimension")->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "Kernel threads per rank")->check(at_least_one())->capture_default_str();
  cmd->add_option("--repeats", a->repeats, "Timed kernel runs per direction (median)")->check(at_least_one())
      ->capture_default_str();
  cmd->add_option("--dtypes", a->dtypes, "Dtypes to measure, comma-separated")->delimiter(',')->capture_default_str();
  cmd->add_option("--sizes", a->sizes, "Message sizes in bytes, comma-separated")->delimiter(',')->capture_default_str();
  cmd->add_option("--iters", a->iters, "Timed shifts per size (latency: the smallest size's fastest; bandwidth: the largest's median)")->capture_default_str();
  cmd->add_flag("--json", a->json, "Print the profile as one JSON object");
  cmd->add_option("--overhead-tokens", a->overhead_tokens, "CP overhead: tokens per rank of its own batch (every "
                  "scheme's forward and backward against the model; 0 skips it)")->check(CLI::Range(int64_t{0}, int64_t{1} << 16))
      ->capture_default_str();
  cmd->add_option("--overhead-seed", a->overhead_seed, "CP overhead: the seed of its batch's document mix")
      ->capture_default_str();
  add_timeout_option(cmd, a->timeout);
  cmd->callback([a] { run_calibrate(*a); });
}

}  // namespace cpattn::cli
