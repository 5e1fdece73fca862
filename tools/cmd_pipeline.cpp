// `cpattn pipeline`: a pipeline schedule's tick table, its simulated figures, JSON, and an SVG
// timeline.
#include <cpattn/error.hpp>
#include <cpattn/file.hpp>
#include <cpattn/pipeline.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "vocab.hpp"

namespace cpattn::cli {

namespace {

struct PipelineArgs {
  int stages = 4;
  int micro = 8;
  std::string schedule = "1f1b";
  std::optional<int> virtual_stages;
  std::string costs;  // "F,B,W" or one "F,B,W" per stage joined by '/'
  double transfer = 0;
  bool json = false;
  std::string svg;
};

double parse_cost(std::string_view field, const std::string& whole) {
  const std::string word(field);
  std::size_t used = 0;
  double v = -1;
  // strtod, not stod: a subnormal (1e-310) is a valid cost, not stod's out_of_range
  const char* begin = word.c_str();
  char* end = nullptr;
  v = std::strtod(begin, &end);
  used = static_cast<std::size_t>(end - begin);
  CPATTN_CHECK(used == word.size() && !word.empty() && std::isfinite(v) && v >= 0,
               "--costs: every cost must be a number >= 0, got '", word, "' in '", whole, "'");
  return v;
}

// "1,2,1" (every stage) or "1,2,1/1,2,1/2,3,1" (one forward,backward,weight triple per stage).
PipelineCosts parse_costs(const std::string& text, int stages, double transfer) {
  PipelineCosts c = uniform_costs(stages, 1, 1, 1, transfer);
  if (text.empty()) return c;
  const auto triples = split_fields(text, '/');
  CPATTN_CHECK(triples.size() == 1 || triples.size() == static_cast<std::size_t>(stages),
               "--costs: give one F,B,W triple or one per stage (", stages, "), got ",
               triples.size(), " in '", text, "'");
  for (int s = 0; s < stages; ++s) {
    const std::string_view t = triples[triples.size() == 1 ? 0 : static_cast<std::size_t>(s)];
    const auto words = split_fields(t, ',');
    CPATTN_CHECK(words.size() == 3, "--costs: expected forward,backward,weight, got '", t, "'");
    const auto us = static_cast<std::size_t>(s);
    c.forward[us] = parse_cost(words[0], text);
    c.backward[us] = parse_cost(words[1], text);
    c.weight[us] = parse_cost(words[2], text);
  }
  return c;
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string peaks_text(const std::vector<int>& p) {
  std::string s;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(p[i]);
  }
  return s;
}

bool same_on_every_stage(const PipelineCosts& c) {
  for (std::size_t s = 1; s < c.forward.size(); ++s)
    if (c.forward[s] != c.forward[0] || c.backward[s] != c.backward[0] || c.weight[s] != c.weight[0])
      return false;
  return true;
}

std::string cell(const std::optional<Action>& a, bool chunks) {
  return a ? action_label(*a, chunks) : std::string("idle");
}

void print_table(const Simulation& sim, const TickTable& ticks, const PipelineCosts& costs) {
  const PipelineSpec& spec = sim.schedule.spec;
  const bool chunks = spec.schedule == PipelineSchedule::interleaved;
  std::printf("cpattn pipeline: %s, %d stages, %d micro-batches", 
              std::string(pipeline_schedule_name(spec.schedule)).c_str(), spec.stages, spec.micro);
  if (chunks) std::printf(", %d chunks per stage (labels F<mb>.<chunk>)", spec.virtual_stages);
  std::printf("\n\ntick table at one tick per action:\n");
  std::size_t width = 4;
  for (const auto& row : ticks)
    for (const auto& c : row) width = std::max(width, cell(c, chunks).size());
  std::printf("%-6s", "tick");
  for (int s = 0; s < spec.stages; ++s) {
    std::string name(1, 's');
    name += std::to_string(s);
    std::printf(" %-*s", static_cast<int>(width), name.c_str());
  }
  std::printf("\n");
  for (std::size_t t = 0; t < ticks.size(); ++t) {
    std::printf("%-6zu", t);
    for (const auto& c : ticks[t]) std::printf(" %-*s", static_cast<int>(width), cell(c, chunks).c_str());
    std::printf("\n");
  }
  const bool uniform = same_on_every_stage(costs);
  std::printf("\nsimulated with forward %s, backward %s, weight %s%s, transfer %s:\n",
              fmt(costs.forward[0]).c_str(), fmt(costs.backward[0]).c_str(),
              fmt(costs.weight[0]).c_str(), uniform ? "" : " (stage 0; others differ)",
              fmt(costs.transfer).c_str());
  std::printf("makespan          %s\n", fmt(sim.makespan).c_str());
  std::printf("bubble fraction   %.4f\n", sim.bubble_fraction);
  std::printf("utilization       %.4f\n", sim.utilization);
  std::printf("peak activations  %s (per stage, held from F until %s)\n",
              peaks_text(sim.peak_activations).c_str(),
              spec.schedule == PipelineSchedule::zb_h1        ? "W"
              : spec.schedule == PipelineSchedule::fill_drain ? "the end of F, forward only"
                                                              : "B");
}

void print_json(const Simulation& sim, const TickTable& ticks, const PipelineCosts& costs) {
  const PipelineSpec& spec = sim.schedule.spec;
  const bool chunks = spec.schedule == PipelineSchedule::interleaved;
  nlohmann::json j;
  j["schedule"] = std::string(pipeline_schedule_name(spec.schedule));
  j["stages"] = spec.stages;
  j["micro"] = spec.micro;
  j["virtual_stages"] = spec.virtual_stages;
  j["costs"] = {{"forward", costs.forward}, {"backward", costs.backward},
                {"weight", costs.weight}, {"transfer", costs.transfer}};
  j["ticks"] = nlohmann::json::array();
  for (const auto& row : ticks) {
    nlohmann::json r = nlohmann::json::array();
    for (const auto& c : row) r.push_back(cell(c, chunks));
    j["ticks"].push_back(std::move(r));
  }
  j["actions"] = nlohmann::json::array();
  j["timeline"] = nlohmann::json::array();
  for (const auto& stage : sim.timeline) {
    nlohmann::json order = nlohmann::json::array(), times = nlohmann::json::array();
    for (const TimedAction& t : stage) {
      order.push_back(action_label(t.action, chunks));
      times.push_back({{"action", action_label(t.action, chunks)}, {"start", t.start}, {"end", t.end}});
    }
    j["actions"].push_back(std::move(order));
    j["timeline"].push_back(std::move(times));
  }
  j["makespan"] = sim.makespan;
  j["bubble_fraction"] = sim.bubble_fraction;
  j["utilization"] = sim.utilization;
  j["peak_activations"] = sim.peak_activations;
  std::cout << j.dump() << '\n';
}

// ---- SVG ----------------------------------------------------------------------------------

// Micro-batch hues (Tableau 10 without its grey, which marks idle time).
const char* const kHues[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                             "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79"};

std::string tint(const std::string& hex, double white) {
  auto channel = [&](int i) {
    const int v = std::stoi(hex.substr(static_cast<std::size_t>(1 + 2 * i), 2), nullptr, 16);
    return static_cast<int>(std::lround(v + (255 - v) * white));
  };
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", channel(0), channel(1), channel(2));
  return buf;
}

// A tick step of 1, 2 or 5 times a power of ten giving about 10 ticks.
double nice_step(double span) {
  const double raw = span / 10;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

void write_svg(const std::string& path, const Simulation& sim, const PipelineCosts& costs) {
  const PipelineSpec& spec = sim.schedule.spec;
  const bool chunks = spec.schedule == PipelineSchedule::interleaved;
  const double left = 80, top = 78, row_h = 34, gap = 8;
  const double plot_w = std::clamp(sim.makespan * 40.0, 480.0, 1400.0);
  const double scale = sim.makespan > 0 ? plot_w / sim.makespan : 1;
  const double rows_h = spec.stages * (row_h + gap) - gap;
  const double width = left + plot_w + 30, height = top + rows_h + 92;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" viewBox=\"0 0 " << width << ' ' << height
    << "\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n"
    << "<defs><pattern id=\"idle\" width=\"8\" height=\"8\" patternUnits=\"userSpaceOnUse\" "
       "patternTransform=\"rotate(45)\"><rect width=\"8\" height=\"8\" fill=\"#f4f4f4\"/>"
       "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"8\" stroke=\"#c8c8c8\" stroke-width=\"3\"/></pattern>"
       "</defs>\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  char title[256];
  std::snprintf(title, sizeof title, "%s: %d stages, %d micro-batches",
                std::string(pipeline_schedule_name(spec.schedule)).c_str(), spec.stages,
                spec.micro);
  char chunk_note[64] = "";
  if (chunks)
    std::snprintf(chunk_note, sizeof chunk_note, ", %d chunks per stage", spec.virtual_stages);
  char figures[512];
  std::snprintf(figures, sizeof figures,
                "makespan %s  ·  bubble %.1f%%  ·  utilization %.1f%%  ·  peak activations per stage: %s",
                fmt(sim.makespan).c_str(), 100 * sim.bubble_fraction, 100 * sim.utilization,
                peaks_text(sim.peak_activations).c_str());
  o << "<text x=\"" << left << "\" y=\"26\" font-size=\"18\" font-weight=\"bold\">" << title << chunk_note
    << "</text>\n<text x=\"" << left << "\" y=\"48\" font-size=\"13\" fill=\"#333\">" << figures
    << "</text>\n";
  for (int s = 0; s < spec.stages; ++s) {
    const double y = top + s * (row_h + gap);
    o << "<text x=\"" << left - 10 << "\" y=\"" << y + row_h / 2 + 5
      << "\" font-size=\"13\" text-anchor=\"end\">stage " << s << "</text>\n"
      << "<rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << plot_w << "\" height=\""
      << row_h << "\" fill=\"url(#idle)\"/>\n";
    for (const TimedAction& t : sim.timeline[static_cast<std::size_t>(s)]) {
      const double x = left + t.start * scale, w = (t.end - t.start) * scale;
      if (w <= 0) continue;
      const std::string hue = kHues[t.action.micro % 10];
      std::string fill = hue, stroke = tint(hue, 0.0), text_fill = "white", dash;
      double stroke_w = 1;
      if (t.action.kind == ActionKind::forward) {
        fill = tint(hue, 0.6);
        stroke = hue;
        text_fill = "#111";
      } else if (t.action.kind == ActionKind::weight) {
        fill = "white";
        stroke = hue;
        text_fill = "#111";
        stroke_w = 2.5;
        dash = " stroke-dasharray=\"4 2\"";
      }
      o << "<rect x=\"" << x + 0.75 << "\" y=\"" << y + 1.5 << "\" width=\"" << std::max(w - 1.5, 0.5)
        << "\" height=\"" << row_h - 3 << "\" fill=\"" << fill << "\" stroke=\"" << stroke
        << "\" stroke-width=\"" << stroke_w << "\"" << dash << " rx=\"3\"><title>stage " << s << ' '
        << action_label(t.action, chunks) << ": " << fmt(t.start) << " to " << fmt(t.end)
        << "</title></rect>\n";
      const std::string label = action_label(t.action, chunks);
      const double font = std::min(12.0, (w - 4) / (0.62 * static_cast<double>(label.size())));
      if (font >= 7)
        o << "<text x=\"" << x + w / 2 << "\" y=\"" << y + row_h / 2 + font * 0.36
          << "\" font-size=\"" << fmt(font) << "\" text-anchor=\"middle\" fill=\"" << text_fill
          << "\">" << label << "</text>\n";
    }
  }
  // Time axis.
  const double ay = top + rows_h + 8;
  o << "<line x1=\"" << left << "\" y1=\"" << ay << "\" x2=\"" << left + plot_w << "\" y2=\"" << ay
    << "\" stroke=\"#333\"/>\n";
  // Ticks relative to the makespan (an absolute 1e-9 put the ticks of a 1e-15 makespan millions
  // of pixels to the right); a zero makespan has the one tick at 0.
  const double step = sim.makespan > 0 ? nice_step(sim.makespan) : 1.0;
  const int ticks = static_cast<int>(std::floor(sim.makespan / step * (1 + 1e-9)));
  for (int i = 0; i <= ticks; ++i) {
    const double t = i * step;
    const double x = left + t * scale;
    o << "<line x1=\"" << x << "\" y1=\"" << ay << "\" x2=\"" << x << "\" y2=\"" << ay + 5
      << "\" stroke=\"#333\"/><text x=\"" << x << "\" y=\"" << ay + 18
      << "\" font-size=\"11\" text-anchor=\"middle\">" << fmt(t) << "</text>\n";
  }
  o << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << ay + 34
    << "\" font-size=\"12\" text-anchor=\"middle\" fill=\"#333\">time (forward " << fmt(costs.forward[0])
    << ", backward " << fmt(costs.backward[0]) << ", weight " << fmt(costs.weight[0])
    << (same_on_every_stage(costs) ? "" : " on stage 0") << ", transfer " << fmt(costs.transfer)
    << ")</text>\n";
  // Legend.
  const double ly = ay + 48;
  double lx = left;
  auto swatch = [&](const std::string& fill, const std::string& stroke, double sw,
                    const std::string& dash, const std::string& text) {
    o << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"26\" height=\"16\" fill=\"" << fill
      << "\" stroke=\"" << stroke << "\" stroke-width=\"" << sw << "\"" << dash
      << " rx=\"3\"/><text x=\"" << lx + 32 << "\" y=\"" << ly + 12.5 << "\" font-size=\"12\">"
      << text << "</text>\n";
    lx += 40 + 7.2 * static_cast<double>(text.size());
  };
  const std::string h = kHues[0];
  swatch(tint(h, 0.6), h, 1, "", "F forward");
  if (spec.schedule != PipelineSchedule::fill_drain)
    swatch(h, h, 1, "", spec.schedule == PipelineSchedule::zb_h1 ? "B input gradient" : "B backward");
  if (spec.schedule == PipelineSchedule::zb_h1)
    swatch("white", h, 2.5, " stroke-dasharray=\"4 2\"", "W weight gradient");
  swatch("url(#idle)", "#bbb", 1, "", "idle");
  o << "<text x=\"" << lx << "\" y=\"" << ly + 12.5
    << "\" font-size=\"12\" fill=\"#333\">colour = micro-batch" << (chunks ? "; label F&lt;mb&gt;.&lt;chunk&gt;" : "")
    << "</text>\n</svg>\n";
  const std::string text = o.str();
  with_flag("--svg", [&] { write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size()))); });
}

void run_pipeline(const PipelineArgs& a) {
  CPATTN_CHECK(a.stages >= 1, "--stages must be >= 1, got ", a.stages);
  CPATTN_CHECK(a.micro >= 1, "--micro must be >= 1, got ", a.micro);
  const PipelineSchedule kind = *parse_pipeline_schedule(a.schedule);
  const bool interleaved = kind == PipelineSchedule::interleaved;
  if (a.virtual_stages) {
    CPATTN_CHECK(*a.virtual_stages >= 1, "--virtual must be >= 1, got ", *a.virtual_stages);
    CPATTN_CHECK(interleaved || *a.virtual_stages == 1,
                 "--virtual applies to --schedule interleaved only, got --virtual ",
                 *a.virtual_stages, " with ", a.schedule);
  }
  CPATTN_CHECK(!interleaved || a.micro % a.stages == 0,
               "--micro must be a multiple of --stages with --schedule interleaved (Megatron's "
               "rule), got --micro ", a.micro, " and --stages ", a.stages);
  CPATTN_CHECK(std::isfinite(a.transfer) && a.transfer >= 0, "--transfer must be >= 0, got ",
               a.transfer);
  // make_schedule's limits, by flag and before the costs are laid out per stage (a billion
  // stages allocated 24 GB first).
  const int v = a.virtual_stages.value_or(interleaved ? 2 : 1);
  CPATTN_CHECK(a.stages <= 1024, "--stages must be <= 1024, got ", a.stages);
  CPATTN_CHECK(int64_t{a.stages} * a.micro * v <= 1'000'000, "--stages * --micro * --virtual must be <= 10^6 (the "
               "schedule's tick table), got ", a.stages, " * ", a.micro, " * ", v);
  if (!a.svg.empty()) check_output_path(a.svg, "--svg");  // before any work
  const PipelineCosts costs = parse_costs(a.costs, a.stages, a.transfer);
  const Schedule schedule = make_schedule({.stages = a.stages,
                                           .micro = a.micro,
                                           .schedule = kind,
                                           .virtual_stages = v});
  // (what simulate still refuses is the costs' sum past the largest double: the flags' values)
  const Simulation sim = with_flag("--costs, --transfer", [&] { return simulate(schedule, costs); });
  const TickTable ticks = tick_table(schedule);
  if (!a.svg.empty()) write_svg(a.svg, sim, costs);
  if (a.json)
    print_json(sim, ticks, costs);
  else
    print_table(sim, ticks, costs);
}

}  // namespace

void add_pipeline_command(CLI::App& app) {
  auto args = std::make_shared<PipelineArgs>();
  CLI::App* cmd = app.add_subcommand(
      "pipeline",
      "A pipeline-parallel schedule: its tick table (one tick per action), and its makespan, "
      "bubble fraction, utilization and peak activations simulated under the given costs. "
      "See docs/pipeline.md.");
  cmd->add_option("--stages", args->stages, "Pipeline stages S, >= 1")->capture_default_str();
  cmd->add_option("--micro", args->micro, "Micro-batches M per step, >= 1")->capture_default_str();
  cmd->add_option("--schedule", args->schedule, "fill-drain, gpipe, 1f1b, interleaved or zb-h1")
      ->check(CLI::IsMember({"fill-drain", "gpipe", "1f1b", "interleaved", "zb-h1"}))
      ->capture_default_str();
  cmd->add_option("--virtual", args->virtual_stages,
                  "Model chunks per stage V for --schedule interleaved (default 2)");
  cmd->add_option("--costs", args->costs,
                  "Forward,backward,weight-gradient time of one micro-batch: one triple for "
                  "every stage (1,1,1, the default) or one per stage joined by '/' "
                  "(1,2,1/1,2,1/2,3,1). Schedules that do not split the backward run B as "
                  "backward + weight");
  cmd->add_option("--transfer", args->transfer, "Time of one send between stages, >= 0")
      ->capture_default_str();
  cmd->add_flag("--json", args->json,
                "Print one JSON object: ticks (per tick, per stage: F<mb>, B<mb>, W<mb> or idle; "
                "interleaved F<mb>.<chunk>), actions, timeline, makespan, bubble_fraction, "
                "utilization, peak_activations");
  cmd->add_option("--svg", args->svg, "Also draw the simulated timeline into this SVG file")->check(path_flag());
  cmd->callback([args] { run_pipeline(*args); });
}

}  // namespace cpattn::cli
