// `cpattn train --compare` (train_compare.hpp): one MPI job per CP size or mesh shape, then the
// curves.
#include "train_compare.hpp"

#include <cpattn/error.hpp>
#include <cpattn/file.hpp>

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "commands.hpp"

extern char** environ;

namespace cpattn::cli {

namespace {

using Clock = std::chrono::steady_clock;

// One line of a run's JSON log.
struct LogRow {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0, step_s = 0, tokens_per_s = 0;
  std::vector<double> peak_rss_mb;  // per rank
};

// Runs argv with stdout and stderr into `out_path` and an environment without Open MPI's and
// PMIx's variables (a nested mpirun must not think it runs inside this job). Returns the exit code.
int spawn(const std::vector<std::string>& argv, const std::string& out_path) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string s = *e;
    if (s.starts_with("OMPI_") && !s.starts_with("OMPI_ALLOW_RUN_AS_ROOT") && !s.starts_with("OMPI_MCA_"))
      continue;
    if (s.starts_with("PMIX_")) continue;
    env.push_back(s);
  }
  std::vector<char*> cargv, cenv;
  for (const std::string& s : argv) cargv.push_back(const_cast<char*>(s.c_str()));
  cargv.push_back(nullptr);
  for (const std::string& s : env) cenv.push_back(const_cast<char*>(s.c_str()));
  cenv.push_back(nullptr);
  std::fflush(stdout);
  const pid_t pid = fork();
  CPATTN_CHECK(pid >= 0, "--compare: fork failed: ", std::strerror(errno));
  if (pid == 0) {
    const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execvpe(cargv[0], cargv.data(), cenv.data());
    std::fprintf(stderr, "cannot run %s: %s\n", cargv[0], std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A run's log: the steps it took, and those it skipped under --skip-nonfinite (no timing, a null
// loss: left out of the curves, and counted apart), in step order.
struct RunLog {
  std::vector<LogRow> rows;
  std::vector<int64_t> skipped;
};

RunLog read_log(const std::string& path) {
  std::ifstream in(path);
  CPATTN_CHECK(in.good(), "--compare: cannot read '", path, "'");
  RunLog log;
  std::vector<LogRow>& rows = log.rows;
  int64_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.empty()) continue;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.value("skipped", false)) {
        log.skipped.push_back(j.at("step").get<int64_t>());
        continue;
      }
      rows.push_back({j.at("step").get<int64_t>(), j.at("loss").get<double>(), j.at("grad_norm").get<double>(),
                      j.at("lr").get<double>(), j.at("step_s").get<double>(), j.at("tokens_per_s").get<double>(),
                      j.at("peak_rss_mb_per_rank").get<std::vector<double>>()});
    } catch (const nlohmann::json::exception& e) {
      throw Error("--compare: the run's log '" + path + "' line " + std::to_string(line_no) +
                  " is not a step as cpattn train writes it: " + e.what());
    }
  }
  return log;
}

// The rows of every run at the steps all of them took, in the first run's order. (A step that
// only some runs skipped is a difference between them: compare_runs counts it as one.)
std::vector<std::vector<LogRow>> common_steps(const std::vector<RunLog>& runs) {
  std::vector<std::unordered_map<int64_t, std::size_t>> index(runs.size());
  for (std::size_t c = 0; c < runs.size(); ++c)
    for (std::size_t i = 0; i < runs[c].rows.size(); ++i) index[c].emplace(runs[c].rows[i].step, i);
  std::vector<std::vector<LogRow>> out(runs.size());
  for (const LogRow& row : runs[0].rows) {
    const bool everywhere =
        std::all_of(index.begin(), index.end(), [&row](const auto& ix) { return ix.contains(row.step); });
    if (!everywhere) continue;
    for (std::size_t c = 0; c < runs.size(); ++c) out[c].push_back(runs[c].rows[index[c].at(row.step)]);
  }
  return out;
}
// The loss curves of every run on one chart: step across, loss up. Curves that agree lie on
// top of each other, so each later run is drawn thinner and dashed over the wider earlier ones:
// a curve that departs shows as its own line.
std::string loss_chart_svg(const std::vector<CompareRun>& labels, const std::vector<RunLog>& runs) {
  constexpr double W = 760, H = 420, left = 70, right = 190, top = 40, bottom = 50;
  double lo = INFINITY, hi = -INFINITY;
  int64_t last = 1;
  for (const RunLog& r : runs)
    for (const LogRow& row : r.rows) {
      lo = std::min(lo, row.loss);
      hi = std::max(hi, row.loss);
      last = std::max(last, row.step);
    }
  if (!(hi > lo)) {  // one value, or none
    lo = std::isfinite(lo) ? lo - 0.5 : 0;
    hi = lo + 1;
  }
  const double pw = W - left - right, ph = H - top - bottom;
  const auto x = [&](double step) { return left + pw * step / static_cast<double>(last); };
  const auto y = [&](double loss) { return top + ph * (hi - loss) / (hi - lo); };
  static constexpr const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  std::string o;
  char b[512];
  const auto put = [&](const char* fmt, auto... v) {
    std::snprintf(b, sizeof b, fmt, v...);
    o += b;
  };
  put("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\">\n", W, H);
  put("<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  put("<text x=\"%.0f\" y=\"24\" font-size=\"15\" fill=\"#222\">cpattn train --compare: loss per step</text>\n", left);
  for (int i = 0; i <= 5; ++i) {  // horizontal grid and loss ticks
    const double v = lo + (hi - lo) * i / 5.0;
    put("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", left, left + pw, y(v), y(v));
    put("<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\" fill=\"#555\">%.3f</text>\n", left - 6,
        y(v) + 4, v);
  }
  for (int i = 0; i <= 5; ++i) {  // step ticks
    const double st = std::round(static_cast<double>(last) * i / 5.0);
    put("<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\" fill=\"#555\">%.0f</text>\n", x(st),
        top + ph + 16, st);
  }
  put("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#888\"/>\n", left, top, pw, ph);
  put("<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"middle\" fill=\"#333\">step</text>\n",
      left + pw / 2, H - 12);
  put("<text x=\"16\" y=\"%.1f\" font-size=\"12\" fill=\"#333\" transform=\"rotate(-90 16 %.1f)\" "
      "text-anchor=\"middle\">loss (nats)</text>\n", top + ph / 2, top + ph / 2);
  for (std::size_t c = 0; c < runs.size(); ++c) {
    const char* colour = kColours[c % std::size(kColours)];
    const double width = std::max(1.0, 5.0 - 1.5 * static_cast<double>(c));
    o += "<polyline fill=\"none\" stroke=\"";
    o += colour;
    put("\" stroke-width=\"%.1f\"%s points=\"", width, c == 0 ? " stroke-opacity=\"0.5\"" : " stroke-dasharray=\"6 4\"");
    for (const LogRow& row : runs[c].rows) put("%.1f,%.1f ", x(static_cast<double>(row.step)), y(row.loss));
    o += "\"><title>" + labels[c].label + "</title></polyline>\n";
    const double ly = top + 14 + 20 * static_cast<double>(c);
    put("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"%.1f\"%s/>\n",
        left + pw + 14, left + pw + 44, ly, ly, colour, width, c == 0 ? " stroke-opacity=\"0.5\"" : " stroke-dasharray=\"6 4\"");
    put("<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" fill=\"#222\">%s (%d rank%s)</text>\n", left + pw + 50, ly + 4,
        labels[c].label.c_str(), labels[c].ranks, labels[c].ranks == 1 ? "" : "s");
  }
  o += "</svg>\n";
  return o;
}
}  // namespace

void compare_runs(const CompareOptions& o) {
  CPATTN_CHECK(!o.runs.empty(), "--compare needs at least one CP size or mesh shape");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  CPATTN_CHECK(size == nullptr || std::atoi(size) == 1,
               "--compare starts its own MPI jobs: run it as plain `cpattn train --compare ...`, not under mpirun");
  // The logs' folder: under $TMPDIR (POSIX's convention), else /tmp.
  const char* tmp = std::getenv("TMPDIR");
  const std::string base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  std::string dir_template = base + "/cpattn-compare-XXXXXX";
  const char* dir = mkdtemp(dir_template.data());
  CPATTN_CHECK(dir != nullptr, "--compare: cannot create a folder in ", base, ": ", std::strerror(errno));
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  CPATTN_CHECK(n > 0, "--compare: cannot find this program's path");
  self[n] = '\0';

  std::vector<RunLog> runs;
  std::vector<double> wall;
  for (std::size_t i = 0; i < o.runs.size(); ++i) {
    const std::string& label = o.runs[i].label;
    const std::string log = std::string(dir) + "/" + label + ".jsonl";
    const std::string out = std::string(dir) + "/" + label + ".out";
    std::vector<std::string> argv = {o.mpirun, "-np", std::to_string(o.runs[i].ranks), "--oversubscribe", self};
    const std::vector<std::string> rest = o.train_args(i, log);
    argv.insert(argv.end(), rest.begin(), rest.end());
    std::printf("running %s: %s ... (output in %s)\n", label.c_str(), argv[0].c_str(), out.c_str());
    const auto t0 = Clock::now();
    const int rc = spawn(argv, out);
    wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (rc != 0) {
      std::ifstream in(out);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
      std::fprintf(stderr, "cpattn: error: the %s run failed with exit code %d:\n%s", label.c_str(), rc, text.c_str());
      throw ExitCode{rc == 2 ? 2 : 1};
    }
    runs.push_back(read_log(log));
  }

  const std::size_t k = o.runs.size();
  const std::string& reference = o.runs[0].label;
  const std::vector<std::vector<LogRow>> same = common_steps(runs);
  const std::size_t steps = same[0].size();
  std::printf("\nper-step loss and grad norm (relative differences against %s)\n", reference.c_str());
  std::printf("%6s", "step");
  for (const CompareRun& r : o.runs) std::printf("  %12s", ("loss " + r.label).c_str());
  for (const CompareRun& r : o.runs) std::printf("  %12s", ("gnorm " + r.label).c_str());
  std::printf("  %10s  %10s\n", "max dloss", "max dgnorm");
  std::vector<double> max_dl(k, 0), max_dg(k, 0), max_dl20(k, 0), max_dg20(k, 0);
  const auto rel = [](double x, double ref) { return std::abs(x - ref) / std::max(std::abs(ref), 1e-30); };
  for (std::size_t s = 0; s < steps; ++s) {
    double dl = 0, dg = 0;
    for (std::size_t c = 1; c < k; ++c) {
      const double l = rel(same[c][s].loss, same[0][s].loss), g = rel(same[c][s].grad_norm, same[0][s].grad_norm);
      dl = std::max(dl, l);
      dg = std::max(dg, g);
      max_dl[c] = std::max(max_dl[c], l);
      max_dg[c] = std::max(max_dg[c], g);
      if (s < 20) {
        max_dl20[c] = std::max(max_dl20[c], l);
        max_dg20[c] = std::max(max_dg20[c], g);
      }
    }
    if (s % static_cast<std::size_t>(o.print_every) != 0 && s + 1 != steps) continue;
    std::printf("%6lld", static_cast<long long>(same[0][s].step));
    for (std::size_t c = 0; c < k; ++c) std::printf("  %12.6f", same[c][s].loss);
    for (std::size_t c = 0; c < k; ++c) std::printf("  %12.6f", same[c][s].grad_norm);
    std::printf("  %10.2e  %10.2e\n", dl, dg);
  }
  // Steps skipped as non-finite (--skip-nonfinite) are left out of the curves above; a run that
  // skipped other steps than the reference took a step the other did not: a difference, inf.
  for (std::size_t c = 0; c < k; ++c) {
    if (runs[c].skipped.empty() && runs[0].skipped.empty()) continue;
    std::printf("%s skipped %zu step(s) as non-finite", o.runs[c].label.c_str(), runs[c].skipped.size());
    if (c > 0 && runs[c].skipped != runs[0].skipped) {
      max_dl[c] = max_dg[c] = max_dl20[c] = max_dg20[c] = INFINITY;
      std::printf(", not the same as %s's: counted as a difference (inf)", reference.c_str());
    }
    std::printf("\n");
  }
  if (steps == 0) std::printf("no step was taken by every run: nothing compared\n");
  std::printf("\n%-12s %16s %16s %16s %16s %12s %12s %10s  %s\n", "run", "max dloss", "max dgnorm",
              "max dloss <20", "max dgnorm <20", "step_s", "tokens/s", "job s", "peak MB per rank");
  for (std::size_t c = 0; c < k; ++c) {
    double s_sum = 0, t_sum = 0;
    int cnt = 0;
    const std::vector<LogRow>& rows = runs[c].rows;
    for (std::size_t s = rows.size() > 1 ? 1 : 0; s < rows.size(); ++s, ++cnt) {
      s_sum += rows[s].step_s;
      t_sum += rows[s].tokens_per_s;
    }
    std::printf("%-12s %16.3e %16.3e %16.3e %16.3e %12.4f %12.0f %10.1f ", o.runs[c].label.c_str(), max_dl[c], max_dg[c],
                max_dl20[c], max_dg20[c], cnt ? s_sum / cnt : 0.0, cnt ? t_sum / cnt : 0.0, wall[c]);
    if (!rows.empty())
      for (const double m : rows.back().peak_rss_mb) std::printf(" %.1f", m);
    std::printf("\n");
  }
  std::printf("\n(differences are relative to %s; logs in %s)\n", reference.c_str(), dir);
  if (!o.svg.empty()) {
    const std::string text = loss_chart_svg(o.runs, runs);
    with_flag("--svg", [&] { write_file_atomically(o.svg, std::as_bytes(std::span(text.data(), text.size()))); });
    std::printf("loss curves drawn in %s\n", o.svg.c_str());
  }
}
}  // namespace cpattn::cli
