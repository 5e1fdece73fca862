// The expert-parallel MoE layer at ep = the world size, against the single-process layer
// (itself checked against float64 in test_moe.cpp) run on every rank's tokens as its groups:
// forward and backward, capacity drops, empty experts, skewed routing, bad arguments and
// ranks that disagree.
#include <cpattn/comm.hpp>
#include <cpattn/error.hpp>
#include <cpattn/moe_ep.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "moe/moe_cases.hpp"
#include "moe/moe_naive.hpp"
#include "mpi_world.hpp"

namespace cpattn {
namespace {

using moe_test::MoeCase;
using moe_test::random_values;

Communicator world() {
  return Communicator(MPI_COMM_WORLD, {.timeout_s = 30, .on_timeout = TimeoutAction::throw_error});
}

// |a - b| <= rel * max|b| everywhere.
void expect_close(std::span<const float> a, std::span<const float> b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double scale = 0;
  for (const float v : b) scale = std::max(scale, std::abs(static_cast<double>(v)));
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_NEAR(a[i], b[i], 1e-5 * std::max(scale, 1e-30)) << what << "[" << i << "]";
}

template <class T>
std::span<const T> part(const std::vector<T>& v, std::int64_t first, std::int64_t count, std::int64_t each) {
  return std::span(v).subspan(static_cast<std::size_t>(first * each), static_cast<std::size_t>(count * each));
}

// Runs case `c` both ways and compares; the router weights may be rigged by `rig`.
void check_against_single_process(const MoeCase& c, const std::function<void(MoeWeights&, std::vector<float>&)>& rig = {}) {
  Communicator comm = world();
  const int rank = comm.rank(), ep = comm.size();
  const std::int64_t D = c.cfg.hidden, T = c.tokens();
  MoeWeights all = moe_init_weights(c.cfg, 17);
  std::vector<float> x = random_values(static_cast<std::size_t>(T * D), 19);
  if (rig) rig(all, x);
  const std::vector<float> dy = random_values(x.size(), 23);
  const MoeForward ref = moe_forward(c.cfg, all, x, c.groups);
  const MoeGrads ref_g = moe_backward(c.cfg, all, x, ref, dy);

  MoeEpLayer layer(comm, c.cfg);
  const MoeWeights mine = moe_slice_experts(all, layer.first_expert(), layer.local_experts());
  const std::int64_t begin = std::accumulate(c.groups.begin(), c.groups.begin() + rank, std::int64_t{0});
  const std::int64_t n = c.groups[static_cast<std::size_t>(rank)];
  const auto x_mine = part(x, begin, n, D);
  const MoeEpForward f = layer.forward(mine, x_mine);
  const MoeEpBackward b = layer.backward(mine, x_mine, f, part(dy, begin, n, D));

  expect_close(f.y, part(ref.y, begin, n, D), "y");
  EXPECT_TRUE(std::equal(f.y.begin(), f.y.end(), ref.y.begin() + begin * D)) << "y bitwise";
  EXPECT_NEAR(f.aux_loss, ref.aux_loss, 1e-12);
  EXPECT_EQ(f.routing.kept, ref.routing[static_cast<std::size_t>(rank)].kept);
  expect_close(b.grads.dx, part(ref_g.dx, begin, n, D), "dx");
  const std::int64_t m = D * c.cfg.ffn;
  expect_close(b.grads.w_gate, part(ref_g.w_gate, layer.first_expert(), layer.local_experts(), m), "w_gate");
  expect_close(b.grads.w_up, part(ref_g.w_up, layer.first_expert(), layer.local_experts(), m), "w_up");
  expect_close(b.grads.w_down, part(ref_g.w_down, layer.first_expert(), layer.local_experts(), m), "w_down");
  // The router's gradient is each rank's share: summed over ranks it is the whole one.
  std::vector<float> router = b.grads.router;
  comm.all_reduce<float>(router, ReduceOp::sum);
  expect_close(router, ref_g.router, "router");

  const MoeLoadReport rep = layer.report(f, b);
  std::vector<std::int64_t> routed(static_cast<std::size_t>(c.cfg.num_experts), 0);
  std::int64_t dropped = 0;
  for (const MoeRouting& r : ref.routing) {
    for (std::size_t e = 0; e < routed.size(); ++e) routed[e] += r.routed[e];
    dropped += r.dropped;
  }
  EXPECT_EQ(rep.routed_per_expert, routed);
  EXPECT_EQ(rep.dropped, dropped);
  EXPECT_EQ(c.drops, dropped > 0) << "the case table says whether this case drops";
  EXPECT_EQ(std::accumulate(rep.tokens_per_rank.begin(), rep.tokens_per_rank.end(), std::int64_t{0}),
            T * c.cfg.top_k - dropped);
  ASSERT_EQ(rep.bytes_sent.size(), static_cast<std::size_t>(ep));
  // Forward: the counts ((ep - 1) * local experts int64), then each remote row once each way
  // (x out, o back); the backward moves the same rows again (d_out out, d_x back).
  std::int64_t out_rows = 0, in_rows = 0;
  for (int q = 0; q < ep; ++q)
    if (q != rank) {
      out_rows += f.send_counts[static_cast<std::size_t>(q)];
      in_rows += f.recv_counts[static_cast<std::size_t>(q)];
    }
  const std::int64_t row_bytes = D * static_cast<std::int64_t>(sizeof(float));
  const std::int64_t counts_bytes = (ep - 1) * layer.local_experts() * static_cast<std::int64_t>(sizeof(std::int64_t));
  EXPECT_EQ(f.bytes_sent, counts_bytes + (out_rows + in_rows) * row_bytes);
  EXPECT_EQ(f.bytes_received, counts_bytes + (in_rows + out_rows) * row_bytes);
  EXPECT_EQ(b.bytes_sent, (out_rows + in_rows) * row_bytes);
  EXPECT_EQ(rep.bytes_sent[static_cast<std::size_t>(rank)], f.bytes_sent + b.bytes_sent);
}

class MoeEpCaseTest : public testing::TestWithParam<MoeCase> {};

TEST_P(MoeEpCaseTest, EqualsSingleProcess) { check_against_single_process(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, MoeEpCaseTest, testing::ValuesIn(moe_test::ep_cases(mpi_test::world_size())),
                         [](const auto& p) { return p.param.name; });

// Feature 0 of every token is 1 and drives the router towards `expert` by +20: every token
// picks it first.
void route_all_to(MoeWeights& w, std::vector<float>& x, int D, int E, int expert) {
  for (std::size_t t = 0; t < x.size() / static_cast<std::size_t>(D); ++t) x[t * static_cast<std::size_t>(D)] = 1;
  w.router[static_cast<std::size_t>(expert)] = 20;
  (void)E;
}

TEST(MoeEp, AllTokensToOneExpertLeavesTheOthersEmpty) {
  const int ep = mpi_test::world_size();
  const MoeCase c{"all_to_last", moe_test::moe_config(2 * ep, 1), moe_test::rank_groups(ep), false};
  check_against_single_process(c, [&](MoeWeights& w, std::vector<float>& x) {
    route_all_to(w, x, c.cfg.hidden, c.cfg.num_experts, c.cfg.num_experts - 1);
  });
}

TEST(MoeEp, AllTokensToOneExpertOverCapacity) {
  const int ep = mpi_test::world_size();
  const MoeCase c{"all_to_first_capped", moe_test::with_capacity(moe_test::moe_config(ep, 1), 1.0, MoeDropPolicy::by_probability),
                  moe_test::rank_groups(ep), ep > 1};
  check_against_single_process(c, [&](MoeWeights& w, std::vector<float>& x) {
    route_all_to(w, x, c.cfg.hidden, c.cfg.num_experts, 0);
  });
}

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// ---- Routing groups spread over ranks (a sequence split by CP) --------------------------------

// A routing group's tokens over its g ranks: the last rank holds one token (position n / 2),
// the others the rest two by two in turn; odd ranks list theirs backwards (the layer must not
// care about the local order, only the positions).
std::vector<std::int64_t> group_part(std::int64_t n, int g, int j) {
  std::vector<std::int64_t> mine;
  std::int64_t i = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    if (t == n / 2) {
      if (j == g - 1) mine.push_back(t);
      continue;
    }
    if ((i++ / 2) % (g - 1) == j) mine.push_back(t);
  }
  if (j % 2 == 1) std::reverse(mine.begin(), mine.end());
  return mine;
}

// World = groups of g consecutive ranks (each group one sequence of 13 + 4 * index tokens),
// and EP groups of ep consecutive ranks; the layer over both against moe_forward over the
// sequences as groups, their tokens in position order. The layer's aux coefficient is the
// wanted one * ep / world (MoeEpLayer::backward's objective: each group's term once per rank).
void check_spread_groups(MoeConfig cfg, int ep, int g) {
  Communicator comm = world();
  const int W = comm.size(), rank = comm.rank();
  Communicator ep_comm = comm.split(rank / ep, rank), group = comm.split(rank / g, rank);
  Communicator same_experts = comm.split(rank % ep, rank);  // the ranks holding this rank's experts
  const std::int64_t D = cfg.hidden, K = cfg.top_k;
  std::vector<std::int64_t> sizes, first;  // per group: tokens, first row in the reference
  std::int64_t T = 0;
  for (int q = 0; q < W / g; ++q) {
    first.push_back(T);
    sizes.push_back(13 + 4 * q);
    T += sizes.back();
  }
  const MoeWeights all = moe_init_weights(cfg, 31);
  const std::vector<float> x = random_values(static_cast<std::size_t>(T * D), 37), dy = random_values(x.size(), 41);
  const MoeForward ref = moe_forward(cfg, all, x, sizes);
  const MoeGrads ref_g = moe_backward(cfg, all, x, ref, dy);

  const int q = rank / g;
  const std::vector<std::int64_t> pos = group_part(sizes[static_cast<std::size_t>(q)], g, rank % g);
  const auto n = static_cast<std::int64_t>(pos.size());
  std::vector<float> x_mine(static_cast<std::size_t>(n * D)), dy_mine(x_mine.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t row = first[static_cast<std::size_t>(q)] + pos[static_cast<std::size_t>(i)];
    std::copy_n(x.begin() + row * D, D, x_mine.begin() + i * D);
    std::copy_n(dy.begin() + row * D, D, dy_mine.begin() + i * D);
  }
  MoeConfig layer_cfg = cfg;
  layer_cfg.aux_loss_coeff = cfg.aux_loss_coeff * ep / W;
  MoeEpLayer layer(ep_comm, layer_cfg, &group);
  ASSERT_EQ(layer.group_size(), g);
  const MoeWeights w = moe_slice_experts(all, layer.first_expert(), layer.local_experts());
  const MoeEpForward f = layer.forward(w, x_mine, pos);
  const MoeEpBackward b = layer.backward(w, x_mine, f, dy_mine);

  const MoeRouting& rr = ref.routing[static_cast<std::size_t>(q)];
  EXPECT_EQ(f.routing.capacity, rr.capacity);
  EXPECT_EQ(f.routing.group.tokens, rr.tokens);
  EXPECT_EQ(f.routing.group.routed, rr.routed);
  std::vector<float> y_ref(x_mine.size()), dx_ref(x_mine.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t p = pos[static_cast<std::size_t>(i)], row = first[static_cast<std::size_t>(q)] + p;
    std::copy_n(ref.y.begin() + row * D, D, y_ref.begin() + i * D);
    std::copy_n(ref_g.dx.begin() + row * D, D, dx_ref.begin() + i * D);
    for (std::int64_t k = 0; k < K; ++k)
      EXPECT_EQ(f.routing.kept[static_cast<std::size_t>(i * K + k)], rr.kept[static_cast<std::size_t>(p * K + k)])
          << "token at position " << p << ", slot " << k;
  }
  expect_close(f.y, y_ref, "y");
  expect_close(b.grads.dx, dx_ref, "dx");
  // Each group's term is held by its g ranks: the EP groups' aux_loss sum to the wanted one.
  std::vector<double> aux{f.aux_loss / ep};
  comm.all_reduce<double>(aux, ReduceOp::sum);
  EXPECT_NEAR(aux[0], ref.aux_loss, 1e-12 * std::max(1.0, ref.aux_loss));
  std::vector<std::int64_t> dropped{f.routing.dropped};
  comm.all_reduce<std::int64_t>(dropped, ReduceOp::sum);
  std::int64_t ref_dropped = 0;
  for (const MoeRouting& r : ref.routing) ref_dropped += r.dropped;
  EXPECT_EQ(dropped[0], ref_dropped);
  if (cfg.capacity_factor) {
    EXPECT_GT(ref_dropped, 0) << "the capacity must drop for this test to mean anything";
  }
  std::vector<float> router = b.grads.router;
  comm.all_reduce<float>(router, ReduceOp::sum);
  expect_close(router, ref_g.router, "router");
  const std::int64_t m = D * cfg.ffn;
  for (auto [mine, whole, what] : {std::tuple{b.grads.w_gate, &ref_g.w_gate, "w_gate"},
                                   std::tuple{b.grads.w_up, &ref_g.w_up, "w_up"},
                                   std::tuple{b.grads.w_down, &ref_g.w_down, "w_down"}}) {
    same_experts.all_reduce<float>(mine, ReduceOp::sum);
    expect_close(mine, part(*whole, layer.first_expert(), layer.local_experts(), m), what);
  }
}

// (ep, g) pairs dividing the world, g > 1: cp = g, EP inside a group, equal to it or spanning
// several (dp x cp x ep), and ep = 1.
std::vector<std::pair<int, int>> spread_shapes(int W) {
  std::vector<std::pair<int, int>> v;
  for (int ep = 1; ep <= W; ++ep)
    for (int g = 2; g <= W; ++g)
      if (W % ep == 0 && W % g == 0) v.emplace_back(ep, g);
  return v;
}

TEST(MoeEpGroup, SpreadGroupEqualsOneProcessWithCapacityAndAux) {
  const int W = mpi_test::world_size();
  if (W == 1) GTEST_SKIP() << "a group spread over ranks needs two";
  for (const MoeDropPolicy policy : {MoeDropPolicy::by_position, MoeDropPolicy::by_probability})
    for (const auto& [ep, g] : spread_shapes(W)) {
      SCOPED_TRACE(cat("ep ", ep, ", group of ", g, " ranks, policy ", static_cast<int>(policy)));
      MoeConfig cfg = moe_test::with_capacity(moe_test::moe_config(2 * W, 2), 1.0, policy);
      cfg.aux_loss_coeff = 0.01;
      check_spread_groups(cfg, ep, g);
    }
}

TEST(MoeEpGroup, SpreadGroupAuxLossWithoutCapacityAndTopKEqualsE) {
  const int W = mpi_test::world_size();
  if (W == 1) GTEST_SKIP() << "a group spread over ranks needs two";
  for (const auto& [ep, g] : spread_shapes(W)) {
    SCOPED_TRACE(cat("ep ", ep, ", group of ", g, " ranks"));
    MoeConfig cfg = moe_test::moe_config(W, W);  // every expert for every token
    cfg.aux_loss_coeff = 0.5;
    check_spread_groups(cfg, ep, g);
  }
}

TEST(MoeEpGroup, BadPositionsOnOneRankFailEveryRank) {
  const int W = mpi_test::world_size();
  if (W == 1) GTEST_SKIP() << "a group spread over ranks needs two";
  Communicator comm = world();
  Communicator alone = comm.split(comm.rank(), 0);  // ep = 1: only the group links the ranks
  const MoeConfig cfg = moe_test::with_capacity(moe_test::moe_config(2, 1), 1.0, MoeDropPolicy::by_position);
  const MoeWeights w = moe_init_weights(cfg, 3);
  const std::vector<float> x = random_values(static_cast<std::size_t>(3 * cfg.hidden), 5);
  std::vector<std::int64_t> pos{3 * comm.rank(), 3 * comm.rank() + 1, 3 * comm.rank() + 2};
  if (comm.rank() == W - 1) pos.pop_back();
  std::string msg = "no error";
  try {
    MoeEpLayer layer(alone, cfg, &comm);
    (void)layer.forward(w, x, pos);
  } catch (const Error& e) {
    msg = e.message();
  }
  EXPECT_NE(msg.find(cat("[rank ", W - 1, "] moe forward: with a routing group (and a capacity factor or the aux "
                         "loss), positions must hold one value in 0..", moe_max_position(1), " per token (3), got 2 values")), std::string::npos) << msg;
}

// Groups {0, 1} and {2, 3}, EP across them ({0, 2} and {1, 3}: a layout of the test's own, EP
// strided over the groups), bad positions on rank 0 alone: every rank throws the same message
// (ranks 2 and 3 passed their group's agreement and waited in the EP one until the timeout).
TEST(MoeEpGroup, BadPositionsInOneGroupFailTheOtherGroups) {
  if (mpi_test::world_size() != 4) GTEST_SKIP() << "two groups of two ranks need four";
  Communicator comm = world();
  Communicator group = comm.split(comm.rank() / 2, comm.rank());
  Communicator ep = comm.split(comm.rank() % 2, comm.rank());
  const MoeConfig cfg = moe_test::with_capacity(moe_test::moe_config(2, 1), 1.0, MoeDropPolicy::by_position);
  const MoeWeights all = moe_init_weights(cfg, 3);
  std::string msg = "no error";
  try {
    MoeEpLayer layer(ep, cfg, &group);
    const MoeWeights mine = moe_slice_experts(all, layer.first_expert(), layer.local_experts());
    const std::vector<float> x = random_values(static_cast<std::size_t>(3 * cfg.hidden), 5 + comm.rank());
    std::vector<std::int64_t> pos{3 * group.rank(), 3 * group.rank() + 1, 3 * group.rank() + 2};
    if (comm.rank() == 0) pos[1] = -1;
    (void)layer.forward(mine, x, pos);
  } catch (const Error& e) {
    msg = e.message();
  }
  EXPECT_NE(msg.find("[rank 0] moe forward: with a routing group"), std::string::npos) << msg;
  const unsigned long h = std::hash<std::string>{}(msg);
  unsigned long lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UNSIGNED_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UNSIGNED_LONG, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi) << "ranks saw different messages; this one: " << msg;
}

// The same message on every rank (hashes compared with plain MPI), containing `part`.
void expect_same_error_everywhere(const MoeConfig& cfg, const std::string& part) {
  Communicator comm = world();
  std::string msg = "no error";
  try {
    MoeEpLayer layer(comm, cfg);
  } catch (const Error& e) {
    msg = e.message();
  }
  EXPECT_NE(msg.find(part), std::string::npos) << msg;
  const unsigned long h = std::hash<std::string>{}(msg);
  unsigned long lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UNSIGNED_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UNSIGNED_LONG, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi) << "ranks saw different messages; this one: " << msg;
}

TEST(MoeEp, RejectsBadArgumentsOnEveryRank) {
  const int ep = mpi_test::world_size();
  expect_same_error_everywhere(moe_test::moe_config(ep, ep + 1), "top_k must be in 1..num_experts");
  expect_same_error_everywhere(moe_test::with_capacity(moe_test::moe_config(ep, 1), 0.0, MoeDropPolicy::by_position),
                               "capacity_factor must be finite and > 0");
  if (ep > 1)
    expect_same_error_everywhere(moe_test::moe_config(ep + 1, 1), cat("the EP size ", ep, " must divide num_experts = ", ep + 1));
}

TEST(MoeEp, OneRankWithBadArgumentsFailsEveryRank) {
  const int ep = mpi_test::world_size();
  MoeConfig cfg = moe_test::moe_config(ep, 1);
  if (mpi_test::world_rank() == ep - 1) cfg.top_k = 0;
  expect_same_error_everywhere(cfg, cat("[rank ", ep - 1, "] moe: top_k must be in 1..num_experts"));
}

TEST(MoeEp, RanksThatDisagreeFailTogether) {
  const int ep = mpi_test::world_size();
  if (ep == 1) GTEST_SKIP() << "needs two ranks";
  MoeConfig cfg = moe_test::moe_config(2 * ep, 1);
  if (mpi_test::world_rank() == 0) cfg.num_experts = ep;
  expect_same_error_everywhere(cfg, cat("num_experts: rank 0 has ", ep));
  cfg = moe_test::moe_config(2 * ep, 1);
  if (mpi_test::world_rank() == 1) cfg.top_k = 2;
  expect_same_error_everywhere(cfg, "top_k: ");
}

}  // namespace
}  // namespace cpattn
