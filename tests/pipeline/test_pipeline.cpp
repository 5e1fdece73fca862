// Pipeline schedules against hand-worked tables, and the simulator's invariants
// (include/cpattn/pipeline.hpp).
#include <cpattn/error.hpp>
#include <cpattn/pipeline.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace cpattn {
namespace {

constexpr PipelineSchedule kAll[] = {PipelineSchedule::fill_drain, PipelineSchedule::gpipe,
                                     PipelineSchedule::one_f_one_b, PipelineSchedule::interleaved,
                                     PipelineSchedule::zb_h1};

// The tick table as the overview writes it: "tick 0: [F0, idle, idle]".
std::vector<std::string> rows(const Schedule& s) {
  std::vector<std::string> out;
  const TickTable t = tick_table(s);
  const bool chunks = s.spec.virtual_stages > 1;
  for (std::size_t i = 0; i < t.size(); ++i) {
    std::string row = "tick ";
    row += std::to_string(i);
    row += ": [";
    for (std::size_t st = 0; st < t[i].size(); ++st) {
      if (st) row += ", ";
      row += t[i][st] ? action_label(*t[i][st], chunks) : std::string("idle");
    }
    row += ']';
    out.push_back(row);
  }
  return out;
}

Schedule make(PipelineSchedule kind, int stages, int micro, int v = 1) {
  return make_schedule({.stages = stages, .micro = micro, .schedule = kind, .virtual_stages = v});
}

std::string error_of(const PipelineSpec& spec) {
  try {
    (void)make_schedule(spec);
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

// The overview's table, verbatim (with F for its "mb"): 6 ticks, utilization 2/3.
TEST(Pipeline, FillDrainIsTheOverviewsTable) {
  const Schedule s = make(PipelineSchedule::fill_drain, 3, 4);
  EXPECT_EQ(rows(s), (std::vector<std::string>{
                         "tick 0: [F0, idle, idle]",
                         "tick 1: [F1, F0, idle]",
                         "tick 2: [F2, F1, F0]",
                         "tick 3: [F3, F2, F1]",
                         "tick 4: [idle, F3, F2]",
                         "tick 5: [idle, idle, F3]",
                     }));
  const Simulation sim = simulate(s, uniform_costs(3, 1, 0, 0));
  EXPECT_EQ(sim.makespan, 6);
  EXPECT_DOUBLE_EQ(sim.utilization, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(sim.bubble_fraction, 1.0 / 3.0);
  EXPECT_EQ(sim.peak_activations, (std::vector<int>{1, 1, 1}));
}

// GPipe, S = 2, M = 3, worked by hand: all forwards, then B0 B1 B2.
TEST(Pipeline, GPipeTable) {
  const Schedule s = make(PipelineSchedule::gpipe, 2, 3);
  EXPECT_EQ(rows(s), (std::vector<std::string>{
                         "tick 0: [F0, idle]",
                         "tick 1: [F1, F0]",
                         "tick 2: [F2, F1]",
                         "tick 3: [idle, F2]",
                         "tick 4: [idle, B0]",
                         "tick 5: [B0, B1]",
                         "tick 6: [B1, B2]",
                         "tick 7: [B2, idle]",
                     }));
  EXPECT_EQ(simulate(s, uniform_costs(2)).peak_activations, (std::vector<int>{3, 3}));
}

// 1F1B, S = 3, M = 4, worked by hand: stage s warms up with 2-s forwards.
TEST(Pipeline, OneFOneBTable) {
  const Schedule s = make(PipelineSchedule::one_f_one_b, 3, 4);
  EXPECT_EQ(rows(s), (std::vector<std::string>{
                         "tick 0: [F0, idle, idle]",
                         "tick 1: [F1, F0, idle]",
                         "tick 2: [F2, F1, F0]",
                         "tick 3: [idle, idle, B0]",
                         "tick 4: [idle, B0, F1]",
                         "tick 5: [B0, F2, B1]",
                         "tick 6: [F3, B1, F2]",
                         "tick 7: [B1, F3, B2]",
                         "tick 8: [idle, B2, F3]",
                         "tick 9: [B2, idle, B3]",
                         "tick 10: [idle, B3, idle]",
                         "tick 11: [B3, idle, idle]",
                     }));
  EXPECT_EQ(simulate(s, uniform_costs(3)).peak_activations, (std::vector<int>{3, 2, 1}));
}

// Interleaved, S = 2, M = 2, V = 2 (virtual stage = chunk * 2 + stage), worked by hand from
// Megatron's rule: stage 0 warms up with 2*(2-0-1) + (2-1)*2 = 4 forwards (all of them, as M == S).
TEST(Pipeline, InterleavedOrder) {
  const Schedule s = make(PipelineSchedule::interleaved, 2, 2, 2);
  auto labels = [&](int stage) {
    std::vector<std::string> out;
    for (const Action& a : s.actions[static_cast<std::size_t>(stage)])
      out.push_back(action_label(a, true));
    return out;
  };
  const std::vector<std::string> want{"F0.0", "F1.0", "F0.1", "F1.1",
                                      "B0.1", "B1.1", "B0.0", "B1.0"};
  EXPECT_EQ(labels(0), want);
  EXPECT_EQ(labels(1), want);
  EXPECT_EQ(rows(s), (std::vector<std::string>{
                         "tick 0: [F0.0, idle]",
                         "tick 1: [F1.0, F0.0]",
                         "tick 2: [F0.1, F1.0]",
                         "tick 3: [F1.1, F0.1]",
                         "tick 4: [idle, F1.1]",
                         "tick 5: [idle, B0.1]",
                         "tick 6: [B0.1, B1.1]",
                         "tick 7: [B1.1, B0.0]",
                         "tick 8: [B0.0, B1.0]",
                         "tick 9: [B1.0, idle]",
                     }));
  // M = 4: stage 1 warms up with (2-1)*2 = 2 forwards, then pairs.
  const Schedule s4 = make(PipelineSchedule::interleaved, 2, 4, 2);
  std::vector<std::string> stage1;
  for (const Action& a : s4.actions[1]) stage1.push_back(action_label(a, true));
  EXPECT_EQ(stage1, (std::vector<std::string>{"F0.0", "F1.0", "F0.1", "B0.1", "F1.1", "B1.1",
                                              "F2.0", "B0.0", "F3.0", "B1.0", "F2.1", "B2.1",
                                              "F3.1", "B3.1", "B2.0", "B3.0"}));
}

// ZB-H1, S = 2, M = 2: B's come as soon as their gradient does, W's fill the wait.
TEST(Pipeline, ZeroBubbleTable) {
  const Schedule s = make(PipelineSchedule::zb_h1, 2, 2);
  EXPECT_EQ(rows(s), (std::vector<std::string>{
                         "tick 0: [F0, idle]",
                         "tick 1: [F1, F0]",
                         "tick 2: [idle, B0]",
                         "tick 3: [B0, F1]",
                         "tick 4: [W0, B1]",
                         "tick 5: [B1, W0]",
                         "tick 6: [W1, W1]",
                     }));
}

// Every F precedes its B, every B its W; each stage runs one action at a time, in its
// schedule's order; inputs arrive before use; each action appears exactly once.
void check_simulation(const Schedule& s, const PipelineCosts& c) {
  const Simulation sim = simulate(s, c);
  const int S = s.spec.stages, M = s.spec.micro, V = s.spec.virtual_stages;
  const bool forward_only = s.spec.schedule == PipelineSchedule::fill_drain;
  const bool split = s.spec.schedule == PipelineSchedule::zb_h1;
  std::map<std::tuple<int, int, int, int>, TimedAction> at;  // (kind, stage, chunk, micro)
  double busy = 0, last = 0;
  for (int st = 0; st < S; ++st) {
    const auto& tl = sim.timeline[static_cast<std::size_t>(st)];
    ASSERT_EQ(tl.size(), s.actions[static_cast<std::size_t>(st)].size());
    double free = 0;
    for (std::size_t i = 0; i < tl.size(); ++i) {
      EXPECT_EQ(tl[i].action, s.actions[static_cast<std::size_t>(st)][i]);
      EXPECT_GE(tl[i].start, free - 1e-9);
      free = tl[i].end;
      busy += tl[i].end - tl[i].start;
      last = std::max(last, tl[i].end);
      const auto key = std::make_tuple(static_cast<int>(tl[i].action.kind), st, tl[i].action.chunk,
                                       tl[i].action.micro);
      EXPECT_EQ(at.count(key), 0u) << "duplicate action";
      at[key] = tl[i];
    }
  }
  const std::size_t kinds = forward_only ? 1 : split ? 3 : 2;
  EXPECT_EQ(at.size(), kinds * static_cast<std::size_t>(S * M * V));
  auto get = [&](ActionKind k, int vs, int mb) {
    return at.at({static_cast<int>(k), vs % S, vs / S, mb});
  };
  for (int mb = 0; mb < M; ++mb)
    for (int vs = 0; vs < S * V; ++vs) {
      const double tr = (S > 1) ? c.transfer : 0.0;
      const TimedAction f = get(ActionKind::forward, vs, mb);
      if (vs > 0) {
        EXPECT_GE(f.start, get(ActionKind::forward, vs - 1, mb).end + tr - 1e-9);
      }
      if (forward_only) continue;
      const TimedAction b = get(ActionKind::backward, vs, mb);
      EXPECT_GE(b.start, f.end - 1e-9) << "forward after its backward";
      if (vs + 1 < S * V) {
        EXPECT_GE(b.start, get(ActionKind::backward, vs + 1, mb).end + tr - 1e-9);
      }
      if (split) {
        EXPECT_GE(get(ActionKind::weight, vs, mb).start, b.end - 1e-9);
      }
    }
  EXPECT_DOUBLE_EQ(sim.makespan, last);
  EXPECT_NEAR(sim.busy, busy, 1e-9 * std::max(1.0, busy));
  EXPECT_NEAR(sim.bubble_fraction + sim.utilization, 1.0, 1e-12);
  // Memory: what the schedule allows on each stage.
  for (int st = 0; st < S; ++st) {
    const int peak = sim.peak_activations[static_cast<std::size_t>(st)];
    switch (s.spec.schedule) {
      case PipelineSchedule::fill_drain: EXPECT_EQ(peak, 1); break;
      case PipelineSchedule::gpipe: EXPECT_EQ(peak, M); break;
      case PipelineSchedule::one_f_one_b: EXPECT_EQ(peak, std::min(S - st, M)); break;
      case PipelineSchedule::zb_h1: EXPECT_LE(peak, std::min(S, M)); break;
      case PipelineSchedule::interleaved: EXPECT_LE(peak, M * V); break;
    }
  }
}

PipelineCosts random_costs(int stages, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(0.2, 3.0);
  PipelineCosts c = uniform_costs(stages);
  for (int s = 0; s < stages; ++s) {
    c.forward[static_cast<std::size_t>(s)] = u(rng);
    c.backward[static_cast<std::size_t>(s)] = u(rng);
    c.weight[static_cast<std::size_t>(s)] = u(rng);
  }
  c.transfer = u(rng) - 0.2;
  return c;
}

TEST(Pipeline, SimulatorInvariants) {
  std::mt19937 rng(12);
  for (int S = 1; S <= 6; ++S)
    for (int M = 1; M <= 13; ++M)
      for (const PipelineSchedule kind : kAll)
        for (int V = 1; V <= (kind == PipelineSchedule::interleaved ? 3 : 1); ++V) {
          if (kind == PipelineSchedule::interleaved && M % S != 0) continue;
          SCOPED_TRACE(::testing::Message() << pipeline_schedule_name(kind) << " S=" << S
                                            << " M=" << M << " V=" << V);
          const Schedule s = make(kind, S, M, V);
          check_simulation(s, uniform_costs(S));
          check_simulation(s, random_costs(S, rng));
        }
}

TEST(Pipeline, FillDrainMakespanAtUnitCosts) {
  for (int S = 1; S <= 8; ++S)
    for (int M = 1; M <= 16; ++M) {
      const Simulation sim =
          simulate(make(PipelineSchedule::fill_drain, S, M), uniform_costs(S, 1, 1, 1, 0));
      EXPECT_EQ(sim.makespan, S + M - 1);
      EXPECT_NEAR(sim.utilization, static_cast<double>(M) / (S + M - 1), 1e-12);
      EXPECT_EQ(tick_table(make(PipelineSchedule::fill_drain, S, M)).size(),
                static_cast<std::size_t>(S + M - 1));
    }
}

// 1F1B's memory advantage over GPipe, zero bubble's bubble advantage over 1F1B.
TEST(Pipeline, OneFOneBHoldsNoMoreThanGPipeAndZeroBubbleIdlesNoMoreThanOneFOneB) {
  std::mt19937 rng(7);
  for (int S = 1; S <= 8; ++S)
    for (int M = 1; M <= 16; ++M) {
      const Schedule gpipe = make(PipelineSchedule::gpipe, S, M);
      const Schedule ofob = make(PipelineSchedule::one_f_one_b, S, M);
      const Schedule zb = make(PipelineSchedule::zb_h1, S, M);
      for (int st = 0; st < S; ++st)
        EXPECT_LE(peak_activations(ofob, st), peak_activations(gpipe, st));
      std::vector<PipelineCosts> costs{uniform_costs(S), uniform_costs(S, 1, 2, 1),
                                       uniform_costs(S, 2, 1, 1, 0.5), uniform_costs(S, 1, 1, 2, 0.1)};
      for (const PipelineCosts& c : costs) {
        const Simulation a = simulate(ofob, c), b = simulate(zb, c);
        EXPECT_LE(b.bubble_fraction, a.bubble_fraction + 1e-12) << "S=" << S << " M=" << M;
        EXPECT_LE(b.makespan, a.makespan + 1e-9) << "S=" << S << " M=" << M;
      }
    }
  // At unit costs and M >= S, 1F1B's makespan is 3M + 3(S-1), ZB-H1's the paper's 3M + (S-1).
  for (int S = 2; S <= 8; ++S)
    for (int M = S; M <= 3 * S; ++M) {
      const double ofob = simulate(make(PipelineSchedule::one_f_one_b, S, M), uniform_costs(S)).makespan;
      const double zb = simulate(make(PipelineSchedule::zb_h1, S, M), uniform_costs(S)).makespan;
      EXPECT_EQ(ofob, 3 * M + 3 * (S - 1));
      EXPECT_EQ(zb, 3 * M + (S - 1)) << "S=" << S << " M=" << M;
    }
}

TEST(Pipeline, Errors) {
  EXPECT_NE(error_of({.stages = 0, .micro = 4}).find("stages must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(error_of({.stages = 2, .micro = 0}).find("micro (micro-batches) must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(error_of({.stages = 2, .micro = 4, .schedule = PipelineSchedule::interleaved,
                      .virtual_stages = 0})
                .find("virtual stages (V) must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of({.stages = 2, .micro = 4, .schedule = PipelineSchedule::gpipe,
                      .virtual_stages = 2})
                .find("needs the interleaved schedule"),
            std::string::npos);
  EXPECT_NE(error_of({.stages = 4, .micro = 6, .schedule = PipelineSchedule::interleaved,
                      .virtual_stages = 2})
                .find("multiple of stages (Megatron's rule"),
            std::string::npos);
  EXPECT_NE(error_of({.stages = 2000, .micro = 1}).find("stages must be <= 1024"), std::string::npos);
  EXPECT_NE(error_of({.stages = 1000, .micro = 1001}).find("<= 10^6"), std::string::npos);
  const Schedule s = make(PipelineSchedule::one_f_one_b, 3, 4);
  PipelineCosts c = uniform_costs(3);
  c.forward.pop_back();
  try {
    (void)simulate(s, c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.message()).find("costs.forward has 2 entries but there are 3 stages"),
              std::string::npos);
  }
  c = uniform_costs(3);
  c.weight[1] = -1;
  EXPECT_THROW((void)simulate(s, c), Error);
  c = uniform_costs(3);
  c.transfer = -0.5;
  EXPECT_THROW((void)simulate(s, c), Error);
  c = uniform_costs(3);
  c.backward[0] = std::nan("");
  EXPECT_THROW((void)simulate(s, c), Error);
  // A schedule built by hand: make_schedule's pass check_schedule; each fault is named by stage
  // and action, by simulate, tick_table and peak_activations alike (a micro-batch past M was
  // written past the simulator's tables; a missing backward was timed as a shorter step).
  for (const PipelineSchedule kind : {PipelineSchedule::fill_drain, PipelineSchedule::gpipe,
                                      PipelineSchedule::one_f_one_b, PipelineSchedule::zb_h1})
    for (const int st : {1, 3})
      for (const int m : {1, 4}) EXPECT_NO_THROW(check_schedule(make(kind, st, m))) << st << " " << m;
  EXPECT_NO_THROW(check_schedule(make(PipelineSchedule::interleaved, 2, 4, 3)));
  const auto fault = [](Schedule bad, const std::string& want) {
    for (const std::function<void()>& call : std::vector<std::function<void()>>{
             [&] { (void)simulate(bad, uniform_costs(bad.spec.stages)); }, [&] { (void)tick_table(bad); },
             [&] { (void)peak_activations(bad, 0); }, [&] { check_schedule(bad); }}) {
      try {
        call();
        ADD_FAILURE() << "no error for " << want;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.message()).find(want), std::string::npos) << e.message();
      }
    }
  };
  Schedule bad = make(PipelineSchedule::one_f_one_b, 1, 1);
  bad.actions[0][0].micro = 5;
  fault(bad, "schedule: stage 0 action 0 (F5.0) is outside micro-batches [0, 1) or chunks [0, 1)");
  bad = make(PipelineSchedule::one_f_one_b, 2, 1);
  bad.actions.pop_back();
  fault(bad, "schedule: 1 stage lists for 2 stages");
  bad = make(PipelineSchedule::one_f_one_b, 2, 3);
  bad.actions[1].erase(std::find(bad.actions[1].begin(), bad.actions[1].end(),
                                 Action{.kind = ActionKind::backward, .micro = 2}));
  fault(bad, "schedule: stage 1 lacks B2");
  bad = make(PipelineSchedule::gpipe, 2, 3);
  bad.actions[0].push_back({.kind = ActionKind::forward, .micro = 1});
  fault(bad, "schedule: stage 0 runs F1 twice (actions 1 and 6)");
  bad = make(PipelineSchedule::gpipe, 2, 2);
  bad.actions[1].push_back({.kind = ActionKind::weight, .micro = 0});
  fault(bad, "schedule: stage 1 runs W0, but only zb-h1 splits the weight gradient");
  bad = make(PipelineSchedule::fill_drain, 2, 2);
  bad.actions[0].push_back({.kind = ActionKind::backward, .micro = 0});
  fault(bad, "schedule: stage 0 runs B0, but fill-drain runs no backward");
  bad = make(PipelineSchedule::gpipe, 1, 2);
  std::swap(bad.actions[0][1], bad.actions[0][2]);  // F0 B0 F1 B1 from F0 F1 B0 B1: fine
  EXPECT_NO_THROW(check_schedule(bad));
  bad.actions[0] = {{.kind = ActionKind::backward, .micro = 0}, {.kind = ActionKind::forward, .micro = 0},
                    {.kind = ActionKind::forward, .micro = 1}, {.kind = ActionKind::backward, .micro = 1}};
  fault(bad, "schedule: stage 0 runs B0 before F0");
  bad = make(PipelineSchedule::zb_h1, 2, 2);
  std::swap(bad.actions[0].back(), bad.actions[0][bad.actions[0].size() - 2]);
  fault(bad, "before B");
  EXPECT_EQ(parse_pipeline_schedule("1f1b"), PipelineSchedule::one_f_one_b);
  EXPECT_EQ(parse_pipeline_schedule("zb-h1"), PipelineSchedule::zb_h1);
  EXPECT_FALSE(parse_pipeline_schedule("1F1B"));
}

}  // namespace
}  // namespace cpattn
