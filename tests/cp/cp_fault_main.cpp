// Faults in the middle of CP attention, each run by CTest as its own job under an outer
// timeout (issue: nothing may hang). argv[1] picks the fault, always on the last rank:
//   sleep        sleeps far past the 2 s collective deadline before forward: the others must
//                print the timeout line naming the operation and MPI_Abort the whole job;
//   kill-before  dies by SIGKILL before forward;
//   kill-during  dies by SIGKILL from a second thread while forward moves a large K/V;
//   stall-during stops (SIGSTOP, as a hung rank) 10 ms into an overlapped forward (4 KV-head
//                groups), its transfers posted or in flight: the others, computing on the
//                groups that arrived, must time out on a point-to-point transfer with it and end
//                the job (a rank whose every transfer with it completed before the stop
//                finishes that forward legitimately and goes on to a second one, which the
//                stopped rank never joins: the others' timeout or the deadline ends it). 50 ms
//                landed after the transfers once the forward stopped copying K/V (2026-12-04);
//                10 ms lands in them here (recv timeouts in 8 runs of 8);
//   stall-shared the same stop in a forward over the node's shared memory (the others take
//                the message path in every other fault): the others wait in the barrier after
//                writing their K/V rows (or, if the stop came after it, in the next forward's
//                agreement) and time out there;
//   throw-during throws in the middle of an overlapped forward (4 KV-head groups): its first
//                kernel call, after group 0's blocks are in and groups 1-3 in flight both
//                ways, finds CPATTN_KERNEL_PATH naming no path (set on this rank only, after the
//                layer was made) and throws. The layer must hand the in-flight requests and
//                their buffers to the communicator before it unwinds (main's e3615a1); the
//                rank prints the error, keeps MPI moving the transfers for a second (into the
//                kept buffers: freed ones are what ASan flags) and ends the job with MPI_Abort;
//                the others finish their forward and wait in a barrier the faulty rank never
//                joins, until the abort or the deadline ends them.
// CTest passes each on the expected message and bounds its time.
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  const std::string fault = argc > 1 ? argv[1] : "";
  {
    cpattn::Communicator comm(MPI_COMM_WORLD, {.timeout_s = 2.0});
    const bool faulty = comm.rank() == comm.size() - 1;
    // Large enough that the all-gather of K and V takes a while; for the stall, small enough
    // that the overlapped forward's first groups take well under the deadline (also under ASan).
    const bool overlapped = fault == "stall-during" || fault == "throw-during" || fault == "stall-shared";
    const std::vector<int64_t> cu = overlapped ? std::vector<int64_t>{0, 6000, 8192}
                                               : std::vector<int64_t>{0, 40000, 65536};
    const cpattn::RankPlan p = cpattn::get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank());
    const int h = 8, d = 64;
    std::vector<float> q(p.local_tokens * h * d, 0.01f), k(q.size(), 0.02f), v(q.size(), 0.03f), out(q.size());
    cpattn::CpAttention attn(comm, {.num_heads_q = h, .num_heads_k = h, .head_dim_qk = d, .head_dim_v = d,
                                    .overlap = overlapped, .shared_memory = fault == "stall-shared"});
    comm.barrier();
    if (faulty && fault == "sleep") {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      std::fprintf(stderr, "rank %d: the late rank was not ended by MPI_Abort\n", comm.rank());
    }
    if (faulty && fault == "kill-before") std::raise(SIGKILL);
    if (faulty && fault == "throw-during") ::setenv("CPATTN_KERNEL_PATH", "no-such-path", 1);
    std::thread killer;
    if (faulty && (fault == "stall-during" || fault == "stall-shared"))
      killer = std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        std::raise(SIGSTOP);  // the whole process, as a hung rank
      });
    if (faulty && fault == "kill-during")
      killer = std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::raise(SIGKILL);
      });
    const int64_t t = p.local_tokens;
    try {
      for (int call = 0; call < (fault == "stall-during" || fault == "stall-shared" ? 2 : 1); ++call)
        (void)attn.forward({.cu_seqlens = cu, .q = cpattn::contiguous(q.data(), t, h, d),
                            .k = cpattn::contiguous(k.data(), t, h, d), .v = cpattn::contiguous(v.data(), t, h, d),
                            .out = cpattn::contiguous(out.data(), t, h, d)});
    } catch (const cpattn::Error& e) {
      if (!(faulty && fault == "throw-during")) throw;
      // The calls show where: past the barrier and the agreement, every group's posts.
      std::fprintf(stderr, "rank %d: forward threw between KV-head groups after %lld communicator calls: %s\n",
                   comm.rank(), static_cast<long long>(comm.calls()), e.message().c_str());
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (std::chrono::steady_clock::now() < until) {  // MPI progress: the in-flight transfers land
        int flag = 0;
        MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
      }
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    if (fault == "throw-during") comm.barrier();  // the faulty rank never comes
    std::fprintf(stderr, "rank %d: forward returned, no fault seen\n", comm.rank());
    if (killer.joinable()) killer.join();
  }
  return 0;
}
