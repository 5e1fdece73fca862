// The schedule simulator (include/cpattn/pipeline.hpp).
#include <cpattn/error.hpp>
#include <cpattn/pipeline.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>

namespace cpattn {

namespace {

bool splits_backward(const Schedule& s) { return s.spec.schedule == PipelineSchedule::zb_h1; }

void check_costs(const std::vector<double>& v, const char* name, int stages) {
  CPATTN_CHECK(v.size() == static_cast<std::size_t>(stages), "costs.", name, " has ", v.size(),
               " entries but there are ", stages, " stages");
  for (std::size_t i = 0; i < v.size(); ++i)
    CPATTN_CHECK(std::isfinite(v[i]) && v[i] >= 0, "costs.", name, "[", i,
                 "] must be finite and >= 0, got ", v[i]);
}

// The most activations `stage` holds (peak_activations, unchecked).
int stage_peak(const Schedule& schedule, int stage) {
  const bool forward_only = schedule.spec.schedule == PipelineSchedule::fill_drain;
  const ActionKind frees = splits_backward(schedule) ? ActionKind::weight : ActionKind::backward;
  int held = 0, peak = 0;
  for (const Action& a : schedule.actions[static_cast<std::size_t>(stage)]) {
    if (a.kind == ActionKind::forward) {
      ++held;
      peak = std::max(peak, held);
      if (forward_only) --held;
    } else if (a.kind == frees) {
      --held;
    }
  }
  return peak;
}

// End times of every action, indexed [stage][kind][chunk * M + micro]; -1 while not run.
struct Ends {
  int m = 0, v = 1;
  std::vector<std::vector<double>> f, b, w;  // [stage][chunk * M + micro]
  double& at(std::vector<std::vector<double>>& t, int s, int chunk, int mb) {
    return t[static_cast<std::size_t>(s)][static_cast<std::size_t>(chunk * m + mb)];
  }
};

// Runs `schedule` with per-action `cost(stage, action)` and `transfer`: each stage takes its
// next action once that action's inputs have ended; a pass over all stages without progress
// means the order waits on itself.
Simulation run(const Schedule& schedule, const std::function<double(int, const Action&)>& cost,
               double transfer) {
  check_schedule(schedule);
  const int S = schedule.spec.stages, M = schedule.spec.micro, V = schedule.spec.virtual_stages;
  const int last_virtual = S * V - 1;
  const auto US = static_cast<std::size_t>(S);
  Ends e{.m = M, .v = V, .f = {}, .b = {}, .w = {}};
  e.f.assign(US, std::vector<double>(static_cast<std::size_t>(M * V), -1.0));
  e.b = e.f;
  e.w = e.f;
  Simulation sim{.schedule = schedule, .timeline = std::vector<std::vector<TimedAction>>(US),
                 .makespan = 0, .busy = 0, .bubble_fraction = 0, .utilization = 0,
                 .peak_activations = std::vector<int>(US, 0)};
  std::vector<std::size_t> next(US, 0);
  std::vector<double> free_at(US, 0.0);
  std::size_t remaining = 0;
  for (const auto& a : schedule.actions) remaining += a.size();

  // When `a` on stage s may start, or -1 while an input is missing.
  auto ready = [&](int s, const Action& a) -> double {
    const int virt = a.chunk * S + s;
    auto from = [&](std::vector<std::vector<double>>& t, int vs) -> double {
      const int st = vs % S;
      const double end = e.at(t, st, vs / S, a.micro);
      return end < 0 ? -1.0 : end + (st == s ? 0.0 : transfer);
    };
    switch (a.kind) {
      case ActionKind::forward: return virt == 0 ? 0.0 : from(e.f, virt - 1);
      case ActionKind::backward: {
        const double own = e.at(e.f, s, a.chunk, a.micro);
        if (own < 0) return -1.0;
        if (virt == last_virtual) return own;
        const double up = from(e.b, virt + 1);
        return up < 0 ? -1.0 : std::max(own, up);
      }
      case ActionKind::weight: return e.at(e.b, s, a.chunk, a.micro);
    }
    return -1.0;
  };

  while (remaining > 0) {
    bool progress = false;
    for (int s = 0; s < S; ++s) {
      const auto us = static_cast<std::size_t>(s);
      const std::vector<Action>& list = schedule.actions[us];
      while (next[us] < list.size()) {
        const Action& a = list[next[us]];
        const double r = ready(s, a);
        if (r < 0) break;
        const double start = std::max(r, free_at[us]);
        const double end = start + cost(s, a);
        auto& table = a.kind == ActionKind::forward ? e.f : a.kind == ActionKind::backward ? e.b : e.w;
        e.at(table, s, a.chunk, a.micro) = end;
        sim.timeline[us].push_back({.action = a, .start = start, .end = end});
        sim.busy += end - start;
        free_at[us] = end;
        ++next[us];
        --remaining;
        progress = true;
      }
    }
    CPATTN_CHECK(progress, "schedule ", pipeline_schedule_name(schedule.spec.schedule),
                 " waits on itself: an action's input never arrives");
  }
  for (double t : free_at) sim.makespan = std::max(sim.makespan, t);
  CPATTN_CHECK(std::isfinite(sim.makespan), "the costs add up past the largest double (makespan ", sim.makespan,
               "): forward, backward, weight and transfer costs must be smaller");
  // The mean over the stages of each one's busy share, each share summed in parts of the
  // makespan: S x makespan overflowed to inf for costs near the largest double (utilization 0,
  // bubble NaN, where both were 0.5).
  sim.utilization = 1.0;
  if (sim.makespan > 0) {
    double shares = 0;
    for (const auto& stage : sim.timeline)
      for (const auto& done : stage) shares += (done.end - done.start) / sim.makespan;
    sim.utilization = shares / static_cast<double>(S);
  }
  sim.bubble_fraction = 1.0 - sim.utilization;
  for (int s = 0; s < S; ++s)
    sim.peak_activations[static_cast<std::size_t>(s)] = stage_peak(schedule, s);
  return sim;
}

}  // namespace

PipelineCosts uniform_costs(int stages, double forward, double backward, double weight,
                            double transfer) {
  CPATTN_CHECK(stages >= 1, "stages must be >= 1, got ", stages);
  const auto n = static_cast<std::size_t>(stages);
  return {.forward = std::vector<double>(n, forward),
          .backward = std::vector<double>(n, backward),
          .weight = std::vector<double>(n, weight),
          .transfer = transfer};
}

int peak_activations(const Schedule& schedule, int stage) {
  check_schedule(schedule);
  CPATTN_CHECK(stage >= 0 && stage < schedule.spec.stages, "stage must be in [0, ",
               schedule.spec.stages, "), got ", stage);
  return stage_peak(schedule, stage);
}


Simulation simulate(const Schedule& schedule, const PipelineCosts& costs) {
  check_schedule(schedule);  // (run checks it too; its stage count first, for the costs' checks)
  const int S = schedule.spec.stages;
  check_costs(costs.forward, "forward", S);
  check_costs(costs.backward, "backward", S);
  check_costs(costs.weight, "weight", S);
  CPATTN_CHECK(std::isfinite(costs.transfer) && costs.transfer >= 0,
               "costs.transfer must be finite and >= 0, got ", costs.transfer);
  const bool split = splits_backward(schedule);
  return run(
      schedule,
      [&](int s, const Action& a) {
        const auto us = static_cast<std::size_t>(s);
        switch (a.kind) {
          case ActionKind::forward: return costs.forward[us];
          case ActionKind::backward: return split ? costs.backward[us] : costs.backward[us] + costs.weight[us];
          case ActionKind::weight: return costs.weight[us];
        }
        return 0.0;
      },
      costs.transfer);
}

TickTable tick_table(const Schedule& schedule) {
  const Simulation sim = run(schedule, [](int, const Action&) { return 1.0; }, 0.0);
  const auto ticks = static_cast<std::size_t>(std::lround(sim.makespan));
  TickTable table(ticks, std::vector<std::optional<Action>>(static_cast<std::size_t>(schedule.spec.stages)));
  for (std::size_t s = 0; s < sim.timeline.size(); ++s)
    for (const TimedAction& t : sim.timeline[s]) table[static_cast<std::size_t>(std::lround(t.start))][s] = t.action;
  return table;
}

}  // namespace cpattn
