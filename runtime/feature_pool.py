"""The verifier's features shared with its drafter through memory both map (ddtree.proto, "Features").

The verifier holds one pool (`FeaturePool`): on a GPU its own device memory, which the drafter maps by CUDA IPC (and
reads in place on the same GPU, or copies device to device from another); on the CPU a shared-memory file. Before a
call that carries features goes out, the verifier writes them into rows of the pool (`place`) and the call names the
rows (pb.FeatureRows) instead of carrying 40 KB a position through host memory, protobuf and a socket; the rows are
the call's until its answer (`release`). The drafter's side is `OpenedPool`.

The rows of the calls on their way lie one after the other, wrapping round at the pool's end (a ring whose oldest
rows are freed first, as calls are mostly answered in the order they went). A call that finds no room waits for
some (`room`): its rows go to the drafter, which works through the calls before it meanwhile, so waiting costs it
no more than queueing there would.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import logging
import os
import secrets
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.tensors import WIRE_DTYPES, WIRE_NAMES

log = logging.getLogger(__name__)

ALIGN = 256  # bytes: every call's rows start on this boundary (a copy kernel's widest access)
TOKEN_BYTES = 16  # the pool's first ALIGN bytes hold its token, which no rows overwrite
SHM_DIR = "/dev/shm"  # where a CPU pool's file lies (tmpfs: memory, not disk), else the temporary directory
SHM_PREFIX = "ddtree-features-"
# the share of the shared-memory filesystem's free space a CPU pool may take (a container's /dev/shm is 64 MB by
# default, and a write past a full tmpfs kills the process)
SHM_SHARE = 0.25


class PoolUnreachable(RuntimeError):
    """The drafter cannot map the verifier's pool (another host, another device, another IPC namespace)."""


@dataclass
class Placement:
    """A call's rows in the pool: bytes [start, end), named to the drafter by `rows`."""

    start: int
    end: int
    rows: pb.FeatureRows
    freed: bool = False

    def part(self, first: int, count: int) -> pb.FeatureRows:
        """Rows [first, first + count) of the placement, named to the drafter (a call's share of several calls' rows
        placed together)."""
        whole = self.rows
        return pb.FeatureRows(pool_id=whole.pool_id, offset=whole.offset + first * whole.width, rows=count,
                              width=whole.width, dtype=whole.dtype)


class FeaturePool:
    """The verifier's side: the pool's memory and its description for the drafter, and the calls' rows."""

    def __init__(self, memory: torch.Tensor, description: pb.FeaturePool, path: str | None = None,
                 lock: int | None = None) -> None:
        """memory: [size] uint8, the pool; description: what the drafter opens it by; path: a CPU pool's file, and
        lock: a descriptor of it holding its lock (both let go at close)."""
        self.memory = memory
        self.description = description
        self.size = memory.numel()
        self._path = path
        self._lock = lock
        self._live: deque[Placement] = deque()  # the rows of the calls on their way, oldest first
        # where a GPU pool is written: beside the steps launched on the device, which a copy behind them would wait
        # for (the features written come from steps already read)
        self._stream = torch.cuda.Stream(memory.device) if memory.is_cuda else None
        # made once: entering a new torch.cuda.stream() context looks the device up again, host time every call
        self._on_stream = torch.cuda.stream(self._stream) if memory.is_cuda else contextlib.nullcontext()
        self._room: asyncio.Event | None = None  # set when rows are freed (made in the event loop, on first wait)

    @classmethod
    def create(cls, device: torch.device, size: int) -> FeaturePool | None:
        """A pool of `size` bytes on `device` (less on the CPU where the shared-memory filesystem is small), or None
        where none can be made (logged: the features then go in the messages)."""
        pool_id = f"{os.getpid()}-{secrets.token_hex(8)}"
        token = secrets.token_bytes(TOKEN_BYTES)
        description = pb.FeaturePool(pool_id=pool_id, token=token)
        try:
            if device.type == "cuda":
                memory = torch.zeros(size, dtype=torch.uint8, device=device)
                memory[:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
                torch.cuda.synchronize(device)
                description.size = size
                _describe_cuda(memory, description.cuda)
                return cls(memory, description)
            if device.type != "cpu":
                log.info("no feature pool on %s: features go in the messages", device)
                return None
            folder = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
            _remove_stale(folder)
            stat = os.statvfs(folder)
            size = min(size, int(stat.f_bavail * stat.f_frsize * SHM_SHARE)) // ALIGN * ALIGN
            if size < ALIGN * 8:
                log.info("no feature pool: %s has too little free space; features go in the messages", folder)
                return None
            path = os.path.join(folder, f"{SHM_PREFIX}{pool_id}")
            # held locked while this process lives: how another verifier's start tells a pool left behind
            lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            memory.zero_()  # every page taken now: a full tmpfs fails here, not at a later write
            memory[:TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
            description.size, description.path = size, path
            return cls(memory, description, path, lock)
        except (RuntimeError, OSError) as exc:
            log.warning("no feature pool on %s (%s): features go in the messages", device, exc)
            return None

    def place(self, pieces: Sequence[torch.Tensor]) -> Placement | None:
        """The rows of pieces [m_i, width] (one dtype) concatenated, written into the pool (complete once `written`
        returns) -> where they lie, or None where the pool has no room for them now."""
        width, dtype = pieces[0].shape[1], pieces[0].dtype
        rows = sum(piece.shape[0] for piece in pieces)
        nbytes = rows * width * dtype.itemsize
        span = -(-nbytes // ALIGN) * ALIGN  # the rows' bytes, rounded up to the next call's boundary
        start = self._allocate(span)
        if start is None:
            return None
        target = self.memory[start : start + nbytes].view(dtype).view(rows, width)
        with self._on_stream:
            torch.cat(list(pieces), out=target)
        placement = Placement(start, start + span, pb.FeatureRows(
            pool_id=self.description.pool_id, offset=start // dtype.itemsize, rows=rows, width=width,
            dtype=WIRE_NAMES[dtype]))
        self._live.append(placement)
        return placement

    def in_host_memory(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """pieces [m_i, width] concatenated in host memory, for a call whose features go in its message: on a GPU
        copied on the pool's stream, which does not wait for the steps launched meanwhile."""
        if not pieces[0].is_cuda:
            return torch.cat(list(pieces)) if len(pieces) > 1 else pieces[0]
        rows = sum(piece.shape[0] for piece in pieces)
        host = torch.empty((rows, pieces[0].shape[1]), dtype=pieces[0].dtype, pin_memory=True)
        with self._on_stream:
            start = 0
            for piece in pieces:
                host[start : start + piece.shape[0]].copy_(piece, non_blocking=True)
                start += piece.shape[0]
        self._stream.synchronize()
        return host

    def written(self) -> None:
        """Once the rows placed so far are in the pool: before the call that names them goes out (the drafter reads
        them as it arrives). One wait for all of a call's placements."""
        if self._stream is not None:
            self._stream.synchronize()

    def fits(self, rows: int, width: int, dtype: torch.dtype) -> bool:
        """Whether that many rows fit the pool at all (a call of more goes in its message)."""
        return rows * width * dtype.itemsize <= self.size - ALIGN

    def release(self, placement: Placement) -> None:
        """A call's rows are free again (its answer came, or it failed)."""
        placement.freed = True
        while self._live and self._live[0].freed:
            self._live.popleft()
        if self._room is not None:
            self._room.set()

    async def room(self) -> None:
        """Once some rows have been freed since this was called."""
        if self._room is None:
            self._room = asyncio.Event()
        self._room.clear()
        await self._room.wait()

    def held_besides(self, own: Sequence[Placement]) -> bool:
        """Whether rows besides `own` (a call's) lie in the pool: a call waiting for room will get some."""
        return any(not placement.freed and all(placement is not mine for mine in own) for placement in self._live)

    def close(self) -> None:
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _allocate(self, nbytes: int) -> int | None:
        """The start of `nbytes` free contiguous bytes after the newest rows (wrapping to the pool's start), or None."""
        if nbytes > self.size - ALIGN:
            return None
        if not self._live:
            return ALIGN
        head, newest = self._live[0].start, self._live[-1]
        tail = newest.end
        if newest.start < head:  # wrapped: the free bytes lie between the newest rows and the oldest
            return tail if tail + nbytes <= head else None
        if tail + nbytes <= self.size:
            return tail
        return ALIGN if nbytes <= head - ALIGN else None


class OpenedPool:
    """The drafter's side: a verifier's pool, mapped."""

    def __init__(self, memory: torch.Tensor, pool_id: str) -> None:
        self.memory = memory  # [size] uint8
        self.pool_id = pool_id

    @classmethod
    def open(cls, description: pb.FeaturePool) -> OpenedPool:
        """Maps the pool -> its memory; PoolUnreachable where it cannot be (or what is mapped is not the verifier's
        pool)."""
        kind = description.WhichOneof("memory")
        try:
            if kind == "path":
                if not os.path.exists(description.path):
                    raise PoolUnreachable(f"no file {description.path} here (another host or IPC namespace)")
                memory = torch.from_file(description.path, shared=True, size=description.size, dtype=torch.uint8)
            elif kind == "cuda":
                memory = _open_cuda(description.size, description.cuda)
            else:
                raise PoolUnreachable("the pool names no memory")
        except PoolUnreachable:
            raise
        except (RuntimeError, OSError, ValueError) as exc:
            raise PoolUnreachable(f"cannot map the pool: {exc}") from None
        if bytes(memory[:TOKEN_BYTES].cpu().numpy()) != description.token:
            raise PoolUnreachable("the memory mapped is not the verifier's pool (its first bytes differ)")
        return cls(memory, description.pool_id)

    def rows(self, rows: pb.FeatureRows, device: torch.device) -> torch.Tensor:
        """[rows, width] the rows named, on `device` (in place where the pool lies there: read before the call is
        answered); ValueError where they do not lie within the pool."""
        dtype = WIRE_DTYPES.get(rows.dtype)
        if dtype is None:
            raise ValueError(f"feature rows' dtype {rows.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        start = rows.offset * dtype.itemsize
        nbytes = rows.rows * rows.width * dtype.itemsize
        if rows.offset < 0 or rows.rows < 1 or rows.width < 1 or start + nbytes > self.memory.numel():
            raise ValueError(f"feature rows [{rows.offset}, +{rows.rows} x {rows.width}) of {rows.dtype} lie outside "
                             f"the pool of {self.memory.numel()} bytes")
        view = self.memory[start : start + nbytes].view(dtype).view(rows.rows, rows.width)
        return view.to(device)


def _describe_cuda(memory: torch.Tensor, out: pb.CudaMemory) -> None:
    """A device tensor's CUDA IPC handle, as torch.multiprocessing shares a storage, into `out`."""
    (_, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = memory.untyped_storage()._share_cuda_()
    out.device_uuid = str(torch.cuda.get_device_properties(memory.device).uuid)
    out.handle, out.storage_size, out.storage_offset = handle, storage_size, storage_offset
    out.ref_counter_handle, out.ref_counter_offset = ref_counter_handle, ref_counter_offset
    out.event_handle, out.event_sync_required = event_handle or b"", event_sync_required


def _open_cuda(size: int, cuda: pb.CudaMemory) -> torch.Tensor:
    """The memory a CudaMemory names, mapped on the local device with its UUID -> [size] uint8."""
    if not torch.cuda.is_available():
        raise PoolUnreachable("this process has no GPU to map the pool's device memory on")
    index = next((i for i in range(torch.cuda.device_count())
                  if str(torch.cuda.get_device_properties(i).uuid) == cuda.device_uuid), None)
    if index is None:
        raise PoolUnreachable(f"GPU {cuda.device_uuid} is not one of this process's devices")
    storage = torch.UntypedStorage._new_shared_cuda(
        index, cuda.handle, cuda.storage_size, cuda.storage_offset, cuda.ref_counter_handle, cuda.ref_counter_offset,
        cuda.event_handle or None, cuda.event_sync_required)
    memory = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    return memory.set_(storage, 0, (size,), (1,))


def _remove_stale(folder: str) -> None:
    """Removes the pool files of verifiers that have gone (a process killed before its close): those whose lock no
    process holds (a lock holds across PID namespaces, where a process id would not tell)."""
    for path in glob.glob(os.path.join(folder, f"{SHM_PREFIX}*")):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:  # held: its verifier lives
            pass
        finally:
            os.close(fd)
