// The fake NCCL's operations (fake_cuda.cc says what the fake is): collectives that wait on their
// stream thread for every rank and compute on the host, sends and receives through the clique's
// mailbox (a large send waits for its receive, as NCCL's p2p does), groups whose calls progress
// together, a non-blocking communicator's calls finishing on a thread of their own, and the stalls
// (fake_nccl_stall) that hang a call.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "fake_nccl_internal.h"

namespace fake_cuda {

// fake_nccl_stall: the next call of that function on that device hangs, as a lazy connection to a
// peer that never answers does. Blocking communicator: the call does not return until the
// communicator is aborted (then ncclSystemError) or, so that a broken test cannot hang CI, 20 s
// have passed (ncclSystemError too; fake_nccl_stalls_ended_by_abort tells the two apart).
// Non-blocking: the call returns ncclInProgress, and the communicator stays in progress until aborted.
std::mutex g_stall_mu;
std::map<std::pair<int, std::string>, int> g_stalls;  // (device, function) -> calls still to stall
std::atomic<int> g_stalls_ended_by_abort{0};

namespace {

size_t eager_bytes() {
  const char* v = std::getenv("FAKE_NCCL_EAGER_BYTES");
  return v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : 64 * 1024;
}

// NCCL: on a non-blocking communicator, no call may follow one that returned ncclInProgress until
// ncclCommGetAsyncError no longer says ncclInProgress (only that query, ncclGetLastError and the abort).
void check_not_in_progress(const std::shared_ptr<Comm>& comm, const char* what) {
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  if (comm->in_progress > 0)
    misuse("%s on non-blocking communicator %p while its previous call is still in progress "
           "(ncclCommGetAsyncError said ncclInProgress): NCCL forbids it",
           comm.get(), what);
}

size_t dtype_size(int t) {
  switch (t) {
    case 0: case 1: return 1;
    case 2: case 3: return 4;
    case 4: case 5: return 8;
    case 6: case 9: return 2;
    case 7: return 4;
    case 8: return 8;
  }
  return 0;
}
bool reducible(int t) { return t == 0 || t == 1 || t == 2 || t == 4 || t == 7 || t == 8; }

template <typename T>
void fold(T* acc, const T* in, size_t n, int op) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case 0: case 4: acc[i] = static_cast<T>(acc[i] + in[i]); break;
      case 1: acc[i] = static_cast<T>(acc[i] * in[i]); break;
      case 2: acc[i] = acc[i] > in[i] ? acc[i] : in[i]; break;
      case 3: acc[i] = acc[i] < in[i] ? acc[i] : in[i]; break;
    }
  }
}
template <typename T>
void divide(T* acc, size_t n, int by) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] / by);
}

// acc op= in, for `n` elements of `dtype`.
void reduce_into(void* acc, const void* in, size_t n, int dtype, int op) {
  switch (dtype) {
    case 0: fold(static_cast<int8_t*>(acc), static_cast<const int8_t*>(in), n, op); break;
    case 1: fold(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(in), n, op); break;
    case 2: fold(static_cast<int32_t*>(acc), static_cast<const int32_t*>(in), n, op); break;
    case 4: fold(static_cast<int64_t*>(acc), static_cast<const int64_t*>(in), n, op); break;
    case 7: fold(static_cast<float*>(acc), static_cast<const float*>(in), n, op); break;
    case 8: fold(static_cast<double*>(acc), static_cast<const double*>(in), n, op); break;
  }
}
void average(void* acc, size_t n, int dtype, int by) {
  if (dtype == 7) divide(static_cast<float*>(acc), n, by);
  if (dtype == 8) divide(static_cast<double*>(acc), n, by);
}

// A peer's process exited (fake_nccl_exit): NCCL's socket transport sees the connection close and
// reports a remote error. Nothing like this happens for a peer that is alive but stopped calling, or
// that aborted its communicator: its peers wait until their own deadline, as with real NCCL.
void peer_exited(const std::shared_ptr<Comm>& comm, int peer) {
  comm->error = kRemoteError;
  comm->clique->last_error = "rank " + std::to_string(peer) + "'s process exited (its connections closed)";
}
int any_exited(const Clique& c) { return c.exited.empty() ? -1 : *c.exited.begin(); }

// Runs on rank `me`'s stream thread: waits for all ranks' collective number `seq`, computes this
// rank's output into a temporary, waits until everybody has read the inputs, then writes it. Ends
// early when this rank's communicator is aborted (results unwritten) or a rank's process exited.
void run_collective(const std::shared_ptr<Comm>& comm, uint64_t seq, Contribution mine) {
  auto& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  auto& slot = c.slots[seq];
  if (slot.empty()) slot.resize(static_cast<size_t>(c.n));
  slot[static_cast<size_t>(comm->rank)] = mine;
  ++c.arrived[seq];
  c.cv.notify_all();
  c.cv.wait(lock, [&] { return comm->aborted || c.arrived[seq] == c.n || any_exited(c) >= 0; });
  if (comm->aborted) return;
  if (c.arrived[seq] != c.n) return peer_exited(comm, any_exited(c));
  for (const auto& other : slot) {
    if (other.kind != mine.kind || other.count != mine.count || other.dtype != mine.dtype || other.op != mine.op ||
        other.root != mine.root) {
      comm->error = kInvalidUsage;
      c.last_error = "ranks called different collectives at the same point";
      break;
    }
  }
  std::vector<char> out;
  if (comm->error == kSuccess) {
    const size_t es = dtype_size(mine.dtype), n = mine.count;
    switch (mine.kind) {
      case 0:  // allreduce
      case 2:  // reduce
        out.assign(static_cast<const char*>(slot[0].send), static_cast<const char*>(slot[0].send) + n * es);
        for (int r = 1; r < c.n; ++r) reduce_into(out.data(), slot[r].send, n, mine.dtype, mine.op);
        if (mine.op == 4) average(out.data(), n, mine.dtype, c.n);
        if (mine.kind == 2 && comm->rank != mine.root) out.clear();
        break;
      case 1:  // broadcast
        out.assign(static_cast<const char*>(slot[mine.root].send),
                   static_cast<const char*>(slot[mine.root].send) + n * es);
        break;
      case 3:  // allgather
        for (int r = 0; r < c.n; ++r)
          out.insert(out.end(), static_cast<const char*>(slot[r].send), static_cast<const char*>(slot[r].send) + n * es);
        break;
      case 4: {  // reduce_scatter: block `rank` of every input
        const size_t off = static_cast<size_t>(comm->rank) * n * es;
        out.assign(static_cast<const char*>(slot[0].send) + off, static_cast<const char*>(slot[0].send) + off + n * es);
        for (int r = 1; r < c.n; ++r)
          reduce_into(out.data(), static_cast<const char*>(slot[r].send) + off, n, mine.dtype, mine.op);
        if (mine.op == 4) average(out.data(), n, mine.dtype, c.n);
        break;
      }
    }
  }
  ++c.finished[seq];
  c.cv.notify_all();
  c.cv.wait(lock, [&] { return comm->aborted || c.finished[seq] == c.n || any_exited(c) >= 0; });
  if (comm->aborted) return;
  if (c.finished[seq] != c.n) return peer_exited(comm, any_exited(c));
  if (!out.empty()) std::memcpy(mine.recv, out.data(), out.size());
}

// One NCCL call as it runs on the GPU, in three steps, so that the calls of one group progress
// together as NCCL's grouped kernels do: `post` (sends put their message out; never waits), `run`
// (receives and collectives, in call order), `finish` (sends above the eager size wait for their
// receive). An ungrouped call is a group of one: an ungrouped large send waits for its receive
// before the next call on its stream starts, which is why a send-then-recv exchange must be grouped.
struct Step {
  Step(std::shared_ptr<Comm> c, void* s) : comm(std::move(c)), stream(s) {}
  std::shared_ptr<Comm> comm;
  void* stream;
  std::function<void()> post, run, finish;
};
thread_local int t_group_depth = 0;
thread_local std::vector<Step> t_group;

// Queues the steps: one task per stream (in call order), with CUDA's stream semantics.
void enqueue_steps(const std::vector<Step>& steps, int device) {
  std::vector<void*> streams;
  for (const auto& s : steps)
    if (std::find(streams.begin(), streams.end(), s.stream) == streams.end()) streams.push_back(s.stream);
  const int saved = t_device;
  t_device = device;  // the legacy stream named by a null stream is the caller's device's
  for (void* stream : streams) {
    std::vector<Step> mine;
    for (const auto& s : steps)
      if (s.stream == stream) mine.push_back(s);
    enqueue(stream, [mine] {
      for (const auto& s : mine) if (s.post) s.post();
      for (const auto& s : mine) if (s.run) s.run();
      for (const auto& s : mine) if (s.finish) s.finish();
    }, "an NCCL group");
  }
  t_device = saved;
}

bool take_stall(int device, const char* what) {
  std::lock_guard<std::mutex> lock(g_stall_mu);
  auto it = g_stalls.find({device, what});
  if (it == g_stalls.end() || it->second == 0) return false;
  --it->second;
  return true;
}

int stall(const std::shared_ptr<Comm>& comm) {
  auto& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  if (!comm->blocking) {
    ++comm->in_progress;  // never finished: only ncclCommAbort ends it
    return kInProgress;
  }
  if (c.cv.wait_for(lock, std::chrono::seconds(20), [&] { return comm->aborted; })) ++g_stalls_ended_by_abort;
  c.last_error = "a stalled call (fake_nccl_stall) ended";
  return kSystemError;
}

// A non-blocking communicator's call: NCCL returns ncclInProgress and finishes the call (connects,
// queues the kernels) on its own thread; only then does ncclCommGetAsyncError say ncclSuccess. Work
// the caller queues on the stream before that runs before the NCCL kernels, as on a GPU.
int finish_later(std::vector<Step> steps, int device) {
  std::vector<std::shared_ptr<Comm>> comms;
  for (const auto& s : steps)
    if (std::find(comms.begin(), comms.end(), s.comm) == comms.end()) comms.push_back(s.comm);
  for (const auto& comm : comms) {
    std::lock_guard<std::mutex> lock(comm->clique->mu);
    ++comm->in_progress;
  }
  std::thread([steps = std::move(steps), comms, device] {
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    enqueue_steps(steps, device);
    for (const auto& comm : comms) {
      std::lock_guard<std::mutex> lock(comm->clique->mu);
      --comm->in_progress;
      comm->clique->cv.notify_all();
    }
  }).detach();
  return kInProgress;
}

// Every NCCL operation goes through here: the stall hook, the group, or the stream.
int submit(Step step, const char* what) {
  check_not_in_progress(step.comm, what);
  if (take_stall(step.comm->device, what)) return stall(step.comm);
  if (t_group_depth > 0) {
    t_group.push_back(std::move(step));
    return kSuccess;
  }
  const int device = t_device;
  if (!step.comm->blocking) return finish_later({std::move(step)}, device);
  enqueue_steps({std::move(step)}, device);
  return kSuccess;
}

int queue_collective(void* comm_ptr, void* stream, Contribution c, const char* what) {
  auto comm = comm_of(comm_ptr, what);
  if ((c.kind == 0 || c.kind == 2 || c.kind == 4) && !reducible(c.dtype)) return kInvalidArgument;
  c.send = view(c.send);
  c.recv = view(c.recv);
  const uint64_t seq = comm->next_collective++;
  Step step(comm, stream);
  step.run = [comm, seq, c] { run_collective(comm, seq, c); };
  return submit(std::move(step), what);
}

}  // namespace
}  // namespace fake_cuda

using namespace fake_cuda;

extern "C" {

int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* comm, void* stream) {
  return queue_collective(comm, stream, {0, s, r, n, t, op, -1}, "ncclAllReduce");
}
int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* comm, void* stream) {
  return queue_collective(comm, stream, {1, s, r, n, t, -1, root}, "ncclBroadcast");
}
int ncclReduce(const void* s, void* r, size_t n, int t, int op, int root, void* comm, void* stream) {
  return queue_collective(comm, stream, {2, s, r, n, t, op, root}, "ncclReduce");
}
int ncclAllGather(const void* s, void* r, size_t n, int t, void* comm, void* stream) {
  return queue_collective(comm, stream, {3, s, r, n, t, -1, -1}, "ncclAllGather");
}
int ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, void* comm, void* stream) {
  return queue_collective(comm, stream, {4, s, r, n, t, op, -1}, "ncclReduceScatter");
}
int ncclSend(const void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr, "ncclSend");
  const size_t bytes = n * dtype_size(t);
  auto msg = std::make_shared<Message>();
  const char* from = static_cast<const char*>(view(buf));
  Step step(comm, stream);
  step.post = [comm, msg, from, bytes, peer] {
    msg->bytes.assign(from, from + bytes);
    auto& c = *comm->clique;
    std::lock_guard<std::mutex> lock(c.mu);
    c.mailbox[{comm->rank, peer}].push_back(msg);
    c.cv.notify_all();
  };
  if (bytes > eager_bytes()) {
    step.finish = [comm, msg, peer] {
      auto& c = *comm->clique;
      std::unique_lock<std::mutex> lock(c.mu);
      c.cv.wait(lock, [&] { return comm->aborted || msg->taken || c.exited.count(peer); });
      if (!comm->aborted && !msg->taken) peer_exited(comm, peer);
    };
  }
  return submit(std::move(step), "ncclSend");
}
int ncclRecv(void* buf, size_t n, int t, int peer, void* comm_ptr, void* stream) {
  auto comm = comm_of(comm_ptr, "ncclRecv");
  const size_t bytes = n * dtype_size(t);
  char* to = static_cast<char*>(view(buf));
  Step step(comm, stream);
  step.run = [comm, to, bytes, peer] {
    auto& c = *comm->clique;
    std::unique_lock<std::mutex> lock(c.mu);
    auto& q = c.mailbox[{peer, comm->rank}];
    c.cv.wait(lock, [&] { return comm->aborted || !q.empty() || c.exited.count(peer); });
    if (comm->aborted) return;
    if (q.empty()) return peer_exited(comm, peer);
    auto msg = q.front();
    q.pop_front();
    if (msg->bytes.size() != bytes) {
      comm->error = kInvalidUsage;
      c.last_error = "message size differs from the receive's";
    } else {
      std::memcpy(to, msg->bytes.data(), bytes);
    }
    msg->taken = true;
    c.cv.notify_all();
  };
  return submit(std::move(step), "ncclRecv");
}
int ncclGroupStart() {
  ++t_group_depth;
  return 0;
}
// The group's calls start together: on a blocking communicator they are queued now; on a
// non-blocking one NCCL finishes the group on its own thread (ncclInProgress until then).
int ncclGroupEnd() {
  if (t_group_depth == 0) return kInvalidUsage;
  if (--t_group_depth > 0) return kSuccess;
  std::vector<Step> steps = std::move(t_group);
  t_group.clear();
  if (steps.empty()) return kSuccess;
  for (const auto& s : steps)
    if (take_stall(s.comm->device, "ncclGroupEnd")) return stall(s.comm);
  const bool blocking = std::all_of(steps.begin(), steps.end(), [](const Step& s) { return s.comm->blocking; });
  if (!blocking) return finish_later(std::move(steps), t_device);
  enqueue_steps(steps, t_device);
  return kSuccess;
}

}  // extern "C"
