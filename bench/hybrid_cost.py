"""Cost of tree verification on a hybrid (Gated DeltaNet + attention) target against an AR decode step.

Builds a random bf16 Qwen3.5-architecture target at Qwen3.6-27B layer shapes (hidden 5120, 24 heads / 4 KV heads of
256, Gated DeltaNet with 16 key / 48 value heads of 128, conv width 4, every fourth layer full attention, vocab
248320) but only `--layers` decoder layers, so it fits and builds in seconds. Our VerifyEngine prefills a random
context, then times verify(tree of 16 and 64 nodes) and decode (a root-only tree), each a median over `--repeat`
calls with the device synchronised. Prints one JSON line; the ratios verify/AR are the figures to compare.

    python bench/hybrid_cost.py --layers 8 --device cuda
    python bench/hybrid_cost.py --tiny --device cpu        # argument / import sanity only
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from ddtree.cost_curve import timed
from ddtree.types import DraftTree, SamplingParams
from verify_server.tree_attention import ATTENTION_NAME
from verify_server.verify import VerifyEngine

QWEN36_27B = dict(
    hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=248320, rope_parameters={"rope_type": "default", "rope_theta": 1e7},
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, vocab_size=512,
)
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


def run(layers: int, device_name: str, tiny: bool, context: int, repeat: int) -> dict:
    device = torch.device(device_name)
    dtype = torch.float32 if tiny else torch.bfloat16
    shape = TINY if tiny else QWEN36_27B
    config = Qwen3_5TextConfig(
        **shape, num_hidden_layers=layers, max_position_embeddings=262144, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(config, attn_implementation=ATTENTION_NAME, dtype=dtype).eval()
    engine = VerifyEngine(model, max_tree_size=max(TREE_SIZES))
    rng = random.Random(0)
    # each call commits at most MAX_DEPTH + 1 tokens (a decode: 1), and the last one needs room for its tree
    room = (repeat + 1) * (len(TREE_SIZES) * (MAX_DEPTH + 1) + 1) + max(TREE_SIZES) + 1
    engine.start_session("bench", context + room, SamplingParams(), taps=[])
    engine.prefill("bench", [rng.randrange(config.vocab_size) for _ in range(context)])
    verify_ms = {}
    for n in TREE_SIZES:
        trees = iter([random_tree(rng, n, config.vocab_size) for _ in range(repeat + 1)])  # built outside the timing
        verify_ms[str(n)] = timed(lambda: engine.verify("bench", next(trees)), device, repeat)
    ar_ms = timed(lambda: engine.decode("bench"), device, repeat)
    sess = engine.sessions["bench"]
    return {
        "shape": "tiny" if tiny else "qwen3.6-27b", "layers": layers, "linear_layers": len(engine.linear.layer_ids),
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "context": context, "repeat": repeat,
        "ar_ms": round(ar_ms, 3), "verify_ms": {n: round(ms, 3) for n, ms in verify_ms.items()},
        "verify_over_ar": {n: round(ms / ar_ms, 3) for n, ms in verify_ms.items()},
        "session_state_bytes": sess.states.nbytes, "kv_bytes_per_token": sess.cache.nbytes // sess.cache.capacity,
        "engine_scratch_bytes": engine.scratch.nbytes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (every fourth is full attention)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=512, help="prefilled tokens before timing")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes, 4 layers: a sanity check, not a figure")
    args = parser.parse_args(argv)
    layers = 4 if args.tiny else args.layers
    if layers < 4:
        parser.error("--layers must be >= 4 (one full-attention layer per four)")
    context = min(args.context, 32) if args.tiny else args.context
    print(json.dumps(run(layers, args.device, args.tiny, context, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
