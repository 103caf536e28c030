"""Times a decode step's projections (one query row) at Qwen3-8B and demo-pair shapes: cuBLAS (F.linear alone,
and with the unfused norm / SiLU gate / residual add around it, as an uncompiled layer runs them) against the
fused Triton GEMVs of kernels/gemv.py under the default plan and a sweep of plans, with each time's bandwidth
as a share of this GPU's copy bandwidth, measured in the same run. Per call, from CUDA graphs of back-to-back
calls that cycle through enough copies of the weight to stream it from memory, as a decode step does.

With --rows M,...: the projections of a step of M rows (a verify step's tree) at the demo pair's shapes instead:
cuBLAS with the compiled norm / SiLU gate / residual add around it, as a compiled layer runs them, against
kernels/gemv.py's rows kernel (gate/up with the SiLU gate as its epilogue, down with the residual) under the default
plan and a sweep.

The lm_head (with the final norm folded in, as verify_server/fused.py's head_logits runs it) is timed too.

Usage: python bench/gemv_tune.py [--out FILE.json] [--quick] [--rows 16,64] [--shapes 8b-lm_head,demo-lm_head]
"""

from __future__ import annotations

import argparse
import itertools
import json

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddtree.cost_curve import copy_bandwidth
from kernels.gemv import NONE, RMSNORM, SWIGLU, GemvPlan, RowsPlan, gemv_plan, launch, launch_rows, rms_norm, rows_plan
from runtime.timing import graph_call_us, ranked
from verify_server.fused_layer import unfused_linear

L2_OVERFLOW = 200 * 2**20  # bytes of distinct weights a timing cycles through
# name -> (out, in, prologue, residual): a layer's four projections and the lm_head at each model's shapes
SHAPES = {
    "8b-qkv": (6144, 4096, RMSNORM, False), "8b-o": (4096, 4096, NONE, True),
    "8b-gate_up": (24576, 4096, RMSNORM, False), "8b-down": (4096, 12288, SWIGLU, True),
    "8b-lm_head": (151936, 4096, RMSNORM, False),
    "demo-qkv": (640, 384, RMSNORM, False), "demo-o": (384, 384, NONE, True),
    "demo-gate_up": (2048, 384, RMSNORM, False), "demo-down": (384, 1024, SWIGLU, True),
    "demo-lm_head": (8192, 384, RMSNORM, False),
}


def unfused(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, res: torch.Tensor, prologue: int, residual: bool):
    if prologue == RMSNORM:
        x = rms_norm(x, norm, 1e-6)
    elif prologue == SWIGLU:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, w)
    return y + res if residual else y


def sweep(quick: bool, names: list[str]) -> dict:
    bandwidth = copy_bandwidth(torch.device("cuda"), 2**30)
    print(f"[gemv-tune] copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results: dict = {"copy_bandwidth_gbs": round(bandwidth / 1e9, 1), "shapes": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    plans = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3, 4)))
    if quick:
        plans = [p for p in plans if p[2] == 4 and p[3] == 1]
    for name in names:
        n, k, prologue, residual = SHAPES[name]
        bf16 = {"device": "cuda", "dtype": torch.bfloat16}
        # as many copies of the weight as it takes to overflow the L2 cache (50 MB on an H200) four times over,
        # used in turn: a step streams every weight from memory, a loop over one small weight would hit L2
        # (the demo pair's whole model fits in L2, so its shapes are timed on one weight)
        copies = -(-L2_OVERFLOW // (n * k * 2)) if name.startswith("8b") else 1
        weights = [torch.randn(n, k, generator=gen, **bf16) / k**0.5 for _ in range(copies)]
        w = weights[0]
        x = torch.randn(1, 2 * k if prologue == SWIGLU else k, generator=gen, **bf16)
        norm = 1 + 0.1 * torch.randn(k, generator=gen, **bf16)
        res = torch.randn(1, n, generator=gen, **bf16)
        args = (x, w, norm if prologue == RMSNORM else None, res if residual else None, 1e-6, prologue)
        xin = x[:, :k]

        def share(us: float) -> float:  # of the copy bandwidth, streaming the weight once
            return round(w.numel() * w.element_size() / (us * 1e-6) / bandwidth, 3)

        def per_weight_us(fn: Callable[[torch.Tensor], object]) -> float:
            return graph_call_us(lambda: [fn(wi) for wi in weights], calls=2) / copies

        timings = {
            "cublas_linear": per_weight_us(lambda wi: F.linear(xin, wi)),
            "cublas_unfused": per_weight_us(lambda wi: unfused(x, wi, norm, res, prologue, residual)),
            "gemv_default": per_weight_us(lambda wi: launch(x, wi, *args[2:], gemv_plan(n, k))),
        }
        swept = []
        for block_n, block_k, warps, stages in plans:
            p = GemvPlan(block_n, block_k, warps, stages)
            try:
                swept.append((per_weight_us(lambda wi: launch(x, wi, *args[2:], p)), p))
            except Exception as exc:  # noqa: BLE001 - a plan that does not compile (registers)
                print(f"[gemv-tune] {name} {p}: {type(exc).__name__}", flush=True)
        want = unfused(x, w, norm, res, prologue, residual).float()
        err = (launch(*args, gemv_plan(n, k)).float() - want).abs().max().item()
        best = ranked(swept)
        results["shapes"][name] = row = {
            "shape": [n, k], "us": {form: round(t, 2) for form, t in timings.items()},
            "share_of_copy_bw": {form: share(t) for form, t in timings.items()}, "default": gemv_plan(n, k).__dict__,
            **best, "best_share": share(best["best_us"]), "max_abs_diff_vs_unfused": err,
        }
        print(f"[gemv-tune] {name} {n}x{k}: {row['us']} best {best['best_us']} us {best['best']} shares "
              f"{row['share_of_copy_bw']} best {row['best_share']}", flush=True)
    return results


def sweep_rows(row_counts: list[int], quick: bool, names: list[str] | None) -> dict:
    results: dict = {"shapes": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    compiled = torch.compile(unfused_linear)
    plans = list(itertools.product((16, 32, 64), (16, 32, 64), (64, 128, 256, 512, 1024), (2, 4, 8), (1, 2, 3)))
    if quick:
        plans = [p for p in plans if p[0] == 16 and p[4] in (1, 2) and p[3] in (4, 8)]
    # name -> (weight rows, in, RMSNorm first, SiLU gate out, residual): the demo layer's projections as a verify
    # step runs them (gate/up's weight holds both halves; its output is the gated half)
    shapes = {"qkv": (640, 384, True, False, False), "o": (384, 384, False, False, True),
              "gate_up": (2048, 384, True, True, False), "down": (384, 1024, False, False, True),
              "lm_head": (8192, 384, True, False, False)}
    for m in row_counts:
        for name, (n, k, normed, swiglu, residual) in shapes.items():
            if names and f"demo-{name}" not in names:
                continue
            w = torch.randn(n, k, generator=gen, **bf16) / k**0.5
            x = torch.randn(m, k, generator=gen, **bf16)
            norm = 1 + 0.1 * torch.randn(k, generator=gen, **bf16) if normed else None
            res = torch.randn(m, n // 2 if swiglu else n, generator=gen, **bf16) if residual else None
            timings = {
                "cublas_linear": graph_call_us(lambda: F.linear(x, w)),
                "cublas_compiled_unfused": graph_call_us(lambda: compiled(x, w, norm, res, 1e-6, swiglu)),
                "rows_default": graph_call_us(lambda: launch_rows(x, w, norm, res, 1e-6, swiglu, rows_plan(m, n, k))),
            }
            swept = []
            for plan in plans:
                p = RowsPlan(*plan)
                try:
                    swept.append((graph_call_us(lambda: launch_rows(x, w, norm, res, 1e-6, swiglu, p)), p))
                except Exception as exc:  # noqa: BLE001 - a plan that does not compile (registers, shared memory)
                    print(f"[gemv-tune] rows {name} {p}: {type(exc).__name__}", flush=True)
            want = unfused_linear(x, w, norm, res, 1e-6, swiglu).float()
            err = (launch_rows(x, w, norm, res, 1e-6, swiglu, rows_plan(m, n, k)).float() - want).abs().max().item()
            results["shapes"][f"demo-{name}-m{m}"] = row = {
                "shape": [n, k], "rows": m, "us": {form: round(t, 2) for form, t in timings.items()},
                "default": rows_plan(m, n, k).__dict__, **ranked(swept), "max_abs_diff_vs_unfused": err,
            }
            print(f"[gemv-tune] rows demo-{name} m={m}: {row['us']} best {row['best_us']} us {row['best']}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="a smaller sweep")
    p.add_argument("--rows", help="comma-separated row counts: time the rows kernel at the demo shapes instead")
    p.add_argument("--shapes", help=f"comma-separated names (default: all): {', '.join(SHAPES)}")
    args = p.parse_args()
    names = args.shapes.split(",") if args.shapes else None
    if names and not set(names) <= set(SHAPES):
        p.error(f"unknown shapes {sorted(set(names) - set(SHAPES))}")
    if args.rows and names and any(not name.startswith("demo-") for name in names):
        p.error("--rows times the demo shapes only (demo-...)")
    if args.rows:
        rows = sweep_rows([int(m) for m in args.rows.split(",")], args.quick, names)
        result = {"gpu": torch.cuda.get_device_name(), **rows}
    else:
        result = {"gpu": torch.cuda.get_device_name(), **sweep(args.quick, names or list(SHAPES))}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
