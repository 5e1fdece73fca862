// The single-process MoE layer against the naive float64 layer (moe_naive.hpp), its
// gradients against finite differences of that layer, hand-worked routing and drops, the bias
// rule and the argument checks.
#include <cpattn/error.hpp>
#include <cpattn/moe.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "moe/moe_cases.hpp"
#include "moe/moe_naive.hpp"

namespace cpattn {
namespace {

using moe_test::naive_moe;
using moe_test::random_values;

// sum(dy * y) + aux of the naive layer: the loss whose gradient moe_backward computes.
double naive_loss(const MoeConfig& c, const MoeWeights& w, std::span<const float> x,
                  std::span<const std::int64_t> groups, std::span<const float> dy) {
  const moe_test::NaiveResult r = naive_moe(c, w, x, groups);
  double l = r.aux;
  for (std::size_t i = 0; i < dy.size(); ++i) l += dy[i] * r.y[i];
  return l;
}

double max_abs(std::span<const float> v) {
  double m = 0;
  for (const float x : v) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

class MoeCaseTest : public testing::TestWithParam<moe_test::MoeCase> {};

TEST_P(MoeCaseTest, ForwardMatchesNaiveFloat64) {
  const moe_test::MoeCase& c = GetParam();
  const MoeWeights w = moe_init_weights(c.cfg, 7);
  const std::vector<float> x = random_values(static_cast<std::size_t>(c.tokens() * c.cfg.hidden), 11);
  const MoeForward f = moe_forward(c.cfg, w, x, c.groups);
  const moe_test::NaiveResult ref = naive_moe(c.cfg, w, x, c.groups);
  double scale = 0;
  for (const double v : ref.y) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < ref.y.size(); ++i) ASSERT_NEAR(f.y[i], ref.y[i], 1e-5 * scale) << "y[" << i << "]";
  EXPECT_NEAR(f.aux_loss, ref.aux, 1e-6 * std::max(1.0, ref.aux));
  std::vector<int> kept;
  std::int64_t dropped = 0;
  for (const MoeRouting& r : f.routing) {
    kept.insert(kept.end(), r.kept.begin(), r.kept.end());
    dropped += r.dropped;
  }
  EXPECT_EQ(kept, ref.kept);
  EXPECT_EQ(dropped, std::count(ref.kept.begin(), ref.kept.end(), 0));
  EXPECT_EQ(c.drops, dropped > 0) << "the case table says whether this case drops";
}

TEST_P(MoeCaseTest, GradientsMatchFiniteDifferences) {
  const moe_test::MoeCase& c = GetParam();
  MoeWeights w = moe_init_weights(c.cfg, 7);
  std::vector<float> x = random_values(static_cast<std::size_t>(c.tokens() * c.cfg.hidden), 11);
  const std::vector<float> dy = random_values(x.size(), 13);
  const MoeForward f = moe_forward(c.cfg, w, x, c.groups);
  const MoeGrads g = moe_backward(c.cfg, w, x, f, dy);
  // Central differences in float64 on a few entries of every tensor (the float perturbation
  // as actually stored).
  const auto check = [&](std::vector<float>& v, const std::vector<float>& grad, const char* name) {
    const double scale = std::max(1e-2, max_abs(grad));
    for (std::size_t i = 0; i < v.size(); i += std::max<std::size_t>(1, v.size() / 7)) {
      const float keep = v[i];
      v[i] = keep + 1e-3f;
      const double hi = v[i], lp = naive_loss(c.cfg, w, x, c.groups, dy);
      v[i] = keep - 1e-3f;
      const double lo = v[i], lm = naive_loss(c.cfg, w, x, c.groups, dy);
      v[i] = keep;
      EXPECT_NEAR(grad[i], (lp - lm) / (hi - lo), 2e-3 * scale) << name << "[" << i << "]";
    }
  };
  check(x, g.dx, "dx");
  check(w.router, g.router, "router");
  check(w.w_gate, g.w_gate, "w_gate");
  check(w.w_up, g.w_up, "w_up");
  check(w.w_down, g.w_down, "w_down");
}

TEST_P(MoeCaseTest, Deterministic) {
  const moe_test::MoeCase& c = GetParam();
  const MoeWeights w = moe_init_weights(c.cfg, 3);
  const std::vector<float> x = random_values(static_cast<std::size_t>(c.tokens() * c.cfg.hidden), 5);
  const MoeForward a = moe_forward(c.cfg, w, x, c.groups), b = moe_forward(c.cfg, w, x, c.groups);
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(moe_backward(c.cfg, w, x, a, x).router, moe_backward(c.cfg, w, x, b, x).router);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeCaseTest, testing::ValuesIn(moe_test::single_process_cases()),
                         [](const auto& p) { return p.param.name; });

// moe.hpp's promise, which expert parallelism's bitwise equality rests on: a token's output
// and input gradient do not depend on which other tokens share the experts' products (how
// many rows an expert gets, where the row sits in the blocks). Each token alone against the
// same token in a batch of 23 (experts get 4-row blocks and rows left over), bitwise.
TEST(Moe, ExpertRowsAreBitwiseTheSameInAnyBatch) {
  const MoeConfig cfg = moe_test::wide_config();
  const std::int64_t D = cfg.hidden, T = 23;
  const MoeWeights w = moe_init_weights(cfg, 9);
  const std::vector<float> x = random_values(static_cast<std::size_t>(T * D), 10), dy = random_values(x.size(), 12);
  const MoeForward all = moe_forward(cfg, w, x, {});
  const MoeGrads g_all = moe_backward(cfg, w, x, all, dy);
  for (std::int64_t t = 0; t < T; ++t) {
    const auto row = [&](const std::vector<float>& v) {
      return std::span(v).subspan(static_cast<std::size_t>(t * D), static_cast<std::size_t>(D));
    };
    const MoeForward one = moe_forward(cfg, w, row(x), {});
    const MoeGrads g_one = moe_backward(cfg, w, row(x), one, row(dy));
    EXPECT_TRUE(std::ranges::equal(one.y, row(all.y))) << "y of token " << t;
    EXPECT_TRUE(std::ranges::equal(g_one.dx, row(g_all.dx))) << "dx of token " << t;
  }
}

// The Switch loss alone (dy = 0): its router gradient against finite differences.
TEST(Moe, AuxLossGradientMatchesFiniteDifferences) {
  const MoeConfig cfg{.hidden = 6, .ffn = 4, .num_experts = 5, .top_k = 2, .aux_loss_coeff = 0.3};
  MoeWeights w = moe_init_weights(cfg, 21);
  const std::vector<float> x = random_values(6 * 9, 22);
  const std::vector<float> dy(x.size(), 0.0f);
  const std::int64_t groups[] = {4, 5};
  const MoeForward f = moe_forward(cfg, w, x, groups);
  EXPECT_GT(f.aux_loss, 0.3 * 0.5);  // E * sum f P >= 1 by Cauchy-Schwarz when balanced-ish
  const MoeGrads g = moe_backward(cfg, w, x, f, dy);
  const double scale = max_abs(g.router);
  ASSERT_GT(scale, 0);
  for (std::size_t i = 0; i < w.router.size(); ++i) {
    const float keep = w.router[i];
    w.router[i] = keep + 1e-3f;
    const double hi = w.router[i], lp = naive_loss(cfg, w, x, groups, dy);
    w.router[i] = keep - 1e-3f;
    const double lo = w.router[i], lm = naive_loss(cfg, w, x, groups, dy);
    w.router[i] = keep;
    EXPECT_NEAR(g.router[i], (lp - lm) / (hi - lo), 1e-3 * scale) << "router[" << i << "]";
  }
  for (const float v : g.w_gate) EXPECT_EQ(v, 0.0f);  // the aux loss does not reach the experts
}

// Hand-worked: router = identity, tokens (0.1,0) (2,0) (1,0) (0,1): the first three pick
// expert 0 (by probability t1 > t2 > t0), the last expert 1. Capacity ceil(0.5 * 4 / 2) = 1.
MoeWeights identity_router(const MoeConfig& cfg) {
  MoeWeights w = moe_init_weights(cfg, 1);
  w.router = {1, 0, 0, 1};
  return w;
}

TEST(Moe, DropByPositionKeepsTheFirstTokens) {
  const MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 2, .top_k = 1, .capacity_factor = 0.5};
  const MoeWeights w = identity_router(cfg);
  const std::vector<float> x = {0.1f, 0, 2, 0, 1, 0, 0, 1};
  const MoeRouting r = moe_route(cfg, w, x, 4);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 0, 0, 1}));
  EXPECT_EQ(r.capacity, 1);
  EXPECT_EQ(r.kept, (std::vector<std::uint8_t>{1, 0, 0, 1}));
  EXPECT_EQ(r.dropped, 2);
  EXPECT_EQ(r.order, (std::vector<std::int64_t>{0, 3}));
  const MoeForward f = moe_forward(cfg, w, x, {});
  for (int d = 0; d < 2; ++d) {  // dropped tokens get exactly zero
    EXPECT_EQ(f.y[2 + d], 0.0f);
    EXPECT_EQ(f.y[4 + d], 0.0f);
  }
}

TEST(Moe, DropByProbabilityKeepsTheLikeliest) {
  const MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 2, .top_k = 1, .capacity_factor = 0.5,
                      .drop_policy = MoeDropPolicy::by_probability};
  const MoeRouting r = moe_route(cfg, identity_router(cfg), std::vector<float>{0.1f, 0, 2, 0, 1, 0, 0, 1}, 4);
  EXPECT_EQ(r.kept, (std::vector<std::uint8_t>{0, 1, 0, 1}));
  EXPECT_EQ(r.routed, (std::vector<std::int64_t>{3, 1}));
  EXPECT_EQ(r.expert_counts, (std::vector<std::int64_t>{1, 1}));
  // Softmax of (2, 0): p = 1 / (1 + e^-2).
  EXPECT_FLOAT_EQ(r.weight[1], 1.0f / (1.0f + std::exp(-2.0f)));
}

// The bias selects but does not weigh: with a large bias on expert 1 every token picks it,
// and the weights are the chosen sigmoids renormalized.
TEST(Moe, SigmoidBiasSelectsWithTheBiasAndWeighsWithoutIt) {
  const MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 3, .top_k = 2, .router = MoeRouter::sigmoid_bias};
  MoeWeights w = moe_init_weights(cfg, 1);
  w.router = {1, 0, 0, 0, 1, 0};  // logits (x0, x1, 0)
  w.bias = {0, 0, 5};
  const MoeRouting r = moe_route(cfg, w, std::vector<float>{2, 1}, 1);
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{2, 0}));
  const float s0 = 1 / (1 + std::exp(-2.0f)), s2 = 0.5f;
  EXPECT_FLOAT_EQ(r.weight[0], s2 / (s0 + s2));
  EXPECT_FLOAT_EQ(r.weight[1], s0 / (s0 + s2));
}

// Every chosen sigmoid 0 (logits below about -104): the weights are 0 and the gradients
// finite, where 0 / 0 made both NaN.
TEST(Moe, SigmoidBiasWithEveryChosenScoreZeroWeighsZero) {
  const MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 3, .top_k = 2, .router = MoeRouter::sigmoid_bias};
  MoeWeights w = moe_init_weights(cfg, 1);
  w.router = {-100, -100, -100, -100, -100, -100};  // logits -200 on every expert
  const std::vector<float> x = {1, 1};
  const MoeRouting r = moe_route(cfg, w, x, 1);
  ASSERT_EQ(r.scores[0], 0.0f);  // the case itself: the sigmoid underflows to 0
  EXPECT_EQ(r.weight, (std::vector<float>{0, 0}));
  const MoeForward f = moe_forward(cfg, w, x, {});
  EXPECT_EQ(f.y, (std::vector<float>{0, 0}));
  const MoeGrads g = moe_backward(cfg, w, x, f, std::vector<float>{1, -1});
  for (const std::vector<float>* t : {&g.dx, &g.router, &g.w_gate, &g.w_up, &g.w_down})
    for (const float v : *t) EXPECT_TRUE(std::isfinite(v));
}

// The capacity: ceil(C * T_g * K / E), a value within 1e-9 of an integer taken as it (in doubles
// 1.1 * 100 * 2 / 4 is 55.000000000000007), and no more than every assignment (a factor of
// 1e300 overflowed the conversion to int64).
TEST(Moe, CapacityIsTheCeilingOfTheExactProduct) {
  MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 4, .top_k = 2};
  EXPECT_EQ(moe_capacity(cfg, 100), -1);
  const auto capacity = [&](double c, std::int64_t tokens) {
    cfg.capacity_factor = c;
    return moe_capacity(cfg, tokens);
  };
  ASSERT_GT(1.1 * 200.0 / 4, 55.0);  // the rounding the rule corrects
  EXPECT_EQ(capacity(1.1, 100), 55);
  EXPECT_EQ(capacity(1.25, 10), 7);   // 6.25
  EXPECT_EQ(capacity(1.0, 3), 2);     // 1.5
  EXPECT_EQ(capacity(0.01, 1), 1);    // 0.005
  EXPECT_EQ(capacity(1.0001, 2000), 1001);  // 1000.1: above by far more than the rounding
  EXPECT_EQ(capacity(4.0, 10), 20);   // exactly every assignment
  EXPECT_EQ(capacity(1e300, 10), 20);
  EXPECT_EQ(capacity(1.0, 0), 0);
}

// A position whose key (position * top_k + slot) would overflow int64 is refused, naming the
// limit (the drops and ties went by a wrapped key).
TEST(Moe, AssignmentsRefuseAPositionPastTheKeyRange) {
  const MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 2, .top_k = 2};
  const MoeRouting r = moe_route(cfg, moe_init_weights(cfg, 1), std::vector<float>{1, 2}, 1);
  const std::int64_t last = moe_max_position(2);
  EXPECT_EQ(last, (INT64_MAX - 1) / 2);
  const std::vector<MoeAssignment> a = moe_assignments(r, std::vector<std::int64_t>{last});
  EXPECT_EQ(a[1].key, INT64_MAX);
  try {
    (void)moe_assignments(r, std::vector<std::int64_t>{last + 1});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("positions must be in 0.."), std::string::npos) << e.message();
  }
}

// The weights' shapes are checked, each tensor named: an empty bias was read past its end by the
// sigmoid router, and a short x by the backward.
TEST(Moe, RejectsWeightsAndInputsOfTheWrongShape) {
  const MoeConfig cfg{.hidden = 2, .ffn = 3, .num_experts = 2, .top_k = 1, .router = MoeRouter::sigmoid_bias};
  MoeWeights w = moe_init_weights(cfg, 1);
  EXPECT_NO_THROW(moe_check_weights(cfg, w));
  MoeWeights bad = w;
  bad.bias.clear();
  try {
    moe_check_weights(cfg, bad);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "moe weights: router must be [D, E] = [2, 2] and bias [E], got 4 and 0 values");
  }
  EXPECT_THROW(moe_forward(cfg, bad, std::vector<float>{1, 2}, {}), Error);
  const std::vector<float> x = {1, 2, 3, 4};
  const MoeForward f = moe_forward(cfg, w, x, {});
  try {
    (void)moe_backward(cfg, w, std::vector<float>{1, 2}, f, std::vector<float>(4, 1.0f));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "moe_backward: x and dy must be [tokens, hidden] like y (4 values), got 2 and 4");
  }
  EXPECT_THROW(moe_backward(cfg, bad, x, f, std::vector<float>(4, 1.0f)), Error);
}

TEST(Moe, BiasRuleMovesTowardsTheMeanLoad) {
  const MoeConfig cfg{.hidden = 1, .ffn = 1, .num_experts = 4, .top_k = 1, .router = MoeRouter::sigmoid_bias,
                      .bias_update_rate = 0.25};
  std::vector<float> bias = {0, 0, 1, 0};
  const std::int64_t load[] = {5, 1, 3, 3};  // mean 3
  moe_update_bias(cfg, bias, load);
  EXPECT_EQ(bias, (std::vector<float>{-0.25f, 0.25f, 1, 0}));
}

std::string error_of(const MoeConfig& cfg) {
  try {
    moe_validate(cfg);
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

TEST(Moe, RejectsBadArguments) {
  const MoeConfig ok{.hidden = 4, .ffn = 4, .num_experts = 4, .top_k = 2};
  EXPECT_EQ(error_of(ok), "no error");
  MoeConfig c = ok;
  c.top_k = 5;
  EXPECT_EQ(error_of(c), "moe: top_k must be in 1..num_experts = 4, got 5");
  c = ok;
  c.capacity_factor = 0.0;
  EXPECT_EQ(error_of(c), "moe: capacity_factor must be finite and > 0, got 0");
  c = ok;
  c.capacity_factor = -1.0;
  EXPECT_NE(error_of(c).find("capacity_factor must be finite and > 0"), std::string::npos);
  c.capacity_factor = std::numeric_limits<double>::infinity();
  EXPECT_EQ(error_of(c), "moe: capacity_factor must be finite and > 0, got inf");
  c = ok;
  c.router = MoeRouter::sigmoid_bias;
  c.aux_loss_coeff = 0.1;
  EXPECT_NE(error_of(c).find("aux_loss_coeff needs the softmax router"), std::string::npos);
  const MoeWeights w = moe_init_weights(ok, 1);
  EXPECT_THROW(moe_forward(ok, w, std::vector<float>(4 * 3), std::vector<std::int64_t>{2}), Error);
}

}  // namespace
}  // namespace cpattn
