"""Model directories: where the bundled demo pair lives (so commands run with no model flags on a fresh checkout),
models named as users name them (a directory, or a Hugging Face hub id found in the local cache: never
downloaded), whether a drafter fits a target, their EOS ids and their tokenizers, read from disk only."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

DEMO_DIR_ENV = "DDTREE_DEMO_MODELS"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_DIR_ENV) or Path(__file__).resolve().parent.parent / "models" / "demo")


def resolve_pair(target: str | None, drafter: str | None) -> tuple[str, str | None]:
    """Explicit flags win; with no --target, the bundled demo target and its drafter are used. Each is a directory
    or a hub id in the local cache (resolve_model); a drafter that does not fit its target stops the command here,
    with the mismatch, before anything loads. A drafter of 'none' passes through as it is."""
    try:
        if target is not None:
            target = resolve_model(target)
            if drafter is not None and drafter.lower() != "none":
                drafter = resolve_model(drafter)
                check_fit(target, drafter)
            return target, drafter
        demo = demo_dir()
        if not (demo / "target" / "config.json").is_file():
            raise SystemExit(f"no --target given and no bundled demo model at {demo}/target")
        default_drafter = demo / "drafter"
        if drafter is None:
            drafter = str(default_drafter) if (default_drafter / "config.json").is_file() else None
        elif drafter.lower() != "none":
            drafter = resolve_model(drafter)
        if drafter is not None and drafter.lower() != "none":
            check_fit(str(demo / "target"), drafter)
        return str(demo / "target"), drafter
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def resolve_model(name: str) -> str:
    """A model directory, or a hub id (`Qwen/Qwen3-8B`) resolved to its snapshot in the local Hugging Face cache
    (HF_HUB_CACHE, else HF_HOME/hub); nothing is downloaded."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if not HUB_ID.match(name) or name.startswith("."):
        raise ValueError(f"model directory {name} does not exist")
    try:
        return snapshot_download(name, local_files_only=True)
    except LocalEntryNotFoundError:
        cached = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"
        raise ValueError(f"{name} is neither a directory nor in the local Hugging Face cache (looked for {cached}; "
                         f"set HF_HUB_CACHE or HF_HOME to another cache, or download it first, e.g. "
                         f"`hf download {name}`)") from None


def is_hub_id(name: str | None) -> bool:
    """Whether a model was named by its hub id (then that is the name it is served under) rather than a path."""
    return name is not None and not Path(name).expanduser().is_dir() and HUB_ID.match(name) is not None


def read_eos_ids(path: str | os.PathLike) -> list[int]:
    """The ids that end a generation: config.json's eos_token_id and generation_config.json's (each an int or a
    list), as vLLM takes them."""
    ids = _as_list(AutoConfig.from_pretrained(str(path), local_files_only=True).eos_token_id)
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        ids += _as_list(json.loads(generation.read_text()).get("eos_token_id"))
    return sorted(set(ids))


def _as_list(eos: int | list[int] | None) -> list[int]:
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class DrafterShape:
    hidden_size: int  # a DFlash drafter shares the target's embeddings and lm_head, so its width is the target's
    vocab_size: int
    target_layer_ids: tuple[int, ...]  # empty where the checkpoint leaves them to its default
    mask_token_id: int | None  # None where unknown (a drafter service's Info does not report it)


def misfit(target: TargetShape, drafter: DrafterShape) -> str | None:
    """Why the drafter cannot draft for the target, or None when it fits."""
    if drafter.hidden_size != target.hidden_size:
        return f"the drafter's hidden size is {drafter.hidden_size}, the target's {target.hidden_size}"
    if drafter.vocab_size != target.vocab_size:
        return f"the drafter's vocabulary has {drafter.vocab_size} tokens, the target's {target.vocab_size}"
    bad = [t for t in drafter.target_layer_ids if not 0 <= t < target.num_layers]
    if bad:
        return f"the drafter taps target layer {bad[0]}, the target has {target.num_layers} layers"
    if drafter.mask_token_id is not None and not 0 <= drafter.mask_token_id < target.vocab_size:
        return f"the drafter's mask token id {drafter.mask_token_id} is outside the target's vocabulary"
    return None


def check_fit(target: str | os.PathLike, drafter: str | os.PathLike) -> None:
    """Raises ValueError naming the mismatch when the drafter directory's model does not fit the target's."""
    problem = misfit(target_shape(target), drafter_shape(drafter))
    if problem is not None:
        raise ValueError(f"drafter {drafter} does not fit target {target}: {problem}")


def target_shape(path: str | os.PathLike) -> TargetShape:
    config = _config(path)
    text = _Config(config.file, config["text_config"]) if "text_config" in config else config  # multimodal ones
    return TargetShape(text["hidden_size"], text["vocab_size"], text["num_hidden_layers"])


def drafter_shape(path: str | os.PathLike) -> DrafterShape:
    """From a DFlash checkpoint's config.json (the published format: dflash_config holds the taps and mask)."""
    config = _config(path)
    dflash = config.get("dflash_config") or {}
    return DrafterShape(config["hidden_size"], config["vocab_size"], tuple(dflash.get("target_layer_ids") or ()),
                        dflash.get("mask_token_id"))


def _config(path: str | os.PathLike) -> _Config:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} holds no config.json")
    return _Config(file, json.loads(file.read_text()))


class _Config(dict):
    """A config.json's keys; a missing one is a ValueError naming the file."""

    def __init__(self, file: Path, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.file = file

    def __missing__(self, key: str) -> Any:
        raise ValueError(f"{self.file} lacks {key!r}")


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer of a local directory; never consults the network."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
