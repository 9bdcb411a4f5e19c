"""Registered KV caches as the server sees them: where their bytes are and how to copy them.

`CPUCacheContext`: a worker's cache in shared memory, copied by the CPU thread pool.
`GPUCacheContext`: a worker's CUDA cache opened over CUDA IPC, copied by the transfer engine
(kernels and copy engines) on the server's own streams.

Both are created from a validated registration request; neither trusts the client: every layer
must fit inside the memory it names before any address is used.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp.head_slices import HeadSlice
from lmcache_mp.layout import LayoutError, LayoutSpec
from lmcache_mp.layout import describe_layers as layout_of_layers
from lmcache_mp.native import cpu_gather, cpu_scatter
from lmcache_mp.server.copies.shared_memory import SharedMapping

logger = logging.getLogger(__name__)

MAX_LAYERS = 4096


class RegistrationError(ValueError):
    """The registration request does not describe a usable KV cache."""


def describe_layers(req: p.RegisterKVCache) -> LayoutSpec:
    """The layout shared by every layer tensor of the request (layout.describe_layers)."""
    if len(req.layers) > MAX_LAYERS:
        raise RegistrationError(f"too many layers ({len(req.layers)} > {MAX_LAYERS})")
    try:
        return layout_of_layers(req.layers, req.layout, req.block_size or None)
    except LayoutError as e:
        raise RegistrationError(str(e)) from None


@dataclass
class Registration:
    """What every context records about its registration (derived values computed once: every
    request reads them)."""

    kv_id: int
    client_id: bytes
    model: str
    world_size: int
    rank: int
    spec: LayoutSpec
    chunk_size: int
    slice: HeadSlice | None = None  # its heads of tp-shared objects (None: objects of its own)

    @functools.cached_property
    def shared(self) -> bool:
        """MLA caches hold the same bytes on every rank: one object serves all of them."""
        spec = self.spec.layer if self.spec.kind == "packed" else self.spec
        return spec.kind == "mla"

    @functools.cached_property
    def object_bytes(self) -> int:
        if self.slice is not None:
            rows = self.chunk_size // self.spec.block_size * self.spec.rows_per_block
            return self.spec.num_segments * self.spec.num_layers * rows * self.slice.pitch
        return self.spec.object_bytes(self.chunk_size)

    @functools.cached_property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.spec.block_size

    @functools.cached_property
    def format_key(self) -> tuple:
        if self.slice is not None:  # every head of each row, whatever the TP size
            s = self.slice
            inner = tuple(d for d in self.spec.block_order if d[0] != 0)  # an opaque head's dims, in memory order
            return ("tp-shared", s.rows, self.spec.num_segments, self.spec.num_layers, s.heads, s.head_bytes,
                    self.spec.dtype, self.spec.block_size if s.rows == "blocks" else 0, inner)
        return self.spec.format_key()

    def native(self, layer_ptrs):
        """The C++ layout at these addresses, with its slice of the object's rows."""
        n = self.spec.native(layer_ptrs)
        if self.slice is not None and self.slice.pitch != self.spec.row_bytes:
            n.object_row_pitch = self.slice.pitch
            n.object_row_offset = self.slice.offset
            n.validate()
        return n


def _check_extent(spec: LayoutSpec, i: int, offset: int, size: int) -> None:
    if offset < 0 or offset + spec.layer_extent > size:
        raise RegistrationError(
            f"layer {i}: the layout spans [{offset}, {offset + spec.layer_extent}) bytes but its "
            f"memory holds {size}"
        )


class EngineCopyContext:
    """A KV cache whose engine moves its chunks itself (transfer="engine", server/copies/engine_copies.py):
    the server knows its layout, never its memory."""

    transfer_mode = "engine"
    mode_reason = "the engine copies in its own CUDA context (transfer='engine')"

    def __init__(self, reg: Registration, req: p.RegisterKVCache):
        self.reg = reg
        self.device = req.device

    def close(self) -> None:
        pass


class CPUCacheContext:
    device = "cpu"
    transfer_mode = "cpu"
    mode_reason = "a CPU cache: the server's copy threads"

    def __init__(self, reg: Registration, req: p.RegisterKVCache):
        self.reg = reg
        self._maps: dict[str, SharedMapping] = {}
        try:
            ptrs = []
            for i in reg.spec.addressed_layers():
                m = req.layers[i].memory
                if m.kind != "shm":
                    raise RegistrationError(f"layer {i}: a CPU cache needs shared memory, got {m.kind!r}")
                mapping = self._maps.get(m.name)
                if mapping is None:
                    mapping = self._maps[m.name] = SharedMapping(m.name, 1)
                _check_extent(reg.spec, i, m.offset, mapping.size)
                ptrs.append(mapping.address + m.offset)
            self.native = reg.native(ptrs)
        except (OSError, ValueError, TypeError, OverflowError) as e:  # TypeError: a value too big for C++
            self.close()
            raise RegistrationError(str(e)) from None

    def copy(self, direction: str, block_ids: np.ndarray, object_ptrs: np.ndarray, capacity: int) -> None:
        fn = cpu_gather if direction == "gather" else cpu_scatter
        fn(self.native, self.reg.chunk_size, block_ids, object_ptrs, capacity)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


class IpcMemoryCache:
    """Opened CUDA IPC allocations, shared by registrations and refcounted: a process may open
    one allocation only once, and several layers or registrations often live in the same one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple[int, bytes], list[int]] = {}  # (device, handle) -> [base, refs]

    def acquire(self, device: int, handle: bytes) -> int:
        from lmcache_mp import native

        with self._lock:
            entry = self._open.get((device, handle))
            if entry is None:
                entry = self._open[(device, handle)] = [native.cuda.open_memory(handle, device), 0]
            entry[1] += 1
            return entry[0]

    def release(self, device: int, handle: bytes) -> None:
        from lmcache_mp import native

        with self._lock:
            entry = self._open.get((device, handle))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[(device, handle)]
                try:
                    native.cuda.close_memory(entry[0], device)
                except RuntimeError as e:  # the exporter may already be gone
                    logger.warning("closing an IPC mapping failed: %s", e)


class IpcEventCache:
    """Opened inter-process events of workers, by handle (opening one is costly)."""

    def __init__(self, limit: int = 4096):
        self._lock = threading.Lock()
        self._events: dict[tuple[int, bytes], int] = {}
        self._limit = limit

    def get(self, device: int, handle: bytes) -> int:
        from lmcache_mp import native

        with self._lock:
            ev = self._events.get((device, handle))
            if ev is None:
                if len(self._events) >= self._limit:  # a worker that never reuses events
                    old_key = next(iter(self._events))
                    native.cuda.destroy_event(self._events.pop(old_key))
                ev = self._events[(device, handle)] = native.cuda.open_event(handle, device)
            return ev

    def close(self) -> None:
        from lmcache_mp import native

        with self._lock:
            for ev in self._events.values():
                native.cuda.destroy_event(ev)
            self._events.clear()


ModePolicy = Callable[[LayoutSpec], tuple[str, str]]


class GPUCacheContext:
    """One registered CUDA KV cache: opened tensors, layout, transfer engine and its streams."""

    device = "cuda"

    def __init__(
        self,
        reg: Registration,
        req: p.RegisterKVCache,
        device_index: int,
        ipc: IpcMemoryCache,
        events: IpcEventCache,
        transfer_mode: str,
        choose_mode: ModePolicy,
        staging_bytes: int,
        direct_ctas: int,
    ):
        from lmcache_mp import native

        self.reg = reg
        self.device_index = device_index
        # The mode of every transfer of this cache, and why (log line, /status)
        self.transfer_mode, self.mode_reason = (
            choose_mode(reg.spec) if transfer_mode == "auto" else (transfer_mode, "--transfer-mode"))
        if transfer_mode == "auto" and reg.slice is not None and reg.slice.pitch != reg.spec.row_bytes:
            self.transfer_mode, self.mode_reason = "staged", (
                f"a slice of tp-shared chunks ({reg.spec.row_bytes} of every {reg.slice.pitch} bytes of a row): "
                "packed on the GPU, one strided copy per chunk")
        self._ipc = ipc
        self._events = events
        self._handles: list[bytes] = []
        try:
            ptrs = []
            for i in reg.spec.addressed_layers():
                m = req.layers[i].memory
                if m.kind != "cuda_ipc":
                    raise RegistrationError(f"layer {i}: a CUDA cache needs a CUDA IPC handle, got {m.kind!r}")
                base = ipc.acquire(device_index, m.handle)
                self._handles.append(m.handle)
                _, alloc_bytes = native.cuda.address_range(base, device_index)
                _check_extent(reg.spec, i, m.offset, alloc_bytes)
                ptrs.append(base + m.offset)
            self.native = reg.native(ptrs)
            self.mover = native.cuda.TransferEngine(
                device_index, self.native, reg.chunk_size, staging_bytes=staging_bytes, direct_ctas=direct_ctas
            )
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:  # TypeError: a value too big for C++
            self.close()
            raise RegistrationError(str(e)) from None

    def submit(self, direction: str, block_ids: np.ndarray, object_ptrs: np.ndarray, capacity: int,
               wait_event: bytes, with_handle: bool = False):
        """The transfer's ticket; with_handle: (ticket, its completion event's IPC handle)."""
        ev = self._events.get(self.device_index, wait_event) if wait_event else 0
        return self.mover.submit(direction, self.transfer_mode, block_ids, object_ptrs, self.reg.chunk_size,
                                  capacity, ev, with_handle)

    def close(self) -> None:
        self.mover = None  # the transfer engine synchronises its streams when destroyed
        for h in self._handles:
            self._ipc.release(self.device_index, h)
        self._handles.clear()
