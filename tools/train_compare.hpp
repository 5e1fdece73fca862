// `cpattn train --compare 1,2,dp2xcp2`: the same training at each CP size or mesh shape, each
// run as its own MPI job (mpirun -np ranks <this program> train ...), the JSON logs read back
// and the loss and gradient-norm curves printed side by side with their relative differences
// (and, with --svg, drawn on one chart).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace cpattn::cli {

// One job of the comparison.
struct CompareRun {
  std::string label;  // "cp4", "dp2xcp2": names the run in the table and the chart
  int ranks = 1;      // its mpirun -np
};

struct CompareOptions {
  std::vector<CompareRun> runs;  // the first one is the reference
  std::string mpirun;            // the launcher
  int print_every = 1;           // print every Nth step of the table
  std::string svg;               // when set, the loss curves of every run on one chart, to this file
  // The arguments of `cpattn train` (after the program's path) for runs[index], its JSON log
  // written to `json_log`.
  std::function<std::vector<std::string>(std::size_t index, const std::string& json_log)> train_args;
};

// Runs the jobs one after the other (logs in a fresh folder under $TMPDIR, else /tmp) and prints the table.
// Refuses to run under mpirun. A failed job ends the program (ExitCode) after printing the
// tail of its output.
void compare_runs(const CompareOptions& o);

}  // namespace cpattn::cli
