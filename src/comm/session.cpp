// MpiSession: MPI_Init_thread and MPI_Finalize for programs, never called by the library.
#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

MpiSession::MpiSession() { init(nullptr, nullptr); }
MpiSession::MpiSession(int& argc, char**& argv) { init(&argc, &argv); }

void MpiSession::init(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;  // someone else's MPI: they finalize it
  int provided = MPI_THREAD_SINGLE;
  const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  CPATTN_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed with error code ", rc);
  owner_ = true;
  if (provided < MPI_THREAD_FUNNELED) {
    MPI_Finalize();
    owner_ = false;
    CPATTN_CHECK(false, "MPI provides thread level ", provided, ", cpattn needs MPI_THREAD_FUNNELED (",
                 MPI_THREAD_FUNNELED, ")");
  }
}

bool MpiSession::ever_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);  // (callable at any time, and true after MPI_Finalize too)
  return initialized != 0;
}

MpiSession::~MpiSession() {
  if (!owner_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace cpattn
