"""The greedy choice within a grammar, in one Triton kernel: each row's argmax over the tokens its bitmask allows.

Why: a captured step takes a grammar session's masks as a graph input (verify_server/tree_steps.py). In torch ops
the choice would unpack each row's bitmask to the whole vocabulary ([rows, V] temporaries beside the logits, per
graph) before masking and reducing; here one program a row reads the logits and the mask words once and keeps
its running best. Ties go to the lowest token, as torch.argmax's do, so the choice is the uncaptured walk's.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops below
    triton = None

BLOCK = 1024  # tokens a program reads at a time


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """logits [R, V] fp32, bitmask [R, W] int32 (bit t % 32 of word t // 32 set where token t is allowed; W * 32 >=
    V) -> [R] int64: each row's argmax among its allowed tokens, the lowest on ties (0 where none is allowed).
    kernel: through the Triton kernel (None: where the tensors are on a GPU)."""
    rows, vocab = logits.shape
    if kernel is None:
        kernel = triton is not None and logits.is_cuda
    if not kernel:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()  # [R, V]
        return logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    _masked_argmax_kernel[(rows,)](logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK)
    return out


if triton is not None:

    @triton.jit
    def _masked_argmax_kernel(Logits, Masks, Out, vocab, stride_logits, stride_masks, BLOCK: tl.constexpr):
        """Program r: row r's best allowed token, block by block (a later block wins only with a greater value)."""
        row = tl.program_id(0).to(tl.int64)
        best = float("-inf")
        best_at = 0
        for first in range(0, vocab, BLOCK):
            tokens = first + tl.arange(0, BLOCK)
            inside = tokens < vocab
            words = tl.load(Masks + row * stride_masks + tokens // 32, mask=inside, other=0)
            allowed = ((words >> (tokens % 32)) & 1) != 0
            values = tl.load(Logits + row * stride_logits + tokens, mask=inside, other=float("-inf"))
            values = tl.where(allowed & inside, values, float("-inf"))
            block_best = tl.max(values, axis=0)
            block_at = tl.argmax(values, axis=0, tie_break_left=True)
            better = block_best > best
            best_at = tl.where(better, first + block_at, best_at)
            best = tl.where(better, block_best, best)
        tl.store(Out + row, best_at)
