// Pipeline-parallel schedules as plain data, and a simulator of their timing and memory
// (DESIGN.md section 8). Pure functions, no MPI.
//
// A schedule is, per stage, the ordered list of actions that stage runs: what an executor
// walks, one action at a time, sending activations down and gradients up between actions.
//   F<mb>  forward of micro-batch mb
//   B<mb>  backward of mb: the whole backward, or with zb-h1 its input-gradient part only
//   W<mb>  weight-gradient part of mb's backward (zb-h1 only)
// With interleaved 1F1B every rank holds V model chunks; chunk c on stage s is virtual stage
// c*S + s (Megatron's layout), and every action names its chunk.
//
// Fill-drain with S = 3, M = 4 at one tick per action (the overview's table; 6 ticks, 2/3):
//   tick 0: [F0, idle, idle]    tick 3: [F3, F2, F1]
//   tick 1: [F1, F0, idle]      tick 4: [idle, F3, F2]
//   tick 2: [F2, F1, F0]        tick 5: [idle, idle, F3]
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {

enum class PipelineSchedule {
  fill_drain,   // forward only: every stage runs F0 .. F(M-1)
  gpipe,        // all forwards, then all backwards (B0 .. B(M-1))
  one_f_one_b,  // 1F1B: S-s-1 warm-up forwards on stage s, then F/B pairs, then the rest of B
  interleaved,  // Megatron's interleaved 1F1B over V chunks per stage; needs M % S == 0
  zb_h1,        // zero bubble H1: backward split into B (input grad) and W (weight grad)
};

// "fill-drain", "gpipe", "1f1b", "interleaved", "zb-h1"; parse_pipeline_schedule is the inverse
// (nullopt for any other name).
std::string_view pipeline_schedule_name(PipelineSchedule schedule);
std::optional<PipelineSchedule> parse_pipeline_schedule(std::string_view name);

enum class ActionKind { forward, backward, weight };

struct Action {
  ActionKind kind = ActionKind::forward;
  int micro = 0;  // micro-batch, 0 .. M-1
  int chunk = 0;  // model chunk on this stage, 0 .. V-1 (0 unless interleaved)
  bool operator==(const Action&) const = default;
};

// "F3", "B0", "W2"; with `with_chunk`, "F3.1" (micro-batch 3 of chunk 1).
std::string action_label(const Action& action, bool with_chunk = false);

struct PipelineSpec {
  int stages = 1;          // S >= 1: pipeline ranks
  int micro = 1;           // M >= 1: micro-batches per step
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int virtual_stages = 1;  // V >= 1: model chunks per stage; only interleaved may have V > 1
};

struct Schedule {
  PipelineSpec spec;
  std::vector<std::vector<Action>> actions;  // [stage] in the order that stage runs them
};

// The schedule of `spec`. Throws cpattn::Error on zero stages or micro-batches, V < 1, V > 1
// outside interleaved, interleaved with M not a multiple of S (Megatron's rule: its
// interleaved schedule sends micro-batches through the chunks in groups of S), or a size
// beyond S <= 1024 and S * M * V <= 10^6 (the tick table must fit in memory).
Schedule make_schedule(const PipelineSpec& spec);
// make_schedule's rules for a spec alone.
void check_pipeline_spec(const PipelineSpec& spec);
// A schedule built by hand (or edited): its spec by check_pipeline_spec, one action list per
// stage, every action's micro-batch in [0, M) and chunk in [0, V), and on every stage each
// chunk's micro-batch forwarded once, then (but fill-drain) its backward once, then (zb-h1
// only) its weight gradient once. Throws cpattn::Error naming the stage and the action.
// simulate, tick_table, peak_activations and run_pipeline check their schedule with it (a
// micro-batch past M was written past the simulator's tables).
void check_schedule(const Schedule& schedule);

// The cost model. Each stage runs its actions one at a time in its schedule's order; an action
// starts when its stage is free and its inputs are there:
//   F(mb, v) after F(mb, v-1) ends (+ transfer when v-1 is on another stage), v the virtual stage;
//   B(mb, v) after B(mb, v+1) ends (+ transfer), or on the last virtual stage after F(mb, v);
//   W(mb, v) after B(mb, v) on its stage.
// An F costs forward[s]; a B costs backward[s] + weight[s] when the schedule does not split the
// backward and backward[s] with zb-h1, whose W costs weight[s]. So the same costs describe
// the same work under every schedule. With interleaved, every chunk's action costs the same
// as the stage's (give per-chunk costs: a stage's layers divided by V).
struct PipelineCosts {
  std::vector<double> forward;   // [stages] time of one forward, >= 0
  std::vector<double> backward;  // [stages] time of the input-gradient part of one backward
  std::vector<double> weight;    // [stages] time of the weight-gradient part
  double transfer = 0;           // time of one point-to-point send between stages, >= 0
};
// forward 1, backward 1, weight 1 on every stage, no transfer.
PipelineCosts uniform_costs(int stages, double forward = 1, double backward = 1,
                            double weight = 1, double transfer = 0);

struct TimedAction {
  Action action;
  double start = 0;
  double end = 0;
};

// Activations held. An F's activation is held from the start of its F until the end of the
// action that frees it: its B, or with zb-h1 its W (the weight gradient still reads the layer
// inputs). Forward-only (fill-drain) holds one only while its F runs. Counted in
// (micro-batch, chunk) units: an interleaved chunk's activation is 1/V of a stage's.
// Bounds: gpipe M; 1f1b min(S - s, M) on stage s; zb-h1 min(S, M).
struct Simulation {
  Schedule schedule;
  std::vector<std::vector<TimedAction>> timeline;  // [stage] in execution order
  double makespan = 0;                  // end of the last action
  double busy = 0;                      // sum of all action times over all stages
  double bubble_fraction = 0;           // idle / (stages * makespan)
  double utilization = 0;               // busy / (stages * makespan) = 1 - bubble_fraction
  std::vector<int> peak_activations;    // [stage] see above
};

// Times every action of `schedule` under `costs`. Throws cpattn::Error on costs of the wrong
// length or negative.
Simulation simulate(const Schedule& schedule, const PipelineCosts& costs);

// The tick table at one tick per action and no transfer: [tick][stage], nullopt for idle.
using TickTable = std::vector<std::vector<std::optional<Action>>>;
TickTable tick_table(const Schedule& schedule);

// The most activations stage `stage` of `schedule` holds, from the order alone: actions run
// one at a time, so the simulator finds the same under any costs.
int peak_activations(const Schedule& schedule, int stage);

}  // namespace cpattn
