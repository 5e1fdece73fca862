// Faults in the middle of CP attention, each run by CTest as its own job under an outer
// timeout (issue: nothing may hang). argv[1] picks the fault, always on the last rank:
//   sleep        sleeps far past the 2 s collective deadline before forward: the others must
//                print the timeout line naming the operation and MPI_Abort the whole job;
//   kill-before  dies by SIGKILL before forward;
//   kill-during  dies by SIGKILL from a second thread while forward moves a large K/V;
//   stall-during stops (SIGSTOP, as a hung rank) 10 ms into an overlapped forward (the second,
//                after one whole forward on every rank; 4 KV-head groups), its transfers posted
//                or in flight: the others, computing on the
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
//   handover-fused, handover-overlap (2 ranks; the communicator throws on a timeout instead of
//                ending the job): the last rank runs its backward on the portable kernels,
//                seconds past the 1 s deadline, so rank 0 times out waiting for its dK/dV
//                with its own dK/dV partials in flight, destroys its layer (which hands its
//                state to the communicator) and fills new buffers of the partials' sizes; the
//                late rank's transfers then complete against the kept state (freed partials
//                would be read as the new buffers' 7s, crash the transfer, or be ASan's
//                use-after-free). Rank 0's new buffers must stay untouched and its requests
//                drain. Overlapped (2 KV-head groups, every group's transfers posted before
//                rank 0 waits) the late rank finishes its backward, bitwise as under a 60 s
//                deadline; fused, rank 0 gave up in the dK reduce-scatter and never posts the
//                dV one, so the late rank times out there (the timeout then has to be its
//                error). Every rank prints its line and the job exits 0.
//   handover-a2a the same with the a2a scheme: rank 0 times out in the all-to-all that
//                returns dQ, with that level's send and receive blocks in flight on its inner
//                group's communicator (the level hands them over; the layer's own state is
//                not involved); the late rank then times out in the dK all-to-all. Those
//                requests are the inner group's, which the test cannot reach: the new buffers
//                are its check, not a drain.
// CTest passes each on the expected message and bounds its time.
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

namespace {

// The handover faults above, by the part after "handover-". 0 when every check held.
int timeout_handover(const std::string& kind) {
  const bool overlap = kind == "overlap";
  using cpattn::contiguous;
  cpattn::Communicator comm(MPI_COMM_WORLD, {.timeout_s = 1.0, .on_timeout = cpattn::TimeoutAction::throw_error});
  cpattn::Communicator patient(MPI_COMM_WORLD, {.timeout_s = 60.0, .on_timeout = cpattn::TimeoutAction::throw_error});
  const int rank = comm.rank();
  const bool late = rank == comm.size() - 1;
#if defined(__SANITIZE_ADDRESS__)  // (ASan's portable backward takes 4x as long on a quarter of the work)
  const std::vector<int64_t> cu{0, 3000, 4096};
#else
  const std::vector<int64_t> cu{0, 6000, 8192};
#endif
  const auto plan = std::make_shared<const cpattn::RankPlan>(
      cpattn::get_thd_load_balanced_cp_metadata(cu, comm.size(), rank));
  // Overlapped: 2 KV-head groups of 4 query heads, each group's backward on the late rank well
  // past the deadline (the other waits on one group's transfers at a time).
  const int h = 8, hkv = overlap ? 2 : 8, d = overlap ? 128 : 64;
  const int64_t t = plan->local_tokens;
  const auto n = static_cast<std::size_t>(t * h * d), nkv = static_cast<std::size_t>(t * hkv * d);
  std::vector<float> q(n), k(nkv), v(nkv), dout(n), out(n);
  const auto fill = [rank](std::vector<float>& x, float scale, float offset) {
    for (std::size_t i = 0; i < x.size(); ++i)  // varied values: the sums' order shows in their bits
      x[i] = static_cast<float>((i * 2654435761u + static_cast<std::size_t>(rank) * 40503u) % 1000u) * scale + offset;
  };
  fill(q, 1e-3f, -0.5f);
  fill(k, -7e-4f, 0.4f);
  fill(v, 2e-3f, -1.0f);
  fill(dout, -5e-4f, 0.3f);
  const cpattn::CpAttnConfig cfg{.num_heads_q = h, .num_heads_k = hkv, .head_dim_qk = d, .head_dim_v = d,
                                 .scheme = kind == "a2a" ? cpattn::CpScheme::a2a : cpattn::CpScheme::allgather,
                                 .overlap = overlap, .shared_memory = false};
  struct Grads {
    std::vector<float> dq, dk, dv;
  };
  // One forward and backward; the late rank's backward on the portable kernels (its forward on
  // the fast ones: a slow forward would make the other time out in backward's agreement).
  const auto step = [&](cpattn::CpAttention& attn, Grads& g, bool backward = true) {
    g = {std::vector<float>(n), std::vector<float>(nkv), std::vector<float>(nkv)};
    cpattn::CpContext ctx = attn.forward({.plan = plan, .q = contiguous(q.data(), t, h, d),
                                          .k = contiguous(k.data(), t, hkv, d), .v = contiguous(v.data(), t, hkv, d),
                                          .out = contiguous(out.data(), t, h, d)});
    if (!backward) return;
    if (late) ::setenv("CPATTN_KERNEL_PATH", "portable", 1);
    MPI_Barrier(MPI_COMM_WORLD);  // (the forwards' skew, seconds under ASan, is not the deadline's to cover)
    try {
      attn.backward(ctx, {.q = contiguous(q.data(), t, h, d), .out = contiguous(out.data(), t, h, d),
                          .dout = contiguous(dout.data(), t, h, d), .dq = contiguous(g.dq.data(), t, h, d),
                          .dk = contiguous(g.dk.data(), t, hkv, d), .dv = contiguous(g.dv.data(), t, hkv, d)});
    } catch (...) {
      ::unsetenv("CPATTN_KERNEL_PATH");
      throw;
    }
    ::unsetenv("CPATTN_KERNEL_PATH");
  };
  Grads want, got;
  {  // the reference for the one kind whose late rank finishes (overlap); else a forward alone,
     // so that the first call's start-up (threads, MPI's connections) is not the deadline's
    cpattn::CpAttention attn(patient, cfg);
    step(attn, want, overlap);
  }
  MPI_Barrier(MPI_COMM_WORLD);  // (the ranks leave the warm-up apart; the next call is under 1 s)
  int failed = 0;
  const auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, why.c_str());
    failed = 1;
  };
  std::vector<std::vector<float>> reused;
  auto attn = std::make_unique<cpattn::CpAttention>(comm, cfg);
  bool late_timed_out = false;
  try {
    step(*attn, got);
    if (!late) fail("the backward returned: no timeout");
    if (late && !overlap) fail("the late rank's backward returned: rank 0 never posts its later transfers");
  } catch (const cpattn::Error& e) {
    const std::string what = e.what();
    if (late) {
      late_timed_out = true;
      if (overlap || what.find(kind == "a2a" ? "timeout: " : "timeout: reduce_scatter_sum") == std::string::npos)
        fail("the late rank's backward threw: " + what);
    } else {
      if (what.find("timeout: ") == std::string::npos) fail("not a timeout: " + what);
      if (kind != "a2a" && !comm.poisoned()) fail("the communicator is not poisoned");  // (a2a: its inner group's)
      attn.reset();  // with the partials in flight: its state stays with the communicator
      for (const std::size_t size : {n, 2 * n, nkv, 2 * nkv})  // the gathered partials' and the local sizes
        for (int i = 0; i < 2; ++i) reused.emplace_back(size, 7.0f);
    }
  }
  if (late_timed_out) attn.reset();
  MPI_Barrier(MPI_COMM_WORLD);  // raw MPI: progress while the late rank's transfers land
  if (!late) {
    if (kind != "a2a" && !comm.drain(30)) fail("transfers still pending 30 s after the late rank finished");
    for (const auto& r : reused)
      for (std::size_t i = 0; i < r.size(); ++i)
        if (r[i] != 7.0f) {
          fail("a new buffer was written at element " + std::to_string(i));
          break;
        }
  } else if (!failed && !late_timed_out) {
    for (const auto& [name, a, b] : {std::tuple{"dq", &got.dq, &want.dq}, {"dk", &got.dk, &want.dk},
                                     {"dv", &got.dv, &want.dv}})
      if (std::memcmp(a->data(), b->data(), a->size() * sizeof(float)) != 0) fail(std::string(name) + " differs from the run without a timeout");
  }
  if (!failed) std::fprintf(stderr, "rank %d: handover checks passed\n", rank);
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  const std::string fault = argc > 1 ? argv[1] : "";
  if (fault.starts_with("handover-")) return timeout_handover(fault.substr(9));
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
    const int64_t t = p.local_tokens;
    const auto forward = [&] {
      (void)attn.forward({.cu_seqlens = cu, .q = cpattn::contiguous(q.data(), t, h, d),
                          .k = cpattn::contiguous(k.data(), t, h, d), .v = cpattn::contiguous(v.data(), t, h, d),
                          .out = cpattn::contiguous(out.data(), t, h, d)});
    };
    const bool stall = fault == "stall-during" || fault == "stall-shared";
    // The stalls start after a whole first forward on every rank: 10 ms after the barrier, on a
    // loaded machine, could land before the first forward's agreement (call #2, no transfer
    // posted yet: the CI run of 2026-12-06 10:29 UTC); after it, in the next forward's
    // transfers or its agreement (call #10 or later), which the pass expressions take.
    if (stall) forward();
    std::thread killer;
    if (faulty && stall)
      killer = std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        std::raise(SIGSTOP);  // the whole process, as a hung rank
      });
    if (faulty && fault == "kill-during")
      killer = std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::raise(SIGKILL);
      });
    try {
      for (int call = 0; call < (stall ? 2 : 1); ++call) forward();
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
