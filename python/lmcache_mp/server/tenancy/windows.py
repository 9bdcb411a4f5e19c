"""Engine-side copies on a server with tenants: a tenant's processes map a window of their own, never L1.

A process that maps L1 can read and write every chunk in it, whoever stored it. With tenants,
MAP_ARENA hands out the tenant's *window* instead: shared memory of its own (a HostArena of
`engine_window` bytes from the tenants file, made on first use, page-locked by the engine's
process as L1 would be), holding only the chunks of that tenant's RESERVEs and READs in flight.
The server copies between the window and L1 on its CPU copy threads: a store's bytes when its
COMMIT says they landed, a read's before its reply (its L1 objects are let go at once). Window
slots go back when the COMMIT or READ_DONE comes, or with the client; only the same tenant's
requests ever reuse them, so a window never holds another tenant's bytes.

The price: one host copy per chunk (the engine's own copy, between its KV cache and the window,
is unchanged), and a RESERVE or READ takes at most what the window has free (the rest is skipped,
as a store without room in L1, or a shorter read).
"""

from __future__ import annotations

import threading

from lmcache_mp import native
from lmcache_mp.native import HostArena


class Slots:
    """A request's slots in a window: one per chunk, in order."""

    __slots__ = ("window", "offsets")

    def __init__(self, window: "Window", offsets: list[int]):
        self.window, self.offsets = window, offsets

    def release(self) -> int:
        self.window.give_back(self.offsets)
        n, self.offsets = len(self.offsets), []
        return n


class Window:
    def __init__(self, capacity: int, slab_bytes: int):
        # A window is the size the tenants file gives it: an arena wants at least four slabs, so a
        # window smaller than four of the server's slabs (128 MiB each on a GPU) gets smaller ones.
        slab = max(4096, min(slab_bytes, capacity // 4 // 4096 * 4096))
        # (not faulted in ahead: a window's pages come when its copies first use them)
        self.arena = HostArena(max(capacity // slab, 4) * slab, slab, False, -1, "", prefault=False)
        self._lock = threading.Lock()

    def take(self, object_bytes: int, n: int) -> Slots:
        """Up to n slots for objects of this size (fewer when the window is full)."""
        with self._lock:
            cls = self.arena.size_class(object_bytes)
            got = []
            for _ in range(n):
                off = self.arena.allocate(cls)
                if off < 0:
                    break
                got.append(off)
        return Slots(self, got)

    def give_back(self, offsets: list[int]) -> None:
        with self._lock:
            for off in offsets:
                self.arena.free(off)

    def copy_in(self, slots: Slots, l1_base: int, l1_offsets: list[int], nbytes: int) -> None:
        """L1 objects -> the window (a read)."""
        for w, o in zip(slots.offsets, l1_offsets):
            native.parallel_memcpy(self.arena.base + w, l1_base + o, nbytes)

    def copy_out(self, slots: Slots, l1_base: int, l1_offsets: list[int], nbytes: int) -> None:
        """The window -> L1 objects (a store's commit)."""
        for w, o in zip(slots.offsets, l1_offsets):
            native.parallel_memcpy(l1_base + o, self.arena.base + w, nbytes)

    def stats(self) -> dict:
        st = self.arena.stats()
        return {"capacity": self.arena.capacity, "bytes_used": st["bytes_allocated"]}


class TenantWindows:
    """The window of each tenant, made when its first process asks to map one."""

    def __init__(self, slab_bytes: int):
        self._slab = slab_bytes
        self._windows: dict[str, Window] = {}
        self._lock = threading.Lock()

    def of(self, tenant) -> Window:
        """The window of a tenant (tenancy.py's TenantState): engine_window bytes."""
        with self._lock:
            w = self._windows.get(tenant.name)
            if w is None:
                w = self._windows[tenant.name] = Window(tenant.tenant.engine_window, self._slab)
            return w

    def size_of(self, name: str) -> int:
        """The size of a tenant's window (0: none made yet). A made window never changes size:
        its processes have it mapped, and the offsets they are given are into it."""
        with self._lock:
            w = self._windows.get(name)
            return w.arena.capacity if w is not None else 0

    def stats(self) -> dict[str, dict]:
        with self._lock:
            return {name: w.stats() for name, w in self._windows.items()}

    def close(self) -> None:
        with self._lock:
            for w in self._windows.values():
                w.arena.release_memory()
            self._windows.clear()
