// The smallest MPI job, for timing a launcher: MPI_Init, one barrier, MPI_Finalize.
// Build: mpicc -O2 -o mpi_trivial mpi_trivial.c
#include <mpi.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}
