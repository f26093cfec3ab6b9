"""Prefill-decode disaggregation: KV migration cost, and P+D vs colocated, in one run.

    .venv/bin/python bench/pd.py [--duration 45] [--concurrency 8] [--reps 5]

The `bench` tiny LLaVA checkpoint, text requests only.

1. Migration cost: `epd serve --role prefill` pinned to core 0 and `--role decode` pinned to
   core 1 (one torch thread each). For each prompt length in `--migration-words`, this
   process plays the proxy: P gets the prompt with `prefill_only`, D gets the
   `migration_request` (streamed, max_tokens 2). Per request: KV megabytes moved
   (blocks x block_size x layers x 2 x kv_heads x head_dim x dtype size), D's own migration
   time from `epd_timings` when D reports one, and D's time to first token (the prefill's
   token, emitted once the blocks are migrated). ms/MB = migration time / KV MB; the slope
   of D's TTFT over KV MB (least squares across sizes) is the marginal cost without D's
   fixed per-request overhead.
2. Serving: `--concurrency` closed-loop clients, prompts of `--prompt-words` words,
   `--max-tokens` tokens (ignore_eos, streamed) for `--duration` seconds, through `epd proxy`
   in both configs: P+D (`--mode pd`, P on core 0, D on core 1) against colocated (one
   `--role llm` on cores 0,1 with `--colocated-threads` torch threads). Prints p50/p99 TTFT
   and TPOT, output tok/s, requests/s and the P+D / colocated ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time

import httpx
from _common import (
    Procs,
    bench_model_dir,
    chat_body,
    closed_loop,
    first_errors,
    host_load,
    model_name,
    ms,
    new_client,
    ratio,
    stream_chat,
    summarize,
    text_prompt,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=45.0, help="seconds per serving phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=150, help="~2 tokens per word")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stagger", type=float, default=0.5, help="seconds between clients' starts")
    ap.add_argument("--migration-words", default="32,128,512,1024,1800")
    ap.add_argument("--reps", type=int, default=5, help="requests per migration size")
    ap.add_argument("--colocated-threads", type=int, default=1)
    ap.add_argument("--model-dir", default=None, help="default: the cached bench checkpoint")
    return ap.parse_args()


def kv_megabytes(mr: dict) -> float:
    lay = mr["kv_layout"]
    per_token = lay["num_layers"] * 2 * lay["num_kv_heads"] * lay["head_dim"]
    return len(mr["block_ids"]) * mr["block_size"] * per_token * DTYPE_BYTES[lay["dtype"]] / 1e6


def migration_seconds(timings: dict | None) -> float | None:
    """D's PD-migration time from its epd_timings (keys per docs: pd_migration or the
    migration statuses' names); None when D reports none."""
    if not timings:
        return None
    for key in ("pd_migration", "kv_migration"):
        if isinstance(timings.get(key), int | float):
            return float(timings[key])
    parts = [v for k, v in timings.items() if "migration" in k.lower() and "epd" not in k.lower()
             and isinstance(v, int | float)]
    return float(sum(parts)) if parts else None


async def migration_sweep(p_url: str, d_url: str, model: str, args) -> list[dict]:
    rows = []
    async with new_client() as client:
        for words in [int(w) for w in args.migration_words.split(",")]:
            samples = []
            for rep in range(args.reps + 1):  # the first of each size is a warm-up
                body = chat_body(model, text_prompt(words * 100 + rep, words), 2)
                p_body = {**body, "prefill_only": True, "stream": False}
                p_body.pop("stream_options")
                r = await client.post(p_url + "/v1/chat/completions", json=p_body)
                if r.status_code != 200:
                    raise RuntimeError(f"prefill: HTTP {r.status_code}: {r.text[:300]}")
                mr = r.json()["migration_request"]
                res = await stream_chat(client, d_url, {**body, "migration_request": mr}, "pd")
                if res.error:
                    raise RuntimeError(f"decode: {res.error}")
                if rep:
                    samples.append((kv_megabytes(mr), mr["num_tokens"], res.ttft,
                                    migration_seconds(res.timings)))
            mig = [s[3] for s in samples if s[3] is not None]
            rows.append({"tokens": samples[0][1], "mb": samples[0][0],
                         "ttft": statistics.median(s[2] for s in samples),
                         "mig": statistics.median(mig) if mig else None})
    return rows


def slope_ms_per_mb(rows: list[dict], key: str) -> float | None:
    pts = [(r["mb"], r[key]) for r in rows if r[key] is not None]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return 1000 * sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def print_migration(rows: list[dict]) -> None:
    print("| prompt tokens | KV MB | D migration ms (epd_timings) | ms/MB | D TTFT ms | "
          "D TTFT ms/MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mig = "n/a" if r["mig"] is None else f"{r['mig'] * 1000:.1f}"
        per = "n/a" if r["mig"] is None else f"{r['mig'] * 1000 / r['mb']:.2f}"
        print(f"| {r['tokens']} | {r['mb']:.2f} | {mig} | {per} | {r['ttft'] * 1000:.1f} | "
              f"{r['ttft'] * 1000 / r['mb']:.2f} |")
    for key, what in (("mig", "D migration time"), ("ttft", "D TTFT")):
        s = slope_ms_per_mb(rows, key)
        if s is not None:
            print(f"marginal cost (least-squares slope of {what} over KV MB): {s:.2f} ms/MB "
                  f"({1 / s:.2f} GB/s)" if s > 0 else f"slope of {what}: {s:.2f} ms/MB")


async def serve_phase(url: str, model: str, args) -> dict:
    def body(i: int) -> dict:
        return chat_body(model, text_prompt(i, args.prompt_words), args.max_tokens)

    async with new_client() as client:
        warm = [await stream_chat(client, url, body(10**6 + k), "warm") for k in range(2)]
        if errs := first_errors(warm):
            raise RuntimeError(f"warm-up failed: {errs}")
        t0 = time.perf_counter()
        res = await closed_loop(client, url, body, args.concurrency, t0 + args.duration,
                                stagger_s=args.stagger)
        out = summarize(res, time.perf_counter() - t0)
    out["error_samples"] = first_errors(res)
    return out


def start_pd(procs: Procs, model_dir: str):
    p = procs.start("prefill", ["serve", "--role", "prefill", "--model", model_dir],
                    cpus={0}, threads=1)
    d = procs.start("decode", ["serve", "--role", "decode", "--model", model_dir],
                    cpus={1}, threads=1)
    procs.wait_healthy()
    proxy = procs.start("proxy", ["proxy", "--mode", "pd", "--prefill", p.url, "--decode",
                                  d.url], cpus=None, threads=1)
    procs.wait_healthy()
    return p, d, proxy


def start_colocated(procs: Procs, model_dir: str, threads: int):
    llm = procs.start("llm", ["serve", "--role", "llm", "--model", model_dir],
                      cpus={0, 1}, threads=threads)
    procs.wait_healthy()
    proxy = procs.start("proxy", ["proxy", "--llm", llm.url], cpus=None, threads=1)
    procs.wait_healthy()
    return proxy


def main() -> int:
    args = parse_args()
    model_dir = str(bench_model_dir(args.model_dir))
    print("command: .venv/bin/python bench/pd.py " + shlex.join(sys.argv[1:]))
    print(f"start: {host_load()}", flush=True)
    serving: dict[str, dict] = {}
    try:
        with Procs() as procs:
            p, d, proxy = start_pd(procs, model_dir)
            model = model_name(proxy.url)
            mig_rows = asyncio.run(migration_sweep(p.url, d.url, model, args))
            print(f"migration sweep done; {host_load()}", flush=True)
            serving["P+D"] = asyncio.run(serve_phase(proxy.url, model, args))
            print(f"P+D serving done; {host_load()}", flush=True)
        with Procs() as procs:
            proxy = start_colocated(procs, model_dir, args.colocated_threads)
            name = f"colocated ({args.colocated_threads} thread(s))"
            serving[name] = asyncio.run(serve_phase(proxy.url, model_name(proxy.url), args))
            print(f"colocated serving done; {host_load()}", flush=True)
    except KeyboardInterrupt:
        print("interrupted; all processes stopped")
        return 130
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"failed: {e}")
        return 1
    print(f"end: {host_load()}")
    print_migration(mig_rows)
    print(f"serving: {args.concurrency} clients, ~{args.prompt_words} words/prompt, "
          f"{args.max_tokens} tokens, {args.duration:.0f}s per config, through epd proxy")
    print("| config | reqs | TTFT p50/p99 ms | TPOT p50/p99 ms | output tok/s | req/s | errors |")
    print("|---|---|---|---|---|---|---|")
    for name, s in serving.items():
        print(f"| {name} | {s['n']} | {ms(s['ttft_p50'])} / {ms(s['ttft_p99'])} | "
              f"{ms(s['tpot_p50'])} / {ms(s['tpot_p99'])} | {s['tokens'] / s['wall_s']:.0f} | "
              f"{s['n'] / s['wall_s']:.2f} | {s['errors']} {s['error_samples'] or ''} |")
    pd_, col = serving["P+D"], serving[name]
    print(f"P+D / colocated: TTFT p50 {ratio(pd_['ttft_p50'], col['ttft_p50'])}, "
          f"TTFT p99 {ratio(pd_['ttft_p99'], col['ttft_p99'])}, "
          f"TPOT p50 {ratio(pd_['tpot_p50'], col['tpot_p50'])}, "
          f"TPOT p99 {ratio(pd_['tpot_p99'], col['tpot_p99'])}, output tok/s "
          f"{(pd_['tokens'] / pd_['wall_s']) / (col['tokens'] / col['wall_s']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
