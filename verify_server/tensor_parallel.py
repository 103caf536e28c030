"""The target tensor-parallel over N ranks (torch.distributed: NCCL on GPUs, gloo on CPU).

Sharding (Megatron style, on the HF modules themselves): q/k/v and gate/up are split by output rows (whole
heads / MLP columns per rank), o_proj and down_proj by input columns followed by an all-reduce; embeddings, norms
and lm_head stay replicated. Every rank then holds only its heads' K/V, so tree attention and the owned KV cache
work unchanged on the local heads.

Rank 0 owns the service; it broadcasts each engine call over a small explicit control channel (an op code, a
JSON header and the tree's index tensors) and every rank runs the same call on the same inputs, so the ranks
stay in lockstep; only rank 0's result is used. Nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from protos.types import DraftTree, SamplingParams, StepResult
from verify_server.session import SessionError
from verify_server.batched_rounds import BatchedRounds
from verify_server.verify import VerifyEngine

log = logging.getLogger("ddtree.verify.tp")

OPS = ("start_session", "end_session", "prefill", "verify", "decode", "shutdown")


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input columns; partial products are summed across ranks."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        cols = linear.in_features // world
        self.linear = nn.Linear(cols, linear.out_features, bias=False, device=linear.weight.device, dtype=linear.weight.dtype)
        self.linear.weight = nn.Parameter(linear.weight[:, rank * cols : (rank + 1) * cols].contiguous(), requires_grad=False)
        # the bias is added once, after the sum
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A linear layer keeping only output `rows` [n] (this rank's heads / MLP columns)."""
    out = nn.Linear(linear.in_features, rows.numel(), bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    out.weight = nn.Parameter(linear.weight[rows.to(linear.weight.device)].contiguous(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[rows.to(linear.bias.device)].contiguous(), requires_grad=False)
    return out


def _block(size: int, rank: int, world: int, offset: int = 0) -> torch.Tensor:
    """Rank's contiguous 1/world share of `size` rows starting at `offset`."""
    part = size // world
    return torch.arange(offset + rank * part, offset + (rank + 1) * part)


def _column_slice(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    return _rows(linear, _block(linear.out_features, rank, world))


def _shard_attention(attn: nn.Module, rank: int, world: int) -> None:
    # whole heads per rank; Qwen3.5's q_proj interleaves [query | gate] per head, so head blocks stay contiguous
    attn.q_proj = _column_slice(attn.q_proj, rank, world)
    attn.k_proj = _column_slice(attn.k_proj, rank, world)
    attn.v_proj = _column_slice(attn.v_proj, rank, world)
    attn.o_proj = RowParallelLinear(attn.o_proj, rank, world)


def _shard_gated_deltanet(m: nn.Module, rank: int, world: int) -> None:
    """Qwen3.5 Gated DeltaNet: whole key/value heads per rank. The fused q|k|v projection and the depthwise
    convolution over those channels keep each segment's slice; z, the gates and the per-head decay follow the
    value heads; out_proj sums across ranks."""
    if not hasattr(m, "in_proj_qkv"):
        raise NotImplementedError(f"tensor parallelism does not know the layout of {type(m).__name__}")
    key_dim, value_dim = m.key_dim, m.value_dim
    qkv = torch.cat((_block(key_dim, rank, world), _block(key_dim, rank, world, key_dim),
                     _block(value_dim, rank, world, 2 * key_dim)))  # [conv_dim / world] channel ids
    m.in_proj_qkv = _rows(m.in_proj_qkv, qkv)
    conv = m.conv1d
    channels = qkv.numel()
    local = nn.Conv1d(channels, channels, conv.kernel_size[0], groups=channels, padding=conv.padding[0],
                      bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    local.weight = nn.Parameter(conv.weight[qkv.to(conv.weight.device)].contiguous(), requires_grad=False)
    if conv.bias is not None:
        local.bias = nn.Parameter(conv.bias[qkv.to(conv.bias.device)].contiguous(), requires_grad=False)
    m.conv1d = local
    heads = _block(m.num_v_heads, rank, world)
    m.in_proj_z = _rows(m.in_proj_z, _block(value_dim, rank, world))
    m.in_proj_b = _rows(m.in_proj_b, heads)
    m.in_proj_a = _rows(m.in_proj_a, heads)
    m.dt_bias = nn.Parameter(m.dt_bias.detach()[heads.to(m.dt_bias.device)].contiguous(), requires_grad=False)
    m.A_log = nn.Parameter(m.A_log.detach()[heads.to(m.A_log.device)].contiguous(), requires_grad=False)
    m.out_proj = RowParallelLinear(m.out_proj, rank, world)
    m.num_k_heads //= world
    m.num_v_heads //= world
    m.key_dim, m.value_dim = key_dim // world, value_dim // world
    m.conv_dim = 2 * m.key_dim + m.value_dim


LINEAR_HEADS = ("linear_num_key_heads", "linear_num_value_heads")


def shard_model(model: nn.Module, rank: int, world: int) -> None:
    """Shards a loaded Qwen3/Llama-family or Qwen3.5 hybrid model in place for `rank` of `world`."""
    cfg = model.config
    counts = {"heads": cfg.num_attention_heads, "KV heads": cfg.num_key_value_heads, "MLP size": cfg.intermediate_size}
    counts.update({name: getattr(cfg, name) for name in LINEAR_HEADS if getattr(cfg, name, None)})
    bad = {k: v for k, v in counts.items() if v % world}
    if bad:
        raise ValueError(f"--tp {world} must divide " + ", ".join(f"{k} ({v})" for k, v in bad.items()))
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # pinned first
    for layer in model.get_decoder().layers:
        if hasattr(layer, "self_attn"):
            _shard_attention(layer.self_attn, rank, world)
        if hasattr(layer, "linear_attn"):
            _shard_gated_deltanet(layer.linear_attn, rank, world)
        mlp = layer.mlp
        if not hasattr(mlp, "gate_proj"):
            raise NotImplementedError(f"tensor parallelism does not shard {type(mlp).__name__} (mixture of experts)")
        mlp.gate_proj = _column_slice(mlp.gate_proj, rank, world)
        mlp.up_proj = _column_slice(mlp.up_proj, rank, world)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world)
    # the local model has 1/world of the heads; the verifier sizes its caches from the config and the modules
    cfg.num_attention_heads //= world
    cfg.num_key_value_heads //= world
    for name in LINEAR_HEADS:
        if getattr(cfg, name, None):
            setattr(cfg, name, getattr(cfg, name) // world)


def init_group(rank: int, world: int, device: str, addr: str, port: int, timeout_s: float) -> torch.device:
    """Joins the group; returns this rank's device (cuda:<rank> on GPUs)."""
    on_gpu = device.startswith("cuda")
    local = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(local)
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(
        "nccl" if on_gpu else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
        device_id=local if on_gpu else None,
    )
    return local


def load_sharded(
    target: str, rank: int, world: int, device: torch.device, dtype: torch.dtype, max_tree_size: int = 1024
) -> VerifyEngine:
    """`target` is a model directory, or `random:<shape>` (verify_server.random_target) for benchmarks at real shapes."""
    from verify_server.random_target import RANDOM_PREFIX, random_target
    from verify_server.verify import load_target

    if target.startswith(RANDOM_PREFIX):
        model = random_target(target.removeprefix(RANDOM_PREFIX), device, dtype)
    else:
        model = load_target(target, "cpu", dtype)  # shard on the host, so each GPU only ever holds its slice
    shard_model(model, rank, world)
    return VerifyEngine(model.to(device), max_tree_size, fused=False)  # the fused path has no sharded form yet


class _Channel:
    """Rank 0 -> all ranks: [op, header length, tree nodes] as int64, then the JSON header bytes, then the tree."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # NCCL broadcasts need device tensors

    def send(self, op: str, header: dict, tree: DraftTree | None = None) -> None:
        raw = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8)
        nodes = 0 if tree is None else tree.tokens.shape[0]
        dist.broadcast(torch.tensor([OPS.index(op), raw.numel(), nodes], device=self.device), 0)
        if raw.numel():
            dist.broadcast(raw.to(self.device), 0)
        if tree is not None:
            dist.broadcast(torch.stack((tree.tokens, tree.parents, tree.depths)).to(self.device), 0)

    def receive(self) -> tuple[str, dict, DraftTree | None]:
        meta = torch.zeros(3, dtype=torch.long, device=self.device)
        dist.broadcast(meta, 0)
        op, length, nodes = meta.tolist()
        header: dict = {}
        if length:
            raw = torch.zeros(length, dtype=torch.uint8, device=self.device)
            dist.broadcast(raw, 0)
            header = json.loads(bytes(raw.tolist()).decode())
        tree = None
        if nodes:
            packed = torch.zeros(3, nodes, dtype=torch.long, device=self.device)
            dist.broadcast(packed, 0)
            tree = DraftTree(packed[0], packed[1], packed[2], max_depth=header["max_depth"])
        return OPS[op], header, tree


class TensorParallelEngine(BatchedRounds):
    """Rank 0's face of a sharded verifier: the VerifyEngine API, each call mirrored on every rank.
    `alive()` says whether every rank still runs; `close()` stops them all. verify_batch runs its calls one by one
    through verify (the sharded target has no fused path, hence no batched forward)."""

    def __init__(self, engine: VerifyEngine, alive: Callable[[], bool], close: Callable[[], None]) -> None:
        self.engine = engine
        self.channel = _Channel(engine.device)
        self.sessions = engine.sessions  # rank 0's table is the service's view (metrics, TTL sweeps)
        self.alive = alive
        self.close = close

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # read-only attributes (vocab_size, device, ...) come from rank 0

    def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        if params.seed is None and not params.greedy:
            # every rank must draw the same samples: fix the seed here instead of letting each rank pick one
            params = SamplingParams(params.temperature, params.top_k, params.top_p, int(torch.randint(2**62, ()).item()))
        self.channel.send("start_session", {"id": session_id, "capacity": capacity, "params": asdict(params), "taps": taps})
        self.engine.start_session(session_id, capacity, params, taps)

    def end_session(self, session_id: str) -> bool:
        self.channel.send("end_session", {"id": session_id})
        return self.engine.end_session(session_id)

    def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False
    ) -> StepResult:
        self.channel.send("prefill", {"id": session_id, "prompt": prompt, "more": more})
        return self.engine.prefill(session_id, prompt, more, keep_features)

    def take_features(self, session_id: str) -> StepResult:
        return self.engine.take_features(session_id)  # only rank 0's features leave the process

    def verify(self, session_id: str, tree: DraftTree, host_features: bool = False) -> StepResult:
        self.channel.send("verify", {"id": session_id, "max_depth": tree.max_depth}, tree)
        return self.engine.verify(session_id, tree, host_features)  # only rank 0's features leave the process

    def decode(self, session_id: str, host_features: bool = False) -> StepResult:
        self.channel.send("decode", {"id": session_id})
        return self.engine.decode(session_id, host_features)

    def shutdown(self) -> None:
        self.channel.send("shutdown", {})


def follow(engine: VerifyEngine) -> None:
    """Ranks > 0: replay rank 0's calls until told to stop. A call that fails does so on every rank alike
    (same inputs, same checks), so errors are skipped here and reported by rank 0."""
    channel = _Channel(engine.device)
    while True:
        op, header, tree = channel.receive()
        if op == "shutdown":
            return
        try:
            if op == "start_session":
                engine.start_session(header["id"], header["capacity"], SamplingParams(**header["params"]), header["taps"])
            elif op == "end_session":
                engine.end_session(header["id"])
            elif op == "prefill":
                engine.prefill(header["id"], header["prompt"], header["more"])
            elif op == "verify":
                engine.verify(header["id"], tree)
            elif op == "decode":
                engine.decode(header["id"])
        except SessionError as exc:
            log.debug("rank %d: %s failed as on rank 0: %s", dist.get_rank(), op, exc)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follower_main(
    rank: int, world: int, target: str, device: str, dtype: str, port: int, timeout_s: float, max_tree_size: int
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[verify rank {rank}] %(message)s")
    local = init_group(rank, world, device, "127.0.0.1", port, timeout_s)
    engine = load_sharded(target, rank, world, local, getattr(torch, dtype), max_tree_size)
    try:
        follow(engine)
    finally:
        dist.destroy_process_group()


class TensorParallelGroup:
    """Starts ranks 1..N-1 as child processes and joins as rank 0: they start and stop together."""

    def __init__(
        self, target: str, world: int, device: str, dtype: torch.dtype, timeout_s: float = 600.0, max_tree_size: int = 1024
    ) -> None:
        import torch.multiprocessing as mp

        port = _free_port()
        ctx = mp.get_context("spawn")
        dtype_name = str(dtype).removeprefix("torch.")
        self.followers = [
            ctx.Process(
                target=_follower_main,
                args=(r, world, target, device, dtype_name, port, timeout_s, max_tree_size),
                daemon=True,
            )
            for r in range(1, world)
        ]
        for p in self.followers:
            p.start()
        local = init_group(0, world, device, "127.0.0.1", port, timeout_s)
        engine = load_sharded(target, 0, world, local, dtype, max_tree_size)
        self.engine = TensorParallelEngine(engine, self.alive, self.close)

    def alive(self) -> bool:
        """False once any rank has died: the service must stop answering (NOT_SERVING), not hang."""
        return all(p.is_alive() for p in self.followers)

    def close(self) -> None:
        if not self.followers:
            return  # closed already
        if self.alive():
            self.engine.shutdown()
        for p in self.followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.followers = []
        dist.destroy_process_group()
