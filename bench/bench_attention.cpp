// Standalone build of `cpattn bench attention` (same code, tools/cmd_bench.cpp), for trees
// built without the CLI:  bench_attention bench attention --seq-len 8192 --threads 1 --json
#include <cpattn/error.hpp>

#include <cstdio>
#include <exception>

#include "../tools/commands.hpp"

namespace cpattn::cli {
void add_bench_command(CLI::App& app);  // tools/cmd_bench.cpp
}

int main(int argc, char** argv) {
  CLI::App app{"cpattn benchmarks"};
  app.require_subcommand(1);
  cpattn::cli::add_bench_command(app);
  try {
    app.parse(argc, argv);
  } catch (const cpattn::cli::ExitCode& e) {  // a failed check (1), already reported
    return e.code;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // exit codes as cpattn's: 2 bad input, 1 a failed check
    std::fprintf(stderr, "bench_attention: error: %s\n", e.what());
    return 2;
  } catch (const cpattn::Error& e) {
    std::fprintf(stderr, "bench_attention: error: %s\n", e.message().c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
