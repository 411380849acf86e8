#!/usr/bin/python3
"""How long K ranks take to meet at torch.distributed.TCPStore (torch 1.13): the rendezvous-store peer.

One TCPStore server (is_master=True, wait_for_workers=False) runs in this process on 127.0.0.1. K clients
are spread over P forked processes, K/P threads each, one TCPStore client per thread, created and parked
before the clock starts. Each client does what a rank does at rendezvous:
    store = TCPStore("127.0.0.1", port, is_master=False)   # connect
    store.set(f"rank/{i}", b"1")                           # publish its own key
    if store.add("joined", 1) == K: store.set("go", b"1")  # count itself in; the last one opens the gate
    store.wait(["go"])                                     # wait for everybody
The clock (time.monotonic, one clock for all processes on Linux) starts when the parent releases the
clients; "total" ends when the last client returns from wait(). Phases are timed from the same start.
Usage: store_bench.py K [P=4] [REPS=3]
Prints one `REP ...` line per repetition and `RESULT store=torch-TCPStore K= P= reps= total_s_median= min= max=`.
"""
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=600)


def client_process(port, K, ids, ready, start, results):
    """Runs the clients `ids` on threads; reports per client (connected, set, added, released) times or an error."""
    threading.stack_size(512 * 1024)
    out = [None] * len(ids)
    stores = []  # kept open until every thread is done
    go = threading.Event()

    def client(j, i):
        go.wait()
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
            connected = time.monotonic()
            store.set(f"rank/{i}", b"1")
            was_set = time.monotonic()
            count = store.add("joined", 1)
            added = time.monotonic()
            if count == K:
                store.set("go", b"1")
            store.wait(["go"])
            out[j] = (connected, was_set, added, time.monotonic())
            stores.append(store)
        except Exception as e:  # counted and the first one shown, not fatal
            out[j] = repr(e)

    threads = [threading.Thread(target=client, args=(j, i)) for j, i in enumerate(ids)]
    for t in threads:
        t.start()
    ready.put(os.getpid())
    start.wait()
    go.set()
    for t in threads:
        t.join()
    results.put(out)


def one_rep(K, P, port):
    ctx = mp.get_context("fork")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=client_process, args=(port, K, list(range(p, K, P)), ready, start, results))
             for p in range(P)]
    for proc in procs:  # forked before the server exists, so they do not inherit it
        proc.start()
    server = dist.TCPStore("127.0.0.1", port, None, True, TIMEOUT, wait_for_workers=False)
    for _ in procs:
        ready.get()
    time.sleep(0.2)  # let every thread park
    t0 = time.monotonic()
    start.set()
    outcomes = [o for _ in procs for o in results.get()]
    parent_wall = time.monotonic() - t0
    for proc in procs:
        proc.join()
    ok = [o for o in outcomes if isinstance(o, tuple)]
    errors = [o for o in outcomes if not isinstance(o, tuple)]
    joined = int(server.add("joined", 0))
    del server

    def phase(k):
        return sorted(o[k] - t0 for o in ok)

    def quantile(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    connected, added, released = phase(0), phase(2), phase(3)
    nan = float("nan")
    return {
        "K": K, "P": P, "ok": len(ok), "errors": len(errors), "joined": joined,
        "first_error": errors[0] if errors else "",
        "total_s": max(released) if released else nan,
        "connect_med_s": quantile(connected, 0.5), "connect_p99_s": quantile(connected, 0.99),
        "connect_max_s": quantile(connected, 1.0),
        "last_join_s": max(added) if added else nan,
        "wait_release_s": max(released) - max(added) if released else nan,
        "parent_wall_s": parent_wall,
    }


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: store_bench.py K [P=4] [REPS=3]")
    K = int(sys.argv[1])
    P = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # two sockets per client, and some room
    nofile = min(hard, max(soft, 4 * K + 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    totals = []
    for rep in range(reps):
        port = 29900 + (os.getpid() % 50) * 10 + rep
        result = one_rep(K, P, port)
        totals.append(result["total_s"])
        print("REP " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()),
              flush=True)
    print(f"RESULT store=torch-TCPStore K={K} P={P} reps={reps} total_s_median={statistics.median(totals):.4f} "
          f"min={min(totals):.4f} max={max(totals):.4f} nofile={nofile}", flush=True)


if __name__ == "__main__":
    main()
