"""A grammar's masks on the device, in Triton kernels: the greedy choice (each row's argmax over the tokens its
bitmask allows) and, for a sampled choice, the forbidden tokens' logits set to -inf in place.

Why: a captured step takes a grammar session's masks as a graph input (verify_server/tree_steps.py). In torch ops
each row's bitmask would be unpacked to the whole vocabulary ([rows, V] temporaries beside the logits, per graph)
first; here a program reads the mask words beside the logits. The greedy kernel keeps one running best a row, ties
to the lowest token, as torch.argmax's; the masking writes what xgrammar's apply_token_bitmask_inplace writes. So
the choices are the uncaptured walk's.
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
        return logits.masked_fill(~_allowed(bitmask, vocab), float("-inf")).argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    _masked_argmax_kernel[(rows,)](logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK)
    return out


def apply_masks_(logits: torch.Tensor, bitmask: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """logits [R, V] fp32, bitmask as masked_argmax's -> logits, each row's forbidden tokens at -inf (in place).
    kernel: as masked_argmax's."""
    rows, vocab = logits.shape
    if kernel is None:
        kernel = triton is not None and logits.is_cuda
    if not kernel:
        return logits.masked_fill_(~_allowed(bitmask, vocab), float("-inf"))
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _apply_masks_kernel[grid](logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK)
    return logits


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [R, W] int32 -> [R, vocab] bool, True where allowed (torch's ops: the CPU's way)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()


if triton is not None:

    @triton.jit
    def _apply_masks_kernel(Logits, Masks, vocab, stride_logits, stride_masks, BLOCK: tl.constexpr):
        """Program (r, c): block c of row r's tokens, the forbidden ones set to -inf."""
        row = tl.program_id(0).to(tl.int64)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        words = tl.load(Masks + row * stride_masks + tokens // 32, mask=inside, other=-1)
        forbidden = ((words >> (tokens % 32)) & 1) == 0
        tl.store(Logits + row * stride_logits + tokens, tl.full((BLOCK,), float("-inf"), tl.float32),
                 mask=inside & forbidden)

    @triton.jit
    def _masked_argmax_kernel(Logits, Masks, Out, vocab, stride_logits, stride_masks, BLOCK: tl.constexpr):
        """Program r: row r's best allowed token, block by block (a later block wins only with a greater value)."""
        row = tl.program_id(0).to(tl.int64)
        best = tl.full((), float("-inf"), tl.float32)
        best_at = tl.full((), 0, tl.int32)
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
