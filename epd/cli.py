"""The `epd` command line.

Each subcommand's module owns its flags (`add_arguments(parser)`) and entry point
(`run(args) -> int`); this file only dispatches, importing lazily so `epd --help` stays
fast and does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# role -> module providing add_arguments(parser) and run(args)
SERVE_ROLES = {
    "llm": "epd.llm.server",
    "prefill": "epd.llm.server",
    "decode": "epd.llm.server",
    "encoder": "epd.encoder.server",
}
COMMANDS = {
    "tiny-model": ("epd.models.tiny_cli", "write a tiny offline checkpoint in Hugging Face layout"),
    "generate": ("epd.llm.generate_cli", "offline greedy generation with the engine (no server)"),
    "proxy": ("epd.proxy.server", "the OpenAI-compatible front door (E -> P -> D routing)"),
    "launch": ("epd.launch", "start encoder + LLM engine(s) (or prefill + decode with --pd) + proxy on this machine"),
}


def _serve(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(prog="epd serve", add_help=False)
    pre.add_argument("--role", choices=sorted(SERVE_ROLES), required=True)
    known, rest = pre.parse_known_args(argv)
    parser = argparse.ArgumentParser(prog=f"epd serve --role {known.role}")
    module = importlib.import_module(SERVE_ROLES[known.role])
    module.add_arguments(parser, role=known.role)
    args = parser.parse_args(rest)
    args.role = known.role
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="epd", description="EPD disaggregated VLM serving engine")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="serve one role: encoder | llm | prefill | decode", add_help=False)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        if rest and rest[0] in ("-h", "--help"):
            print("usage: epd serve --role {encoder,llm,prefill,decode} [role flags] (--help after --role)")
            return 0
        return _serve(rest)
    if command not in COMMANDS:
        top.error(f"unknown command {command!r}")
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"epd {command}", description=COMMANDS[command][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
