"""ZeroMQ CURVE for the server: encrypted, authenticated connections (pyzmq's zmq.auth).

`lmcache-mp-server keygen DIR` makes DIR/server.key (public: give it to the clients),
DIR/server.key_secret (the server's: --curve-secret-key), and one client key pair:
DIR/clients/client.key (public) and DIR/client-secret/client.key_secret; `keygen DIR --client
NAME` adds another client's pair (DIR/clients/NAME.key, DIR/client-secret/NAME.key_secret). With
--curve-clients DIR/clients, only clients whose public key file is in that folder (read at start)
get past the handshake; without it, any client that knows the server's public key does. A client
without the right keys gets no handshake, so no request of its ever reaches the engine; the
server logs the refusals (a WARNING, at most one a minute of each kind, with the count of the
others): keys not let in (by their fingerprint), and handshakes that failed (a wrong server key,
or a client without CURVE).
"""

from __future__ import annotations

import logging
import os
import threading

import zmq
import zmq.auth

from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.transport.refusals import RefusalLog, fingerprint  # noqa: F401 (fingerprint: re-exported)

logger = logging.getLogger(__name__)


class CurveServer:
    """Applies the server's keys to the ROUTER socket and runs the authenticator (ZAP) thread, in
    a ZeroMQ context of its own (`context`, for the server's socket too): a context has one ZAP
    endpoint, so two servers in one process each need theirs."""

    def __init__(self, secret_key_file: str, clients_dir: str = "", tenancy: Tenancy | NoTenancy = NoTenancy(),
                 audit=None):
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(secret_key_file)
        if secret is None:
            raise ValueError(f"{secret_key_file} holds no secret key (the server needs server.key_secret)")
        if clients_dir and not os.path.isdir(clients_dir):
            raise ValueError(f"curve_clients: {clients_dir} is not a folder of client public keys")
        self.public, self._secret = public, secret
        self.refusals = RefusalLog()
        self._audit = audit  # (--audit-log: refused handshakes and keys go there too, rate-limited)
        self._clients_dir = clients_dir
        self.context = zmq.Context()
        self._auth = self._gate = None
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()
        if tenancy.enabled:  # the tenants file says which keys get in, and as whom
            from lmcache_mp.server.tenancy.gate import TenantGate

            self._gate = TenantGate(self.context, tenancy, self.refusals)
            logger.info("CURVE: server key %s, clients with a key of a tenant in %s", public.decode(), tenancy.path)
            return
        self._auth = ThreadAuthenticator(self.context, log=logging.getLogger("lmcache_mp.auth"))
        self._auth.start()
        if clients_dir:
            self._allowed = set(zmq.auth.load_certificates(clients_dir))  # z85 public keys
            self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        else:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        logger.info("CURVE: server key %s, clients %s", public.decode(),
                    f"with a key in {clients_dir} ({len(self._allowed)})" if clients_dir else "that know the server key")

    def callback(self, domain: str, z85_key: bytes) -> bool:
        """ZAP (the authenticator's thread): is this client's key let in?"""
        if z85_key in self._allowed:
            return True
        fp = fingerprint(z85_key)
        self.refusals.refused("key", f"its CURVE key {fp} is not in --curve-clients {self._clients_dir}")
        if self._audit is not None:
            self._audit.refused(f"curve:{fp}", transport="zmq", fingerprint=f"curve:{fp}",
                                reason="its CURVE key is not in --curve-clients")
        return False

    def apply(self, sock: zmq.Socket) -> None:
        """Before the bind. The handshakes that fail (a wrong server key, a client without CURVE)
        are logged from a monitor of the socket, on a thread of its own (its events end when the
        socket closes)."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._monitor = threading.Thread(target=self._watch, args=(sock.get_monitor_socket(events),),
                                         name="lmcache-curve-monitor", daemon=True)
        self._monitor.start()

    def _watch(self, monitor: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        try:
            while not self._stopping.is_set():  # (the socket's close does not always end the events)
                if not monitor.poll(200):
                    continue
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self.refusals.refused("handshake", "its CURVE handshake failed (it has another server's public "
                                      "key, or uses no CURVE: give it this server's server.key)")
                if self._audit is not None:  # (ZeroMQ names no peer of a failed handshake)
                    self._audit.refused("handshake", transport="zmq", reason="the CURVE handshake failed (another "
                                        "server's public key, or no CURVE)")
        except zmq.ZMQError:
            return
        finally:
            monitor.close(0)

    def stop(self) -> None:
        """After the server's socket: the context ends once that socket is closed."""
        if self._monitor is not None:
            self._stopping.set()
            self._monitor.join(5)
        if self._auth is not None:
            self._auth.stop()
        if self._gate is not None:
            self._gate.stop()
        threading.Thread(target=self.context.term, name="lmcache-mp-curve-term", daemon=True).start()


def keygen(directory: str, client: str = "") -> str:
    """The server's key pair and one client's (client: another client's pair only, beside the
    server's); returns what to do with them. Keys are never overwritten."""
    if client and (not client.replace("-", "").replace("_", "").isalnum() or client == "server"):
        raise ValueError(f"--client {client!r}: a name of letters, digits, - and _ (not 'server')")
    name = client or "client"
    secret_dir = os.path.join(directory, "client-secret")
    has_server = os.path.exists(os.path.join(directory, "server.key_secret"))
    if client and not has_server:
        raise FileNotFoundError(f"{directory}/server.key_secret does not exist: run keygen {directory} first")
    if not client and has_server:
        raise FileExistsError(f"{directory}/server.key_secret exists: keys are never overwritten (another "
                              f"client's pair: keygen {directory} --client NAME)")
    for path in (os.path.join(directory, "clients", f"{name}.key"), os.path.join(secret_dir, f"{name}.key_secret")):
        if os.path.exists(path):
            raise FileExistsError(f"{path} exists: keys are never overwritten")
    os.makedirs(os.path.join(directory, "clients"), exist_ok=True)
    os.makedirs(secret_dir, mode=0o700, exist_ok=True)
    old = os.umask(0o077)  # secret keys: this user only
    try:
        if not client:
            zmq.auth.create_certificates(directory, "server")
        zmq.auth.create_certificates(os.path.join(directory, "clients"), name)
    finally:
        os.umask(old)
    os.replace(os.path.join(directory, "clients", f"{name}.key_secret"), os.path.join(secret_dir, f"{name}.key_secret"))
    # public keys are for others to read (the clients the server's, the server or its tenants file the clients')
    for public in ([os.path.join(directory, "server.key")] if not client else []) + [
            os.path.join(directory, "clients", f"{name}.key")]:
        os.chmod(public, 0o644)
    key = f"{directory}/clients/{name}.key"
    return ((f"server:  --curve-secret-key {directory}/server.key_secret --curve-clients {directory}/clients\n"
             f"         (or, with --tenants FILE instead of --curve-clients: list {key} in a tenant's curve_keys)\n"
             if not client else f"a server started with --curve-clients {directory}/clients lets it in once "
                                f"restarted; a server with --tenants FILE once {key} is in a tenant's curve_keys "
                                "there and the server got SIGHUP (kill -HUP PID: no restart)\n")
            + f"clients: LMCACHE_MP_CURVE_SERVER_KEY={directory}/server.key "
            f"LMCACHE_MP_CURVE_CLIENT_KEY={secret_dir}/{name}.key_secret\n"
            + ("" if client else f"(more clients: keygen {directory} --client NAME)"))
