// The deadline's default action, run by CTest as its own job: the last rank sleeps far past
// a 1 s deadline while the others enter an all-gather. They must print the timeout line and
// MPI_Abort the whole job, the sleeper included, long before its sleep ends. CTest passes the
// test on the line (PASS_REGULAR_EXPRESSION) and its TIMEOUT bounds the time.
//
// With the argument "split": the same in throw_error mode around split(), whose color gather
// aborts whatever the mode says: the late rank (3 s) found the gather complete and waited in
// the blocking MPI_Comm_split for ever, the others having thrown and left.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  const bool split = argc > 1 && std::string(argv[1]) == "split";
  {
    cpattn::Communicator comm(MPI_COMM_WORLD, {.timeout_s = 1.0,
                                               .on_timeout = split ? cpattn::TimeoutAction::throw_error
                                                                   : cpattn::TimeoutAction::abort});
    comm.barrier();  // call #1: everyone is here
    const bool late = comm.rank() == comm.size() - 1;
    if (split) {
      if (late) std::this_thread::sleep_for(std::chrono::seconds(3));
      try {
        const cpattn::Communicator half = comm.split(0, comm.rank());  // call #2
        std::fprintf(stderr, "rank %d: split returned, no timeout\n", comm.rank());
      } catch (const cpattn::Error& e) {
        std::fprintf(stderr, "rank %d: split threw, the job goes on: %s\n", comm.rank(), e.what());
      }
      return 0;
    }
    std::vector<float> mine(4, 1.0f), all(4 * static_cast<std::size_t>(comm.size()));
    if (late) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      std::fprintf(stderr, "rank %d: the late rank was not ended by MPI_Abort\n", comm.rank());
    }
    comm.all_gather<float>(mine, all);  // call #2
    std::fprintf(stderr, "rank %d: all_gather returned, no timeout\n", comm.rank());
  }
  return 0;
}
