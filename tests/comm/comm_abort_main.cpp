// The deadline's default action, run by CTest as its own job: the last rank sleeps far past
// a 1 s deadline while the others enter an all-gather. They must print the timeout line and
// MPI_Abort the whole job, the sleeper included, long before its sleep ends. CTest passes the
// test on the line (PASS_REGULAR_EXPRESSION) and its TIMEOUT bounds the time.
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "cpattn/comm.hpp"

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  {
    cpattn::Communicator comm(MPI_COMM_WORLD, {.timeout_s = 1.0});  // abort is the default
    comm.barrier();  // call #1: everyone is here
    std::vector<float> mine(4, 1.0f), all(4 * static_cast<std::size_t>(comm.size()));
    if (comm.rank() == comm.size() - 1) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      std::fprintf(stderr, "rank %d: the late rank was not ended by MPI_Abort\n", comm.rank());
    }
    comm.all_gather<float>(mine, all);  // call #2
    std::fprintf(stderr, "rank %d: all_gather returned, no timeout\n", comm.rank());
  }
  return 0;
}
