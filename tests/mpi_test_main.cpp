// main() of cpattn's MPI GoogleTest binaries (run through mpiexec by cpattn_add_mpi_test):
// an MpiSession around the tests. Only rank 0 prints GoogleTest's usual output; other
// ranks print just their failures, prefixed with their rank. The exit code is non-zero when a
// test failed on any rank.
#include <cpattn/comm.hpp>
#include <gtest/gtest.h>

#include <cstdio>

namespace {

// Failures of ranks other than 0, which have no default printer.
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(),
                   info.name());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  // Plain MPI on the world here and in the tests (mpi_world.hpp, fault injection): the
  // harness must not depend on the Communicator it tests.
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int local = RUN_ALL_TESTS() == 0 ? 0 : 1;
  int any = 0;
  MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any && !local) std::fprintf(stderr, "tests failed on another rank\n");
  return any;
}
