"""`epd tiny-model`: write a tiny offline checkpoint (wired into epd/cli.py by the lead)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `epd tiny-model` (the contract of epd/cli.py: add_arguments + run)."""
    p.add_argument("--arch", choices=["llava", "fastvlm"], default="llava")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", choices=["test", "bench"], default="test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["native", "hub"], default="native",
                   help="weight key layout: transformers-5 native or the legacy hub keys")


def add_tiny_model_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tiny-model", help="write a tiny random VLM checkpoint (HF layout)")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from epd.models.tiny import build_tiny_checkpoint

    out = build_tiny_checkpoint(args.arch, args.out, size=args.size, seed=args.seed,
                                layout=args.layout)
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    add_tiny_model_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
