// Pipeline schedules as per-stage action lists (include/cpattn/pipeline.hpp).
#include <cpattn/error.hpp>
#include <cpattn/pipeline.hpp>

#include <algorithm>
#include <cstddef>

namespace cpattn {

namespace {

Action fwd(int mb, int chunk = 0) { return {.kind = ActionKind::forward, .micro = mb, .chunk = chunk}; }
Action bwd(int mb, int chunk = 0) { return {.kind = ActionKind::backward, .micro = mb, .chunk = chunk}; }
Action wgt(int mb) { return {.kind = ActionKind::weight, .micro = mb, .chunk = 0}; }

std::vector<Action> fill_drain(int m) {
  std::vector<Action> a;
  for (int i = 0; i < m; ++i) a.push_back(fwd(i));
  return a;
}

std::vector<Action> gpipe(int m) {
  std::vector<Action> a = fill_drain(m);
  for (int i = 0; i < m; ++i) a.push_back(bwd(i));
  return a;
}

// Stage s warms up with S-s-1 forwards, then alternates F(w+i), B(i), then drains the B's.
std::vector<Action> one_f_one_b(int s_count, int m, int s) {
  const int warmup = std::min(s_count - s - 1, m);
  std::vector<Action> a;
  for (int i = 0; i < warmup; ++i) a.push_back(fwd(i));
  for (int i = 0; i < m - warmup; ++i) {
    a.push_back(fwd(warmup + i));
    a.push_back(bwd(i));
  }
  for (int i = m - warmup; i < m; ++i) a.push_back(bwd(i));
  return a;
}

// Megatron-Core's interleaved schedule (forward_backward_pipelining_with_interleaving): the
// k-th forward of a stage is micro-batch (k / (S*V)) * S + k % S of chunk (k / S) % V, the k-th
// backward the same micro-batch of chunk V-1 - (k / S) % V; stage s runs
// 2*(S-s-1) + (V-1)*S warm-up forwards (all of them when M == S), then F/B pairs.
std::vector<Action> interleaved(int s_count, int m, int v, int s) {
  const int total = m * v;
  auto mb_of = [&](int k) { return (k / (s_count * v)) * s_count + k % s_count; };
  auto chunk_of = [&](int k) { return (k % (s_count * v)) / s_count; };
  int warmup = m == s_count ? total : 2 * (s_count - s - 1) + (v - 1) * s_count;
  warmup = std::min(warmup, total);
  std::vector<Action> a;
  for (int k = 0; k < warmup; ++k) a.push_back(fwd(mb_of(k), chunk_of(k)));
  for (int i = 0; i < total - warmup; ++i) {
    a.push_back(fwd(mb_of(warmup + i), chunk_of(warmup + i)));
    a.push_back(bwd(mb_of(i), v - 1 - chunk_of(i)));
  }
  for (int k = total - warmup; k < total; ++k) a.push_back(bwd(mb_of(k), v - 1 - chunk_of(k)));
  return a;
}

// ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism): stage s runs 1F1B's order of F and B
// (B now the input gradient only) and defers each weight gradient by s micro-batches: W(k)
// right after B(k + s), the last s W's at the end, where 1F1B's stage s would sit idle
// waiting for nothing. Stage s then holds at most (S - s) + s = S activations until their W
// (1F1B's first stage's peak), and at unit costs with M >= S the makespan is the paper's
// 3M + (S - 1) against 1F1B's 3M + 3(S - 1).
std::vector<Action> zb_h1(int s_count, int m, int s) {
  std::vector<Action> a;
  int next_w = 0;
  for (const Action& x : one_f_one_b(s_count, m, s)) {
    a.push_back(x);
    if (x.kind == ActionKind::backward && x.micro - next_w >= s) a.push_back(wgt(next_w++));
  }
  while (next_w < m) a.push_back(wgt(next_w++));
  return a;
}

}  // namespace

std::string_view pipeline_schedule_name(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::fill_drain: return "fill-drain";
    case PipelineSchedule::gpipe: return "gpipe";
    case PipelineSchedule::one_f_one_b: return "1f1b";
    case PipelineSchedule::interleaved: return "interleaved";
    case PipelineSchedule::zb_h1: return "zb-h1";
  }
  return "?";
}

std::optional<PipelineSchedule> parse_pipeline_schedule(std::string_view name) {
  for (const PipelineSchedule s :
       {PipelineSchedule::fill_drain, PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b,
        PipelineSchedule::interleaved, PipelineSchedule::zb_h1})
    if (pipeline_schedule_name(s) == name) return s;
  return std::nullopt;
}

std::string action_label(const Action& action, bool with_chunk) {
  const char kind = action.kind == ActionKind::forward    ? 'F'
                    : action.kind == ActionKind::backward ? 'B'
                                                          : 'W';
  std::string s(1, kind);
  s += std::to_string(action.micro);
  if (with_chunk) {
    s += '.';
    s += std::to_string(action.chunk);
  }
  return s;
}

void check_pipeline_spec(const PipelineSpec& spec) {
  CPATTN_CHECK(spec.stages >= 1, "stages must be >= 1, got ", spec.stages);
  CPATTN_CHECK(spec.micro >= 1, "micro (micro-batches) must be >= 1, got ", spec.micro);
  CPATTN_CHECK(spec.virtual_stages >= 1, "virtual stages (V) must be >= 1, got ",
               spec.virtual_stages);
  CPATTN_CHECK(spec.virtual_stages == 1 || spec.schedule == PipelineSchedule::interleaved,
               "virtual stages (V) = ", spec.virtual_stages,
               " needs the interleaved schedule, not ", pipeline_schedule_name(spec.schedule));
  CPATTN_CHECK(spec.schedule != PipelineSchedule::interleaved || spec.micro % spec.stages == 0,
               "interleaved needs micro-batches to be a multiple of stages (Megatron's rule: "
               "micro-batches go through the chunks in groups of S), got micro = ",
               spec.micro, ", stages = ", spec.stages);
  // The tick table has S * (about 3*M*V + 2*S) cells: keep it to a few million.
  CPATTN_CHECK(spec.stages <= 1024, "stages must be <= 1024, got ", spec.stages);
  CPATTN_CHECK(static_cast<long long>(spec.stages) * spec.micro * spec.virtual_stages <= 1'000'000,
               "stages * micro * virtual stages must be <= 10^6, got ", spec.stages, "*",
               spec.micro, "*", spec.virtual_stages);
}

void check_schedule(const Schedule& schedule) {
  const PipelineSpec& spec = schedule.spec;
  check_pipeline_spec(spec);
  const int S = spec.stages, M = spec.micro, V = spec.virtual_stages;
  CPATTN_CHECK(schedule.actions.size() == static_cast<std::size_t>(S), "schedule: ", schedule.actions.size(),
               " stage lists for ", S, " stages");
  const bool backward = spec.schedule != PipelineSchedule::fill_drain;
  const bool weight = spec.schedule == PipelineSchedule::zb_h1;
  // Per stage: where each (kind, chunk, micro) ran, -1 while not seen.
  std::vector<int> at(static_cast<std::size_t>(3 * V * M));
  for (int st = 0; st < S; ++st) {
    std::fill(at.begin(), at.end(), -1);
    const std::vector<Action>& list = schedule.actions[static_cast<std::size_t>(st)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      CPATTN_CHECK(a.micro >= 0 && a.micro < M && a.chunk >= 0 && a.chunk < V, "schedule: stage ", st, " action ", i,
                   " (", action_label(a, true), ") is outside micro-batches [0, ", M, ") or chunks [0, ", V, ")");
      CPATTN_CHECK(a.kind != ActionKind::backward || backward, "schedule: stage ", st, " runs ", action_label(a, V > 1),
                   ", but ", pipeline_schedule_name(spec.schedule), " runs no backward");
      CPATTN_CHECK(a.kind != ActionKind::weight || weight, "schedule: stage ", st, " runs ", action_label(a, V > 1),
                   ", but only zb-h1 splits the weight gradient from the backward");
      int& seen = at[static_cast<std::size_t>((static_cast<int>(a.kind) * V + a.chunk) * M + a.micro)];
      CPATTN_CHECK(seen < 0, "schedule: stage ", st, " runs ", action_label(a, V > 1), " twice (actions ", seen,
                   " and ", i, ")");
      seen = static_cast<int>(i);
    }
    for (int c = 0; c < V; ++c)
      for (int m = 0; m < M; ++m) {
        const auto pos = [&](ActionKind k) { return at[static_cast<std::size_t>((static_cast<int>(k) * V + c) * M + m)]; };
        const auto name = [&](ActionKind k) { return action_label({.kind = k, .micro = m, .chunk = c}, V > 1); };
        const int f = pos(ActionKind::forward), b = pos(ActionKind::backward), w = pos(ActionKind::weight);
        CPATTN_CHECK(f >= 0, "schedule: stage ", st, " lacks ", name(ActionKind::forward));
        CPATTN_CHECK(!backward || b >= 0, "schedule: stage ", st, " lacks ", name(ActionKind::backward));
        CPATTN_CHECK(!weight || w >= 0, "schedule: stage ", st, " lacks ", name(ActionKind::weight));
        CPATTN_CHECK(!backward || f < b, "schedule: stage ", st, " runs ", name(ActionKind::backward), " before ",
                     name(ActionKind::forward));
        CPATTN_CHECK(!weight || b < w, "schedule: stage ", st, " runs ", name(ActionKind::weight), " before ",
                     name(ActionKind::backward));
      }
  }
}

Schedule make_schedule(const PipelineSpec& spec) {
  check_pipeline_spec(spec);
  Schedule out{.spec = spec, .actions = {}};
  const int S = spec.stages, M = spec.micro;
  out.actions.resize(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) {
    std::vector<Action>& a = out.actions[static_cast<std::size_t>(s)];
    switch (spec.schedule) {
      case PipelineSchedule::fill_drain: a = fill_drain(M); break;
      case PipelineSchedule::gpipe: a = gpipe(M); break;
      case PipelineSchedule::one_f_one_b: a = one_f_one_b(S, M, s); break;
      case PipelineSchedule::interleaved: a = interleaved(S, M, spec.virtual_stages, s); break;
      case PipelineSchedule::zb_h1: a = zb_h1(S, M, s); break;
    }
  }
  return out;
}

}  // namespace cpattn
