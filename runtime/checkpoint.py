"""safetensors I/O in the HF layout (one file, or shards plus `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _weight_files(path: Path) -> dict[str, Path]:
    """key -> file holding it."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    single = path / SINGLE_NAME
    if single.is_file():
        with safe_open(single, "pt") as f:
            return {key: single for key in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {path}")


def checkpoint_keys(path: str | Path) -> set[str]:
    return set(_weight_files(Path(path)))


def load_state_dict_files(path: str | Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Loads all tensors (or only `keys`) from a checkpoint directory onto the CPU."""
    files = _weight_files(Path(path))
    wanted = files.keys() if keys is None else keys
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        if key not in files:
            raise KeyError(f"checkpoint {path} has no tensor {key!r}")
        by_file.setdefault(files[key], []).append(key)
    state: dict[str, torch.Tensor] = {}
    for file, file_keys in by_file.items():
        with safe_open(file, "pt") as f:
            for key in file_keys:
                state[key] = f.get_tensor(key)
    return state


def save_state_dict_sharded(state: dict[str, torch.Tensor], path: Path, max_shard_bytes: int) -> None:
    """Writes one file when it fits, else shards of at most `max_shard_bytes` (a lone larger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.contiguous()
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_NAME, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
