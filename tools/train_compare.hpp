// `cpattn train --compare 1,2,4`: the same training at each CP size, each run as its own MPI
// job (mpirun -np cp <this program> train ...), the JSON logs read back and the loss and
// gradient-norm curves printed side by side with their relative differences.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace cpattn::cli {

struct CompareOptions {
  std::vector<int> cps;  // the CP sizes, the first one the reference
  std::string mpirun;    // the launcher
  int print_every = 1;   // print every Nth step of the table
  // The arguments of `cpattn train` (after the program's path) for one CP size, its JSON log
  // written to `json_log`.
  std::function<std::vector<std::string>(int cp, const std::string& json_log)> train_args;
};

// Runs the jobs one after the other (logs in a fresh folder under /tmp) and prints the table.
// Refuses to run under mpirun. A failed job ends the program (ExitCode) after printing the
// tail of its output.
void compare_runs(const CompareOptions& o);

}  // namespace cpattn::cli
