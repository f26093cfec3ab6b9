"""Read bandwidth of the TCP transfer backend between two processes vs. `dst.copy_(src)`.

    .venv/bin/python bench/transfer.py [--sizes-kib 64,256,1024,8192,65536] [--reps 15]

A producer process (`python -m epd.transfer._selftest`) registers a pool of pseudo-random
bytes and serves the HTTP handshake; this process connects with `http_handshake` and
times `read(...)` + `wait()` (the public API, including its polling back-off) for one
contiguous range of each size, issued as 1 op and as N parallel ops (dlslime opens one
TCP connection per op). Reads are checked byte for byte once per size and split.
The reference is the median of `dst.copy_(src)` for the same size in this process with
one torch thread (the TCP path has one I/O thread per side; torch's 2-thread copy is
erratic on a loaded 2-core host). The ratio column is the best split over the copy.
"loopback" is the ceiling of plain TCP here: one Python socket streaming the same bytes
over 127.0.0.1 between two threads (`sendall` / `recv_into`, no dlslime).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

from epd.transfer import ReadOp, create_transfer_engine
from epd.transfer._selftest import pattern_bytes
from epd.transfer.http import http_handshake

SEED = 3


def split_op(nbytes: int, parts: int) -> list[ReadOp]:
    step = -(-nbytes // parts)
    return [ReadOp(off, off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


def time_read(engine, ops: list[ReadOp], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fut = engine.read("producer", "pool", "pool", ops)
        if not fut.wait(60) or fut.error:
            raise RuntimeError(f"read failed: {fut.error or 'timeout'}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_copy(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_loopback(nbytes: int, reps: int) -> float:
    payload, sink = bytearray(nbytes), bytearray(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                while conn.recv(1):
                    conn.sendall(payload)

        threading.Thread(target=serve, daemon=True).start()
        times = []
        with socket.create_connection(server.getsockname()) as client:
            view = memoryview(sink)
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                client.sendall(b"x")
                got = 0
                while got < nbytes:
                    got += client.recv_into(view[got:])
                times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-kib", default="64,256,1024,8192,65536")
    parser.add_argument("--splits", default="1,4", help="parallel ops per read")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) * 1024 for s in args.sizes_kib.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    pool_bytes = max(sizes)

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epd.transfer._selftest",
            "--nbytes",
            str(pool_bytes),
            "--seed",
            str(SEED),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    engine = create_transfer_engine("tcp", "127.0.0.1")
    try:
        info = json.loads(proc.stdout.readline())
        expected = pattern_bytes(pool_bytes, SEED)
        dst = torch.zeros(pool_bytes, dtype=torch.uint8)
        dst.fill_(1)  # touch the pages before timing
        engine.register_pool("pool", dst)
        engine.connect("producer", http_handshake(info["url"], engine.engine_id))

        header = (
            ["size", "copy GB/s", "loopback GB/s"]
            + [f"tcp x{n} GB/s" for n in splits]
            + ["best/copy", "best/loopback"]
        )
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"cpus: {os.cpu_count()}, load average: {load}, reps: {args.reps} (median)")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for size in sizes:
            reps = args.reps if size <= (8 << 20) else max(5, args.reps // 3)
            copy_bw = size / time_copy(size, reps) / 1e9
            loop_bw = size / time_loopback(size, reps) / 1e9
            label = f"{size // 1024} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
            row = [label, f"{copy_bw:.2f}", f"{loop_bw:.2f}"]
            best = 0.0
            for n in splits:
                ops = split_op(size, n)
                dst[:size].zero_()
                time_read(engine, ops, 1)
                if not torch.equal(dst[:size], expected[:size]):
                    raise RuntimeError(f"wrong bytes for {size} B in {n} ops")
                bw = size / time_read(engine, ops, reps) / 1e9
                best = max(best, bw)
                row.append(f"{bw:.2f}")
            row += [f"{best / copy_bw:.2f}", f"{best / loop_bw:.2f}"]
            print("| " + " | ".join(row) + " |", flush=True)
    finally:
        engine.close()
        proc.stdin.close()
        proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
