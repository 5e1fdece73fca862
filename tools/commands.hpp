// The subcommands of the `cpattn` command line. Each registers itself on the app and runs
// through its callback; errors reach main() as exceptions (see main.cpp for the exit codes).
#pragma once

#include <CLI/CLI.hpp>
#include <cpattn/error.hpp>

#include <charconv>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace cpattn::check {
struct AttnBenchOptions;
}

namespace cpattn::cli {

// Thrown by a subcommand to end the program with `code` after printing what it had to.
struct ExitCode {
  int code;
};

// Whether MPI has started in this process (MpiSession::ever_initialized), for the quiet ranks'
// messages (app.cpp): set by main(); the fuzzers, built without MPI, leave it null (not started).
inline bool (*mpi_started)() = nullptr;

// The app's name and global flags, and the parse-and-run frame with cpattn's exit codes.
void configure_app(CLI::App& app);
int run_app(CLI::App& app, int argc, const char* const* argv);

// The check of every flag that takes a path: given, its value must not be empty (an empty
// value was read as the flag not given, e.g. --svg "" drew nothing and said nothing).
inline const CLI::Validator& path_flag() {
  static const CLI::Validator v([](const std::string& s) { return s.empty() ? std::string("a path must not be empty") : std::string(); },
                                "PATH");
  return v;
}

// The check of a count flag that must be >= 1 ("must be >= 1, got 0"; CLI's PositiveNumber
// prints the whole range of a double). A value that is no integer is left to the conversion.
inline const CLI::Validator& at_least_one() {
  static const CLI::Validator v(
      [](const std::string& s) {
        long long x = 0;  // (read as the option's own conversion reads it: 0x0, " 0", ...)
        return CLI::detail::lexical_cast(s, x) && x < 1 ? "must be >= 1, got " + s : std::string();
      },
      "INT >= 1");
  return v;
}

// The check of each value of an integer list flag (--lengths 16,24): within int64. CLI11's
// conversion takes a value past it as the limit, so an error quoted -9223372036854775808 for a
// --lengths of -99999999999999999999. Other malformed values are left to the conversion.
inline const CLI::Validator& int64_value() {
  static const CLI::Validator v(
      [](const std::string& s) {
        std::int64_t x = 0;
        const char* b = s.data() + (s.starts_with('+') ? 1 : 0);
        return std::from_chars(b, s.data() + s.size(), x).ec == std::errc::result_out_of_range
                   ? "must be an integer within int64 (|x| <= 9223372036854775807), got " + s
                   : std::string();
      },
      "INT");
  return v;
}

// Runs `f` and returns what it returns; a cpattn::Error from the library (which names its own
// arguments) gets the flag (or flags) that gave them in front: "--costs: ...".
template <class F>
auto with_flag(const char* flag, F&& f) -> decltype(f()) {
  return rewrite_errors(f, [flag](const std::string& m) { return std::string(flag) + ": " + m; });
}

// Parses one document length per line (blank lines and '#' comments skipped); errors name the
// file and line.
std::vector<int64_t> read_lengths_file(const std::string& path);
// The same on the file's text (`path` names it in messages; fuzz_lengths feeds it bytes).
std::vector<int64_t> parse_lengths_file(std::istream& text, const std::string& path);

// Refuses an attention benchmark case (check::run_attention_bench) past the available memory,
// naming `what` and both sizes (cmd_bench.cpp; cpattn bench attention and cpattn calibrate).
void check_bench_memory(const check::AttnBenchOptions& o, const std::string& what);

// The router flags' rules that `cpattn moe` and `cpattn train` share, named by flag:
// --capacity-factor finite and > 0 (when given), --aux-loss-coeff finite and >= 0 and only with
// --router softmax (cmd_moe.cpp).
void check_router_flags(const std::optional<double>& capacity_factor, double aux_loss_coeff,
                        const std::string& router);

void add_plan_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_mesh_command(CLI::App& app);
void add_pipeline_command(CLI::App& app);
void add_moe_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_calibrate_command(CLI::App& app);

}  // namespace cpattn::cli
