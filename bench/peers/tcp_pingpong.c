// Loopback TCP round trip (127.0.0.1) between two processes: the floor under any TCP collective on one host.
// The parent sends BYTES, the forked child echoes them back; 1 warm-up batch, then 5 timed batches of ITERS
// round trips. Two ways to wait for data:
//   block  recv() sleeps in the kernel until data arrives (the receiver must be woken: Gloo, torch)
//   spin   recv(MSG_DONTWAIT) polled in a loop, never sleeping (Open MPI's way)
// Build: gcc -O2 -o tcp_pingpong tcp_pingpong.c
// Usage: ./tcp_pingpong block|spin [BYTES=8] [ITERS=20000]
// Prints: RESULT pingpong mode=M bytes=B rtt_us_median= min= max=   (over the 5 timed batches)
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { BATCHES = 6 };  // batch 0 is the warm-up
static int spin;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

static void send_all(int fd, char *p, size_t n) {
  while (n) {
    ssize_t r = send(fd, p, n, 0);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (r < 0) die("send");
    p += r;
    n -= (size_t)r;
  }
}

static void recv_all(int fd, char *p, size_t n) {
  while (n) {
    ssize_t r = recv(fd, p, n, spin ? MSG_DONTWAIT : 0);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;  // spin: nothing yet, ask again
    if (r < 0) die("recv");
    if (r == 0) { fprintf(stderr, "tcp_pingpong: the other side closed\n"); exit(1); }
    p += r;
    n -= (size_t)r;
  }
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc < 2 || (strcmp(argv[1], "block") && strcmp(argv[1], "spin"))) {
    fprintf(stderr, "usage: tcp_pingpong block|spin [BYTES=8] [ITERS=20000]\n");
    return 2;
  }
  spin = strcmp(argv[1], "spin") == 0;
  size_t bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : 8;
  int iters = argc > 3 ? atoi(argv[3]) : 20000;
  char *buf = calloc(1, bytes ? bytes : 1);
  int one = 1;

  int listener = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};  // any free port
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  socklen_t len = sizeof addr;
  if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || getsockname(listener, (struct sockaddr *)&addr, &len) ||
      listen(listener, 1))
    die("listen");

  pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {  // the echo side
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (long i = 0; i < (long)BATCHES * iters; i++) {
      recv_all(fd, buf, bytes);
      send_all(fd, buf, bytes);
    }
    _exit(0);
  }
  int fd = accept(listener, NULL, NULL);
  if (fd < 0) die("accept");
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  double rtt[BATCHES];
  for (int b = 0; b < BATCHES; b++) {
    double start = now();
    for (int i = 0; i < iters; i++) {
      send_all(fd, buf, bytes);
      recv_all(fd, buf, bytes);
    }
    rtt[b] = (now() - start) / iters;
  }
  waitpid(child, NULL, 0);
  qsort(rtt + 1, BATCHES - 1, sizeof(double), by_value);
  printf("RESULT pingpong mode=%s bytes=%zu rtt_us_median=%.2f min=%.2f max=%.2f\n", argv[1], bytes, rtt[3] * 1e6,
         rtt[1] * 1e6, rtt[BATCHES - 1] * 1e6);
  return 0;
}
