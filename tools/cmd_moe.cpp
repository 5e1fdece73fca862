// `cpattn moe`: the expert-parallel MoE layer (include/cpattn/moe_ep.hpp) on a seeded batch
// under mpirun, checked against the single-process layer, with its load report.
//   mpirun -np 2 cpattn moe --experts 8 --top-k 2 --ep 2 [--capacity-factor 1.25] [--json]
// Every rank builds the whole batch and runs the single-process layer on it (the reference),
// then compares its own rows; the verdict is agreed over all ranks.
#include <cpattn/comm.hpp>
#include <cpattn/error.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/moe_ep.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "commands.hpp"
#include "vocab.hpp"

namespace cpattn::cli {

namespace {

struct MoeArgs {
  int experts = 0, top_k = 1, ep = 1;
  std::optional<double> capacity_factor;
  std::string drop_policy = "position";
  std::string router = "softmax";
  double skew = 0;
  double aux_loss_coeff = 0;
  int balance_steps = 0;
  int64_t tokens = 256;  // per rank
  int hidden = 64, ffn = 128;
  uint64_t seed = 1;
  int repeats = 1;
  std::optional<double> timeout;  // --timeout (unset: CPATTN_COMM_TIMEOUT_S, else 300 s)
  bool json = false;
};

constexpr double kTolerance = 1e-5;  // max relative error of every tensor against one process

// The flags' own rules, named by flag.
MoeConfig config_of(const MoeArgs& a, int world) {
  CPATTN_CHECK(a.ep == world, "--ep ", a.ep, " must equal the number of MPI ranks (", world,
               "): launch with mpirun -np ", a.ep);
  CPATTN_CHECK(a.experts >= 1, "--experts must be >= 1, got ", a.experts);
  CPATTN_CHECK(a.top_k >= 1 && a.top_k <= a.experts, "--top-k must be in 1..--experts = ", a.experts, ", got ",
               a.top_k);
  CPATTN_CHECK(a.experts % a.ep == 0, "--ep ", a.ep, " must divide --experts ", a.experts);
  check_router_flags(a.capacity_factor, a.aux_loss_coeff, a.router);
  CPATTN_CHECK(a.tokens >= 0 && a.hidden >= 1 && a.ffn >= 1, "--tokens must be >= 0, --hidden and --ffn >= 1");
  CPATTN_CHECK(std::isfinite(a.skew) && std::abs(a.skew) <= 1e4, "--skew must be in [-10000, 10000] (logits that "
               "large already route every token alike; past the float range they made the router NaN), got ", a.skew);
  CPATTN_CHECK(a.repeats >= 1 && a.balance_steps >= 0, "--repeats must be >= 1 and --balance-steps >= 0");
  CPATTN_CHECK(a.balance_steps == 0 || a.router == "sigmoid-bias", "--balance-steps needs --router sigmoid-bias");
  return {.hidden = a.hidden,
          .ffn = a.ffn,
          .num_experts = a.experts,
          .top_k = a.top_k,
          .router = a.router == "softmax" ? MoeRouter::softmax : MoeRouter::sigmoid_bias,
          .capacity_factor = a.capacity_factor,
          .drop_policy = a.drop_policy == "position" ? MoeDropPolicy::by_position : MoeDropPolicy::by_probability,
          .aux_loss_coeff = a.aux_loss_coeff};
}

// The whole batch [ep * tokens, hidden] from the seed, uniform in [-1, 1). With a skew,
// feature 0 is 1 on every token and the router adds skew * (E - 1 - e) / (E - 1) to expert
// e's logit through it: expert 0 is favoured most, the last expert not at all.
std::vector<float> make_batch(const MoeArgs& a, const MoeConfig& cfg, MoeWeights& w) {
  std::mt19937_64 rng(a.seed * 7919 + 1);
  std::vector<float> x(static_cast<std::size_t>(a.ep * a.tokens * a.hidden));
  for (float& v : x) v = static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0);
  if (a.skew != 0) {
    for (std::size_t t = 0; t < x.size(); t += static_cast<std::size_t>(a.hidden)) x[t] = 1;
    const int E = cfg.num_experts;
    for (int e = 0; e < E; ++e)
      w.router[static_cast<std::size_t>(e)] = static_cast<float>(a.skew * (E == 1 ? 1.0 : double(E - 1 - e) / (E - 1)));
  }
  return x;
}

// max |got - want| / max |want|; infinite where either side holds a NaN or an infinity (the
// check fails: std::max would keep its old value past a NaN).
double rel_error(std::span<const float> got, std::span<const float> want) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) return HUGE_VAL;
    err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return scale > 0 ? err / scale : err;
}

struct CheckResult {
  double y = 0, dx = 0, router = 0, experts = 0;  // max over ranks of the relative errors
  double max() const { return std::max({y, dx, router, experts}); }
};

template <class T>
std::span<const T> rows(const std::vector<T>& v, int64_t first, int64_t count, int64_t width) {
  return std::span(v).subspan(static_cast<std::size_t>(first * width), static_cast<std::size_t>(count * width));
}

// Runs the sigmoid-bias router's balancing rule `steps` times: a forward, the load of the
// whole batch (summed over ranks), one moe_update_bias step, on every rank alike.
void balance(Communicator& comm, MoeEpLayer& layer, MoeWeights& mine, std::span<const float> x, int steps) {
  for (int s = 0; s < steps; ++s) {
    std::vector<int64_t> load = layer.forward(mine, x).routing.routed;
    comm.all_reduce<int64_t>(load, ReduceOp::sum);
    moe_update_bias(layer.config(), mine.bias, load);
  }
}

// The EP layer against the single-process one on this rank's rows (the router gradient
// summed over ranks first); errors are maxima over ranks.
CheckResult check(Communicator& comm, const MoeConfig& cfg, const MoeWeights& all, std::span<const float> x,
                  std::span<const float> dy, const MoeEpLayer& layer, const MoeEpForward& f, const MoeEpBackward& b) {
  const int64_t D = cfg.hidden, n = f.routing.tokens, first = n * comm.rank();
  const std::vector<int64_t> groups(static_cast<std::size_t>(comm.size()), n);
  const MoeForward ref = moe_forward(cfg, all, x, groups);
  const MoeGrads g = moe_backward(cfg, all, x, ref, dy);
  std::vector<float> router = b.grads.router;
  comm.all_reduce<float>(router, ReduceOp::sum);
  const int64_t m = D * cfg.ffn;
  const auto expert_rows = [&](const std::vector<float>& v) {
    return rows(v, layer.first_expert(), layer.local_experts(), m);
  };
  std::vector<double> e = {rel_error(f.y, rows(ref.y, first, n, D)), rel_error(b.grads.dx, rows(g.dx, first, n, D)),
                           rel_error(router, g.router),
                           std::max({rel_error(b.grads.w_gate, expert_rows(g.w_gate)),
                                     rel_error(b.grads.w_up, expert_rows(g.w_up)),
                                     rel_error(b.grads.w_down, expert_rows(g.w_down))})};
  comm.all_reduce<double>(e, ReduceOp::max);
  return {e[0], e[1], e[2], e[3]};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Each phase's median over the repeats.
MoePhaseTimes median_times(const std::vector<MoePhaseTimes>& runs) {
  const auto phase = [&](double MoePhaseTimes::*p) {
    std::vector<double> v;
    for (const MoePhaseTimes& t : runs) v.push_back(t.*p);
    return median(v);
  };
  return {phase(&MoePhaseTimes::routing), phase(&MoePhaseTimes::dispatch), phase(&MoePhaseTimes::experts),
          phase(&MoePhaseTimes::combine)};
}

nlohmann::json times_json(const MoePhaseTimes& t) {
  return {{"routing_s", t.routing}, {"dispatch_s", t.dispatch}, {"experts_s", t.experts}, {"combine_s", t.combine}};
}

nlohmann::json report_json(const MoeArgs& a, const MoeLoadReport& r, const CheckResult& c, double aux_loss) {
  nlohmann::json ranks = nlohmann::json::array();
  for (std::size_t q = 0; q < r.tokens_per_rank.size(); ++q)
    ranks.push_back({{"rank", q}, {"tokens", r.tokens_per_rank[q]}, {"bytes_sent", r.bytes_sent[q]},
                     {"bytes_received", r.bytes_received[q]}, {"forward", times_json(r.forward[q])},
                     {"backward", times_json(r.backward[q])}});
  return {{"experts", a.experts}, {"top_k", a.top_k}, {"ep", a.ep}, {"router", a.router},
          {"capacity_factor", a.capacity_factor ? nlohmann::json(*a.capacity_factor) : nlohmann::json()},
          {"drop_policy", a.drop_policy}, {"skew", a.skew}, {"tokens_per_rank_input", a.tokens},
          {"hidden", a.hidden}, {"ffn", a.ffn}, {"seed", a.seed}, {"repeats", a.repeats},
          {"balance_steps", a.balance_steps}, {"aux_loss", aux_loss},
          {"check", {{"y", c.y}, {"dx", c.dx}, {"router", c.router}, {"experts", c.experts},
                     {"tolerance", kTolerance}, {"pass", c.max() <= kTolerance}}},
          {"routed_per_expert", r.routed_per_expert}, {"kept_per_expert", r.kept_per_expert},
          {"imbalance", r.imbalance}, {"rank_imbalance", r.rank_imbalance}, {"dropped", r.dropped},
          {"ranks", ranks}};
}

void print_report(const MoeArgs& a, const MoeLoadReport& r, const CheckResult& c, double aux_loss) {
  std::printf("cpattn moe: %d experts, top-%d, ep %d (%d per rank), %s router, ", a.experts, a.top_k, a.ep,
              a.experts / a.ep, a.router.c_str());
  if (a.capacity_factor)
    std::printf("capacity factor %g (drop by %s)", *a.capacity_factor, a.drop_policy.c_str());
  else
    std::printf("no capacity");
  std::printf(", skew %g\n  %lld tokens per rank, hidden %d, ffn %d, seed %llu, %d repeat(s)\n", a.skew,
              static_cast<long long>(a.tokens), a.hidden, a.ffn, static_cast<unsigned long long>(a.seed), a.repeats);
  std::printf("check against one process (max relative error, tolerance %g): y %.2e dx %.2e router %.2e experts "
              "%.2e: %s\n",
              kTolerance, c.y, c.dx, c.router, c.experts, c.max() <= kTolerance ? "PASS" : "FAIL");
  if (a.aux_loss_coeff > 0) std::printf("aux loss %.6g\n", aux_loss);
  std::printf("\nexpert  routed  kept\n");
  for (std::size_t e = 0; e < r.routed_per_expert.size(); ++e)
    std::printf("%6zu  %6lld  %4lld\n", e, static_cast<long long>(r.routed_per_expert[e]),
                static_cast<long long>(r.kept_per_expert[e]));
  std::printf("imbalance (max/mean): experts %.3f, ranks %.3f; dropped %lld of %lld assignments\n\n", r.imbalance,
              r.rank_imbalance, static_cast<long long>(r.dropped),
              static_cast<long long>(std::accumulate(r.routed_per_expert.begin(), r.routed_per_expert.end(), int64_t{0})));
  std::printf("rank  tokens  sent KiB  recv KiB | forward ms: routing dispatch experts combine | backward ms: "
              "routing dispatch experts combine\n");
  for (std::size_t q = 0; q < r.tokens_per_rank.size(); ++q) {
    const MoePhaseTimes &f = r.forward[q], &b = r.backward[q];
    std::printf("%4zu  %6lld  %8.1f  %8.1f | %19.3f %8.3f %7.3f %7.3f | %20.3f %8.3f %7.3f %7.3f\n", q,
                static_cast<long long>(r.tokens_per_rank[q]), static_cast<double>(r.bytes_sent[q]) / 1024,
                static_cast<double>(r.bytes_received[q]) / 1024, 1e3 * f.routing, 1e3 * f.dispatch, 1e3 * f.experts,
                1e3 * f.combine, 1e3 * b.routing, 1e3 * b.dispatch, 1e3 * b.experts, 1e3 * b.combine);
  }
}

// What a rank allocates at least, refused with both sizes before anything is when past the
// available memory (the flags alone decide it: the same on every rank). fp32 values: every
// expert's weights (W1, W3: hidden x ffn, W2: ffn x hidden) and the router, held by the
// reference with its gradients and, for this rank's experts, by the layer with theirs; the
// global batch x, dy and the reference's y, dx; each top-k assignment's expert activations
// (3 x ffn + 2 x hidden) for the reference's whole batch and the layer's rows.
void check_moe_memory(const MoeArgs& a) {
  const auto e = static_cast<uint64_t>(a.experts), h = static_cast<uint64_t>(a.hidden);
  const auto f = static_cast<uint64_t>(a.ffn), k = static_cast<uint64_t>(a.top_k);
  const auto local = static_cast<uint64_t>(a.tokens), global = saturating_mul(local, static_cast<uint64_t>(a.ep));
  const uint64_t weights = saturating_mul(saturating_add(saturating_mul(saturating_mul(3, h), f), h), e);
  const uint64_t held = saturating_add(saturating_mul(weights, 2), saturating_mul(weights / static_cast<uint64_t>(a.ep), 2));
  const uint64_t batch = saturating_mul(saturating_mul(global, h), 4);
  const uint64_t per_assignment = saturating_add(saturating_mul(3, f), saturating_mul(2, h));
  const uint64_t activations =
      saturating_mul(saturating_mul(saturating_add(global, saturating_mul(local, 2)), k), per_assignment);
  const uint64_t bytes = saturating_mul(saturating_add(saturating_add(held, batch), activations), sizeof(float));
  check_memory(bytes, "cpattn moe of " + std::to_string(a.tokens) + " tokens per rank",
               "weights and gradients " + format_bytes(saturating_mul(held, sizeof(float))) + ", batch " +
                   format_bytes(saturating_mul(batch, sizeof(float))) + ", expert activations " +
                   format_bytes(saturating_mul(activations, sizeof(float))) + ", per rank");
}

// Returns whether the check passed. Errors are the same on every rank (flags, agree()).
bool run_moe(Communicator& comm, const MoeArgs& a) {
  // (Agreed: the memory check reads each node's own free memory, and a launch may give ranks
  // different flags; a rank failing alone left the others in the layer's agreement until the
  // timeout.)
  MoeConfig cfg;
  on_every_rank(comm, [&] {
    cfg = config_of(a, comm.size());
    check_moe_memory(a);
  });
  MoeEpLayer layer(comm, cfg);
  MoeWeights all = moe_init_weights(cfg, a.seed);
  const std::vector<float> x_all = make_batch(a, cfg, all);
  std::mt19937_64 rng(a.seed * 104729 + 3);
  std::vector<float> dy_all(x_all.size());
  for (float& v : dy_all) v = static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0);
  MoeWeights mine = moe_slice_experts(all, layer.first_expert(), layer.local_experts());
  const auto x = rows(x_all, a.tokens * comm.rank(), a.tokens, a.hidden);
  const auto dy = rows(dy_all, a.tokens * comm.rank(), a.tokens, a.hidden);
  balance(comm, layer, mine, x, a.balance_steps);
  all.bias = mine.bias;  // the reference routes with the balanced bias too

  std::vector<MoePhaseTimes> fwd, bwd;
  MoeEpForward f;
  MoeEpBackward b;
  for (int i = 0; i < a.repeats; ++i) {
    comm.barrier();  // every rank starts each pass together, so that waits are the imbalance's
    f = layer.forward(mine, x);
    b = layer.backward(mine, x, f, dy);
    fwd.push_back(f.times);
    bwd.push_back(b.times);
  }
  f.times = median_times(fwd);
  b.times = median_times(bwd);
  const MoeLoadReport rep = layer.report(f, b);
  const CheckResult c = check(comm, cfg, all, x_all, dy_all, layer, f, b);
  if (comm.rank() == 0) {
    if (a.json)
      std::cout << report_json(a, rep, c, f.aux_loss).dump() << std::endl;
    else
      print_report(a, rep, c, f.aux_loss);
  }
  return c.max() <= kTolerance;
}

void run(const MoeArgs& a) {
  const MpiSession mpi;  // finalizes only what it initialized
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = a.timeout, .timeout_name = "--timeout"});
  bool pass = false;
  try {
    pass = run_moe(comm, a);
  } catch (const Error& e) {
    // The same on every rank: rank 0 prints it; the barrier keeps the launcher from ending
    // rank 0 before it has.
    if (comm.rank() == 0) std::fprintf(stderr, "cpattn: error: %s\n", e.message().c_str());
    std::fflush(stderr);
    comm.barrier();
    throw ExitCode{2};
  }
  if (!pass) throw ExitCode{1};
}

}  // namespace

void check_router_flags(const std::optional<double>& capacity_factor, double aux_loss_coeff,
                        const std::string& router) {
  CPATTN_CHECK(!capacity_factor || (std::isfinite(*capacity_factor) && *capacity_factor > 0),
               "--capacity-factor must be finite and > 0, got ", capacity_factor.value_or(0));
  CPATTN_CHECK(std::isfinite(aux_loss_coeff) && aux_loss_coeff >= 0, "--aux-loss-coeff must be finite and >= 0, got ",
               aux_loss_coeff);
  CPATTN_CHECK(aux_loss_coeff == 0 || router == "softmax",
               "--aux-loss-coeff needs --router softmax (sigmoid-bias balances by its bias instead)");
}

void add_moe_command(CLI::App& app) {
  auto a = std::make_shared<MoeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "moe",
      "The expert-parallel mixture-of-experts layer (top-k router, SwiGLU experts over the ranks, two "
      "all-to-alls) on a seeded batch, forward and backward, checked against one process, with its load "
      "report. Launch with mpirun -np EP. See docs/moe.md.");
  cmd->add_option("--experts", a->experts, "Experts E (divisible by --ep)")->required();
  cmd->add_option("--top-k", a->top_k, "Experts per token K (1..E)")->capture_default_str();
  cmd->add_option("--ep", a->ep, "Expert-parallel size: the number of MPI ranks")->capture_default_str();
  cmd->add_option("--capacity-factor", a->capacity_factor,
                  "Capacity per expert: ceil(C * tokens per rank * K / E); unset: no capacity");
  cmd->add_option("--drop-policy", a->drop_policy, "Which assignments over capacity are dropped")
      ->check(CLI::IsMember({"position", "probability"}))
      ->capture_default_str();
  cmd->add_option("--router", a->router, "softmax (top-k of softmax) or sigmoid-bias (auxiliary-loss-free)")
      ->check(CLI::IsMember({"softmax", "sigmoid-bias"}))
      ->capture_default_str();
  cmd->add_option("--skew", a->skew, "Router bias towards low experts: + S * (E-1-e)/(E-1) on expert e's logit")
      ->capture_default_str();
  cmd->add_option("--aux-loss-coeff", a->aux_loss_coeff, "Weight of the Switch load-balancing loss (softmax)")
      ->capture_default_str();
  cmd->add_option("--balance-steps", a->balance_steps,
                  "sigmoid-bias: forwards that update the bias from the load before the measured one")
      ->capture_default_str();
  cmd->add_option("--tokens", a->tokens, "Tokens per rank")->capture_default_str();
  cmd->add_option("--hidden", a->hidden, "Hidden size H")->capture_default_str();
  cmd->add_option("--ffn", a->ffn, "Each expert's SwiGLU width F")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of the batch and the weights")->capture_default_str();
  cmd->add_option("--repeats,--repeat", a->repeats, "Forward+backward passes timed (medians reported; --repeat: the same, its older spelling)")->capture_default_str();
  add_timeout_option(cmd, a->timeout);
  cmd->add_flag("--json", a->json, "Print the report as one JSON object");
  cmd->callback([a] { run(*a); });
}

}  // namespace cpattn::cli
