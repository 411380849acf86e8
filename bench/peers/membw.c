// Memory bandwidth of this machine: the ceiling for any intra-host collective, which copies and adds buffers.
// Two kernels on buffers of MIB MiB, each thread on its own contiguous slice (first touched by that thread):
//   memcpy(dst, src, S)   counts 2*S bytes (read src, write dst)
//   a[i] += b[i] (fp32)   counts 3*S bytes (read a, read b, write a) -- the reduction a collective does
// GB/s = 1e9 bytes per second. One warm-up repetition, then REPS timed ones.
// Build: gcc -O3 -march=native -fopenmp -o membw membw.c
// Usage: OMP_NUM_THREADS=T ./membw [MIB=256] [REPS=11]
// Prints every repetition, then: RESULT threads=T memcpy_median= min= max= reduce_median= min= max=
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

// This thread's slice [*lo, *hi) of n items.
static void my_slice(size_t n, size_t *lo, size_t *hi) {
  size_t t = (size_t)omp_get_thread_num(), threads = (size_t)omp_get_num_threads();
  *lo = n * t / threads;
  *hi = n * (t + 1) / threads;
}

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 256;
  int reps = argc > 2 ? atoi(argv[2]) : 11;
  if (mib < 1 || reps < 1) { fprintf(stderr, "usage: membw [MIB>=1] [REPS>=1]\n"); return 2; }
  size_t bytes = mib << 20, n = bytes / sizeof(float);
  float *a = aligned_alloc(64, bytes), *b = aligned_alloc(64, bytes);
  char *src = aligned_alloc(64, bytes), *dst = aligned_alloc(64, bytes);
  double *copy_gbs = malloc(sizeof(double) * reps), *reduce_gbs = malloc(sizeof(double) * reps);
  if (!a || !b || !src || !dst || !copy_gbs || !reduce_gbs) { fprintf(stderr, "membw: out of memory\n"); return 1; }

#pragma omp parallel
  {  // first touch: each slice's pages land near the thread that uses them
    size_t lo, hi;
    my_slice(n, &lo, &hi);
    for (size_t i = lo; i < hi; i++) { a[i] = 0.0f; b[i] = 1.0f; }
    my_slice(bytes, &lo, &hi);
    memset(src + lo, 1, hi - lo);
    memset(dst + lo, 0, hi - lo);
  }
  for (int r = -1; r < reps; r++) {  // r = -1: warm-up
    double t0 = now();
#pragma omp parallel
    {
      size_t lo, hi;
      my_slice(bytes, &lo, &hi);
      memcpy(dst + lo, src + lo, hi - lo);
    }
    double t1 = now();
#pragma omp parallel
    {
      size_t lo, hi;
      my_slice(n, &lo, &hi);
      float *restrict x = a;
      const float *restrict y = b;
      for (size_t i = lo; i < hi; i++) x[i] += y[i];
    }
    double t2 = now();
    if (r >= 0) {
      copy_gbs[r] = 2.0 * bytes / (t1 - t0) / 1e9;
      reduce_gbs[r] = 3.0 * bytes / (t2 - t1) / 1e9;
    }
  }
  volatile float keep = a[n / 2] + dst[bytes / 3];  // the results are used, so the loops stay
  (void)keep;

  int threads = omp_get_max_threads();
  printf("threads=%d size=%zuMiB reps=%d\nmemcpy GB/s:", threads, mib, reps);
  for (int r = 0; r < reps; r++) printf(" %.2f", copy_gbs[r]);
  printf("\nreduce GB/s:");
  for (int r = 0; r < reps; r++) printf(" %.2f", reduce_gbs[r]);
  qsort(copy_gbs, reps, sizeof(double), by_value);
  qsort(reduce_gbs, reps, sizeof(double), by_value);
  printf("\nRESULT threads=%d memcpy_median=%.2f min=%.2f max=%.2f reduce_median=%.2f min=%.2f max=%.2f\n", threads,
         copy_gbs[reps / 2], copy_gbs[0], copy_gbs[reps - 1],  //
         reduce_gbs[reps / 2], reduce_gbs[0], reduce_gbs[reps - 1]);
  return 0;
}
