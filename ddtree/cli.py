"""The one `ddtree` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> (module exposing `add_parser(subparsers)`, one line for `ddtree --help`); the module's parser
# sets `func`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("ddtree.generate", "one prompt through the in-process round loop"),
    "bench": ("ddtree.bench", "ar, chain and ddtree side by side, in-process or through a gateway; the cost curve"),
    "train-target": ("training.demo.train_target", "train the demo target"),
    "train-drafter": ("training.train_drafter", "train a DFlash drafter for a local target"),
    "distill-corpus": ("training.distill", "answer a corpus's prompts with a target: the drafter's training data"),
    "embed-pair": ("training.embed_pair", "write the demo pair embedded into a real architecture's shapes"),
    "draft": ("draft_server.server", "the drafter service"),
    "verify": ("verify_server.server", "the verifier service"),
    "gateway": ("gateway.cli", "the OpenAI-compatible gateway"),
    "serve": ("ddtree.serve", "the drafter, the verifier and the gateway as three processes"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Imports only the chosen subcommand's module when it is known: the services pull in gRPC, training pulls
    in data tooling, and a machine that runs one of them need not have what the others import."""
    parser = argparse.ArgumentParser(prog="ddtree", description="Lossless DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [command] if command in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in names:
        importlib.import_module(SUBCOMMANDS[name][0]).add_parser(sub)
    return parser


def overview() -> argparse.ArgumentParser:
    """`ddtree` and `ddtree --help`: the subcommands and their one-liners, importing none of their modules (each
    pulls in torch, transformers or gRPC)."""
    parser = argparse.ArgumentParser(prog="ddtree", description="Lossless DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        overview().parse_args(argv)  # prints the overview or the error, and exits
    args = build_parser(argv[0]).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, NotADirectoryError) as exc:  # bad paths are user errors, not crashes
        print(f"ddtree {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
