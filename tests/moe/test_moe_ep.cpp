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
                               "capacity_factor must be > 0");
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
