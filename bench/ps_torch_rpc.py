#!/usr/bin/python3
"""The peer of bench/ps_bench.cc (issue 18): a sparse-embedding parameter server written with
PyTorch's torch.distributed.rpc, following PyTorch's RPC parameter-server tutorial
(docs.pytorch.org/tutorials/intermediate/rpc_param_server_tutorial): each server process holds a
ParameterServer object; workers get an RRef to it with rpc.remote(get_parameter_server) and call its
methods through rpc_async(rref.owner(), call_method, (ParameterServer.method, rref, ...)).

  /usr/bin/python3 bench/ps_torch_rpc.py [--servers 1] [--workers 2] [--steps 500] [--warmup 50]
                                         [--ids 4096] [--dim 64]

Work per step per worker (the same as ps_bench.cc): pull `--ids` random ids (uniform over 2^20,
torch.Generator seeded with the worker index) x `--dim` float32, then push a gradient for those ids
(a constant 1e-3 gradient); the server applies SGD (row -= lr * grad) under a lock. Step = pull +
push, timed on the worker.

Table: 2^20 rows (--rows) of float32, zero-initialised and PREALLOCATED as one tensor per server
(server s holds the ids with id % servers == s at local row id // servers); pull is index_select,
push is index_add_ (duplicate ids are summed, as cohort's push does). Preallocating is what an
idiomatic torch server would do; it spares the server the first-touch row creation of cohort's
sparse tables (a hash map), so it favours torch.

With 2 servers each worker splits the ids by id % 2 and sends one request per server per pull and
per push, in parallel (rpc_async, then wait on both), and scatters the returned rows back into
request order.

All processes are spawned here (multiprocessing, 'spawn'), rendezvous on a free localhost port
(TensorPipe, init_method tcp://127.0.0.1:PORT). After the warm-up the workers meet at a barrier held
by server 0, then time `--steps` steps. The parent prints

  RESULT impl=torch_rpc servers=S workers=W steps=N ids=I dim=D rows_per_s=R p50_ms=.. p99_ms=.. max_ms=..

At the end each worker pulls its last ids again and checks every value is at most -lr * 1e-3.
rows_per_s: (pulled + pushed rows over all workers) / (last worker's end - first worker's start)
(CLOCK_MONOTONIC, comparable across processes). The latencies are over every timed step of every
worker.
"""
import argparse
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


# --- the server side (the tutorial's ParameterServer / get_parameter_server / call_method) ---------

class ParameterServer:
    def __init__(self, shard, num_shards, rows, dim, lr):
        self.shard, self.num_shards, self.lr = shard, num_shards, lr
        local_rows = (rows - shard + num_shards - 1) // num_shards
        self.table = torch.zeros(local_rows, dim, dtype=torch.float32)
        self.lock = threading.Lock()
        self.pushes = 0
        self.barrier_cv = threading.Condition()
        self.barrier_count = 0

    def pull(self, ids):
        return self.table.index_select(0, torch.div(ids, self.num_shards, rounding_mode="floor"))

    def push(self, ids, grads):
        local = torch.div(ids, self.num_shards, rounding_mode="floor")
        with self.lock:
            self.table.index_add_(0, local, grads, alpha=-self.lr)
            self.pushes += 1

    def barrier(self, parties):
        with self.barrier_cv:
            generation = self.barrier_count // parties
            self.barrier_count += 1
            if self.barrier_count % parties == 0:
                self.barrier_cv.notify_all()
            else:
                self.barrier_cv.wait_for(lambda: self.barrier_count // parties > generation)


param_server = None
global_lock = threading.Lock()


def get_parameter_server(shard, num_shards, rows, dim, lr):
    global param_server
    with global_lock:  # every worker asks; the first creates it
        if param_server is None:
            param_server = ParameterServer(shard, num_shards, rows, dim, lr)
        return param_server


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method_async(method, rref, *args):
    return rpc.rpc_async(rref.owner(), call_method, args=[method, rref] + list(args))


# --- processes -------------------------------------------------------------------------------------

def backend_options(args):
    kw = dict(init_method=f"tcp://127.0.0.1:{args.port}", num_worker_threads=args.rpc_threads,
              rpc_timeout=120)
    if args.transports:
        kw["_transports"] = args.transports.split(",")
    if args.channels:
        kw["_channels"] = args.channels.split(",")
    return rpc.TensorPipeRpcBackendOptions(**kw)


def run_worker(index, args, queue):
    S = args.servers
    name = f"worker{index}"
    rpc.init_rpc(name, rank=S + index, world_size=S + args.workers, rpc_backend_options=backend_options(args))
    try:
        rrefs = [rpc.remote(f"ps{s}", get_parameter_server, args=(s, S, args.rows, args.dim, args.lr))
                 for s in range(S)]
        gen = torch.Generator().manual_seed(index)
        grads = torch.full((args.ids, args.dim), 1e-3, dtype=torch.float32)
        rows = torch.empty(args.ids, args.dim, dtype=torch.float32)

        def pull(ids, sel, sids):
            if S == 1:
                return remote_method_async(ParameterServer.pull, rrefs[0], ids).wait()
            futs = [remote_method_async(ParameterServer.pull, rrefs[s], sids[s]) for s in range(S)]
            for s in range(S):
                rows.index_copy_(0, sel[s], futs[s].wait())
            return rows

        def one_step():
            ids = torch.randint(0, args.rows, (args.ids,), generator=gen, dtype=torch.int64)
            if S == 1:
                pull(ids, None, None)
                remote_method_async(ParameterServer.push, rrefs[0], ids, grads).wait()
                return ids, None, None
            shard = torch.remainder(ids, S)
            sel = [(shard == s).nonzero().squeeze(1) for s in range(S)]
            sids = [ids[i] for i in sel]
            pull(ids, sel, sids)
            futs = [remote_method_async(ParameterServer.push, rrefs[s], sids[s], grads.index_select(0, sel[s]))
                    for s in range(S)]
            for f in futs:
                f.wait()
            return ids, sel, sids

        for _ in range(args.warmup):
            one_step()
        remote_method_async(ParameterServer.barrier, rrefs[0], args.workers).wait()
        lat = []
        last = None
        start = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            last = one_step()
            lat.append(time.perf_counter() - t0)
        end = time.perf_counter()
        # Sanity, as ps_bench.cc: every row of the last step's ids has had at least one push.
        got = pull(*last)
        bound = -args.lr * 1e-3 * 0.999
        if not bool((got <= bound).all()):
            raise RuntimeError(f"check failed: a pulled value is above {bound} (max {got.max().item()})")
        queue.put((index, start, end, lat))
    except BaseException as e:
        queue.put((index, None, None, repr(e)))
        raise
    finally:
        rpc.shutdown()  # graceful: waits for every process's outstanding work


def run_server(shard, args, queue):
    rpc.init_rpc(f"ps{shard}", rank=shard, world_size=args.servers + args.workers,
                 rpc_backend_options=backend_options(args))
    rpc.shutdown()  # serves until every worker has shut down


def entry(rank, args, queue):
    torch.set_num_threads(args.intra_op_threads)
    if rank < args.servers:
        run_server(rank, args, queue)
    else:
        run_worker(rank - args.servers, args, queue)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(sorted_values, q):
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--ids", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=1 << 20, help="id space = preallocated rows over all servers")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--rpc-threads", type=int, default=16, help="TensorPipe num_worker_threads")
    p.add_argument("--intra-op-threads", type=int, default=1, help="torch.set_num_threads in every process")
    p.add_argument("--transports", default="", help="TensorPipe _transports, e.g. uv or shm,uv (default: torch's)")
    p.add_argument("--channels", default="", help="TensorPipe _channels, e.g. basic (default: torch's)")
    p.add_argument("--timeout", type=float, default=120, help="seconds before the run is abandoned")
    args = p.parse_args()
    args.port = free_port()
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe's uv transport: listen on loopback

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    nprocs = args.servers + args.workers
    procs = [ctx.Process(target=entry, args=(r, args, queue), daemon=True) for r in range(nprocs)]
    # A SIGTERM (e.g. from `timeout`) must not leave the children behind: exit through the finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {}
    failed = False
    try:
        for pr in procs:
            pr.start()
        deadline = time.monotonic() + args.timeout
        while len(results) < args.workers:
            if queue.empty():
                if time.monotonic() > deadline or any(pr.exitcode not in (None, 0) for pr in procs):
                    failed = True
                    break
                time.sleep(0.05)
                continue
            index, start, end, lat = queue.get()
            if start is None:
                print(f"worker {index} failed: {lat}", file=sys.stderr)
                failed = True
                break
            results[index] = (start, end, lat)
        for pr in procs:
            pr.join(timeout=max(1.0, deadline - time.monotonic()) if not failed else 2.0)
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
    if failed or len(results) < args.workers:
        print(f"ps_torch_rpc: failed (exit codes {[pr.exitcode for pr in procs]})", file=sys.stderr)
        sys.exit(1)

    span = max(r[1] for r in results.values()) - min(r[0] for r in results.values())
    lat = sorted(x for r in results.values() for x in r[2])
    rows = 2 * args.ids * args.steps * args.workers
    print(f"RESULT impl=torch_rpc servers={args.servers} workers={args.workers} steps={args.steps} "
          f"ids={args.ids} dim={args.dim} rows_per_s={rows / span:.0f} "
          f"p50_ms={percentile(lat, 0.50) * 1e3:.3f} p99_ms={percentile(lat, 0.99) * 1e3:.3f} "
          f"max_ms={lat[-1] * 1e3:.3f}", flush=True)


if __name__ == "__main__":
    main()
