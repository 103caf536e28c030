"""How much slower a round call's host steps run right after the host did something else for a while, and whether
rehearsing them meanwhile (runtime/event_loop.py, keep_warm) keeps them fast. No GPU needed: the steps are a Verify
call's host-only ones at Qwen3-8B shapes (parse a 64-node tree's request, decode and check the tree, encode an
answer with two rows of features), as the verifier service's rehearsal runs them.

    python bench/cold_host.py --out results/cold_host.json

Before each measured run of the steps (`--runs` of them, medians in µs after the first sixth) the host does one of:
nothing (`back to back`); sleeps `--wait-us` (`asleep`); spins in Python (`spinning`); polls a socket with a
PollingSelector, as a service's loop does between rounds (`busy polling`); the same while the selector rehearses
the steps every `--every-us` (`busy polling, rehearsing`).
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.event_loop import PollingSelector
from protos.types import DraftTree
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from verify_server.validate import TreeLimits, check_tree

NODES, FEATURE_WIDTH, VOCAB = 64, 3 * 4096, 151936  # a 64-node tree, Qwen3-8B's three taps of 4096


def verify_steps() -> Callable[[], None]:
    chain = torch.arange(NODES + 1)
    request = pb.VerifyRequest(session_id="s")
    tensors.tree_to_pb(DraftTree(chain + 100, chain - 1, chain, max_depth=NODES), out=request.tree)
    payload = request.SerializeToString()
    features = torch.randn(2, FEATURE_WIDTH).to(torch.bfloat16)
    limits = TreeLimits(VOCAB, 1024, 1024)

    def steps() -> None:
        tree = tensors.tree_from_pb(pb.VerifyRequest.FromString(payload).tree)
        check_tree(tree, int(tree.tokens[0]), limits)
        answer = pb.StepResponse(tokens=[1, 2, 3])
        tensors.tensor_to_pb(features, out=answer.features)
        answer.SerializeToString()

    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--wait-us", type=int, default=6500, help="about a verify forward at Qwen3-8B shapes on an H200")
    p.add_argument("--every-us", type=int, default=300)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    steps, wait = verify_steps(), args.wait_us / 1e6
    ours, theirs = socket.socketpair()
    selector = PollingSelector(window=60.0)
    selector.register(ours, selectors.EVENT_READ)

    def spin() -> None:
        end = time.perf_counter() + wait
        while time.perf_counter() < end:
            pass

    def poll(rehearse: bool) -> None:
        theirs.send(b"x")  # an event first: the selector polls only within its window after one
        selector.select(1.0)
        ours.recv(1)
        selector.keep_warm(steps if rehearse else None, args.every_us / 1e6)
        assert selector.select(wait) == []  # polls (and rehearses) for the whole wait

    settings = {"back to back": lambda: None, "asleep": lambda: time.sleep(wait), "spinning": spin,
                "busy polling": lambda: poll(False), "busy polling, rehearsing": lambda: poll(True)}
    result: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.passes):
        for name, before in settings.items():
            times = []
            for _ in range(args.runs):
                before()
                start = time.perf_counter()
                steps()
                times.append(time.perf_counter() - start)
            result[name].append(round(1e6 * statistics.median(times[args.runs // 6 :]), 1))
            print(f"{name:28s} {result[name][-1]:8.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"median_us_per_pass": result, "wait_us": args.wait_us,
                                              "every_us": args.every_us}, indent=1) + "\n")


if __name__ == "__main__":
    main()
