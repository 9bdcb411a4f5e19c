"""The clients a server knows: when each was last heard from, and the processes it watches for
them (process_watch.py), so that a client that went silent or whose process exited is forgotten
with its leases, registrations, reservations and reads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from lmcache_mp import protocol as p
from lmcache_mp.processes import own_pid_namespace
from lmcache_mp.server.registry.process_watch import ProcessWatch

if TYPE_CHECKING:
    from lmcache_mp.server.transport.lane import LaneConn


class Clients:
    def __init__(self, on_exit: Callable[[list[bytes], int], None]):
        """on_exit(clients, pid): a watched process exited (called from the watcher's thread)."""
        self._heard: dict[bytes, float] = {}  # client id -> last time heard from
        self._pid_namespace = own_pid_namespace()
        self._processes = ProcessWatch(on_exit)  # clients whose process this server sees

    def touch(self, client_id: bytes) -> None:
        if client_id:
            self._heard[client_id] = time.monotonic()

    def known(self, client_id: bytes) -> bool:
        return client_id in self._heard

    def heard(self, client_id: bytes) -> float:
        """When the client was last heard from (0: never, or forgotten)."""
        return self._heard.get(client_id, 0)

    def silent_since(self, deadline: float) -> list[bytes]:
        return [c for c, seen in list(self._heard.items()) if seen < deadline]

    def __len__(self) -> int:
        return len(self._heard)

    def drop(self, client_id: bytes) -> None:
        """(under the registrations' lock: a registration being opened sees the client or not)"""
        self._heard.pop(client_id, None)

    def unwatch(self, client_id: bytes) -> None:
        self._processes.forget(client_id)

    def watch_hello(self, msg: p.Hello) -> bool:
        """Watch the process a HELLO names, when it is in this server's pid namespace."""
        return (msg.pid > 0 and msg.pid_namespace == self._pid_namespace != 0
                and self._processes.watch(msg.client_id, msg.pid, msg.start_time or None))

    def watch_lane_peer(self, client_id: bytes, conn: LaneConn) -> None:
        """On the local lane the kernel says which process the client is."""
        if client_id and not self._processes.watching(client_id):
            self._processes.watch(client_id, conn.peer[0])

    def close(self) -> None:
        self._processes.close()
