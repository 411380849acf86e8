#!/usr/bin/env python3
"""Someone outside a job who knows its id (so every key and the communicators' scope) but not its token.

  impostor.py store HOST PORT JOB_ID
      connects to the job's store without a proof and pipelines a write of the job's end key (which would
      stop every node); prints 'store: refused: <reason>' or 'store: accepted'.
  impostor.py notice HOST PORT NAME
      asks the job's store for its notice NAME before authenticating, as anyone may (a Slurm per-node job's
      munge credentials, src/launch/munge.h); prints the value, or 'no notice: <reason>' and exits 1.
  impostor.py data HOST PORT SCOPE CLAIMED_RANK TARGET_RANK
      connects to a rank's data port four times, posing as CLAIMED_RANK: two connections with the hello
      of cohort before issue 47 (magic and scope hash: all it asked for), two through the authenticated
      hello (src/transport/tcp/hello.h) with a guessed token. Prints 'hellos sent' once all are on their
      way, then one line per connection: 'refused' (closed without a byte of data), 'no answer' (open and
      silent at the end) or 'got N bytes of data' (taken as the rank it claimed).
"""
import hashlib
import hmac
import os
import select
import socket
import struct
import sys
import time


def fnv1a(text):
    h = 1469598103934665603
    for c in text.encode():
        h ^= c
        h = (h * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def frame(op, payload=b""):
    return struct.pack("<IBI", 5 + len(payload), op, 0) + payload


def string(b):
    return struct.pack("<I", len(b)) + b


def store(host, port, job_id):
    s = socket.create_connection((host, int(port)), timeout=10)
    s.recv(4096)  # the Challenge
    hello = frame(2, struct.pack("<IH", 0x53484F43, 1) + string(b""))
    end = frame(16, string(f"cohort/launch/{job_id}/end".encode()) + string(b'{"by":"impostor"}'))
    s.sendall(hello + end)
    data = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    if len(data) >= 9 and data[4] == 4:
        (n,) = struct.unpack_from("<I", data, 9)
        print("store: refused:", data[13:13 + n].decode(errors="replace"))
    else:
        print("store: accepted" if data else "store: closed without an answer")


def notice(host, port, name):
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(frame(5, string(name.encode())))
    data = b""
    while True:  # the Challenge, then the reply to the notice
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) >= 4 and len(data) >= 4 + struct.unpack_from("<I", data)[0] + 4:
            (first,) = struct.unpack_from("<I", data)
            reply = data[4 + first:]
            if len(reply) >= 4 and len(reply) >= 4 + struct.unpack_from("<I", reply)[0]:
                break
    (first,) = struct.unpack_from("<I", data)
    reply = data[4 + first:]
    op = reply[4]
    (n,) = struct.unpack_from("<I", reply, 9)
    text = reply[13:13 + n].decode(errors="replace")
    if op == 64:
        print(text)
    else:
        print("no notice:", text)
        sys.exit(1)


def data(host, port, scope, claimed, target):
    claimed, target = int(claimed), int(target)
    conns = []
    for index in (0, 1):  # the hello of cohort before issue 47
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(struct.pack("<IIIIQ", 0x31484843, claimed, index, 0, fnv1a(scope)))
        conns.append({"sock": s, "what": f"old hello, connection {index}", "v2": False})
    for index in (0, 1):  # the authenticated hello with a guessed token
        s = socket.create_connection((host, int(port)), timeout=10)
        nonce = os.urandom(16)
        s.sendall(struct.pack("<IIIIQ", 0x32484843, claimed, index, target, fnv1a(scope)) + nonce)
        conns.append({"sock": s, "what": f"new hello, connection {index}", "v2": True, "nonce": nonce, "index": index})
    print("hellos sent", flush=True)
    for c in conns:
        c["got"] = b""
        c["closed"] = False
    deadline = time.monotonic() + float(os.environ.get("IMPOSTOR_SECONDS", "25"))
    while time.monotonic() < deadline and not all(c["closed"] for c in conns):
        ready, _, _ = select.select([c["sock"] for c in conns if not c["closed"]], [], [], 0.2)
        for c in conns:
            if c["sock"] not in ready:
                continue
            try:
                chunk = c["sock"].recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                c["closed"] = True
                continue
            if c["v2"] and "challenged" not in c and len(c["got"]) + len(chunk) >= 56:
                challenge = (c["got"] + chunk)[:56]
                c["challenged"] = True
                c["got"] = (c["got"] + chunk)[56:]
                # The proof, keyed with a guess: everything else in it is known to an outsider.
                f = lambda b: struct.pack("<I", len(b)) + b
                msg = (b"cohort-tcp-hello-v1" + b"D" + f(scope.encode()) +
                       struct.pack("<III", claimed, c["index"], target) + f(c["nonce"]) + f(challenge[8:24]))
                mac = hmac.new(b"a guessed token", msg, hashlib.sha256).digest()
                c["sock"].sendall(struct.pack("<II", 0x32504843, 0) + mac)
                continue
            c["got"] += chunk
    for c in conns:
        if c["got"]:
            print(f"{c['what']}: got {len(c['got'])} bytes of data")
        elif c["closed"]:
            print(f"{c['what']}: refused")
        else:
            print(f"{c['what']}: no answer")


if __name__ == "__main__":
    {"store": store, "notice": notice, "data": data}[sys.argv[1]](*sys.argv[2:])
