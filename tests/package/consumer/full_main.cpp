// Uses the whole of cpattn the way a user's MPI program would (run through mpiexec): an
// MpiSession, a Communicator on the world and a split of it, and the planner.
#include <cpattn/cpattn.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  cpattn::Communicator world(MPI_COMM_WORLD, {.timeout_s = 60});
  cpattn::Communicator group = world.split(0, world.rank());
  std::vector<std::int64_t> one{1};
  group.all_reduce<std::int64_t>(one, cpattn::ReduceOp::sum);

  const std::vector<int64_t> cu{0, 16, 40};
  const cpattn::RankPlan plan = cpattn::get_thd_load_balanced_cp_metadata(cu, 2, 1);
  const bool ok = plan.actual_seq_kvlen == std::vector<int64_t>{8, 20, 32, 50} &&
                  one[0] == world.size() && group.size() == world.size();
  std::printf("cpattn %s full: %d rank(s), rank 1 of 2: %lld local tokens, %s\n",
              CPATTN_VERSION_STRING, world.size(), static_cast<long long>(plan.local_tokens),
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
