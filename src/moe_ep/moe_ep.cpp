// The expert-parallel MoE layer (include/cpattn/moe_ep.hpp): moe.hpp's routing, experts and
// combine, with the rows carried between ranks by all_to_all_v.
#include <cpattn/error.hpp>
#include <cpattn/moe_ep.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <numeric>
#include <string>

namespace cpattn {

namespace {

using std::int64_t;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Adds the seconds since `start` to `phase` and restarts the clock.
void lap(double& start, double& phase) {
  const double t = now_s();
  phase += t - start;
  start = t;
}

std::int64_t bits(double v) { return std::bit_cast<std::int64_t>(v); }

std::string local_error(const auto& check) {
  try {
    check();
  } catch (const Error& e) {
    return e.message();
  }
  return {};
}

std::vector<int64_t> scaled(std::span<const int64_t> counts, int64_t by) {
  std::vector<int64_t> v(counts.begin(), counts.end());
  for (int64_t& c : v) c *= by;
  return v;
}

// Rows each rank's block of experts gets: sums of `per_expert` over blocks of `local`.
std::vector<int64_t> block_sums(std::span<const int64_t> per_expert, int local) {
  std::vector<int64_t> v(per_expert.size() / static_cast<std::size_t>(local), 0);
  for (std::size_t e = 0; e < per_expert.size(); ++e) v[e / static_cast<std::size_t>(local)] += per_expert[e];
  return v;
}

double max_over_mean(std::span<const int64_t> v) {
  const double sum = static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0}));
  if (sum == 0) return 1;
  return static_cast<double>(*std::max_element(v.begin(), v.end())) / (sum / static_cast<double>(v.size()));
}

// agree() over the routing group (when there is one), then over the EP group with the group's
// failure as each of its ranks' error: an error on one rank of a group reaches its whole group
// and every EP group of those ranks (with EP across the groups, every rank). The group's
// agreement alone threw on the group's ranks only, and the other groups' ranks waited in the EP
// agreement for them until the timeout.
void agree_group_then_ep(Communicator* group, Communicator& ep, const Fingerprint& fp, const std::string& what,
                         const std::string& err) {
  std::string merged = err;
  if (group) {
    try {
      agree(*group, fp, what + " (routing group)", err);
    } catch (const Error& e) {
      merged = e.message();
    }
  }
  agree(ep, fp, what, merged);
}

}  // namespace

MoeEpLayer::MoeEpLayer(Communicator& comm, const MoeConfig& cfg, Communicator* group)
    : comm_(&comm), group_(group && group->size() > 1 ? group : nullptr), cfg_(cfg) {
  const int ep = comm.size();
  const std::string err = local_error([&] {
    moe_validate(cfg);
    CPATTN_CHECK(cfg.num_experts % ep == 0, "moe: the EP size ", ep, " must divide num_experts = ",
                 cfg.num_experts);
  });
  Fingerprint fp;
  fp.add("hidden", cfg.hidden)
      .add("ffn", cfg.ffn)
      .add("num_experts", cfg.num_experts)
      .add("top_k", cfg.top_k)
      .add("router", static_cast<int64_t>(cfg.router))
      .add("capacity_factor", cfg.capacity_factor ? bits(*cfg.capacity_factor) : -1)
      .add("drop_policy", static_cast<int64_t>(cfg.drop_policy))
      .add("aux_loss_coeff", bits(cfg.aux_loss_coeff))
      .add("bias_update_rate", bits(cfg.bias_update_rate));
  agree_group_then_ep(group_, comm, fp, "moe layer", err);
  local_ = cfg.num_experts / ep;
  first_ = comm.rank() * local_;
}

MoeRouting MoeEpLayer::route_in_group(const MoeWeights& w, std::span<const float> x,
                                      std::span<const int64_t> positions) {
  const int64_t D = cfg_.hidden, E = cfg_.num_experts;
  MoeRouting r = moe_route_tokens(cfg_, w, x, static_cast<int64_t>(x.size()) / D);
  // The group's figures: its tokens and routed counts, and the scores' sums, over its ranks.
  std::vector<int64_t> counts(r.group.routed);
  counts.push_back(r.group.tokens);
  group_->all_reduce<int64_t>(counts, ReduceOp::sum);
  r.group.tokens = counts.back();
  r.group.routed.assign(counts.begin(), counts.begin() + E);
  group_->all_reduce<double>(r.group.score_sum, ReduceOp::sum);
  if (!cfg_.capacity_factor) return r;
  // Every part's assignments (key, expert and weight bits), in group rank order; each rank
  // decides over all of them as one process does and keeps its own slice.
  const std::vector<MoeAssignment> mine = moe_assignments(r, positions);
  std::vector<int64_t> packed(2 * mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    packed[2 * i] = mine[i].key;
    packed[2 * i + 1] = (static_cast<int64_t>(mine[i].expert) << 32) |
                        static_cast<int64_t>(std::bit_cast<std::uint32_t>(mine[i].weight));
  }
  const std::vector<int64_t> sizes = group_->all_gather_counts(static_cast<int64_t>(packed.size()));
  std::vector<int64_t> all_packed(static_cast<std::size_t>(std::accumulate(sizes.begin(), sizes.end(), int64_t{0})));
  group_->all_gather_v<int64_t>(packed, sizes, all_packed);
  std::vector<MoeAssignment> all(all_packed.size() / 2);
  for (std::size_t i = 0; i < all.size(); ++i) {
    const int64_t v = all_packed[2 * i + 1];
    all[i] = {.key = all_packed[2 * i], .expert = static_cast<std::int32_t>(v >> 32),
              .weight = std::bit_cast<float>(static_cast<std::uint32_t>(v & 0xffffffff))};
  }
  const int64_t capacity = moe_capacity(cfg_, r.group.tokens);
  const std::vector<std::uint8_t> kept = moe_keep(cfg_, all, capacity);
  const int64_t at = std::accumulate(sizes.begin(), sizes.begin() + group_->rank(), int64_t{0}) / 2;
  moe_set_kept(cfg_, r, capacity, std::span(kept).subspan(static_cast<std::size_t>(at), mine.size()));
  return r;
}

MoeEpForward MoeEpLayer::forward(const MoeWeights& w, std::span<const float> x, std::span<const int64_t> positions) {
  const int64_t D = cfg_.hidden;
  // The routing group takes part only when it decides something (the constructor agreed on
  // cfg over it, so its ranks choose alike).
  const bool grouped = group_ && (cfg_.capacity_factor || cfg_.aux_loss_coeff > 0);
  const std::string err = local_error([&] {
    CPATTN_CHECK(x.size() % static_cast<std::size_t>(D) == 0, "moe forward: x must be [tokens, hidden = ", D,
                 "], got ", x.size(), " values");
    const int64_t max_position = moe_max_position(cfg_.top_k);
    CPATTN_CHECK(!grouped || (positions.size() == x.size() / static_cast<std::size_t>(D) &&
                             std::ranges::all_of(positions, [&](int64_t p) { return p >= 0 && p <= max_position; })),
                 "moe forward: with a routing group (and a capacity factor or the aux loss), positions must hold "
                 "one value in 0..", max_position, " per token (",
                 x.size() / static_cast<std::size_t>(D), "), got ", positions.size(), " values");
    CPATTN_CHECK(w.first_expert == first_ && w.local_experts == local_, "moe forward: this rank holds experts [",
                 first_, ", ", first_ + local_, "), the weights hold [", w.first_expert, ", ",
                 w.first_expert + w.local_experts, ")");
    moe_check_weights(cfg_, w);
  });
  agree_group_then_ep(grouped ? group_ : nullptr, *comm_, Fingerprint{}, "moe forward", err);
  MoeEpForward f;
  double clock = now_s();
  f.routing = grouped ? route_in_group(w, x, positions) : moe_route(cfg_, w, x, static_cast<int64_t>(x.size()) / D);
  const std::vector<float> rows = moe_dispatch_rows(f.routing, x, cfg_.hidden);
  if (cfg_.aux_loss_coeff > 0) {
    // Every rank's group's term gathered and summed in rank order, as the single-process layer
    // sums its groups' terms.
    std::vector<double> terms(static_cast<std::size_t>(comm_->size()));
    const double mine = moe_aux_term(cfg_, f.routing);
    comm_->all_gather<double>(std::span(&mine, 1), terms);
    for (const double t : terms) f.aux_loss += t;
    f.aux_loss *= cfg_.aux_loss_coeff / static_cast<double>(comm_->size());
  }
  lap(clock, f.times.routing);

  const int64_t sent0 = comm_->bytes_sent(), received0 = comm_->bytes_received();
  // Rows per (source rank, local expert): each rank's expert_counts, block q sent to rank q.
  const std::vector<int64_t> per_rank(static_cast<std::size_t>(comm_->size()), local_);
  f.experts.counts.resize(static_cast<std::size_t>(cfg_.num_experts));
  comm_->all_to_all_v<int64_t>(f.routing.expert_counts, per_rank, f.experts.counts, per_rank);
  f.send_counts = block_sums(f.routing.expert_counts, local_);
  f.recv_counts = block_sums(f.experts.counts, local_);
  f.experts.rows.resize(static_cast<std::size_t>(std::accumulate(f.recv_counts.begin(), f.recv_counts.end(), int64_t{0}) * D));
  comm_->all_to_all_v<float>(rows, scaled(f.send_counts, D), f.experts.rows, scaled(f.recv_counts, D));
  lap(clock, f.times.dispatch);

  const std::vector<float> out = moe_experts_forward(cfg_, w, f.experts);
  lap(clock, f.times.experts);

  f.out.resize(rows.size());
  comm_->all_to_all_v<float>(out, scaled(f.recv_counts, D), f.out, scaled(f.send_counts, D));
  f.bytes_sent = comm_->bytes_sent() - sent0;
  f.bytes_received = comm_->bytes_received() - received0;
  f.y = moe_combine(f.routing, f.out, cfg_.hidden);
  lap(clock, f.times.combine);
  return f;
}

MoeEpBackward MoeEpLayer::backward(const MoeWeights& w, std::span<const float> x, const MoeEpForward& f,
                                   std::span<const float> dy) {
  const int64_t D = cfg_.hidden;
  const std::string err = local_error([&] {
    CPATTN_CHECK(dy.size() == f.y.size() && x.size() == f.y.size(), "moe backward: x and dy must be [tokens, hidden] like y (",
                 f.y.size(), " values), got ", x.size(), " and ", dy.size());
    CPATTN_CHECK(w.first_expert == first_ && w.local_experts == local_, "moe backward: this rank holds experts [",
                 first_, ", ", first_ + local_, "), the weights hold [", w.first_expert, ", ",
                 w.first_expert + w.local_experts, ")");
    moe_check_weights(cfg_, w);
  });
  agree(*comm_, Fingerprint{}, "moe backward", err);
  MoeEpBackward b{.grads = moe_zero_grads(cfg_, w, f.routing.tokens), .times = {}};
  double clock = now_s();
  std::vector<float> d_weight;
  const std::vector<float> d_out = moe_combine_backward(f.routing, f.out, dy, cfg_.hidden, d_weight);
  lap(clock, b.times.combine);

  const int64_t sent0 = comm_->bytes_sent(), received0 = comm_->bytes_received();
  std::vector<float> d_expert_out(f.experts.rows.size());
  comm_->all_to_all_v<float>(d_out, scaled(f.send_counts, D), d_expert_out, scaled(f.recv_counts, D));
  lap(clock, b.times.dispatch);

  const std::vector<float> d_rows = moe_experts_backward(cfg_, w, f.experts, d_expert_out, b.grads);
  lap(clock, b.times.experts);

  std::vector<float> d_home(d_out.size());
  comm_->all_to_all_v<float>(d_rows, scaled(f.recv_counts, D), d_home, scaled(f.send_counts, D));
  b.bytes_sent = comm_->bytes_sent() - sent0;
  b.bytes_received = comm_->bytes_received() - received0;
  lap(clock, b.times.combine);

  moe_add_dispatched(f.routing, d_home, cfg_.hidden, b.grads.dx);
  // The group's term is counted once per rank of the group (backward's objective).
  moe_router_backward(cfg_, w, f.routing, x, d_weight,
                      cfg_.aux_loss_coeff / static_cast<double>(comm_->size()) * group_size(), b.grads.dx, b.grads);
  lap(clock, b.times.routing);
  return b;
}

MoeLoadReport MoeEpLayer::report(const MoeEpForward& f, const MoeEpBackward& b) {
  const int ep = comm_->size();
  MoeLoadReport r;
  const int64_t bytes[2] = {f.bytes_sent + b.bytes_sent, f.bytes_received + b.bytes_received};
  std::vector<int64_t> all_bytes(static_cast<std::size_t>(2 * ep));
  comm_->all_gather<int64_t>(bytes, all_bytes);
  for (int q = 0; q < ep; ++q) {
    r.bytes_sent.push_back(all_bytes[static_cast<std::size_t>(2 * q)]);
    r.bytes_received.push_back(all_bytes[static_cast<std::size_t>(2 * q + 1)]);
  }
  r.routed_per_expert = f.routing.routed;
  comm_->all_reduce<int64_t>(r.routed_per_expert, ReduceOp::sum);
  r.kept_per_expert = f.routing.expert_counts;
  comm_->all_reduce<int64_t>(r.kept_per_expert, ReduceOp::sum);
  r.tokens_per_rank = block_sums(r.kept_per_expert, local_);
  r.dropped = std::accumulate(r.routed_per_expert.begin(), r.routed_per_expert.end(), int64_t{0}) -
              std::accumulate(r.kept_per_expert.begin(), r.kept_per_expert.end(), int64_t{0});
  r.imbalance = max_over_mean(r.routed_per_expert);
  r.rank_imbalance = max_over_mean(r.tokens_per_rank);
  const auto& tf = f.times;
  const auto& tb = b.times;
  const double mine[8] = {tf.routing, tf.dispatch, tf.experts, tf.combine,
                          tb.routing, tb.dispatch, tb.experts, tb.combine};
  std::vector<double> all(static_cast<std::size_t>(8 * ep));
  comm_->all_gather<double>(mine, all);
  for (int q = 0; q < ep; ++q) {
    const double* t = &all[static_cast<std::size_t>(8 * q)];
    r.forward.push_back({t[0], t[1], t[2], t[3]});
    r.backward.push_back({t[4], t[5], t[6], t[7]});
  }
  return r;
}

}  // namespace cpattn
