// Collective benchmark for MPI in the style of nccl-tests (fp32), the Open MPI peer of `cohort bench`.
// Build: mpicc -O2 -o bench_mpi bench_mpi.c -lm
// Usage: mpirun -n N ./bench_mpi [OP=allreduce] [SIZES=8,1024,...,268435456] [TRIALS=5] [MIN_TIME=0.5] [TAG]
//                               [no-cache-reuse]
//   OP: allreduce    MPI_Allreduce(MPI_IN_PLACE, sum)        bytes = the buffer
//       broadcast    MPI_Bcast(root 0)                       bytes = the buffer
//       allgather    MPI_Allgather(bytes/N in, bytes out)    bytes = the gathered total
//       reduce_scatter MPI_Reduce_scatter_block(bytes in, bytes/N out)
//       alltoall     MPI_Alltoall(bytes in, bytes out)
//       gather       MPI_Gather(bytes/N in, bytes out on root 0)
//       scatter      MPI_Scatter(bytes on root 0, bytes/N out)
//   TAG is appended to the peer name (e.g. "-tcp" gives peer=mpi-tcp; "" for none).
//   no-cache-reuse: as `cohort bench --no-cache-reuse`, the iterations rotate through buffer sets that
//   together exceed twice the L3 cache, so that no iteration finds its data in the cache; every page of
//   them is written before the timing (a line "# B B: K buffer sets, ... MiB of them in memory" says so).
// Method (shared with bench_torch.py, bench_gloo.cc and `cohort bench`), per size:
//   1. one correctness check with rank-dependent values, then the buffers are zeroed;
//   2. warm-up: 5 ops, then about 0.2 s more;
//   3. iterations per trial: the smallest count that lasts MIN_TIME (at least 2);
//   4. TRIALS trials, each after a barrier; a trial's time per op is the slowest rank's.
// Every count the ranks must agree on is the maximum over ranks, so all issue the same collectives.
// Prints one line per size on rank 0:
//   RESULT peer=mpiTAG op=OP n=N bytes=B iters=I trials=T time_us_median= time_us_min= time_us_max=
//          algbw_GBps= busbw_GBps=
// algbw = bytes / time (1e9 B/s); busbw as nccl-tests: allreduce 2(N-1)/N, broadcast 1, the others (N-1)/N.
#include <unistd.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum op { ALLREDUCE, BROADCAST, ALLGATHER, REDUCE_SCATTER, ALLTOALL, GATHER, SCATTER };
static const char *const op_names[] = {"allreduce", "broadcast", "allgather", "reduce_scatter",
                                       "alltoall",  "gather",    "scatter"};
#define NOPS 7

static int rank, nranks;

struct bufs {
  float *in, *out;  // `out` is unused by allreduce and broadcast (in place)
  size_t count;     // elements per call: the whole buffer, or one rank's part
  size_t bytes;     // the size reported
  // no-cache-reuse: sets 1..nsets-1 besides in/out (set 0); the next call uses set `next`
  float **ins, **outs;
  size_t in_count, out_count;
  int nsets, next;
};

// The L3 cache (sysfs, else sysconf), 32 MiB if unknown.
static size_t l3_bytes(void) {
  FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
  unsigned long kib = 0;
  char unit = 0;
  if (f) {
    int got = fscanf(f, "%lu%c", &kib, &unit);
    fclose(f);
    if (got >= 1 && kib > 0) return unit == 'M' ? kib << 20 : kib << 10;
  }
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? (size_t)l3 : (size_t)32 << 20;
}

// `bytes` of zeros, every page of them written, so that each is a page of memory of its own. Not
// malloc + memset: the compiler turns that pair into calloc, whose fresh pages all stay mapped to the
// kernel's one shared zero page until something writes them. The rotated input sets, which the timed
// calls only read, then never were in memory: every read of them (the local copy, and the peer's
// process_vm_readv through Open MPI's CMA) mapped one 4 KiB page, in the cache, and Open MPI's
// allgather and alltoall at 64 MiB (five of every six calls on such sets) copied from there, not from
// memory (docs/algorithms-shm.md, "The copy limit"). explicit_bzero is a write the compiler keeps.
static float *zeros_in_memory(size_t bytes) {
  float *p = malloc(bytes);
  if (p) explicit_bzero(p, bytes);
  return p;
}

// This process's resident memory in bytes (/proc/self/statm), 0 if unknown. A page mapped to the zero
// page is not counted: so the growth across allocating the rotated sets says how much of them is memory.
static size_t resident_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long size = 0, resident = 0;
  if (f) {
    if (fscanf(f, "%lu %lu", &size, &resident) != 2) resident = 0;
    fclose(f);
  }
  return (size_t)resident * (size_t)sysconf(_SC_PAGESIZE);
}

static double max_over_ranks(double x) {
  double y;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

static void run(enum op op, struct bufs *b) {
  float *in = b->next ? b->ins[b->next] : b->in, *out = b->next ? b->outs[b->next] : b->out;
  b->next = (b->next + 1) % b->nsets;
  struct bufs cur = *b;
  cur.in = in, cur.out = out;
  b = &cur;
  switch (op) {
    case ALLREDUCE: MPI_Allreduce(MPI_IN_PLACE, b->in, (int)b->count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case BROADCAST: MPI_Bcast(b->in, (int)b->count, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    case ALLGATHER:
      MPI_Allgather(b->in, (int)b->count, MPI_FLOAT, b->out, (int)b->count, MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case REDUCE_SCATTER:
      MPI_Reduce_scatter_block(b->in, b->out, (int)b->count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case ALLTOALL:
      MPI_Alltoall(b->in, (int)b->count, MPI_FLOAT, b->out, (int)b->count, MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case GATHER:
      MPI_Gather(b->in, (int)b->count, MPI_FLOAT, b->out, (int)b->count, MPI_FLOAT, 0, MPI_COMM_WORLD);
      break;
    case SCATTER:
      MPI_Scatter(b->in, (int)b->count, MPI_FLOAT, b->out, (int)b->count, MPI_FLOAT, 0, MPI_COMM_WORLD);
      break;
  }
}

static void fail(const char *what) {
  fprintf(stderr, "bench_mpi: %s gave a wrong result on rank %d\n", what, rank);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

// Allocates the buffers for `nbytes`, runs the operation once on known values and checks the result.
static struct bufs prepare(enum op op, size_t nbytes, int no_cache_reuse) {
  struct bufs b;
  b.nsets = 1, b.next = 0, b.ins = b.outs = NULL;
  size_t in_count, out_count = 0;
  if (op == ALLREDUCE || op == BROADCAST) {
    b.count = in_count = nbytes / 4 ? nbytes / 4 : 1;
    b.bytes = b.count * 4;
  } else {
    b.count = nbytes / nranks / 4 ? nbytes / nranks / 4 : 1;  // one rank's part
    in_count = op == ALLGATHER || op == GATHER ? b.count : b.count * nranks;
    out_count = op == REDUCE_SCATTER || op == SCATTER ? b.count : b.count * nranks;
    b.bytes = b.count * nranks * 4;
  }
  b.in = calloc(in_count, 4);
  b.out = out_count ? calloc(out_count, 4) : NULL;
  if (!b.in || (out_count && !b.out)) fail("allocation");

  for (size_t i = 0; i < in_count; i++)
    b.in[i] = op == BROADCAST ? rank + 7
              : op == ALLTOALL || op == SCATTER ? (float)(rank * 1000 + i / b.count)
                                                : rank + 1;
  run(op, &b);
  float sum = nranks * (nranks + 1) / 2;
  if (op == ALLREDUCE) {
    for (size_t i = 0; i < in_count; i++) if (b.in[i] != sum) fail(op_names[op]);
  } else if (op == BROADCAST) {
    for (size_t i = 0; i < in_count; i++) if (b.in[i] != 7) fail(op_names[op]);
  } else if (op == ALLGATHER) {
    for (size_t i = 0; i < out_count; i++) if (b.out[i] != i / b.count + 1) fail(op_names[op]);
  } else if (op == REDUCE_SCATTER) {
    for (size_t i = 0; i < out_count; i++) if (b.out[i] != sum) fail(op_names[op]);
  } else if (op == GATHER) {
    if (rank == 0) for (size_t i = 0; i < out_count; i++) if (b.out[i] != i / b.count + 1) fail(op_names[op]);
  } else if (op == SCATTER) {  // block `rank` of root 0's input
    for (size_t i = 0; i < out_count; i++) if (b.out[i] != (float)rank) fail(op_names[op]);
  } else {  // alltoall: part r of the output is part `rank` of rank r's input
    for (int r = 0; r < nranks; r++) if (b.out[r * b.count] != (float)(r * 1000 + rank)) fail(op_names[op]);
  }
  memset(b.in, 0, in_count * 4);  // timing runs on zeros, as the other peers do
  if (b.out) memset(b.out, 0, out_count * 4);
  b.in_count = in_count, b.out_count = out_count;
  if (no_cache_reuse) {
    size_t set = (in_count + out_count) * 4, l3 = l3_bytes();
    b.nsets = (int)((2 * l3 + set) / set);
    if (b.nsets < 2) b.nsets = 2;
    b.ins = calloc(b.nsets, sizeof(float *));
    b.outs = calloc(b.nsets, sizeof(float *));
    const size_t before = resident_bytes();
    for (int k = 1; k < b.nsets; k++) {  // every page is in memory before the first timed call
      b.ins[k] = zeros_in_memory(in_count * 4);
      b.outs[k] = out_count ? zeros_in_memory(out_count * 4) : NULL;
      if (!b.ins[k] || (out_count && !b.outs[k])) fail("allocation");
    }
    // As `cohort bench` says it, and how much of the sets added here the kernel holds in memory (all
    // of them, or the timed calls read the zero page: see zeros_in_memory).
    const size_t grown = resident_bytes() - before;
    if (rank == 0)
      printf("# %zu B: %d buffer sets, %zu MiB per rank; sets 1-%d: %zu MiB, %zu MiB of them in memory\n", b.bytes,
             b.nsets, ((size_t)b.nsets * set) >> 20, b.nsets - 1, ((size_t)(b.nsets - 1) * set) >> 20, grown >> 20);
  }
  return b;
}

// Seconds per op of `iters` ops back to back, the slowest rank's.
static double timed(enum op op, struct bufs *b, long iters) {
  MPI_Barrier(MPI_COMM_WORLD);
  double start = MPI_Wtime();
  for (long i = 0; i < iters; i++) run(op, b);
  return max_over_ranks((MPI_Wtime() - start) / iters);
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  const char *op_name = argc > 1 ? argv[1] : "allreduce";
  char *sizes = strdup(argc > 2 ? argv[2] : "8,1024,65536,1048576,4194304,16777216,67108864,268435456");
  int trials = argc > 3 ? atoi(argv[3]) : 5;
  double min_time = argc > 4 ? atof(argv[4]) : 0.5;
  const char *tag = argc > 5 ? argv[5] : "";
  int no_cache_reuse = argc > 6 && strcmp(argv[6], "no-cache-reuse") == 0;
  int op = -1;
  for (int i = 0; i < NOPS; i++) if (strcmp(op_name, op_names[i]) == 0) op = i;
  if (op < 0 || trials < 1) {
    if (rank == 0) fprintf(stderr, "bench_mpi: unknown operation %s or trials < 1\n", op_name);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }

  for (char *size = strtok(sizes, ","); size; size = strtok(NULL, ",")) {
    struct bufs b = prepare(op, strtoull(size, NULL, 10), no_cache_reuse);
    double per_op = timed(op, &b, 5);                             // warm-up, 5 ops
    long more = (long)max_over_ranks(ceil(0.2 / fmax(per_op, 1e-9)));
    per_op = timed(op, &b, more);                                 // warm-up, ~0.2 s; calibrates one op
    long iters = (long)max_over_ranks(fmax(2, ceil(min_time / fmax(per_op, 1e-9))));
    double *times = malloc(sizeof(double) * trials);
    for (int t = 0; t < trials; t++) times[t] = timed(op, &b, iters);
    qsort(times, trials, sizeof(double), by_value);
    double median = trials % 2 ? times[trials / 2] : (times[trials / 2 - 1] + times[trials / 2]) / 2;
    double algbw = b.bytes / median / 1e9;
    double busbw = op == ALLREDUCE ? algbw * 2.0 * (nranks - 1) / nranks
                   : op == BROADCAST ? algbw : algbw * (nranks - 1) / nranks;
    if (rank == 0)
      printf("RESULT peer=mpi%s op=%s n=%d bytes=%zu iters=%ld trials=%d time_us_median=%.2f time_us_min=%.2f "
             "time_us_max=%.2f algbw_GBps=%.4f busbw_GBps=%.4f\n",
             tag, op_name, nranks, b.bytes, iters, trials, median * 1e6, times[0] * 1e6, times[trials - 1] * 1e6,
             algbw, busbw);
    fflush(stdout);
    free(times);
    free(b.in);
    free(b.out);
    for (int k = 1; k < b.nsets; k++) free(b.ins[k]), free(b.outs[k]);
    free(b.ins), free(b.outs);
  }
  free(sizes);
  MPI_Finalize();
  return 0;
}
