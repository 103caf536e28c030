"""The one `ddtree` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module exposing `add_parser(subparsers)`; the module's parser sets `func`.
SUBCOMMANDS: dict[str, str] = {
    "generate": "ddtree.generate",
    "bench": "ddtree.bench",
    "train-target": "training.demo.train_target",
    "train-drafter": "training.train_drafter",
    "distill-corpus": "training.distill",
    "embed-pair": "training.embed_pair",
    "draft": "draft_server.server",
    "verify": "verify_server.server",
    "gateway": "gateway.cli",
    "serve": "ddtree.serve",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Imports only the chosen subcommand's module when it is known: the services pull in gRPC, training pulls
    in data tooling, and a machine that runs one of them need not have what the others import."""
    parser = argparse.ArgumentParser(prog="ddtree", description="Lossless DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [command] if command in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in names:
        importlib.import_module(SUBCOMMANDS[name]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, NotADirectoryError) as exc:  # bad paths are user errors, not crashes
        print(f"ddtree {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
