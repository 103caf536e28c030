"""A checkpoint written as its tensors are made, in the HF safetensors layout runtime/checkpoint.py reads: a large
model is built layer by layer and never held whole in host memory, only the shard being filled."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.checkpoint import INDEX_NAME, SINGLE_NAME


class ShardWriter:
    def __init__(self, path: Path, max_shard_bytes: int) -> None:
        self.path = path
        self.max_shard_bytes = max_shard_bytes
        path.mkdir(parents=True, exist_ok=True)
        for stale in list(path.glob("model*.safetensors")) + [path / INDEX_NAME]:
            stale.unlink(missing_ok=True)
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # (temporary file, its keys)
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[key] = tensor.contiguous()
        self._shard_bytes += nbytes
        self.total_bytes += nbytes

    def close(self) -> None:
        """Names the shards (model.safetensors alone, else model-i-of-n plus the index)."""
        self._flush()
        if len(self._written) == 1:
            self._written[0][0].rename(self.path / SINGLE_NAME)
            return
        weight_map = {}
        for i, (file, keys) in enumerate(self._written, start=1):
            name = f"model-{i:05d}-of-{len(self._written):05d}.safetensors"
            file.rename(self.path / name)
            weight_map.update({key: name for key in keys})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.path / INDEX_NAME).write_text(json.dumps(index, indent=2))

    def _flush(self) -> None:
        if not self._shard:
            return
        file = self.path / f"model-part{len(self._written):05d}.safetensors"
        save_file(self._shard, file, metadata={"format": "pt"})
        self._written.append((file, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0
