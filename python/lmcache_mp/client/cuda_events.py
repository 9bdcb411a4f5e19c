"""The client's CUDA events: the ones it records for the server to wait on, and the server's
completion events it opens. Torch is imported only when a CUDA stream is needed."""

from __future__ import annotations

import threading


class EventPool:
    """Inter-process CUDA events this client records for the server to wait on, reused once the
    server has answered (by then it has queued its wait)."""

    def __init__(self, device: int):
        self.device = device
        self._free: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()

    def record(self, stream: int) -> tuple[tuple[int, bytes] | None, bytes]:
        """(event, its handle) recorded on the stream; (None, b"") when the stream has no work
        pending: there is nothing to wait for, and recording is GPU work of this process, after
        which the server's first kernel waits for the GPU to switch contexts (~170 us on an H200,
        see bench/bench_cross_process.py)."""
        from lmcache_mp import native

        if native.cuda.stream_query(stream):
            return None, b""
        with self._lock:
            ev = self._free.pop() if self._free else None
        if ev is None:
            e = native.cuda.create_event(self.device, interprocess=True, blocking=False)
            ev = (e, native.cuda.event_ipc_handle(e))
        native.cuda.record_event(ev[0], stream)
        return ev, ev[1]

    def give_back(self, ev: tuple[int, bytes]) -> None:
        with self._lock:
            self._free.append(ev)


class OpenedEvents:
    """Completion events of the server, opened once each (opening is costly)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: dict[tuple[int, bytes], int] = {}

    def get(self, device: int, handle: bytes) -> int:
        from lmcache_mp import native

        with self._lock:
            ev = self._events.get((device, handle))
            if ev is None:
                ev = self._events[(device, handle)] = native.cuda.open_event(handle, device)
            return ev


def current_stream(device: int) -> int:
    """The device's current stream as a cudaStream_t (torch's raw getter when it has one: a
    stream object costs microseconds on every store and retrieve)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream
