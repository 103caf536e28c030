"""copy_together: several copies in one launch where their bytes are whole words, a copy_ each otherwise."""

from __future__ import annotations

import pytest
import torch

from kernels.device_copies import copy_together
from kernels.readback import PinnedReadback


def devices() -> list:
    """The CPU, and the GPU where there is one (marked gpu)."""
    return ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def mixed_pairs(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A round's kinds of copies: int64 scalars, a tree's rows into a row of a larger buffer, bf16 feature rows
    (whole words), and some that cannot travel as words (a row of 3 bf16, a strided destination, an unaligned
    start)."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.zeros(64, dtype=torch.long, device=device)
    scalars = torch.tensor([41, 7], device=device)
    tree = torch.randint(0, 1000, (3, 9), generator=gen).to(device)
    features = torch.randn(5, 12, generator=gen).to(torch.bfloat16).to(device)
    odd = torch.randn(2, 3, generator=gen).to(torch.bfloat16).to(device)
    table = torch.zeros(6, 4, dtype=torch.long, device=device)
    halves = torch.zeros(9, dtype=torch.bfloat16, device=device)
    return [
        (inputs[50:51], scalars[:1]), (inputs[52:53], scalars[1:]),
        *[(inputs[16 * i : 16 * i + 9], tree[i]) for i in range(3)],
        (torch.zeros(5, 12, dtype=torch.bfloat16, device=device), features),
        (torch.zeros(2, 3, dtype=torch.bfloat16, device=device), odd),
        (table[:, 1], torch.arange(6, device=device)),  # a column: not contiguous
        (halves[1:5], features[0, :4]),  # starts half a word in
    ]


@pytest.mark.parametrize("device", devices())
def test_every_copy_lands_exactly(device: str) -> None:
    pairs = mixed_pairs(device)
    copy_together(pairs)
    for dst, src in pairs:
        assert torch.equal(dst, src)


def test_copies_of_other_shapes_or_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="copy of"):
        copy_together([(torch.zeros(3), torch.zeros(4))])
    with pytest.raises(ValueError, match="copy of"):
        copy_together([(torch.zeros(3, dtype=torch.long), torch.zeros(3))])


def test_nothing_to_copy_is_fine() -> None:
    copy_together([])
    copy_together([(torch.zeros(0, 4), torch.ones(0, 4))])


@pytest.mark.gpu(reason="kernel launches are counted on a GPU")
def test_word_copies_are_one_launch_into_device_and_mapped_host_memory() -> None:
    from torch.profiler import ProfilerActivity, profile

    pairs = mixed_pairs("cuda")[:6]  # the scalars, the tree's rows and the features: all whole words
    readback = PinnedReadback(32, torch.long, torch.device("cuda"))
    stored, host = readback.target(pairs[2][1])
    copy_together(pairs + [(stored, pairs[2][1])])  # compiles nothing; warms the allocator
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        copy_together(pairs + [(stored, pairs[2][1])])
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
    assert torch.equal(host, pairs[2][1].cpu())
