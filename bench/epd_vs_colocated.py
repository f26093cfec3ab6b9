"""Text requests' latency under a stream of image requests: EPD vs colocated, in one run.

    .venv/bin/python bench/epd_vs_colocated.py [--duration 60] [--image-rate 0.25]
        [--text-concurrency 8] [--configs colocated,epd]

Workload (the `bench` tiny LLaVA checkpoint): `--text-concurrency` closed-loop clients send
decode-heavy text requests (a short prompt, `--text-max-tokens` tokens, ignore_eos, streamed)
for `--duration` seconds, while image requests (4 example images each, as PNG data URLs,
every image made unique so no cache serves it) arrive at a steady `--image-rate` per second.
Each config also runs the text stream alone first (the no-image baseline).

- colocated-Nt: one `epd serve --role llm --vision local` on cores 0,1 with N torch threads
  (one config per N in `--colocated-threads`); the clients talk to it directly (the proxy
  cannot route images without an encoder).
- epd: `epd serve --role encoder` on core 0 and `epd serve --role llm` on core 1 (one torch
  thread each), `epd proxy` unpinned in front of them; the clients talk to the proxy.

Prints per phase p50/p99 TTFT and TPOT of the text requests, output tok/s and requests/s of
all requests, then the ratios. The load generator runs in this process (unpinned).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
import time

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
    open_loop,
    ratio,
    stream_chat,
    summarize,
    text_prompt,
    unique_image_urls,
)

IMAGES_PER_REQUEST = 4


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=50.0, help="seconds per phase")
    ap.add_argument("--image-rate", type=float, default=0.2, help="image requests per second")
    ap.add_argument("--text-concurrency", type=int, default=8)
    ap.add_argument("--text-stagger", type=float, default=0.5,
                    help="seconds between the text clients' first requests")
    ap.add_argument("--text-max-tokens", type=int, default=96)
    ap.add_argument("--text-words", type=int, default=12, help="prompt length of text requests")
    ap.add_argument("--image-max-tokens", type=int, default=16)
    ap.add_argument("--colocated-threads", default="2,1",
                    help="comma list: one colocated config per torch thread count")
    ap.add_argument("--configs", default="colocated,epd", help="comma list: colocated, epd")
    ap.add_argument("--model-dir", default=None, help="default: the cached bench checkpoint")
    return ap.parse_args()


def start_config(procs: Procs, config: str, model_dir: str, args) -> str:
    """Start one config's processes; returns the base URL clients talk to."""
    if config.startswith("colocated"):
        threads = int(config.split("-")[1].removesuffix("t"))
        llm = procs.start(config, ["serve", "--role", "llm", "--model", model_dir,
                                   "--vision", "local"], cpus={0, 1}, threads=threads)
        procs.wait_healthy()
        return llm.url
    enc = procs.start("encoder", ["serve", "--role", "encoder", "--model", model_dir],
                      cpus={0}, threads=1)
    llm = procs.start("llm", ["serve", "--role", "llm", "--model", model_dir], cpus={1},
                      threads=1)
    procs.wait_healthy()
    proxy = procs.start("proxy", ["proxy", "--encoder", enc.url, "--llm", llm.url],
                        cpus=None, threads=1)
    procs.wait_healthy()
    return proxy.url


async def run_phase(url: str, model: str, args, urls: list[str] | None) -> dict:
    def text_body(i: int) -> dict:
        return chat_body(model, text_prompt(i, args.text_words), args.text_max_tokens)

    def image_body(i: int) -> dict:
        imgs = urls[i * IMAGES_PER_REQUEST:(i + 1) * IMAGES_PER_REQUEST]
        return chat_body(model, f"Image request {i}: describe the pictures.",
                         args.image_max_tokens, imgs)

    async with new_client() as client:
        # warm-up: one text and (when images are in play) one image request, not measured
        warm = [await stream_chat(client, url, text_body(10**6), "warm")]
        if urls:
            warm.append(await stream_chat(client, url, image_body(len(urls) // 4 - 1), "warm"))
        if errs := first_errors(warm):
            raise RuntimeError(f"warm-up failed: {errs}")
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        rate = args.image_rate if urls else 0.0
        texts, images = await asyncio.gather(
            closed_loop(client, url, text_body, args.text_concurrency, deadline,
                        stagger_s=args.text_stagger),
            open_loop(client, url, image_body, rate, deadline))
        wall = time.perf_counter() - t0
    everything = texts + images
    out = summarize(texts, wall)
    out["all_tokens"] = sum(r.tokens for r in everything if r.error is None)
    out["all_n"] = sum(r.error is None for r in everything)
    out["errors"] = sum(r.error is not None for r in everything)
    out["img"] = summarize(images, wall)
    out["error_samples"] = first_errors(everything)
    out["img_timings"] = median_timings(images)
    return out


def median_timings(results) -> dict[str, float]:
    """Median seconds per `epd_timings` stage over the requests that reported one."""
    stages: dict[str, list[float]] = {}
    for r in results:
        for k, v in (r.timings or {}).items():
            if isinstance(v, int | float):
                stages.setdefault(k, []).append(float(v))
    return {k: round(statistics.median(v), 3) for k, v in stages.items()}


def print_table(rows: dict[tuple[str, str], dict]) -> None:
    print("| config | phase | text reqs | text TTFT p50/p99 ms | text TPOT p50/p99 ms | "
          "image reqs | image TTFT p50 ms | output tok/s | req/s | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (config, phase), s in rows.items():
        img = s["img"]
        print(f"| {config} | {phase} | {s['n']} | {ms(s['ttft_p50'])} / {ms(s['ttft_p99'])} | "
              f"{ms(s['tpot_p50'])} / {ms(s['tpot_p99'])} | {img['n']} | "
              f"{ms(img['ttft_p50'])} | {s['all_tokens'] / s['wall_s']:.0f} | "
              f"{s['all_n'] / s['wall_s']:.2f} | {s['errors']} |")


def print_ratios(rows: dict[tuple[str, str], dict]) -> None:
    for config in dict.fromkeys(c for c, _ in rows):
        base, load = rows.get((config, "text only")), rows.get((config, "text + images"))
        if base and load:
            verdict = ("within" if load["tpot_p99"] <= 1.5 * base["tpot_p99"] else "NOT within")
            print(f"{config}: with images / text only: TPOT p99 "
                  f"{ratio(load['tpot_p99'], base['tpot_p99'])} ({verdict} 1.5x), "
                  f"TPOT p50 {ratio(load['tpot_p50'], base['tpot_p50'])}, "
                  f"TTFT p99 {ratio(load['ttft_p99'], base['ttft_p99'])}")
    for (config, phase), c in rows.items():
        e = rows.get(("epd", phase))
        if e and config != "epd":
            tput = (e["all_tokens"] / e["wall_s"]) / (c["all_tokens"] / c["wall_s"])
            rps = (e["all_n"] / e["wall_s"]) / (c["all_n"] / c["wall_s"])
            print(f"epd / {config}, {phase}: TTFT p50 {ratio(e['ttft_p50'], c['ttft_p50'])}, "
                  f"TTFT p99 {ratio(e['ttft_p99'], c['ttft_p99'])}, "
                  f"TPOT p50 {ratio(e['tpot_p50'], c['tpot_p50'])}, "
                  f"TPOT p99 {ratio(e['tpot_p99'], c['tpot_p99'])}, "
                  f"output tok/s {tput:.2f}x, req/s {rps:.2f}x")


def main() -> int:
    args = parse_args()
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not wanted or any(c not in ("colocated", "epd") for c in wanted):
        print("--configs takes colocated and/or epd")
        return 2
    configs = [f"colocated-{int(t)}t" for t in args.colocated_threads.split(",")
               if "colocated" in wanted] + ["epd"] * ("epd" in wanted)
    model_dir = str(bench_model_dir(args.model_dir))
    n_image_reqs = math.ceil(args.duration * args.image_rate) + 2
    print("command: .venv/bin/python bench/epd_vs_colocated.py " + shlex.join(sys.argv[1:]))
    print(f"start: {host_load()}", flush=True)
    rows: dict[tuple[str, str], dict] = {}
    try:
        for k, config in enumerate(configs):
            urls = unique_image_urls(n_image_reqs * IMAGES_PER_REQUEST, seed=k + 1)
            with Procs() as procs:
                url = start_config(procs, config, model_dir, args)
                model = model_name(url)
                for phase, phase_urls in (("text only", None), ("text + images", urls)):
                    s = asyncio.run(run_phase(url, model, args, phase_urls))
                    rows[(config, phase)] = s
                    print(f"{config} / {phase}: {s['n']} text, {s['img']['n']} image requests, "
                          f"{s['errors']} errors {s['error_samples']}; {host_load()}"
                          + (f"; image epd_timings medians (s): {s['img_timings']}"
                             if s["img_timings"] else ""),
                          flush=True)
    except KeyboardInterrupt:
        print("interrupted; all processes stopped")
        return 130
    print(f"end: {host_load()}")
    print(f"duration {args.duration:.0f}s/phase, text concurrency {args.text_concurrency}, "
          f"text max_tokens {args.text_max_tokens}, image rate {args.image_rate}/s x "
          f"{IMAGES_PER_REQUEST} images, image max_tokens {args.image_max_tokens}")
    print_table(rows)
    print_ratios(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
