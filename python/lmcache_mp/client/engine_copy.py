"""The engine's own copies (register_kv_cache(..., transfer="engine")): this process maps the
server's L1 and moves its KV chunks between its cache and L1 itself.

Why: without MPS a GPU runs the kernels of one CUDA context at a time. Packing kernels launched
by the server (another process, another context) wait for the engine's time slice and then take
the whole GPU, so a busy engine lost 13-21% of its compute while the server stored. Here the
same kernels (the transfer engine's staged path: a kernel packs each chunk into a small device
ring, a copy engine moves it to host memory) run in the engine's own context, on streams of low
priority ordered after the engine's work, as any work of the engine itself would.

`MappedArena` maps L1 (its file descriptor, from a MAP_ARENA request on a local-lane connection
of its own) and page-locks it for this process's copies a slab at a time, the first time a
request needs the slab (that stalls every CUDA call of the process meanwhile: see use_device). `EngineCopier` moves one
registered cache's chunks: on the GPU with a TransferEngine of its own, on the CPU with the CPU
copy threads (CPU caches: tests and CPU engines that ask for it).
"""

from __future__ import annotations

import array
import logging
import mmap
import os
import socket
import threading
from typing import Callable

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp.client.lane import claim_lane, socket_address
from lmcache_mp.completions import CompletionWaiter
from lmcache_mp.errors import RequestError, ServerUnavailable

logger = logging.getLogger(__name__)

CLIENT_RING_CHUNKS = 4  # chunks per direction in the GPU staging ring (capped below)
CLIENT_RING_MAX_BYTES = 256 << 20
COMPLETION_SPIN_US = 1000


def request_arena(lane_address: str, client_id: bytes, timeout: float,
                  ticket: bytes = b"") -> tuple[int, p.MapArenaReply]:
    """(file descriptor, reply) of a MAP_ARENA, on a lane connection of its own (the reply
    carries the descriptor; the client's own lane connection stays as it is). On a server with
    tenants the descriptor is of the tenant's window (server/tenancy/windows.py), not of L1."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_address(lane_address))
        claim_lane(sock, ticket)
        sock.send(p.pack_lane(1, p.encode(p.MapArena(client_id=client_id))))
        data, anc, _flags, _ = sock.recvmsg(p.LANE_MAX_BYTES, socket.CMSG_SPACE(array.array("i").itemsize))
    except OSError as e:
        raise ServerUnavailable(f"cannot map the server's L1 over its local lane {lane_address}: {e}") from None
    finally:
        sock.close()
    fds = [fd for level, kind, raw in anc if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for fd in array.array("i", raw[: len(raw) - len(raw) % 4])]
    try:
        _, body, _ = p.unpack_lane_reply(data)
        reply = p.decode_reply(body)
        if isinstance(reply, p.Error):
            raise RequestError(reply.code, reply.message)
        if not isinstance(reply, p.MapArenaReply) or len(fds) != 1:
            raise RequestError(int(p.ErrorCode.INTERNAL), "MAP_ARENA: no arena descriptor in the reply")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], reply


class MappedArena:
    """The server's L1 in this process: mapped, and page-locked for CUDA copies slab by slab."""

    def __init__(self, lane_address: str, client_id: bytes, timeout: float = 10.0, ticket: bytes = b""):
        fd, info = request_arena(lane_address, client_id, timeout, ticket)
        try:
            self._map = mmap.mmap(fd, info.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._view.ctypes.data
        self.capacity = info.capacity
        self.slab_bytes = info.slab_bytes
        self.session_id = info.session_id
        self._lock = threading.Lock()
        self._pinned: set[int] = set()  # slabs page-locked here
        self._device = -1  # CUDA device whose context locks the pages (-1: none needed)
        self.closed = False

    def use_device(self, device: int) -> None:
        """Copies of this process will be CUDA copies on this device: slabs get page-locked here,
        each the first time a request needs it (ensure_pinned). Never in the background: while
        cudaHostRegister runs, every other CUDA call of the process waits (0.17 s for a slab of
        256 MiB on an H200 host, bench/bench_host_register.py), and during a graph capture it
        fails and breaks the capture."""
        with self._lock:
            if self._device < 0:
                self._device = device

    def pin_all(self) -> None:
        """Page-lock every slab now (before timing a benchmark, or at start-up)."""
        if self._device >= 0:
            self.ensure_pinned(np.arange(0, self.capacity, self.slab_bytes, dtype=np.uint64))

    def _pin(self, slab: int) -> None:
        from lmcache_mp import native

        with self._lock:
            if slab in self._pinned or self.closed:
                return
            native.cuda.host_register(self.base + slab * self.slab_bytes, self.slab_bytes, self._device)
            self._pinned.add(slab)

    def ensure_pinned(self, offsets: np.ndarray) -> None:
        """Lock the slabs these objects lie in, where not done yet (objects never straddle two
        slabs)."""
        if self._device < 0:
            return
        for slab in set((offsets // self.slab_bytes).tolist()) - self._pinned:
            try:
                self._pin(int(slab))
            except RuntimeError as e:  # the copy still works, through bounce buffers
                logger.debug("page-locking slab %d failed: %s", slab, e)

    def pointers(self, offsets: np.ndarray, object_bytes: int) -> np.ndarray:
        if len(offsets) and int(offsets.max()) + object_bytes > self.capacity:
            raise RequestError(int(p.ErrorCode.INTERNAL), "the server named an object outside its L1")
        return (offsets + np.uint64(self.base)).astype(np.uint64)

    def close(self) -> None:
        """Unlock and unmap (every copy into it must have ended)."""
        from lmcache_mp.native import cuda_built

        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._pinned and cuda_built():
                from lmcache_mp import native

                for slab in self._pinned:
                    native.cuda.host_unregister(self.base + slab * self.slab_bytes, self._device)
            self._pinned.clear()
        del self._view
        self._map.close()


class EngineCopier:
    """Moves one registered cache's chunks between its tensors and the mapped L1, in this process.

    CPU caches: a copy runs on the calling thread (the CPU copy threads). CUDA caches: a
    TransferEngine of this process (staged: pack kernels on streams of low priority, copy
    engines for the bytes), ordered after the caller's stream; `done(error)` is called from a
    completion thread of this copier once the bytes have landed."""

    def __init__(self, layout_spec, tensors: list, chunk_size: int, device_index: int, object_bytes: int,
                 staging_bytes: int | None = None, pack_ctas: int = 0):
        self.chunk_size = chunk_size
        self.device_index = device_index
        self.object_bytes = object_bytes
        self.cuda = device_index >= 0
        self.native = layout_spec.native([tensors[i].data_ptr() for i in layout_spec.addressed_layers()])
        self.mover = None
        self._waiters: dict[str, CompletionWaiter] = {}
        if not self.cuda:
            return
        from lmcache_mp import native

        if staging_bytes is None:
            staging_bytes = max(2 * object_bytes, min(CLIENT_RING_CHUNKS * object_bytes, CLIENT_RING_MAX_BYTES))
        # Tuning knobs, for measuring (docs/PERFORMANCE.md): the copy streams' priority and the
        # packing kernels' CTAs.
        high = os.environ.get("LMCACHE_MP_COPY_PRIORITY", "low") == "high"
        pack_ctas = pack_ctas or int(os.environ.get("LMCACHE_MP_PACK_CTAS", "0"))
        self.mover = native.cuda.TransferEngine(device_index, self.native, chunk_size, staging_bytes=staging_bytes,
                                             pack_ctas=pack_ctas, high_priority=high)
        for direction in ("gather", "scatter"):
            self._waiters[direction] = CompletionWaiter(f"lmcache-client-{direction}", lambda: self.mover, direction,
                                                        COMPLETION_SPIN_US)

    def copy(self, direction: str, block_ids: np.ndarray, object_ptrs: np.ndarray, done: Callable,
             wait_event: int = 0, then_stream: int = 0) -> Callable[[], bool] | None:
        """Copy (gather: cache -> L1; scatter: L1 -> cache); done(error or None) once landed. On
        the GPU, returns a function that waits for the copy on the calling thread and runs done
        there (False if the completion thread had it first); None once done (the CPU's copies)."""
        if not self.cuda:
            from lmcache_mp.native import cpu_gather, cpu_scatter

            fn = cpu_gather if direction == "gather" else cpu_scatter
            try:
                fn(self.native, self.chunk_size, block_ids, object_ptrs, self.object_bytes)
            except BaseException as e:  # noqa: BLE001 - handed to the request
                done(e)
                return None
            done(None)
            return None
        if self.mover is None:
            raise ServerUnavailable("this KV cache's copier was closed (the client closed, or the server restarted)")
        ticket = self.mover.submit(direction, "staged", block_ids, object_ptrs, self.chunk_size, self.object_bytes,
                                    wait_event, False, then_stream)
        waiter = self._waiters[direction]
        waiter.add(ticket, lambda error, _stamps: done(error))
        return lambda: waiter.wait_here(ticket)

    def close(self) -> None:
        """Wait for every copy submitted so far (their callbacks run), then free the engine."""
        for waiter in self._waiters.values():
            waiter.stop()
        self._waiters.clear()
        self.mover = None
