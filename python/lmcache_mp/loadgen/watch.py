"""Whether the server a bench runs against still answers, so that a run whose server died ends
within seconds instead of waiting out its workers' request timeouts (minutes, by default).

A socket of its own pings the server about once a second and watches the connection's events:
the server counts as gone once its connection closed and was not made again within CLOSED_S (it
died), or once it has not answered a ping for SILENT_S (it hangs). Polled by the bench's
collecting loop; no thread.
"""

from __future__ import annotations

import itertools
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache_mp import protocol as p
from lmcache_mp.client.curve import apply_curve

PING_EVERY_S = 1.0
CLOSED_S = 2.0  # a connection made again within this long (a brief hiccup) is no server gone
SILENT_S = 30.0  # generous: a busy server on a loaded machine still answers a ping well within it


class ServerWatch:
    def __init__(self, url: str):
        self.url = url
        self._ctx = zmq.Context()
        apply_curve(self._ctx, None, None)  # the keys the bench's own clients take (from the environment)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(url)
        self._ids = itertools.count(1)
        now = time.monotonic()
        self._answered = now  # the last reply (the bench's handshake has just been answered)
        self._sent = 0.0
        self._closed_at: float | None = None

    def gone(self) -> str | None:
        """Why the server counts as gone (a clause for a message), or None while it answers."""
        now = time.monotonic()
        while self._monitor.poll(0):  # in order: the last word on the connection counts
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._closed_at = self._closed_at or now
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._closed_at = None
        while self._sock.poll(0):
            self._sock.recv_multipart()  # any reply (a ping's, or an older ping's): it answers
            self._answered = now
        if now - self._sent >= PING_EVERY_S:
            self._sent = now
            try:
                self._sock.send_multipart((p.pack_request_id(next(self._ids)), p.encode(p.Ping())), zmq.NOBLOCK)
            except zmq.Again:  # not connected now: the events and the silence tell
                pass
        if self._closed_at is not None and now - self._closed_at >= CLOSED_S:
            return f"its connection closed {now - self._closed_at:.0f} s ago and was not made again: it stopped"
        if now - self._answered >= SILENT_S:
            return f"it has not answered a ping for {now - self._answered:.0f} s"
        return None

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
