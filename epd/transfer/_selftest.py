"""A producer process for transfer tests and benchmarks.

`python -m epd.transfer._selftest --nbytes N [--block-nbytes B] [--seed S]` registers a
pool named "pool" filled with `pattern_bytes(N, S)`, serves the handshake router on a
free port of `--host`, prints one JSON line `{"url", "engine_id", "nbytes"}` once ready,
and exits when its stdin closes (so it dies with its parent) or on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading

import torch


def pattern_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    """Deterministic pseudo-random bytes, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from fastapi import FastAPI

    from epd.transfer.http import make_transfer_router
    from epd.transfer.registry import create_transfer_engine

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--block-nbytes", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    pool = pattern_bytes(args.nbytes, args.seed)
    if args.block_nbytes:
        pool = pool.view(-1, args.block_nbytes)
    engine = create_transfer_engine(args.backend, args.host)
    engine.register_pool("pool", pool)
    app = FastAPI()
    app.include_router(make_transfer_router(engine))

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.bind((args.host, 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

    def watch_stdin() -> None:
        sys.stdin.read()
        server.should_exit = True

    threading.Thread(target=watch_stdin, daemon=True).start()
    info = {"url": f"http://{host}:{port}", "engine_id": engine.engine_id, "nbytes": args.nbytes}
    print(json.dumps(info), flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
