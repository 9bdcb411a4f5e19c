"""Noticing a server that went away or restarted, and coming back from it: a part of Client.

A heartbeat that gets no reply (while nothing else was heard from the server either), or nobody
listening at the server's address when something (its local lane closing) made the client look,
means the server is away: until it is back, requests fail at once with ServerUnavailable instead
of each waiting for its timeout, and so do those waiting to be sent; requests in flight keep
theirs (a store or retrieve may still be copying) unless nothing listens at the server's address
any more (its process is gone: no reply will come). A heartbeat reply then (or a new session id, or an unknown registration) makes a
thread of its own handshake again, fail what was in flight to a restarted server and register
again every KV cache the server no longer knows; only then do requests go out again, so the
first one finds its KV caches registered.

A server that refuses the client's credential (a reload removed it from the tenants file: the
refusal of a request, or of a reconnection's handshake, says so) did not go away: the client says
so once, in one WARNING line, and from then on every request fails at once with
CredentialRevoked; nothing is recovered (only a client made again, with an accepted key, gets in)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from lmcache_mp import protocol as p
from lmcache_mp.client.endpoint import nothing_listens
from lmcache_mp.client.futures import Heartbeat
from lmcache_mp.client.results import check_reply, is_revoked
from lmcache_mp.errors import CREDENTIAL_REVOKED, CredentialRevoked, ServerUnavailable

logger = logging.getLogger(__name__)

RECOVERY_CALL_S = 2.0  # longest one call of a recovery after a suspected restart may take
# After a connection dropped, how long the listening socket of a server whose process died may
# still take to go (its process is being torn down): looked at every DROP_POLL_S meanwhile.
DROP_GRACE_S = 0.5
DROP_POLL_S = 0.01
RECOVERY_STOP_S = 1.0  # how long closing waits for a recovery to end (it ends once the I/O thread stops)


class RestartRecovery:
    """Expects Client's url, name, timeout, client_id, session_id, chunk_size, server_info, _io,
    _lock, _handles, _closed, _away, _revoked, _restarting, _hello_msg, _connect_lane and _register."""

    @property
    def server_away(self) -> str:
        """Why the server is taken to be away ('' while it answers): requests then fail at once
        with ServerUnavailable. Its heartbeat notices when the server is back, within a second."""
        return self._away

    def _away_message(self, why: str) -> str:
        return f"the server at {self.url} is away ({why}); requests fail at once until it is back"

    def _away_error(self, why: str) -> ServerUnavailable | CredentialRevoked:
        if self._revoked:
            return CredentialRevoked(self._revoked)
        return ServerUnavailable(self._away_message(why))

    def _check_reachable(self) -> None:
        away = self._away
        if away:
            raise self._away_error(away)

    def _heartbeat_msg(self) -> Heartbeat | None:
        if self._revoked:  # (refused for good: nothing to watch)
            return None
        sent = time.monotonic()

        def convert(reply: Any) -> None:
            if isinstance(reply, p.PingReply) and (reply.session_id != self.session_id or self._away):
                self._suspect_restart()
            elif is_revoked(reply):
                self._credential_revoked(reply.message)

        def failed(error: BaseException) -> None:
            if self._io is not None and self._io.last_heard > sent:
                return  # the server answered something else meanwhile: only this beat was slow
            self._went_away(f"no reply to its heartbeat: {error}")
            self._suspect_restart()  # (which also finds out whether its process is gone)

        return Heartbeat(p.Ping(client_id=self.client_id), convert, failed)

    def _went_away(self, why: str, gone: bool = False) -> None:
        """gone: nothing listens at its address any more: its process is gone, and no request it
        took will be answered (those fail now; otherwise they keep their timeouts: a store or
        retrieve may still be copying). Requests not sent yet fail now either way."""
        with self._lock:
            if self._closed or self._revoked or (self._away and not gone):
                return
            was, self._away = self._away, self._away or why
            self._gone = self._gone or gone
        if self._io is not None:
            self._io.set_away(self._away_message(self._away), in_flight=gone)
        if not was:  # (debug: the caller hears of it from its requests, and says what it means for it)
            logger.debug("lmcache-mp client %s: server %s is away (%s); requests fail at once until it is back",
                         self.name, self.url, why)

    def _credential_revoked(self, why: str) -> None:
        """The server refuses this client's credential (why: its refusal's message, or the
        handshake's): every request fails at once with CredentialRevoked from now on."""
        why = why.removeprefix(CREDENTIAL_REVOKED + ": ")
        message = (f"{CREDENTIAL_REVOKED}: the server at {self.url} no longer accepts this client's credential "
                   f"({why}); every request is refused until the client is made again with an accepted key")
        with self._lock:
            if self._closed or self._revoked:
                return
            self._revoked = self._away = message
        if self._io is not None:  # (what is in flight too: the server closes the connection)
            self._io.set_away(message, in_flight=True, error=CredentialRevoked)
        logger.warning("lmcache-mp client %s: %s", self.name, message)

    def _refused_handshake(self, status: int) -> None:
        """A reconnection's handshake was refused (libzmq does not try again)."""
        if status == 400:  # (ZAP: the credential is refused; 300, 500: the server's own trouble)
            self._credential_revoked(f"it refused this client's handshake, ZAP status {status}")

    def _came_back(self) -> None:
        with self._lock:
            if self._revoked:
                return
            was, self._away, self._gone = self._away, "", False
        if self._io is not None:
            self._io.set_away("")
        if was:
            logger.debug("lmcache-mp client %s: server %s is back", self.name, self.url)

    def _suspect_restart(self, dropped: bool = False) -> None:
        """dropped: a connection to the server closed (the lane's, or ZeroMQ's)."""
        if self._closed or self._revoked or not self._restarting.acquire(blocking=False):
            return
        threading.Thread(target=self._recover, args=(dropped,), name="lmcache-client-recover", daemon=True).start()

    def _nothing_listens(self, dropped: bool) -> bool:
        """Whether nothing listens at the server's address. Its process may still be dying when
        the connection drops (the fds close one after another): then it is asked a while longer."""
        deadline = time.monotonic() + (DROP_GRACE_S if dropped else 0.0)
        while True:
            if nothing_listens(self.url):
                return True
            if time.monotonic() >= deadline or self._closed:
                return False
            time.sleep(DROP_POLL_S)

    def _recover(self, dropped: bool = False) -> None:
        """Runs off the I/O thread: handshake again and register every KV cache the server no
        longer knows: all of them after a restart, or those it dropped when it stopped hearing
        from this client."""
        short = min(self.timeout, RECOVERY_CALL_S)
        if self._revoked:  # (found out since this recovery was asked for)
            self._restarting.release()
            return
        if self._nothing_listens(dropped):  # (its process is gone: a dropped connection is the first sign)
            self._went_away("nothing listens at its address", gone=True)
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
                    self._io.fail_all("the server restarted; the request was lost")
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
                except (ServerUnavailable, CredentialRevoked):
                    raise
                except Exception as e:
                    if self._closed:
                        return
                    logger.error("re-registering %r failed: %s", h, e)
            self._came_back()
        except CredentialRevoked as e:  # (not a restart: the server refuses this client)
            self._credential_revoked(e.message)
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
        fut = self._io.request(msg, timeout, lambda r: check_reply(r, expected), while_away=True)
        return Future.result(fut, timeout + 1.0)  # the plain wait: this thread does not read the socket
