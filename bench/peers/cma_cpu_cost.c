// What a single copy by the kernel costs against memcpy, in CPU time per MiB (user + system, so that a
// loaded host's waiting is not counted): 8 buffers of 32 MiB that a second process shares (fork: the
// same pages), read a piece at a time into one cache-resident buffer, by process_vm_readv from the
// other process and by memcpy from our own mapping. The shm group's single-copy paths pay the first
// (docs/algorithms-shm.md, "The copy limit"); the staged paths pay the second twice.
//
// With "untouched" the sources are never written, as calloc hands out fresh pages: every read of them
// maps the kernel's one zero page, so both copies read a cached 4 KiB page instead of memory. That is
// what a benchmark measures whose input buffers were only calloc'd (or malloc'd and memset to zero,
// which the compiler turns into calloc): bench/peers/bench_mpi.c's rotated sets before they were
// written (docs/algorithms-shm.md, "The copy limit").
//
//   gcc -O2 -o /tmp/cma_cpu_cost bench/peers/cma_cpu_cost.c
//   for kib in 128 1024 32768; do /tmp/cma_cpu_cost $kib; done     # piece sizes in KiB
//   /tmp/cma_cpu_cost 32768 untouched
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

enum { kSets = 8 };
static const size_t kSetBytes = (size_t)32 << 20;

static double cpu_seconds(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return (double)u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + (double)u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}

int main(int argc, char** argv) {
  const size_t piece = (argc > 1 ? (size_t)atol(argv[1]) : 128) << 10;
  const int untouched = argc > 2 && strcmp(argv[2], "untouched") == 0;
  if (piece == 0 || kSetBytes % piece != 0) {
    fprintf(stderr, "cma_cpu_cost: the piece (KiB) must divide 32768\n");
    return 2;
  }
  char* src[kSets];
  for (int i = 0; i < kSets; i++) {
    src[i] = mmap(NULL, kSetBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src[i] == MAP_FAILED) { perror("cma_cpu_cost: mmap"); return 1; }
    if (!untouched) memset(src[i], i + 1, kSetBytes);
  }
  int hold[2];
  if (pipe(hold) != 0) { perror("cma_cpu_cost: pipe"); return 1; }
  const pid_t peer = fork();
  if (peer == 0) {  // keeps the mappings alive until the parent writes a byte (or exits: read returns 0)
    char x;
    close(hold[1]);
    (void)!read(hold[0], &x, 1);
    _exit(0);
  }
  close(hold[0]);
  char* buf = aligned_alloc(4096, piece);
  memset(buf, 0, piece);
  int failed = 0;
  for (int kernel = 0; kernel < 2 && !failed; kernel++) {
    double best = 1e9;
    for (int rep = 0; rep < 5 && !failed; rep++) {
      const double start = cpu_seconds();
      for (int s = 0; s < kSets && !failed; s++)
        for (size_t off = 0; off < kSetBytes; off += piece) {
          if (!kernel) { memcpy(buf, src[s] + off, piece); continue; }
          struct iovec local = {buf, piece}, remote = {src[s] + off, piece};
          if (process_vm_readv(peer, &local, 1, &remote, 1, 0) != (ssize_t)piece) {
            perror("cma_cpu_cost: process_vm_readv");
            failed = 1;
            break;
          }
        }
      const double per_mib = (cpu_seconds() - start) / (kSets * 32.0);
      if (per_mib < best) best = per_mib;
    }
    if (!failed)
      printf("piece %zu KiB, %s%s: %.3f ms CPU per MiB (%.1f GB/s of one core), best of 5\n", piece >> 10,
             kernel ? "process_vm_readv" : "memcpy", untouched ? " from untouched pages" : "", best * 1e3,
             1.048576e-3 / best);
  }
  (void)!write(hold[1], "x", 1);
  waitpid(peer, NULL, 0);
  return failed;
}
