// Reduce-scatter and all-gather: the MPI library's collectives against cpattn's ring, the
// choice behind CommOptions' defaults (docs/benchmarks.md, "Communication").
//
//   mpirun -np 2 build/release/bench/comm_bench [--reps 5] [--max-mib 64]
//
// For each size S (MiB per rank: the rank-major buffer of size() blocks, i.e. the send buffer
// of a reduce-scatter and the receive buffer of an all-gather) it checks every variant's result,
// then prints the median and the best over --reps of the slowest rank's time, and S / time in
// GB/s (1e9 B/s) for both (the best is the steadier figure on a machine shared with other work).
// "sendrecv" is MPI_Sendrecv of what one ring rank sends in total, (p - 1) / p of S: the
// transfer floor of both operations. It calls MPI's collectives itself, on purpose: they are
// what cpattn's are measured against (<mpi.h> through cpattn/comm.hpp).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cpattn/comm.hpp"

namespace {

int g_rank = 0, g_size = 1;

struct Timing {
  double median, best;  // seconds, of the slowest rank
};

Timing time_op(int reps, const std::function<void()>& op) {
  op();  // warm up (page faults, MPI's first-use setup)
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    op();
    double dt = MPI_Wtime() - t0, slowest = 0;
    MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(slowest);
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: wrong result: %s\n", g_rank, what);
  MPI_Abort(MPI_COMM_WORLD, 2);
}

void row(const char* op, const char* variant, double mib, Timing t) {
  if (g_rank != 0) return;
  const double bytes = mib * 1048576.0;
  std::printf("| %-14s | %-27s | %5.0f | %9.3f | %6.2f | %9.3f | %6.2f |\n", op, variant, mib,
              t.median * 1e3, bytes / t.median / 1e9, t.best * 1e3, bytes / t.best / 1e9);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const cpattn::MpiSession mpi(argc, argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int reps = 5, max_mib = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--max-mib")) max_mib = std::atoi(argv[i + 1]);
  }
  const int p = g_size, r = g_rank;
  cpattn::Communicator ring(MPI_COMM_WORLD, {.reduce_scatter_algorithm = cpattn::CommAlgorithm::ring,
                                             .all_gather_algorithm = cpattn::CommAlgorithm::ring});
  cpattn::Communicator lib(MPI_COMM_WORLD, {.reduce_scatter_algorithm = cpattn::CommAlgorithm::mpi,
                                            .all_gather_algorithm = cpattn::CommAlgorithm::mpi});
  if (r == 0) {
    std::printf("ranks %d, reps %d (median and best of the slowest rank)\n\n", p, reps);
    std::printf("| operation      | variant                     |   MiB | median ms |   GB/s |   best ms |   GB/s |\n");
    std::printf("|----------------|-----------------------------|------:|----------:|-------:|----------:|-------:|\n");
  }
  for (int mib = 1; mib <= max_mib; mib *= 2) {
    const std::int64_t total = std::int64_t{mib} * 1048576 / 4 / p * p;  // floats, rank-major
    const std::int64_t n = total / p;                                      // one block
    std::vector<float> big(total), block(n);

    // Reduce-scatter: x[q][b][i] = q + 1 + b + i % 7, so block b sums to p(p+1)/2 + p(b + i % 7).
    for (std::int64_t j = 0; j < total; ++j)
      big[j] = static_cast<float>(r + 1 + j / n + (j % n) % 7);
    auto check_rs = [&](const char* what) {
      for (std::int64_t i = 0; i < n; ++i)
        require(block[i] == static_cast<float>(p * (p + 1) / 2 + p * (r + (i % 7))), what);
      std::fill(block.begin(), block.end(), -1.0f);
    };
    MPI_Reduce_scatter_block(big.data(), block.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                             MPI_COMM_WORLD);
    check_rs("MPI_Reduce_scatter_block");
    lib.reduce_scatter_sum(big, block);
    check_rs("mpi reduce_scatter_sum");
    ring.reduce_scatter_sum(big, block);
    check_rs("ring reduce_scatter_sum");
    row("reduce-scatter", "MPI_Reduce_scatter_block", mib, time_op(reps, [&] {
          MPI_Reduce_scatter_block(big.data(), block.data(), static_cast<int>(n), MPI_FLOAT,
                                   MPI_SUM, MPI_COMM_WORLD);
        }));
    row("reduce-scatter", "mpi (Ireduce_scatter_block)", mib,
        time_op(reps, [&] { lib.reduce_scatter_sum(big, block); }));
    row("reduce-scatter", "ring (Isend/Irecv)", mib,
        time_op(reps, [&] { ring.reduce_scatter_sum(big, block); }));

    // All-gather: rank q's block holds q * 1000 + i % 1000.
    for (std::int64_t i = 0; i < n; ++i) block[i] = static_cast<float>(r * 1000 + i % 1000);
    auto check_ag = [&](const char* what) {
      for (std::int64_t j = 0; j < total; ++j)
        require(big[j] == static_cast<float>(j / n * 1000 + (j % n) % 1000), what);
      std::fill(big.begin(), big.end(), -1.0f);
    };
    MPI_Allgather(block.data(), static_cast<int>(n), MPI_FLOAT, big.data(), static_cast<int>(n),
                  MPI_FLOAT, MPI_COMM_WORLD);
    check_ag("MPI_Allgather");
    lib.all_gather<float>(block, big);
    check_ag("mpi all_gather");
    ring.all_gather<float>(block, big);
    check_ag("ring all_gather");
    row("all-gather", "MPI_Allgather", mib, time_op(reps, [&] {
          MPI_Allgather(block.data(), static_cast<int>(n), MPI_FLOAT, big.data(),
                        static_cast<int>(n), MPI_FLOAT, MPI_COMM_WORLD);
        }));
    row("all-gather", "mpi (Iallgather)", mib,
        time_op(reps, [&] { lib.all_gather<float>(block, big); }));
    row("all-gather", "ring (Isend/Irecv)", mib,
        time_op(reps, [&] { ring.all_gather<float>(block, big); }));

    // The floor: MPI_Sendrecv of (p - 1) blocks with the ring neighbours.
    const int right = (r + 1) % p, left = (r + p - 1) % p;
    const auto moved = static_cast<int>(n * (p - 1));
    std::vector<float> sink(static_cast<std::size_t>(moved));
    if (p > 1)
      row("(floor)", "MPI_Sendrecv (p-1)/p of S", mib, time_op(reps, [&] {
            MPI_Sendrecv(big.data(), moved, MPI_FLOAT, right, 7, sink.data(), moved, MPI_FLOAT,
                         left, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          }));
  }
  return 0;
}
