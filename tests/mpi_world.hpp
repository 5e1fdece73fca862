// Rank and size in MPI_COMM_WORLD, for the MPI tests. Plain MPI on purpose (as in the tests'
// fault injection): the harness must not depend on the Communicator under test.
#pragma once

#include <cpattn/comm.hpp>  // <mpi.h>

namespace cpattn::mpi_test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

}  // namespace cpattn::mpi_test
