"""Cost of tree verification on a hybrid (Gated DeltaNet + attention) target against an AR decode step.

Builds a random bf16 Qwen3.5-architecture target at Qwen3.6-27B layer shapes (hidden 5120, 24 heads / 4 KV heads of
256, Gated DeltaNet with 16 key / 48 value heads of 128, conv width 4, every fourth layer full attention, vocab
248320) but only `--layers` decoder layers, so it fits and builds in seconds. VerifyEngine prefills a random
context, then times verify(tree of 16 and 64 nodes) and decode (a root-only tree), each a median over `--repeat`
calls with the device synchronised. Prints one JSON line; the ratios verify/AR are the figures to compare.

    python bench/hybrid_cost.py --layers 8 --device cuda
    python bench/hybrid_cost.py --layers 16 --tp 2 --device cuda   # sharded over cuda:0 and cuda:1
    python bench/hybrid_cost.py --tiny --device cpu        # argument / import sanity only
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from ddtree.cost_curve import timed
from verify_server.random_target import RANDOM_PREFIX, random_target
from protos.types import DraftTree, SamplingParams
from verify_server.tensor_parallel import TensorParallelGroup
from verify_server.verify import VerifyEngine

TREE_SIZES = (16, 64)
MAX_DEPTH = 15  # a block-16 drafter's deepest node


def random_tree(rng: random.Random, nodes: int, vocab: int) -> DraftTree:
    """`nodes` nodes under the root, each hung under a random earlier node shallower than MAX_DEPTH."""
    parents, depths = [-1], [0]
    for _ in range(nodes):
        parent = rng.choice([i for i, d in enumerate(depths) if d < MAX_DEPTH])
        parents.append(parent)
        depths.append(depths[parent] + 1)
    tokens = [0] + [rng.randrange(vocab) for _ in range(nodes)]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), max_depth=max(depths))


def run(layers: int, device_name: str, tiny: bool, context: int, repeat: int, tp: int = 1) -> dict:
    dtype = torch.float32 if tiny else torch.bfloat16
    spec = f"{'tiny-hybrid' if tiny else 'qwen3.6-27b'}:{layers}"
    group = None
    if tp > 1:
        group = TensorParallelGroup(RANDOM_PREFIX + spec, tp, device_name, dtype, max_tree_size=max(TREE_SIZES))
        engine = group.engine
    else:
        engine = VerifyEngine(random_target(spec, device_name, dtype), max_tree_size=max(TREE_SIZES))
    device = engine.device
    vocab = engine.vocab_size
    rng = random.Random(0)
    # each call commits at most MAX_DEPTH + 1 tokens (a decode: 1), and the last one needs room for its tree
    room = (repeat + 1) * (len(TREE_SIZES) * (MAX_DEPTH + 1) + 1) + max(TREE_SIZES) + 1
    engine.start_session("bench", context + room, SamplingParams(), taps=[])
    engine.prefill("bench", [rng.randrange(vocab) for _ in range(context)])
    verify_ms = {}
    for n in TREE_SIZES:
        trees = iter([random_tree(rng, n, vocab) for _ in range(repeat + 1)])  # built outside the timing
        verify_ms[str(n)] = timed(lambda: engine.verify("bench", next(trees)), device, repeat)
    ar_ms = timed(lambda: engine.decode("bench"), device, repeat)
    sess = engine.sessions["bench"]
    result = {
        "shape": spec.split(":")[0], "layers": layers, "linear_layers": len(engine.linear.layer_ids),
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "context": context, "repeat": repeat,
        "ar_ms": round(ar_ms, 3), "verify_ms": {n: round(ms, 3) for n, ms in verify_ms.items()},
        "verify_over_ar": {n: round(ms / ar_ms, 3) for n, ms in verify_ms.items()},
        "session_state_bytes": sess.states.nbytes, "kv_bytes_per_token": sess.cache.nbytes // sess.cache.capacity,
        "engine_scratch_bytes": engine.scratch.nbytes, "tp": tp,
    }
    if group is not None:
        group.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (every fourth is full attention)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=512, help="prefilled tokens before timing")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes, 4 layers: a sanity check, not a figure")
    parser.add_argument("--tp", type=int, default=1, help="shard the target over N ranks (GPUs cuda:0..N-1)")
    args = parser.parse_args(argv)
    layers = 4 if args.tiny else args.layers
    if layers < 4:
        parser.error("--layers must be >= 4 (one full-attention layer per four)")
    context = min(args.context, 32) if args.tiny else args.context
    print(json.dumps(run(layers, args.device, args.tiny, context, args.repeat, args.tp)), flush=True)


if __name__ == "__main__":
    main()
