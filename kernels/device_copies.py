"""Several small copies between device tensors in one launch.

Between two rounds queued on the device without the host reading the first (chained rounds, gateway/round_loops.py),
each engine moves a few small tensors from the last round's outcome into the next step's static inputs: a tree's
rows, a cursor's scalars, the accepted path's features. Each copy_ or fill_ is a launch of its own, a tiny kernel
and the gap before the next, and a round has many (`bench/profile_round.py --census` counts them).
torch's multi-tensor copy (`torch._foreach_copy_`) does a list of copies in one kernel where all share a dtype and
each is dense, so the copies here travel as int64 words: a bf16 feature row and int64 scalars share the launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

WORD = 8  # bytes of the int64 words the copies travel as


def copy_together(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every (dst, src) pair, of one shape and dtype each, on one device: one launch for those
    whose bytes are whole aligned words in contiguous memory on both sides, a copy_ each for any others."""
    Copies(pairs).run()


class Copies:
    """copy_together's pairs checked and cut into words once, for copies that recur with the same tensors (a
    chained round's, from a graph's outputs into a session's buffers; CopiesMemo keeps them): run() is then the
    multi-tensor launch alone. That launch is most of a call's host time; what made-once copies save is their
    callers' slicing and pair building, every round."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._dsts: list[torch.Tensor] = []
        self._srcs: list[torch.Tensor] = []
        self._others: list[tuple[torch.Tensor, torch.Tensor]] = []  # not whole words: a copy_ each
        for dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"copy of {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
            if dst.numel() == 0:
                continue
            words = _words(dst), _words(src)
            if words[0] is None or words[1] is None:
                self._others.append((dst, src))
            else:
                self._dsts.append(words[0])
                self._srcs.append(words[1])

    def run(self, more: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """The copies, with `more` (pairs that change from call to call, checked now) in the same launch."""
        extra = Copies(more) if more else None
        dsts, srcs = (self._dsts + extra._dsts, self._srcs + extra._srcs) if extra else (self._dsts, self._srcs)
        for dst, src in self._others + (extra._others if extra else []):
            dst.copy_(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """t's bytes as an int64 view (its last axis in words), or None where they are not contiguous whole aligned
    words (a tensor that is not dense would send the whole list down torch's slow path: a copy each). Few calls:
    this is host time on every chained round."""
    if not t.is_contiguous():
        return None
    if t.dtype == torch.long:
        return t
    size = t.element_size()
    if t.ndim == 0 or t.shape[-1] * size % WORD or t.storage_offset() * size % WORD:
        return None
    return t.view(torch.long)


class CopiesMemo:
    """Copies remembered by the tensors they are made from, for copies that recur with the same tensors round after
    round. An entry is keyed by those objects' ids (ints, such as a count that shapes the pairs, by value) and keeps
    the objects alive, so no other object can take an id of a live key; past `limit` entries (those of ended
    sessions, or of graphs left behind) it forgets them all."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._memo: dict[tuple, tuple[tuple, Copies]] = {}

    def run(
        self, objects: tuple[object, ...], make: Callable[[], Sequence[tuple[torch.Tensor, torch.Tensor]]],
        more: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        """The copies that make() gives for these objects (made on the first call), with `more` (Copies.run)."""
        key = tuple(x if type(x) is int else id(x) for x in objects)
        entry = self._memo.get(key)
        if entry is None:
            if len(self._memo) >= self.limit:
                self._memo.clear()
            entry = self._memo[key] = (objects, Copies(make()))
        entry[1].run(more)
