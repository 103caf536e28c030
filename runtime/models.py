"""Model directories: where the bundled demo pair lives (so commands run with no model flags on a fresh checkout),
and their tokenizers, read from disk only."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

DEMO_DIR_ENV = "DDTREE_DEMO_MODELS"


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_DIR_ENV) or Path(__file__).resolve().parent.parent / "models" / "demo")


def resolve_pair(target: str | None, drafter: str | None) -> tuple[str, str | None]:
    """Explicit flags win; with no --target, the bundled demo target and its drafter are used."""
    if target is not None:
        return target, drafter
    demo = demo_dir()
    if not (demo / "target" / "config.json").is_file():
        raise SystemExit(f"no --target given and no bundled demo model at {demo}/target")
    default_drafter = demo / "drafter"
    return str(demo / "target"), drafter or (str(default_drafter) if (default_drafter / "config.json").is_file() else None)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer of a local directory; never consults the network."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
