"""Noticing at once that a client's process died: a pidfd per process, in an epoll set of a thread.

A client that dies without its BYE (SIGKILL, a crash, the OOM killer) keeps its registrations, and
with them the server's mappings of its memory (CUDA IPC: the GPU memory of its KV cache stays
allocated until the server closes them), until its heartbeats have been missing for
--heartbeat-timeout. When the server can see the client's process it watches it instead and
forgets the client as soon as it exits. It can when:

- the client is in the server's pid namespace: its HELLO names its pid, pid namespace and start
  time, and the server checks all three before it opens the pidfd (a pid of another namespace,
  or one reused meanwhile, never is watched);
- or it reaches the local lane (another pid namespace on this machine, sharing the network
  namespace or the socket's folder): the kernel gives the lane the connecting process's pid as
  the server's namespace numbers it.

Elsewhere (another machine, or a namespace the server sees neither way) the heartbeat bound stays.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Callable

from lmcache_mp.processes import process_start

logger = logging.getLogger(__name__)


class ProcessWatch:
    """Calls on_exit(client ids, pid) on its own thread when a watched process exits."""

    def __init__(self, on_exit: Callable[[list[bytes], int], None]):
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._by_pid: dict[int, tuple[int, set[bytes]]] = {}  # pid -> (pidfd, its clients)
        self._by_fd: dict[int, int] = {}  # pidfd -> pid
        self._clients: dict[bytes, int] = {}  # client id -> pid
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-process-watch", daemon=True)
        self._thread.start()

    def watching(self, client: bytes) -> bool:
        return client in self._clients

    def watch(self, client: bytes, pid: int, start: int | None = None) -> bool:
        """Watch the process pid for this client (start: its start time, when the client said it;
        a process of another start time is not the client's). False when it cannot be watched."""
        if pid <= 0 or client in self._clients:
            return client in self._clients
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or no pidfds here (Linux < 5.3)
            return False
        seen = process_start(pid)  # checked after the pidfd is open: it names the process checked
        if seen is None or (start is not None and seen != start):
            os.close(fd)
            return False
        with self._lock:
            if self._stop:
                os.close(fd)
                return False
            had = self._by_pid.get(pid)
            if had is not None:  # another client of the same process: one pidfd
                os.close(fd)
                had[1].add(client)
            else:
                self._by_pid[pid] = (fd, {client})
                self._by_fd[fd] = pid
                self._epoll.register(fd, select.EPOLLIN)
            self._clients[client] = pid
        return True

    def forget(self, client: bytes) -> None:
        """The client left (BYE, or forgotten): its process is no longer watched for it."""
        with self._lock:
            pid = self._clients.pop(client, None)
            if pid is None:
                return
            fd, clients = self._by_pid[pid]
            clients.discard(client)
            if not clients:
                self._drop(pid)

    def _drop(self, pid: int) -> list[bytes]:
        """(lock held) Stop watching pid; its clients."""
        fd, clients = self._by_pid.pop(pid)
        del self._by_fd[fd]
        self._epoll.unregister(fd)
        os.close(fd)
        for client in clients:
            self._clients.pop(client, None)
        return list(clients)

    def _run(self) -> None:
        while True:
            events = self._epoll.poll()
            exited = []
            with self._lock:
                if self._stop:
                    break
                for fd, _ in events:
                    pid = self._by_fd.get(fd)
                    if pid is not None:
                        exited.append((pid, self._drop(pid)))
            for pid, clients in exited:
                try:
                    self._on_exit(clients, pid)
                except Exception:
                    logger.exception("error forgetting the clients of process %d", pid)
        with self._lock:
            for fd in list(self._by_fd):
                os.close(fd)
            self._by_fd.clear()
            self._by_pid.clear()
            self._clients.clear()
            self._epoll.close()
            os.close(self._wake)

    def close(self) -> None:
        with self._lock:
            if self._stop:
                return
            self._stop = True
            os.eventfd_write(self._wake, 1)
        self._thread.join(5)
