"""The ZAP handler of a server with tenants: which connections get past the handshake, and as whom.

ZeroMQ asks the context's ZAP endpoint about every new connection of a socket with a ZAP domain
(CURVE: with the client's public key; NULL on ipc://: with the peer's "uid:gid:pid" that libzmq
reads from the kernel). A credential of a tenant gets in, and the reply's user id (the credential)
comes with every message of that connection (`zmq.Frame.get("User-Id")`), so the transport
names the tenant of each request from what the handshake proved, never from what the client says.
Any other is refused at the handshake, logged (rate-limited) and audited.
"""

from __future__ import annotations

import logging
import threading

import zmq

from lmcache_mp.server.transport.refusals import RefusalLog
from lmcache_mp.server.tenancy.tenancy import Tenancy
from lmcache_mp.server.tenancy.tenants_file import credential_fingerprint

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"lmcache-mp"


class TenantGate:
    """Serves ZAP on `context` (one per context: give the server's socket a context of its own)."""

    def __init__(self, context: zmq.Context, tenancy: Tenancy, refusals: RefusalLog | None = None):
        self.tenancy = tenancy
        self.refusals = refusals or RefusalLog()
        self._sock = context.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-zap", daemon=True)
        self._thread.start()

    @staticmethod
    def apply(sock: zmq.Socket) -> None:
        """Before the bind: ZAP for every connection, NULL ones too (ipc://)."""
        sock.zap_domain = DOMAIN

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                request = self._sock.recv_multipart()
                try:
                    status, text, user = self.decide(request)
                except Exception:  # a malformed request from the library itself: refuse it, keep serving
                    logger.exception("error deciding a ZAP request")
                    status, text, user = b"500", b"internal error", b""
                request_id = request[1] if len(request) > 1 else b""
                self._sock.send_multipart([b"1.0", request_id, status, text, user, b""])
        except zmq.ZMQError:
            return
        finally:
            self._sock.close(0)

    def decide(self, request: list[bytes]) -> tuple[bytes, bytes, bytes]:
        """(status, text, user id) of a ZAP request: [version, id, domain, address, identity,
        mechanism, *credentials]."""
        mechanism, address, creds = request[5], request[3].decode("ascii", "replace"), request[6:]
        if mechanism == b"CURVE" and len(creds) == 1:
            from zmq.utils import z85

            cred = self.tenancy.curve_credential(z85.encode(creds[0]))
            transport, peer = "zmq", address
        elif mechanism == b"NULL" and address.count(":") >= 3:
            _, uid, gid, pid = address.rsplit(":", 3)
            cred = self.tenancy.peer_credential(int(uid), int(gid))
            transport, peer = "zmq", f"pid {pid} uid {uid} gid {gid}"
        else:
            self.refusals.refused("credential", f"a {mechanism.decode(errors='replace')} connection from {address} "
                                  "carries no credential a tenant can have (CURVE, or a local ipc:// peer)")
            self.tenancy.audit.refused(address, transport="zmq", peer=address,
                                       reason="no credential (tenants need CURVE or ipc://)")
            return b"400", b"no credential", b""
        state = self.tenancy.state_of(cred)
        fp = credential_fingerprint(cred)
        if state is None:
            self.refusals.refused("tenant", f"its credential {fp} ({peer}) is in no tenant of {self.tenancy.path}")
            self.tenancy.audit.refused(fp, transport=transport, fingerprint=fp, peer=peer,
                                       reason="credential in no tenant")
            return b"400", b"credential in no tenant", b""
        self.tenancy.audit.write("connection_accepted", tenant=state.name, fingerprint=fp, transport=transport,
                                 peer=peer)
        return b"200", b"OK", cred.encode()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
