"""The one `ddtree` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module exposing `add_parser(subparsers)`; the module's parser sets `func`.
SUBCOMMANDS: dict[str, str] = {
    "generate": "ddtree.generate",
    "bench": "ddtree.bench",
    "train-target": "ddtree.demo.train_target",
    "train-drafter": "draft_server.train_cli",
    "draft": "draft_server.server",
    "verify": "verify_server.server",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="Lossless DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, NotADirectoryError) as exc:  # bad paths are user errors, not crashes
        print(f"ddtree {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
