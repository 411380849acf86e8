// barrier: the smallest complete cohort program. Builds the world communicator from the launcher's
// environment (or torchrun's / Open MPI's), passes one barrier, and exits. It is the start-up benchmark
// (`cohort run -n 8 build/examples/barrier` against `mpirun -n 8 mpi_trivial`), and a quick check that
// a machine can run cohort at all.
#include <cstdio>
#include <exception>

#include "cohort/cohort.h"

int main() {
  try {
    auto comm = cohort::Communicator::from_env();
    comm->barrier();
    if (comm->rank() == 0) std::printf("barrier passed: %d ranks\n", comm->size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "barrier: %s\n", e.what());
    return 1;
  }
}
