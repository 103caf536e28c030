"""Several small copies between device tensors in one launch.

A round moves a few small tensors out of a graph's outputs at its end: its packed outcome into the host's readback
buffer (kernels/readback.py), its accepted path's features into memory of their own; a batch writes its trees'
rows already on the device into its static inputs; the prefix cache keeps a commit's blocks. Each copy_ is a launch
of its own, a tiny kernel and the gap before the next. torch's multi-tensor copy (`torch._foreach_copy_`) does a
list of copies in one kernel where all share a dtype and each is dense, so the copies here travel as int64 words: a
bf16 feature row and int64 scalars share the launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WORD = 8  # bytes of the int64 words the copies travel as


def copy_together(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every (dst, src) pair, of one shape and dtype each, on one device: one launch for those
    whose bytes are whole aligned words in contiguous memory on both sides, a copy_ each for any others."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    others: list[tuple[torch.Tensor, torch.Tensor]] = []  # not whole words: a copy_ each
    for dst, src in pairs:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy of {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
        if dst.numel() == 0:
            continue
        words = _words(dst), _words(src)
        if words[0] is None or words[1] is None:
            others.append((dst, src))
        else:
            dsts.append(words[0])
            srcs.append(words[1])
    for dst, src in others:
        dst.copy_(src)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """t's bytes as an int64 view (its last axis in words), or None where they are not contiguous whole aligned
    words (a tensor that is not dense would send the whole list down torch's slow path: a copy each)."""
    if not t.is_contiguous():
        return None
    if t.dtype == torch.long:
        return t
    size = t.element_size()
    if t.ndim == 0 or t.shape[-1] * size % WORD or t.storage_offset() * size % WORD:
        return None
    return t.view(torch.long)
