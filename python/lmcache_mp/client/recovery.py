"""Noticing a restarted server and coming back from it: a part of Client. A heartbeat (or a lane
that closed, or an unknown registration) makes a thread of its own handshake again, fail what
was in flight to the old server and register again every KV cache the server no longer knows."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from lmcache_mp import protocol as p
from lmcache_mp.client.results import check_reply
from lmcache_mp.errors import ServerUnavailable

logger = logging.getLogger(__name__)

RECOVERY_CALL_S = 2.0  # longest one call of a recovery after a suspected restart may take
RECOVERY_STOP_S = 1.0  # how long closing waits for a recovery to end (it ends once the I/O thread stops)


class RestartRecovery:
    """Expects Client's url, timeout, client_id, session_id, chunk_size, server_info, _io, _lock, _handles,
    _closed, _restarting, _hello_msg, _connect_lane and _register."""

    def _heartbeat_msg(self):
        def convert(reply: Any) -> None:
            if isinstance(reply, p.PingReply) and reply.session_id != self.session_id:
                self._suspect_restart()

        return p.Ping(client_id=self.client_id), convert

    def _suspect_restart(self) -> None:
        if self._closed or not self._restarting.acquire(blocking=False):
            return
        threading.Thread(target=self._recover, name="lmcache-client-recover", daemon=True).start()

    def _recover(self) -> None:
        """Runs off the I/O thread: handshake again and register every KV cache the server no
        longer knows: all of them after a restart, or those it dropped when it stopped hearing
        from this client."""
        short = min(self.timeout, RECOVERY_CALL_S)
        try:
            # A look at _closed between calls; a call in flight fails once the I/O thread stops.
            hello = self._recovery_call(self._hello_msg(), p.HelloReply, short)
            if self._closed:
                return
            if hello.session_id != self.session_id:
                if self._handles:
                    logger.warning("lmcache-mp server at %s restarted: registering %d KV caches again",
                                   self.url, len(self._handles))
                else:
                    logger.warning("lmcache-mp server at %s restarted", self.url)
                if self._io is not None:
                    self._io.fail_all(ServerUnavailable("the server restarted; the request was lost"))
                self.session_id = hello.session_id
                self.chunk_size = hello.chunk_size
                # the new server's lane (engine-side copies map its L1 through it) and capabilities
                self.server_info = {f: getattr(hello, f) for f in hello.__struct_fields__}
                if self._io is not None and not self._io.has_lane:  # the same server closing it: stay off
                    self._connect_lane(hello.lane)
            status = self._recovery_call(p.Status(client_id=self.client_id), p.StatusReply, short).status
            known = set(status.get("mine", ()))
            with self._lock:
                lost = [h for h in self._handles if h.kv_id not in known]
            for h in lost:
                if self._closed:
                    return
                try:
                    self._register(h, self._recovery_call)
                except Exception as e:
                    if self._closed:
                        return
                    logger.error("re-registering %r failed: %s", h, e)
        except ServerUnavailable:
            pass  # still down (or closing); the next heartbeat tries again
        except Exception:
            logger.exception("recovering from a server restart failed")
        finally:
            self._restarting.release()

    def _recovery_call(self, msg: p._Msg, expected: type, timeout: float) -> Any:
        """A call of the recovery: sent by the I/O thread's socket and read by that thread, so the
        recovery owns no socket that closing the client could pull from under it (that aborts
        libzmq), and stopping the I/O thread fails the call at once."""
        fut = self._io.request(msg, timeout, lambda r: check_reply(r, expected))
        return Future.result(fut, timeout + 1.0)  # the plain wait: this thread does not read the socket
