"""`epd generate`: offline greedy generation through the engine (no server).

Builds one OpenAI-style user message (images first, then the prompt), runs it through
`epd.LLM` and prints the reply on stdout (diagnostics go to stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the embedded tiny llava checkpoint)")
    parser.add_argument("--image", action="append", default=[],
                        help="image file (repeatable); placed before the prompt")
    parser.add_argument("--prompt", default="Describe the image.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--device", default="auto")


def build_messages(prompt: str, images: list[str]) -> list[dict]:
    if not images:
        return [{"role": "user", "content": prompt}]
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": str(Path(p).resolve())}} for p in images
    ]
    parts.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": parts}]


def run(args) -> int:
    from epd import LLM, SamplingParams
    from epd.errors import EPDError

    if args.max_tokens < 1:
        print("--max-tokens must be at least 1", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from epd.models import default_model_dir

        model = str(default_model_dir())
    for image in args.image:
        if not Path(image).is_file():
            print(f"--image {image!r} is not a file", file=sys.stderr)
            return 2
    overrides = {"device": args.device}
    if args.num_blocks is not None:
        overrides["num_blocks"] = args.num_blocks
    llm = LLM(model, **overrides)
    try:
        out = llm.generate(build_messages(args.prompt, args.image),
                           SamplingParams(max_tokens=args.max_tokens, temperature=0.0))[0]
    except EPDError as exc:
        print(f"error ({exc.param}): {exc.message}", file=sys.stderr)
        return 1
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
    print(out.text)
    print(f"[{out.num_prompt_tokens} prompt tokens, {len(out.token_ids)} generated, "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
