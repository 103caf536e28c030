"""Host buffers the device writes: on a GPU through a kernel's stores into mapped pinned memory (copy_together),
else a copy."""

from __future__ import annotations

import pytest
import torch

from kernels.device_copies import copy_together
from kernels.readback import PinnedReadback


def devices() -> list:
    """The CPU, and the GPU where there is one (marked gpu)."""
    return ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.long, torch.bfloat16, torch.float32])
def test_writes_land_in_the_host_buffer_exactly(device: str, dtype: torch.dtype) -> None:
    buf = PinnedReadback(100, dtype, torch.device(device))
    assert buf.host.device.type == "cpu" and buf.host.is_pinned() == (device == "cuda")
    gen = torch.Generator().manual_seed(0)
    for shape in ((66,), (5, 20), (1,)):  # later writes shorter than earlier ones: only the head is rewritten
        src = (1000 * torch.randn(shape, generator=gen)).to(dtype)
        src.view(-1)[0] = float("nan") if dtype.is_floating_point else -7
        stored, host = buf.target(src)
        copy_together([(stored, src.to(device))])
        if device == "cuda":
            torch.cuda.synchronize()
        assert host.shape == src.shape and host.data_ptr() == buf.host.data_ptr()
        assert torch.equal(host.isnan(), src.isnan()) and torch.equal(host.nan_to_num(), src.nan_to_num())


def test_a_write_beyond_the_capacity_is_refused() -> None:
    with pytest.raises(RuntimeError):
        PinnedReadback(4, torch.long, torch.device("cpu")).target(torch.arange(5))
