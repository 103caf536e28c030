"""Cost curves at real model shapes with random weights (`ddtree bench --cost-curve`).

Measures, in one run on one device: the copy bandwidth, hence the weight-streaming bound of a decode step
(weight bytes / bandwidth); an AR step of the verifier; verify time against tree size; and a drafter step at the
matching DFlash shape. Everything is a ratio against numbers taken in the same process. Writes JSON and a PNG of
it (ddtree/plots.py).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree.plots import cost_curve_figure, save_figure
from protos.types import SamplingParams
from draft_server.dflash import DFlashDrafter, init_drafter_weights
from draft_server.dflash_config import DFlashConfig
from draft_server.engine import DraftEngine
from draft_server.target_head import TargetHead
from draft_server.tree import TreeLayouts, build_tree
from kernels.tree_build import kernel_supported, kernel_tree
from verify_server.random_target import RANDOM_PREFIX, random_target
from verify_server.verify import VerifyEngine
from runtime.shapes import SHAPES

def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median wall time of fn in ms, synchronising the device around each call."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    samples = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once, as reading weights is)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, 10)
    return 2 * nbytes / (ms / 1000)


def verifier_curve(engine: VerifyEngine, prompt: list[int], sizes: list[int], tree_logprobs: torch.Tensor,
                   repeat: int) -> dict:
    """Prefill of `prompt`, AR step and verify(n nodes) times of one engine, each step after a fresh prefill."""
    device = engine.device

    def prefill() -> None:
        engine.end_session("prefill")
        engine.start_session("prefill", len(prompt) + 1, SamplingParams(), [])
        engine.prefill("prefill", prompt)

    prefill_ms = timed(prefill, device, repeat)
    engine.end_session("prefill")

    def fresh_session(name: str, nodes: int) -> None:
        engine.end_session(name)
        engine.start_session(name, len(prompt) + nodes + 2 + (repeat + 4) * (nodes + 1), SamplingParams(), [])
        engine.prefill(name, prompt)

    fresh_session("ar", 1)
    ar_ms = timed(lambda: engine.decode("ar"), device, repeat)
    engine.end_session("ar")
    verify_ms = {}
    for n in sizes:
        fresh_session("tree", n)
        tree = build_tree(tree_logprobs, 0, n)
        # the random tree is rejected after the root almost surely, so the cache grows by ~1 slot per call
        verify_ms[n] = timed(lambda tree=tree: engine.verify("tree", tree), device, repeat)
        engine.end_session("tree")
    return {
        "prefill_ms": round(prefill_ms, 3),
        "ar_step_ms": round(ar_ms, 3),
        "verify_ms": {str(n): round(v, 3) for n, v in verify_ms.items()},
        "verify_over_ar": {str(n): round(v / ar_ms, 3) for n, v in verify_ms.items()},
    }


def random_drafter(s: dict, device: torch.device | str, dtype: torch.dtype) -> tuple[DFlashDrafter, TargetHead]:
    """The DFlash drafter matching a SHAPES entry, and a target head of its vocabulary: random weights."""
    dcfg = DFlashConfig(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_hidden_layers=s["drafter_layers"],
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
        vocab_size=s["vocab_size"], block_size=s["block_size"], mask_token_id=s["vocab_size"] - 1,
        target_layer_ids=list(range(s["drafter_layers"])), num_target_layers=s["num_hidden_layers"],
    )
    drafter = DFlashDrafter(dcfg)
    init_drafter_weights(drafter, seed=0)
    drafter = drafter.to(device, dtype).eval()
    head = TargetHead(torch.randn(s["vocab_size"], s["hidden_size"], device=device, dtype=dtype) * 0.02,
                      torch.randn(s["vocab_size"], s["hidden_size"], device=device, dtype=dtype) * 0.02)
    return drafter, head


def drafter_curve(s: dict, device: torch.device, dtype: torch.dtype, context: int, sizes: list[int],
                  repeat: int) -> dict:
    """A whole draft call (context append of 4 accepted positions, block forward, tree build) at the DFlash shape
    matching the target shape, per tree budget: the eager path, the static one (CUDA graphs on a GPU) and, on a GPU,
    the static one compiled (what `ddtree draft --compile` runs). read_bytes: what a draft must read at least, the
    drafter's weights and the target's lm_head (its bound, once the copy bandwidth is known)."""
    drafter, head = random_drafter(s, device, dtype)
    dcfg = drafter.config
    step = 4
    room = context + step * (repeat + 4) + 1
    features = torch.randn(context, dcfg.num_taps * s["hidden_size"], device=device, dtype=dtype)
    result = {}
    variants = {"eager": (True, False), "static": (False, False)}
    if device.type == "cuda":
        variants["static+compile"] = (False, True)
    for name, (eager, compiled) in variants.items():
        engine = DraftEngine(drafter, head, eager=eager, max_context=room, compile=compiled)
        draft_ms = {}
        for n in sizes:
            engine.start_session("d", room)
            engine.draft("d", features, 0, context, budget=n)
            session = engine.session("d")
            draft_ms[n] = timed(
                lambda n=n, engine=engine, session=session: engine.draft(
                    "d", features[:step], 0, session.length + step, budget=n
                ),
                device,
                repeat,
            )
            engine.end_session("d")
        result[name] = {str(n): round(v, 3) for n, v in draft_ms.items()}
    weights = sum(p.numel() * p.element_size() for p in drafter.parameters())
    return {"draft_ms": result, "read_bytes": weights + head.lm_head.numel() * head.lm_head.element_size()}


def tree_curve(s: dict, logprobs: torch.Tensor, sizes: list[int], repeat: int) -> dict:
    """The tree build alone per budget, from the block's [B-1, vocab] log-probs: build_tree in torch (uncaptured:
    what the CPU runs, and the GPU without Triton) and, on a GPU, the kernels a static draft runs
    (kernels/tree_build.py)."""
    device = logprobs.device
    layouts = TreeLayouts(s["block_size"] - 1, s["vocab_size"], device)
    builds = {"torch": lambda n, k, layout: build_tree(logprobs, 0, n, layout=layout)}
    if kernel_supported(device):
        root = torch.zeros(1, dtype=torch.long, device=device)
        builds["kernels"] = lambda n, k, layout: kernel_tree(logprobs, root, k, layout.nodes)
    return {name: {str(n): round(timed(lambda n=n, shape=layouts.get(n, None): build(n, *shape), device, repeat), 3)
                   for n in sizes}
            for name, build in builds.items()}


VARIANTS = {  # the fused forward replayed from CUDA graphs: (torch.compile, attention kernel, fused_rows)
    "fused+graphs": (False, "sdpa", 0), "fused+graphs+grouped": (False, "grouped", 0),
    "fused+graphs+matmul": (False, "matmul", 0), "fused+graphs+compile+grouped": (True, "grouped", 0),
    "fused+graphs+compile+matmul": (True, "matmul", 0), "fused+graphs+compile+flex": (True, "flex", 0),
    "fused+graphs+flash": (False, "flash", 0), "fused+graphs+compile+flash": (True, "flash", 0),
    # +gemv: one-row steps through the fused GEMVs; +rows: steps of up to 64 rows through the fused projections
    "fused+graphs+flash+gemv": (False, "flash", 1), "fused+graphs+compile+matmul+gemv": (True, "matmul", 1),
    "fused+graphs+compile+flash+gemv": (True, "flash", 1), "fused+graphs+compile+matmul+rows": (True, "matmul", 64),
    "fused+graphs+compile+flash+rows": (True, "flash", 64),
}
PATHS = ("hf", "fused", *VARIANTS)


def run_cost_curve(
    shape: str, device_name: str, dtype: torch.dtype, context: int, sizes: list[int], repeat: int, out: Path, tp: int = 1,
    paths_wanted: tuple[str, ...] = PATHS,
) -> dict:
    """Every verifier forward this build has (or those in `paths_wanted`), side by side: the generic HF modules
    (eager), the fused forward, and the fused forward replayed from CUDA graphs (on a GPU); with tp > 1 the
    sharded HF path only."""
    unknown = set(paths_wanted) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown verifier paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    s = SHAPES[shape]
    device = torch.device(device_name if tp == 1 else "cuda:0" if device_name.startswith("cuda") else "cpu")
    prompt = torch.randint(0, s["vocab_size"], (context,), generator=torch.Generator().manual_seed(0)).tolist()
    tree_logprobs = torch.log_softmax(
        torch.randn(s["block_size"] - 1, s["vocab_size"], generator=torch.Generator().manual_seed(1)), -1
    ).to(device)
    paths: dict[str, dict] = {}
    if tp > 1:
        from verify_server.tensor_parallel import TensorParallelGroup

        group = TensorParallelGroup(RANDOM_PREFIX + shape, tp, device_name, dtype)
        model = group.engine.model
        weight_bytes, embed = _weight_bytes(model)
        paths["hf"] = verifier_curve(group.engine, prompt, sizes, tree_logprobs, repeat)
        group.close()
        del group, model
    else:
        model = random_target(shape, device, dtype)
        weight_bytes, embed = _weight_bytes(model)
        print(f"[cost-curve] {shape}: {weight_bytes / 1e9:.2f} GB of weights on {device}", flush=True)
        if "hf" in paths_wanted:
            paths["hf"] = verifier_curve(VerifyEngine(model, fused=False), prompt, sizes, tree_logprobs, repeat)
        del model
        engine = VerifyEngine(random_target(shape, device, dtype), fused=True, graphs=False)
        if "fused" in paths_wanted:
            paths["fused"] = verifier_curve(engine, prompt, sizes, tree_logprobs, repeat)
            print(f"[cost-curve] {json.dumps(paths)}", flush=True)
        variants = {name: v for name, v in VARIANTS.items() if name in paths_wanted and device.type == "cuda"}
        for name, (compiled, attention, fused_rows) in variants.items():
            start = time.perf_counter()
            try:
                # dynamo counts a function's recompiles across torch.compile wrappers: each variant starts afresh
                torch._dynamo.reset()
                engine.fused.configure(graphs=True, compile=compiled, attention=attention, fused_rows=fused_rows)
                paths[name] = verifier_curve(engine, prompt, sizes, tree_logprobs, repeat)
            except Exception as exc:  # noqa: BLE001 - a variant that fails to build is a finding, not the end of the run
                paths[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            paths[name]["setup_and_timing_s"] = round(time.perf_counter() - start, 1)
            print(f"[cost-curve] {name}: {json.dumps(paths[name])}", flush=True)
        del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # a decode step reads every weight except the embedding table (only one row of it is read)
    streamed = weight_bytes - embed
    bandwidth = copy_bandwidth(device, min(4 * 2**30, streamed)) if device.type == "cuda" else None
    bound_ms = streamed / bandwidth * 1000 if bandwidth else None  # only meaningful on a GPU
    for curve in paths.values():
        if "ar_step_ms" in curve:
            curve["ar_step_over_bound"] = bound_ms and round(curve["ar_step_ms"] / bound_ms, 2)
    drafter = drafter_curve(s, device, dtype, context, sizes, repeat)
    if bandwidth:
        drafter["bound_ms"] = round(drafter["read_bytes"] / bandwidth * 1000, 3)
        drafter["over_bound"] = {name: {n: round(ms / drafter["bound_ms"], 2) for n, ms in curve.items()}
                                 for name, curve in drafter["draft_ms"].items()}
    result = {
        "hardware": {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__},
        "shape": shape, "tp": tp, "dtype": str(dtype).removeprefix("torch."), "context": context,
        "weight_bytes": weight_bytes, "streamed_bytes": streamed, "copy_bandwidth_gbs": bandwidth and round(bandwidth / 1e9, 1),
        "weight_streaming_bound_ms": bound_ms and round(bound_ms, 3),
        "verifier": paths,
        "drafter": drafter,
        "tree_build_ms": tree_curve(s, tree_logprobs, sizes, repeat),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    save_figure(cost_curve_figure, result, out.with_suffix(".png"))
    return result


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all parameters, bytes of the input embedding) of this rank's model."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()), embed.numel() * embed.element_size()
