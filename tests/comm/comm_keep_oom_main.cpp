// Out of memory while a timed-out call's buffers are handed over (throw mode), run by CTest as
// its own job: rank 0 times out (1 s) in an all-gather the last rank joins 3 s late, its
// requests still pending on its own buffers, and hands those to Communicator::keep_if_poisoned
// with operator new set to fail. argv[1]:
//   object  the object that keeps them cannot be allocated (keep_if_poisoned's first allocation);
//   slot    the communicator's slot for that object cannot (retain_while_pending's, the second);
//   none    nothing fails: the buffers are kept, the late rank's data lands, the requests drain
//           and every rank prints its line (the case the other two would reach without the rule).
// Out of memory, the buffers must never be freed under the pending requests: the rank prints
// the line naming the timed-out call and ends the job (MPI_Abort) instead of returning.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

namespace {
std::atomic<int> fail_in{0};  // > 0: the fail_in-th operator new from now throws std::bad_alloc (any thread)
}  // namespace

void* operator new(std::size_t n) {
  if (fail_in.load() > 0 && fail_in.fetch_sub(1) == 1) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  const int fail_at = what == "object" ? 1 : what == "slot" ? 2 : what == "none" ? 0 : -1;
  if (fail_at < 0) {
    std::fprintf(stderr, "usage: comm_keep_oom_test object|slot|none\n");
    return 2;
  }
  const cpattn::MpiSession mpi(argc, argv);
  {
    cpattn::Communicator comm(MPI_COMM_WORLD,
                              {.timeout_s = 1.0, .on_timeout = cpattn::TimeoutAction::throw_error});
    comm.barrier();  // call #1: everyone is here
    const int r = comm.rank(), p = comm.size();
    std::vector<float> mine(256, static_cast<float>(r + 1)), all(256 * static_cast<std::size_t>(p), -1.0f);
    if (r == p - 1) {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      try {
        comm.all_gather<float>(mine, all);  // call #2: completes against rank 0's pending requests
      } catch (const cpattn::Error&) {
      }
    } else {
      try {
        comm.all_gather<float>(mine, all);
        std::fprintf(stderr, "rank %d: all_gather returned, no timeout\n", r);
      } catch (const cpattn::Error&) {
        fail_in = fail_at;
        comm.keep_if_poisoned(mine, all);  // out of memory: never returns
        fail_in = 0;
        const bool kept = mine.empty() && all.empty();
        std::fprintf(stderr, "rank %d: buffers %s, requests %s\n", r, kept ? "kept" : "NOT kept",
                     comm.drain(30) ? "drained" : "NOT drained");
      }
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "rank %d: done\n", rank);
  return 0;
}
