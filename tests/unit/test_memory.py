"""Device memory reserved at start-up (runtime/memory.py): the arithmetic that sizes sessions and caches from the
models' configurations agrees with what the engines allocate, a share is a CUDA device's and within (0, 1], a step
that finds no device memory is answered as one short of cache memory (ABORTED: the gateway resumes the request),
and on a GPU the reservation holds the caches' bytes for this process and refuses a share that does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from draft_server.config import DraftServerConfig
from draft_server.server import slots_first
from runtime import memory
from runtime.models import resolve_pair
from runtime.service import EngineHost, ServiceMetrics
from verify_server.config import VerifyServerConfig
from verify_server.server import STATUSES, kv_cache_bytes
from verify_server.verify import VerifyEngine

CUDA = pytest.mark.gpu(reason="needs a CUDA device")


def test_session_tokens_fit_the_sessions_within_the_context() -> None:
    per_token, sessions = 1000, 64
    assert memory.session_tokens(64 * 1000 * 4096, sessions, per_token, 40960) == 4096
    assert memory.session_tokens(64 * 1000 * 4100, sessions, per_token, 40960) == 4096  # a multiple of 256
    assert memory.session_tokens(64 * 1000 * 10**6, sessions, per_token, 40960) == 40960  # the context bounds it
    with pytest.raises(memory.MemoryMisfit, match="--gpu-memory-utilization"):
        memory.session_tokens(64 * 1000 * 255, sessions, per_token, 40960)


def test_the_drafters_sessions_come_before_its_prefix_cache() -> None:
    """Every session's slot (and the scratch slot) first, the prefix cache what they leave, up to its size; short of
    room for the slots, as many as fit and no prefix cache."""
    slot, sessions = 90, 64
    assert slots_first(100 * slot, slot, sessions, 40 * slot) == (64, 35 * slot)  # the cache cut to what is left
    assert slots_first(100 * slot, slot, sessions, 10 * slot) == (64, 10 * slot)  # its whole size
    assert slots_first(65 * slot, slot, sessions, 10 * slot) == (64, 0)
    assert slots_first(60 * slot + 7, slot, sessions, 10 * slot) == (59, 0)  # short: as many as fit


def test_the_configurations_arithmetic_is_what_the_engine_allocates() -> None:
    """A token's K/V, from config.json alone, is the verifier engine's cache row (the demo target, fp32); the
    weights, from the safetensors headers alone, are the checkpoint's tensor bytes at its own dtype (bf16)."""
    target, _ = resolve_pair(None, None)
    engine = VerifyEngine.from_pretrained(target, "cpu", torch.float32, max_sessions=2)
    config = json.loads((Path(target) / "config.json").read_text())
    assert memory.kv_bytes_per_token(config, torch.float32) == engine.caches.row_bytes
    stored = 0
    for path in Path(target).glob("*.safetensors"):
        with open(path, "rb") as f:
            stored += path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")  # past the header: the data
    assert memory.weight_bytes(target, torch.bfloat16) == stored
    assert memory.weight_bytes(target, torch.float32) == 2 * stored


@pytest.mark.parametrize("config_cls", [VerifyServerConfig, DraftServerConfig])
def test_a_share_is_a_cuda_devices_and_within_one(config_cls) -> None:
    target, drafter = resolve_pair(None, None)
    models = {"target": target} | ({"drafter": drafter} if config_cls is DraftServerConfig else {})
    assert config_cls(**models, device="cpu").memory_share is None  # no reservation on a CPU
    with pytest.raises(ValueError, match="CUDA device"):
        config_cls(**models, device="cpu", gpu_memory_utilization=0.5)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            config_cls(**models, device="cpu", gpu_memory_utilization=bad)


def test_a_step_without_device_memory_is_answered_as_short_of_cache_memory() -> None:
    """ABORTED, as a cache that could not grow: the gateway then resumes the request on new sessions once memory
    frees (gateway/resume.py), where RESOURCE_EXHAUSTED would have ended its answer with an error."""
    host = EngineHost(ServiceMetrics("test_verify", "kv", "kv", torch.device("cpu")), STATUSES, kv_cache_bytes, 60.0)
    try:
        assert host._status(torch.OutOfMemoryError("CUDA out of memory")) == grpc.StatusCode.ABORTED
    finally:
        host.close()


@CUDA
def test_a_reservation_holds_the_caches_bytes_and_refuses_a_share_that_does_not_fit() -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()  # what earlier tests of this process left cached is no working memory of this one's
    weights = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # the working memory: held throughout
    torch.cuda.reset_peak_memory_stats(device)
    total = memory.device_total(device)
    utilization = (torch.cuda.memory_reserved(device) + 2**30) / total  # 1 GiB of caches, less the headroom
    budget = memory.measure(device, utilization, 0, "test")
    assert 0.9 * 2**30 < budget.caches < 2**30
    memory.reserve(device, budget, "test")
    assert torch.cuda.memory_reserved(device) >= budget.share
    reserved = torch.cuda.memory_reserved(device)
    caches = [torch.empty(budget.caches // 4, dtype=torch.uint8, device=device) for _ in range(4)]
    assert torch.cuda.memory_reserved(device) == reserved  # the caches came out of the reservation
    del caches
    with pytest.raises(memory.MemoryMisfit, match="--gpu-memory-utilization"):
        memory.measure(device, 1e-6, 0, "test")
    free, _ = torch.cuda.mem_get_info(device)
    too_much = memory.CacheBudget(total, reserved + free + 2**30, 0, free + 2**30)
    with pytest.raises(memory.MemoryMisfit, match="other processes hold"):
        memory.reserve(device, too_much, "test")
    del weights


def test_the_drafters_part_of_a_stacks_share_follows_what_it_holds() -> None:
    """ddtree serve's split on one device: the drafter's part grows with the share and with its sessions, and stays
    a fraction of it (the verifier gets the rest); with the demo pair's tiny weights, about its working memory's
    guess and prefix cache."""
    target, drafter = resolve_pair(None, None)
    total, prefixes = 16 * memory.GIB, (4 * memory.GIB, memory.GIB)
    part = lambda utilization, sessions: memory.drafter_share(  # noqa: E731
        total, utilization, target, drafter, torch.bfloat16, sessions, prefixes)
    # (the demo's tokens are small: only thousands of sessions keep them below its 2048-token context)
    assert 0 < part(0.6, 4096) < part(0.9, 4096) < 0.9 / 2
    assert part(0.9, 16) < part(0.9, 4096) < part(0.9, 8192)
    guess = memory.working_guess(memory.weight_bytes(drafter, torch.bfloat16)) + prefixes[1]
    assert guess / total < part(0.9, 64) < (guess + 0.5 * memory.GIB) / total


def test_the_drafter_sizes_its_sessions_as_serve_split_for_them() -> None:
    """The drafter's own default session length in the part `ddtree serve` gave it is the length the split was
    worked out for: `sessions` slots of it fit that part (and one quantum more would not)."""
    target, drafter = resolve_pair(None, None)
    total, sessions, prefix = 16 * memory.GIB, 4096, memory.GIB
    footprint = memory.DrafterFootprint.of(target, drafter, torch.bfloat16)
    part = memory.drafter_share(total, 0.9, target, drafter, torch.bfloat16, sessions, (4 * memory.GIB, prefix))
    tokens = footprint.session_tokens(int(part * total), sessions, prefix)
    assert footprint.share(tokens, sessions, prefix) <= part * total
    assert footprint.share(tokens + memory.TOKEN_QUANTUM, sessions, prefix) > part * total
