"""The one `ddtree` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module exposing `add_parser(subparsers)`; the module's parser sets `func`.
SUBCOMMANDS: dict[str, str] = {
    "generate": "ddtree.generate",
    "train-target": "ddtree.demo.train_target",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="Lossless DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
