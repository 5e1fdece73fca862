// `cpattn`: the command line (see app.cpp for parsing and exit codes).
#include <cpattn/comm.hpp>

#include "commands.hpp"

int main(int argc, char** argv) {
  cpattn::cli::mpi_started = &cpattn::MpiSession::ever_initialized;
  CLI::App app{"cpattn: context-parallel attention on packed variable-length sequences"};
  cpattn::cli::configure_app(app);
  cpattn::cli::add_plan_command(app);
  cpattn::cli::add_run_command(app);
  cpattn::cli::add_bench_command(app);
  cpattn::cli::add_train_command(app);
  cpattn::cli::add_mesh_command(app);
  cpattn::cli::add_pipeline_command(app);
  cpattn::cli::add_moe_command(app);
  cpattn::cli::add_simulate_command(app);
  cpattn::cli::add_calibrate_command(app);
  return cpattn::cli::run_app(app, argc, argv);
}
