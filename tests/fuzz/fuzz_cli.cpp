// Fuzzes the command line's parser with `cpattn plan`: the input is split at NUL bytes into
// arguments. Any arguments must end in an exit code (0 or 2), never a crash or an escaping
// exception.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The plan's tables are not the point here (scripts/fuzz.sh also runs this target with
  // -close_fd_mask=2 for its one-line errors; a crash still leaves its input behind).
  if (!std::freopen("/dev/null", "w", stdout)) return 1;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"cpattn", "plan"};
  std::string cur;
  for (size_t i = 0; i < size && args.size() < 32; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) args.push_back(cur);
  for (const std::string& a : args)  // a lengths file would read the disk: keep to flags
    if (a.find("--lengths-file") != std::string::npos) return 0;
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  CLI::App app{"fuzz"};
  cpattn::cli::configure_app(app);
  cpattn::cli::add_plan_command(app);
  const int rc = cpattn::cli::run_app(app, static_cast<int>(argv.size()), argv.data());
  if (rc != 0 && rc != 2) std::abort();
  return 0;
}
