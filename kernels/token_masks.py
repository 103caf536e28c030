"""A grammar's masks on the device, in one Triton kernel: each row's forbidden tokens' logits set to -inf in place,
as xgrammar's apply_token_bitmask_inplace sets them, before the step's choice (an argmax or a draw).

Why: a captured step takes a grammar session's masks as a graph input (verify_server/tree_steps.py). In torch ops
each row's bitmask would be unpacked to the whole vocabulary ([rows, V] temporaries beside the logits, per graph);
here each program reads its block's mask words beside its logits, and every block of every row is a program of its
own, so a step of one row is as parallel as one of hundreds. The choice after it is the uncaptured walk's.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops below
    triton = None

BLOCK = 1024  # tokens a program masks


def apply_masks_(logits: torch.Tensor, bitmask: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """logits [R, V] fp32, bitmask [R, W] int32 (bit t % 32 of word t // 32 set where token t is allowed; W * 32 >=
    V) -> logits, each row's forbidden tokens at -inf (in place). kernel: through the Triton kernel (None: where the
    tensors are on a GPU), else torch's ops."""
    rows, vocab = logits.shape
    if kernel is None:
        kernel = triton is not None and logits.is_cuda
    if not kernel:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()  # [R, V]
        return logits.masked_fill_(~allowed, float("-inf"))
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _apply_masks_kernel[grid](logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK)
    return logits


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
