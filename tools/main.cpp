// `cpattn`: the command line. Exit codes: 0 success, 1 a run that failed its own check or an
// unexpected error, 2 bad flags or values (one line on stderr, no stack trace).
#include <cpattn/error.hpp>

#include <cstdio>
#include <exception>

#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"cpattn: context-parallel attention on packed variable-length sequences"};
  app.name("cpattn");
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print the help of every subcommand");
  cpattn::cli::add_plan_command(app);
  try {
    app.parse(argc, argv);
  } catch (const cpattn::cli::ExitCode& e) {
    return e.code;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-')
      std::fprintf(stderr, "cpattn: error: unknown command '%s' (see cpattn --help)\n", argv[1]);
    else
      std::fprintf(stderr, "cpattn: error: %s (see cpattn --help)\n", e.what());
    return 2;
  } catch (const cpattn::Error& e) {
    std::fprintf(stderr, "cpattn: error: %s\n", e.message().c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpattn: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
