"""Output tokens/s of the epd engine vs transformers' generate(), measured in one run.

    .venv/bin/python bench/engine_vs_hf.py [--arch llava] [--requests 32] [--max-tokens 64] [--reps 3]

The `bench`-size tiny checkpoint (`build_tiny_checkpoint(arch, dir, size="bench")`),
`--requests` chat requests of mixed prompt lengths, every third one with an example
image, `max_tokens` new tokens each (ignore_eos / min_new_tokens so every request
produces exactly that many). Three ways, same process, same threads:

- `epd`: the offline API `epd.LLM(...).generate(all requests)` (continuous batching);
- `hf x1`: `model.generate()` one request at a time;
- `hf padded`: `model.generate()` on left-padded batches of `--hf-batch` requests.

Tokens/s counts generated tokens only (`requests * max_tokens` on every side). Each side
is warmed up first on a conversation that is not part of the workload (its own image);
the engine is built fresh for every timed run and its prefix cache reset after the
warm-up, so the timed run starts cold; sharing within the workload (repeated images) is
the engine's to use. With `--reps N` the three sides run interleaved N times and the
median wall time of each is reported (the host is shared: interleaving spreads load
changes over all sides); CPU seconds (process time) are printed too, as they are less
sensitive to other jobs on the host.

Also checks that the engine's greedy tokens equal `hf x1`'s for every request.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
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


def warmup_conversation() -> list[dict]:
    """Not part of the workload: a generated image and a different text."""
    from PIL import Image

    img = Image.new("RGB", (64, 48))
    img.putdata([(x * 4, y * 5, (x + y) * 2) for y in range(48) for x in range(64)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = {"type": "text", "text": "Warm-up: describe this gradient."}
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text]}]


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


class EpdSide:
    """A fresh engine per timed run (warmed up, then its prefix cache reset): no prefix
    blocks or image features carry over from the warm-up or an earlier repetition."""

    def __init__(self, model_dir: Path, max_tokens: int) -> None:
        from epd.llm.sampling_params import SamplingParams

        self.model_dir = model_dir
        self.sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llm = None

    def run(self, convs):
        from epd.llm.api import LLM
        from epd.llm.sampling_params import SamplingParams

        self.llm = None  # free the previous engine's KV cache first
        self.llm = LLM(self.model_dir)
        self.llm.generate([warmup_conversation()], SamplingParams(max_tokens=4, temperature=0.0))
        self.llm.engine.blocks.reset_prefix_cache()
        outs, dt, cpu = timed(lambda: self.llm.generate(convs, self.sp))
        return [o.token_ids for o in outs], dt, cpu


def hf_inputs(processor, convs):
    from epd.models.reference import _image_sources, load_image

    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in convs]
    images = [load_image(u) for c in convs for u in _image_sources(c)]
    return texts, images


class HfSide:
    def __init__(self, model_dir: Path, max_tokens: int) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        tok = self.processor.tokenizer
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        self.gen = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                        temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
        self.generate([warmup_conversation()])

    def generate(self, chunk):
        texts, images = hf_inputs(self.processor, chunk)
        inputs = self.processor(text=texts, images=images or None, return_tensors="pt",
                                padding=True)
        with torch.inference_mode():
            out = self.model.generate(**inputs, **self.gen)
        return out[:, inputs["input_ids"].shape[1]:].tolist()

    def run_single(self, convs):
        return timed(lambda: [self.generate([c])[0] for c in convs])

    def run_padded(self, convs, batch: int):
        return timed(lambda: [t for i in range(0, len(convs), batch)
                              for t in self.generate(convs[i : i + batch])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llava", choices=("llava", "fastvlm"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse a built checkpoint")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions (median)")
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

    epd, hf = EpdSide(model_dir, args.max_tokens), HfSide(model_dir, args.max_tokens)
    times: dict[str, list[tuple[float, float]]] = {"epd": [], "hf x1": [], "hf padded": []}
    for _ in range(args.reps):
        epd_tokens, *t = epd.run(convs)
        times["epd"].append(tuple(t))
        hf_tokens, *t = hf.run_single(convs)
        times["hf x1"].append(tuple(t))
        _, *t = hf.run_padded(convs, args.hf_batch)
        times["hf padded"].append(tuple(t))
    llm = epd.llm
    # HF forbids eos (min_new_tokens) while the engine only ignores it: compare greedy
    # tokens up to the first point where HF had to suppress an eos.
    eos = set(llm.engine.spec.eos_token_ids)
    same = 0
    for a, b in zip(epd_tokens, hf_tokens, strict=True):
        cut = next((i for i, t in enumerate(a) if t in eos), len(a))
        same += a[:cut] == b[:cut]
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    tps = {k: n_out / w for k, w in wall.items()}
    print(f"arch={args.arch} requests={args.requests} max_tokens={args.max_tokens} "
          f"hf_batch={args.hf_batch} threads={torch.get_num_threads()} reps={args.reps} "
          f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} stats={llm.engine.stats()}")
    names = {"epd": "epd (continuous batching)", "hf x1": "transformers generate, one at a time",
             "hf padded": f"transformers generate, padded batches of {args.hf_batch}"}
    print("| engine | seconds (median) | cpu seconds | output tok/s |")
    print("|---|---|---|---|")
    for k, name in names.items():
        print(f"| {name} | {wall[k]:.2f} | {cpu[k]:.2f} | {tps[k]:.0f} |")
    print(f"speedup vs one-at-a-time: {tps['epd'] / tps['hf x1']:.2f}x "
          f"(cpu time: {cpu['hf x1'] / cpu['epd']:.2f}x); "
          f"vs padded batches: {tps['epd'] / tps['hf padded']:.2f}x "
          f"(cpu time: {cpu['hf padded'] / cpu['epd']:.2f}x); "
          f"greedy tokens equal to hf x1 (up to eos): {same}/{args.requests}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
