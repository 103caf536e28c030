"""Where the verifier's start-up goes: loading, the warm-up's forwards (compiles) and its graph captures, with the
time and the Dynamo compiles (torch._dynamo counters: frames captured, unique graphs) of each capture stage
(capture_rounds, capture_prompts, timed by wrapping them for this run). Loads and warms up the engine as the
service does (verify_server.server.load_engine, warm_up). Point TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at empty
directories for a cold start (a fresh machine), then run again with the same ones for a warm start (what the compose
file's compile-cache volume gives a restarted service); TORCH_LOGS=recompiles says why each recompile was needed.

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc python bench/warm_up_time.py --device cuda
        [--target DIR --drafter DIR] [--sessions 4] [--out warm_up_time.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch._dynamo.utils import counters

import verify_server.warm_up as warm_up_module
from runtime.models import resolve_pair
from ddtree.serve import drafter_taps
from verify_server.config import VerifyServerConfig
from verify_server.server import load_engine

STAGES = ("capture_rounds", "capture_prompts")


def _timed(name: str, spent: dict[str, list[dict[str, Any]]]) -> Callable[..., None]:
    """warm_up_module's `name`, recording each call's seconds and the Dynamo counters it moved into spent[name]."""
    inner = getattr(warm_up_module, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        before, start = dict(counters["stats"]), time.perf_counter()
        inner(*args, **kwargs)
        moved = {k: v - before.get(k, 0) for k, v in counters["stats"].items()}
        spent.setdefault(name, []).append({"s": round(time.perf_counter() - start, 3), **moved})

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter", help="whose taps the warm-up captures (default: the bundled demo drafter)")
    p.add_argument("--device", default="auto")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the warm-up's own stages
    target, drafter = resolve_pair(args.target, args.drafter)
    taps = ",".join(map(str, drafter_taps(drafter) if drafter else []))
    config = VerifyServerConfig(target=target, device=args.device, max_sessions=args.sessions, warm_up_taps=taps)
    spent: dict[str, list[dict[str, Any]]] = {}
    for name in STAGES:
        setattr(warm_up_module, name, _timed(name, spent))
    start = time.perf_counter()
    engine = load_engine(config)
    loaded = time.perf_counter() - start
    print(f"[warm-up-time] load {loaded:.1f} s", flush=True)
    start = time.perf_counter()
    warm_up_module.warm_up(engine, config.warm_up_tap_list, min(config.warm_up_nodes, config.max_tree_size))
    result = {"device": str(engine.device), "load_s": round(loaded, 3),
              "warm_up_s": round(time.perf_counter() - start, 3),
              "graphs": len(engine.fused.graphs) if engine.fused is not None else 0,
              "dynamo": dict(counters["stats"]), "stages": spent}
    print(f"[warm-up-time] warm-up {result['warm_up_s']:.1f} s, {result['graphs']} graphs, Dynamo {result['dynamo']}",
          flush=True)
    for name, calls in spent.items():
        print(f"[warm-up-time] {name}: {calls}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
