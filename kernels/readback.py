"""Host buffers that a GPU fills with a kernel's stores (zero-copy) rather than a copy engine's DMA.

Why: a verify round reads its outcome back right after its graph replay. A cudaMemcpyAsync into pinned memory
runs on a copy engine, and the hand-off to it from the kernels before adds latency; an elementwise kernel that
stores into the same pinned memory runs right after the replay's kernels, with no hand-off.

With unified addressing (every 64-bit CUDA platform), pinned host memory is mapped into the device's address space
at the same address, so a CUDA tensor over that address is a device view of the host buffer. The host reads it
after a sync on work queued after the kernel, as it would after a copy.
"""

from __future__ import annotations

import torch


class _CudaArray:
    """__cuda_array_interface__ (v3) of `numel` bytes at `address`: what torch.as_tensor wraps without copying."""

    def __init__(self, address: int, numel: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (numel,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }


class PinnedReadback:
    """host [capacity] of `dtype`, pinned on a GPU; target() says where a kernel stores a device tensor into its
    head."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=dtype, pin_memory=cuda)
        self._device_view = None  # the same bytes, as a CUDA tensor
        # target()'s views by shape: a round's readback has the same shape round after round, and making the two
        # views is host time that every round would pay again
        self._targets: dict[torch.Size, tuple[torch.Tensor, torch.Tensor]] = {}
        if cuda:
            raw = _CudaArray(self.host.data_ptr(), self.host.numel() * self.host.element_size())
            self._device_view = torch.as_tensor(raw, device=device).view(dtype)

    @property
    def capacity(self) -> int:
        return self.host.numel()

    def target(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (this buffer's dtype, at most capacity elements) -> (where a kernel is to store it: the buffer's head
        as the device sees it, the host view off a GPU; the host view of src's shape, which holds src once the
        queued store has run). The caller queues the store with the round's other copies
        (kernels.device_copies.copy_together: a multi-tensor kernel's stores, no copy engine)."""
        views = self._targets.get(src.shape)
        if views is None:
            n = src.numel()
            host = self.host[:n].view(src.shape)
            views = self._targets[src.shape] = (
                host if self._device_view is None else self._device_view[:n].view(src.shape)), host
        return views
