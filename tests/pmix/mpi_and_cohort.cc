// mpi_and_cohort: a program that uses MPI and cohort in one process, started by mpirun with nothing
// else set. Both meet through the same PMIx server (PMIx counts the inits; cohort's PMIx_Finalize ends
// only its own). argv[1]: "mpi-first" (MPI_Init, then Communicator::from_env) or "cohort-first" (the
// other order). Each rank sums (rank + 1) with both libraries and checks the result; rank 0 prints it.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <exception>

#include "cohort/cohort.h"

int main(int argc, char** argv) {
  const bool mpi_first = argc > 1 && std::strcmp(argv[1], "mpi-first") == 0;
  try {
    std::shared_ptr<cohort::Communicator> comm;
    if (mpi_first) MPI_Init(&argc, &argv);
    comm = cohort::Communicator::from_env();
    if (!mpi_first) MPI_Init(&argc, &argv);
    int mpi_rank = 0, mpi_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    if (mpi_rank != comm->rank() || mpi_size != comm->size()) {
      std::fprintf(stderr, "mpi_and_cohort: MPI says rank %d of %d, cohort rank %d of %d\n", mpi_rank, mpi_size,
                   comm->rank(), comm->size());
      return 1;
    }
    double mine = comm->rank() + 1, by_cohort = 0, by_mpi = 0;
    comm->allreduce(&mine, &by_cohort, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kSum);
    MPI_Allreduce(&mine, &by_mpi, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double want = comm->size() * (comm->size() + 1) / 2.0;
    if (by_cohort != want || by_mpi != want) {
      std::fprintf(stderr, "mpi_and_cohort: rank %d: sums %g (cohort) and %g (MPI), expected %g\n", comm->rank(),
                   by_cohort, by_mpi, want);
      return 1;
    }
    if (comm->rank() == 0) std::printf("sum over %d ranks: cohort %g, MPI %g\n", comm->size(), by_cohort, by_mpi);
    comm.reset();
    MPI_Finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_and_cohort: %s\n", e.what());
    return 1;
  }
}
