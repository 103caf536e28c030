"""The deterministic mode's projections (kernels/invariant.py invariant_linear) against cuBLAS (F.linear), at a
shape's weights and several row counts: microseconds per call and the weight's streaming rate. Candidate tiles beside
the kernel's own (TILE) show what another fixed tile would give; any one of them keeps rows invariant, since a
call's tile never depends on its rows.

The kernels are CUDA-only here (Triton against cuBLAS, timed with CUDA events): without a CUDA device it says so,
lists each weight's K splits per tile untimed and exits cleanly.

    python bench/profile_invariant.py qwen3-8b --rows 1,16,64,256 [--tiles 16x64x128w4s4,16x32x64w4s2]
"""

from __future__ import annotations

import argparse
import re

import torch
import torch.nn.functional as F

from kernels.invariant import TILE, Tile, k_splits, launch_linear
from runtime.shapes import SHAPES


def parse_tile(text: str) -> Tile:
    found = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"a tile is MxNxKwWARPSsSTAGES, e.g. 16x64x128w4s4; got {text!r}")
    return Tile(*(int(g) for g in found.groups()))


def time_us(fn, repeat: int) -> float:
    """Microseconds of one call of fn: repeat calls back to back between two CUDA events, after a warm-up, so that
    the host's launches run ahead of the device and a small call's time is its kernels' (as in a captured graph)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--tiles", type=lambda s: [parse_tile(t) for t in s.split(",")], default=[],
                   help="candidate tiles timed beside TILE")
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    s = SHAPES[args.shape]
    hidden, heads, kv, d = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    weights = {  # name -> (N, K) as the fused layer holds them
        "qkv": ((heads + 2 * kv) * d, hidden), "o": (hidden, heads * d),
        "gate_up": (2 * s["intermediate_size"], hidden), "down": (hidden, s["intermediate_size"]),
        "lm_head": (s["vocab_size"], hidden),
    }
    tiles = [TILE, *[t for t in args.tiles if t != TILE]]
    rows = [int(r) for r in args.rows.split(",")]
    if not torch.cuda.is_available():
        print(f"no CUDA device: the projections are CUDA kernels; {args.shape}'s weights and each tile's K splits "
              f"are listed, not timed; TILE = {TILE}")
        for name, (n, k) in weights.items():
            print(f"{name:8s} [{n}, {k}]: " + " | ".join(f"{t.m}x{t.n}x{t.k}w{t.warps}s{t.stages} (splits "
                                                           f"{k_splits(n, k, t)})" for t in tiles))
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{args.shape}, bf16, {torch.cuda.get_device_name()}; us per call (GB/s of the weight); TILE = {TILE}")
    totals: dict[tuple[str, int], float] = {}
    for name, (n, k) in weights.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
        gb = w.numel() * w.element_size() / 1e9
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            cells = []
            for label, fn in [("cublas", lambda: F.linear(x, w))] + [
                (f"{t.m}x{t.n}x{t.k}w{t.warps}s{t.stages} (splits {k_splits(n, k, t)})",
                 lambda t=t: launch_linear(x, w, None, t)) for t in tiles]:
                us = time_us(fn, args.repeat)
                layers = 1 if name == "lm_head" else s["num_hidden_layers"]
                totals[(label.split(" ")[0], m)] = totals.get((label.split(" ")[0], m), 0.0) + us * layers
                cells.append(f"{label} {us:8.1f} ({gb / us * 1e6:6.0f})")
            print(f"{name:8s} [{n}, {k}] rows {m:4d}: " + " | ".join(cells), flush=True)
    print("per step, every layer's projections and the lm_head (ms):")
    for (label, m), us in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  rows {m:4d} {label:18s} {us / 1000:7.3f}")


if __name__ == "__main__":
    main()
