"""The target tensor-parallel over N ranks (torch.distributed: NCCL on GPUs, gloo on CPU), each rank holding its
shard of the target (verify_server/sharding.py).

Rank 0 owns the service; it broadcasts each engine call over a small explicit control channel (an op code, a
JSON header and the tree's index tensors) and every rank runs the same call on the same inputs, so the ranks
stay in lockstep; only rank 0's result is used. Nothing is pickled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.types import DraftTree, SamplingParams, StepResult
from verify_server.batched_rounds import verify_alone
from verify_server.prefill import PrefillCall
from verify_server.prompt_batch import end_failed_starts, prefill_each
from verify_server.session import SessionError, VerifySession
from verify_server.sharding import shard_model
from verify_server.verify import VerifyEngine

log = logging.getLogger("ddtree.verify.tp")

STORE_HOST = "127.0.0.1"  # the ranks are processes of one host
OPS = ("start_session", "end_session", "prefill", "verify", "decode", "shutdown", "untap", "limit_kv_caches")


def init_group(rank: int, world: int, device: str, store: dist.Store, timeout_s: float) -> torch.device:
    """Joins the group through rank 0's store; returns this rank's device (cuda:<rank> on GPUs)."""
    on_gpu = device.startswith("cuda")
    local = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
        device_id=local if on_gpu else None,
    )
    return local


def load_sharded(
    target: str, rank: int, world: int, device: torch.device, dtype: torch.dtype, max_tree_size: int = 1024
) -> VerifyEngine:
    """`target` is a model directory, or `random:<shape>` (verify_server.random_target) for benchmarks at real shapes.
    Every rank compiles sessions' grammars from the directory's tokenizer: the full-vocabulary logits are on every
    rank (lm_head is replicated), so each masks its own alike and the ranks' walks stay in lockstep. A random
    target has no tokenizer: every rank refuses a grammar alike."""
    from verify_server.random_target import RANDOM_PREFIX, random_target
    from verify_server.verify import load_target

    path = None
    if target.startswith(RANDOM_PREFIX):
        model = random_target(target.removeprefix(RANDOM_PREFIX), device, dtype)
    else:
        model = load_target(target, "cpu", dtype)  # shard on the host, so each GPU only ever holds its slice
        path = target
    shard_model(model, rank, world)
    # the fused path has no sharded form yet
    return VerifyEngine(model.to(device), max_tree_size, fused=False, target_path=path)


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


class TensorParallelEngine:
    """Rank 0's face of a sharded verifier: the VerifyEngine API the service uses, each call that changes state
    mirrored on every rank, what is only read (shapes, sessions, KV cache memory) rank 0's. The sharded target has no
    fused path (no graphs, no shared or launched-ahead forwards) and no prefix cache (every rank would have to
    restore its shard in lockstep with rank 0's lookups). `alive()` says whether every rank still runs
    (runtime.service.ShardedEngine); `close()` stops them all."""

    def __init__(self, engine: VerifyEngine, alive: Callable[[], bool], close: Callable[[], None]) -> None:
        self.engine = engine
        self.channel = _Channel(engine.device)
        self.sessions = engine.sessions  # rank 0's table is the service's view (metrics, TTL sweeps)
        self.caches = engine.caches  # rank 0's, for the metrics; limit_kv_caches limits every rank's
        self.model, self.num_layers, self.hidden_size = engine.model, engine.num_layers, engine.hidden_size
        self.vocab_size, self.device, self.dtype, self.path = engine.vocab_size, engine.device, engine.dtype, engine.path
        self.fused: None = None
        self.ahead: None = None
        self.prefix: None = None
        self._ranks_alive = alive
        self.close = close

    def alive(self) -> bool:
        """False once any rank has died: the service must stop answering (NOT_SERVING), not hang."""
        return self._ranks_alive()

    def session(self, session_id: str) -> VerifySession:
        return self.engine.session(session_id)

    def limit_kv_caches(self, nbytes: int) -> None:
        """Every rank's KV caches (shards of the same sessions' alike) held to nbytes, so that a step one rank's
        caches refuse is refused on all, before any of them runs its forward."""
        self.channel.send("limit_kv_caches", {"bytes": nbytes})
        self.engine.limit_kv_caches(nbytes)

    def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        if params.seed is None and not params.greedy:
            # every rank must draw the same samples: fix the seed here instead of letting each rank pick one
            params = replace(params, seed=int(torch.randint(2**62, ()).item()))
        # rank 0 first: a session it refuses (its checks, memory) is not started on the others
        self.engine.start_session(session_id, capacity, params, taps)
        # the params in the wire's own encoding; every rank runs the same logits processors on the same logits
        wire = tensors.sampling_to_pb(params).SerializeToString().hex()
        self.channel.send("start_session", {"id": session_id, "capacity": capacity, "params": wire, "taps": taps})

    def end_session(self, session_id: str) -> bool:
        self.channel.send("end_session", {"id": session_id})
        return self.engine.end_session(session_id)

    def untap(self, session_id: str) -> None:
        self.channel.send("untap", {"id": session_id})
        self.engine.untap(session_id)

    def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, host_features: bool = False,
        skip_features: int = 0,
    ) -> StepResult:
        self.channel.send("prefill", {"id": session_id, "prompt": prompt, "more": more})
        return self.engine.prefill(session_id, prompt, more, host_features, skip_features)  # rank 0's features only

    def prefill_batch(self, calls: list[PrefillCall]) -> list[StepResult | Exception]:
        """Each call alone through prefill, in order (the sharded target has no fused path, hence no shared
        forward) -> its StepResult, or the exception it raised (VerifyEngine.prefill_batch's ends)."""
        return end_failed_starts(self.end_session, calls, prefill_each(self.prefill, calls))

    def launch_decodes(self, session_ids: list[str], host_features: bool = False) -> None:
        """No AR step is launched ahead here (no fused path): verify_batch runs them."""
        return None

    def settle(self) -> None:
        """Nothing is launched ahead to read."""

    def verify(self, session_id: str, tree: DraftTree, host_features: bool = False) -> StepResult:
        self.channel.send("verify", {"id": session_id, "max_depth": tree.max_depth}, tree)
        return self.engine.verify(session_id, tree, host_features)  # only rank 0's features leave the process

    def decode(self, session_id: str, host_features: bool = False) -> StepResult:
        """One AR step (the root alone), on every rank."""
        self.channel.send("decode", {"id": session_id})
        return self.engine.decode(session_id, host_features)

    @torch.inference_mode()
    def verify_batch(
        self, calls: list[tuple[str, DraftTree]], host_features: bool = False
    ) -> list[StepResult | Exception]:
        """Each call alone through verify, in order (the sharded target has no fused path, hence no batched
        forward) -> its StepResult, or the exception it raised."""
        return [verify_alone(self.verify, session_id, tree, host_features) for session_id, tree in calls]

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
                params = tensors.sampling_from_pb(pb.SamplingParams.FromString(bytes.fromhex(header["params"])))
                engine.start_session(header["id"], header["capacity"], params, header["taps"])
            elif op == "end_session":
                engine.end_session(header["id"])
            elif op == "prefill":
                engine.prefill(header["id"], header["prompt"], header["more"])
            elif op == "verify":
                engine.verify(header["id"], tree)
            elif op == "decode":
                engine.decode(header["id"])
            elif op == "untap":
                engine.untap(header["id"])
            elif op == "limit_kv_caches":
                engine.limit_kv_caches(header["bytes"])
        except SessionError as exc:
            log.debug("rank %d: %s failed as on rank 0: %s", dist.get_rank(), op, exc)


def _follower_main(
    rank: int, world: int, target: str, device: str, dtype: str, port: int, timeout_s: float, max_tree_size: int
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[verify rank {rank}] %(message)s")
    store = dist.TCPStore(STORE_HOST, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
    local = init_group(rank, world, device, store, timeout_s)
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

        # Rank 0 holds the group's store on a port the kernel picks, bound before any follower is told of it: no
        # other process can take the port in between.
        store = dist.TCPStore(
            STORE_HOST, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        port = store.port
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
        local = init_group(0, world, device, store, timeout_s)
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
