"""Output tokens/s of the epd engine vs transformers' generate(), measured in one run.

    .venv/bin/python bench/engine_vs_hf.py [--arch llava] [--requests 32] [--max-tokens 64]

The `bench`-size tiny checkpoint (`build_tiny_checkpoint(arch, dir, size="bench")`),
`--requests` chat requests of mixed prompt lengths, every third one with an example
image, `max_tokens` new tokens each (ignore_eos / min_new_tokens so every request
produces exactly that many). Three ways, same process, same threads:

- `epd`: the offline API `epd.LLM(...).generate(all requests)` (continuous batching);
- `hf x1`: `model.generate()` one request at a time;
- `hf padded`: `model.generate()` on left-padded batches of `--hf-batch` requests.

Also checks that the engine's greedy tokens equal `hf x1`'s for every request.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

IMAGES = Path(__file__).resolve().parent.parent / "examples" / "images"
IMAGE_NAMES = ["sunset.png", "bar_chart.jpg", "city_street.jpg", "cat.png", "spiral.webp"]
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank at dawn. "


def make_conversations(n: int) -> list[list[dict]]:
    convs = []
    for i in range(n):
        words = SENTENCE * (1 + (i * 7) % 12)  # mixed prompt lengths
        if i % 3 == 0:
            img = {"type": "image_url", "image_url": {"url": str(IMAGES / IMAGE_NAMES[i % 5])}}
            content = [img, {"type": "text", "text": f"Request {i}: {words}"}]
        else:
            content = f"Request {i}: {words}"
        convs.append([{"role": "user", "content": content}])
    return convs


def run_epd(model_dir: Path, convs, max_tokens: int):
    from epd.llm.api import LLM
    from epd.llm.sampling_params import SamplingParams

    llm = LLM(model_dir)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(convs[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(convs, sp)
    dt = time.perf_counter() - t0
    return [o.token_ids for o in outs], dt, llm


def hf_inputs(processor, convs):
    from epd.models.reference import _image_sources, load_image

    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in convs]
    images = [load_image(u) for c in convs for u in _image_sources(c)]
    return texts, images


def run_hf(model_dir: Path, convs, max_tokens: int, batch: int):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor.tokenizer.padding_side = "left"
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    gen = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
               temperature=None, top_p=None, top_k=None,
               pad_token_id=processor.tokenizer.pad_token_id)

    def generate(chunk):
        texts, images = hf_inputs(processor, chunk)
        inputs = processor(text=texts, images=images or None, return_tensors="pt",
                           padding=True)
        with torch.inference_mode():
            out = model.generate(**inputs, **gen)
        return out[:, inputs["input_ids"].shape[1]:].tolist()

    generate(convs[:1])  # warm-up
    t0 = time.perf_counter()
    single = [generate([c])[0] for c in convs]
    dt_single = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, len(convs), batch):
        generate(convs[i : i + batch])
    dt_batch = time.perf_counter() - t0
    return single, dt_single, dt_batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llava", choices=("llava", "fastvlm"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse a built checkpoint")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (1: on a small shared host, 2 OpenMP "
                         "threads that get descheduled make every op wait for the slower one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from epd.models.tiny import build_tiny_checkpoint

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = build_tiny_checkpoint(args.arch, Path(tempfile.mkdtemp()) / "bench", size="bench")
    convs = make_conversations(args.requests)
    n_out = args.requests * args.max_tokens

    epd_tokens, dt_epd, llm = run_epd(model_dir, convs, args.max_tokens)
    hf_tokens, dt_single, dt_batch = run_hf(model_dir, convs, args.max_tokens, args.hf_batch)
    # HF forbids eos (min_new_tokens) while the engine only ignores it: compare greedy
    # tokens up to the first point where HF had to suppress an eos.
    eos = set(llm.engine.spec.eos_token_ids)
    same = 0
    for a, b in zip(epd_tokens, hf_tokens, strict=True):
        cut = next((i for i, t in enumerate(a) if t in eos), len(a))
        same += a[:cut] == b[:cut]
    tps = {"epd": n_out / dt_epd, "hf x1": n_out / dt_single, "hf padded": n_out / dt_batch}
    print(f"arch={args.arch} requests={args.requests} max_tokens={args.max_tokens} "
          f"hf_batch={args.hf_batch} threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.1f} stats={llm.engine.stats()}")
    print("| engine | seconds | output tok/s |")
    print("|---|---|---|")
    print(f"| epd (continuous batching) | {dt_epd:.2f} | {tps['epd']:.0f} |")
    print(f"| transformers generate, one at a time | {dt_single:.2f} | {tps['hf x1']:.0f} |")
    print(f"| transformers generate, padded batches of {args.hf_batch} | {dt_batch:.2f} | "
          f"{tps['hf padded']:.0f} |")
    print(f"speedup vs one-at-a-time: {tps['epd'] / tps['hf x1']:.2f}x; "
          f"vs padded batches: {tps['epd'] / tps['hf padded']:.2f}x; "
          f"greedy tokens equal to hf x1 (up to eos): {same}/{args.requests}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
