"""A prompt longer than the largest captured bucket (verify_server/step_inputs.py MAX_GRAPH_NODES) runs uncaptured:
through the compiled prompt step, against the uncompiled layers it ran before, side by side on one random-weight
target, alternated, with the first token each picked (the same in both).

    python bench/long_prefill.py [--shape qwen3-8b --sizes 1024,4096 --passes 2 --device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from verify_server.random_target import random_target
from protos.types import SamplingParams
from verify_server.fused_runner import FusedRunner
from verify_server.kv_cache import KVCache
from verify_server.verify import VerifyEngine


def uncompiled_forward(
    self: FusedRunner, cache: KVCache, taps: tuple[int, ...], ids: torch.Tensor, positions: torch.Tensor,
    tree: torch.Tensor | None, last_only: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompt's uncaptured forward before the sixteenth session: the uncompiled layers, causal."""
    q, start = ids.shape[0], cache.length
    slots = torch.arange(start, start + q, device=self.device)
    hidden, features = self.decoder.forward(ids, positions, cache, slots, None, start + q, taps)
    return self.decoder.logits(hidden[-1:] if last_only else hidden), features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--sizes", default="1024,4096")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu: a check that the script runs (no graphs, fp32)")
    args = p.parse_args()
    gpu = args.device != "cpu"
    model = random_target(args.shape, args.device, torch.bfloat16 if gpu else torch.float32)
    engine = VerifyEngine(model, fused=True, graphs=gpu)
    engine.fused.configure(graphs=gpu, compile=gpu)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    variants = {"compiled": FusedRunner.forward, "uncompiled": uncompiled_forward}
    sizes = [int(n) for n in args.sizes.split(",")]
    prompt = torch.randint(0, engine.vocab_size, (max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill(n: int) -> int:
        engine.start_session("p", n + 1, SamplingParams(), [])
        token = engine.prefill("p", prompt[:n]).tokens[-1]
        engine.end_session("p")
        return token

    for n in sizes:
        ms: dict[str, list[float]] = {name: [] for name in variants}
        tokens: dict[str, set[int]] = {name: set() for name in variants}
        for _ in range(args.passes):
            for name, forward in variants.items():
                FusedRunner.forward = forward
                prefill(n)  # compiles on first use
                sync()
                start = time.perf_counter()
                for _ in range(3):
                    tokens[name].add(prefill(n))
                sync()
                ms[name].append((time.perf_counter() - start) / 3 * 1000)
        print(n, {name: f"{min(v):.1f} ms" for name, v in ms.items()}, "first tokens", tokens, flush=True)
    FusedRunner.forward = variants["compiled"]


if __name__ == "__main__":
    main()
