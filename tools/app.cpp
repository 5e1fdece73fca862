// The command line's frame: parsing, dispatch and exit codes, shared by `cpattn` and the
// command-line fuzzer. Exit codes (docs/cli.md): 0 success, 1 a run that failed its own check
// or an unexpected error, 2 bad flags, values or files (one line on stderr, no stack trace).
#include <cpattn/error.hpp>
#include <cpattn/version.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>
#include <thread>

#include "commands.hpp"


namespace cpattn::cli {

namespace {
// Under mpirun every rank parses the same flags and meets the same error: only rank 0 says so.
const char* world_rank() { return std::getenv("OMPI_COMM_WORLD_RANK"); }
bool quiet_rank() {
  const char* rank = world_rank();
  return rank != nullptr && std::atoi(rank) != 0;
}

// A quiet rank's exit code: after a pause, because mpirun ends the whole job at the first
// non-zero exit, and a quiet rank that exits first would kill rank 0 before it prints the
// line that says why. An error met before MPI started may be this rank's alone (launched with
// other flags than rank 0, say): the rank says it itself after the pause, naming its rank (the
// job is usually over by then when rank 0 met it too). After MPI started, the errors ranks meet
// are agreed, every rank's the same, and rank 0 says them.
int quiet_exit(int code, const std::string& message) {
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const char* rank = world_rank();
  if (!message.empty() && !(mpi_started != nullptr && mpi_started()))
    std::fprintf(stderr, "cpattn: error (rank %s): %s\n", rank != nullptr ? rank : "?", message.c_str());
  return code;
}
// CLI11 drops the empty fields of a comma-separated value (`--lengths 16,,24` read as 16,24,
// `--lengths 16,` as 16): a value of an option that splits at commas is refused, naming the flag,
// where a field is empty. Follows the command line's subcommands as CLI11 does; a value is a
// token after the option (or after its '=') up to the next flag.
void refuse_empty_list_fields(CLI::App& app, int argc, const char* const* argv) {
  CLI::App* at = &app;
  const CLI::Option* list = nullptr;  // the comma-splitting option whose values follow
  const auto check = [](const CLI::Option& o, std::string_view v) {
    if (v.empty() || v.front() == ',' || v.back() == ',' || v.find(",,") != std::string_view::npos)
      throw Error(o.get_name() + ": an empty field in '" + std::string(v) +
                  "' (one value between each two commas, none at either end)");
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view t = argv[i];
    const bool flag = t.size() > 1 && t[0] == '-' && !(t[1] >= '0' && t[1] <= '9') && t[1] != '.';
    if (flag) {
      const std::size_t eq = t.find('=');
      const CLI::Option* o = t.starts_with("--") ? at->get_option_no_throw(std::string(t.substr(0, eq))) : nullptr;
      list = o != nullptr && o->get_delimiter() == ',' ? o : nullptr;
      if (list != nullptr && eq != std::string_view::npos) {
        check(*list, t.substr(eq + 1));
        list = nullptr;
      }
    } else if (list != nullptr) {
      check(*list, t);
    } else {
      const std::vector<CLI::App*> sub = at->get_subcommands([&](CLI::App* a) { return a->get_name() == t; });
      if (!sub.empty()) at = sub.front();
    }
  }
}
}  // namespace

void configure_app(CLI::App& app) {
  app.name("cpattn");
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print the help of every subcommand");
  app.set_version_flag("--version", std::string("cpattn ") + CPATTN_VERSION_STRING, "Print cpattn's version");
}

int run_app(CLI::App& app, int argc, const char* const* argv) {
  try {
    refuse_empty_list_fields(app, argc, argv);
    app.parse(argc, argv);
  } catch (const ExitCode& e) {
    return e.code != 0 && quiet_rank() ? quiet_exit(e.code, {}) : e.code;  // (the command said why)
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (quiet_rank()) return quiet_exit(2, e.what());
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-')
      std::fprintf(stderr, "cpattn: error: unknown command '%s' (see cpattn --help)\n", argv[1]);
    else
      std::fprintf(stderr, "cpattn: error: %s (see cpattn --help)\n", e.what());
    return 2;
  } catch (const Error& e) {
    if (quiet_rank()) return quiet_exit(2, e.message());
    std::fprintf(stderr, "cpattn: error: %s\n", e.message().c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpattn: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace cpattn::cli
