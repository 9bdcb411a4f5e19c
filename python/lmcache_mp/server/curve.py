"""ZeroMQ CURVE for the server: encrypted, authenticated connections (pyzmq's zmq.auth).

`lmcache-mp-server keygen DIR` makes DIR/server.key (public: give it to the clients),
DIR/server.key_secret (the server's: --curve-secret-key), and one client key pair:
DIR/clients/client.key (public) and DIR/client-secret/client.key_secret. With --curve-clients
DIR/clients, only clients whose public key file is in that folder (read at start) get past the
handshake; without it, any client that knows the server's public key does. A client without the
right keys gets no handshake, so no request of its ever reaches the engine.
"""

from __future__ import annotations

import logging
import os
import threading

import zmq
import zmq.auth

logger = logging.getLogger(__name__)


class CurveServer:
    """Applies the server's keys to the ROUTER socket and runs the authenticator (ZAP) thread, in
    a ZeroMQ context of its own (`context`, for the server's socket too): a context has one ZAP
    endpoint, so two servers in one process each need theirs."""

    def __init__(self, secret_key_file: str, clients_dir: str = ""):
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(secret_key_file)
        if secret is None:
            raise ValueError(f"{secret_key_file} holds no secret key (the server needs server.key_secret)")
        if clients_dir and not os.path.isdir(clients_dir):
            raise ValueError(f"curve_clients: {clients_dir} is not a folder of client public keys")
        self.public, self._secret = public, secret
        self.context = zmq.Context()
        self._auth = ThreadAuthenticator(self.context, log=logging.getLogger("lmcache_mp.auth"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=clients_dir or zmq.auth.CURVE_ALLOW_ANY)
        logger.info("CURVE: server key %s, clients %s", public.decode(),
                    f"with a key in {clients_dir}" if clients_dir else "that know the server key")

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        """After the server's socket: the context ends once that socket is closed."""
        self._auth.stop()
        threading.Thread(target=self.context.term, name="lmcache-mp-curve-term", daemon=True).start()


def keygen(directory: str) -> str:
    """The server's key pair and one client's; returns what to do with them."""
    os.makedirs(os.path.join(directory, "clients"), exist_ok=True)
    if os.path.exists(os.path.join(directory, "server.key_secret")):
        raise FileExistsError(f"{directory}/server.key_secret exists: keys are never overwritten")
    old = os.umask(0o077)  # secret keys: this user only
    try:
        zmq.auth.create_certificates(directory, "server")
        zmq.auth.create_certificates(os.path.join(directory, "clients"), "client")
    finally:
        os.umask(old)
    secret_dir = os.path.join(directory, "client-secret")
    os.makedirs(secret_dir, exist_ok=True)
    os.replace(os.path.join(directory, "clients", "client.key_secret"), os.path.join(secret_dir, "client.key_secret"))
    return (f"server:  --curve-secret-key {directory}/server.key_secret --curve-clients {directory}/clients\n"
            f"clients: LMCACHE_MP_CURVE_SERVER_KEY={directory}/server.key "
            f"LMCACHE_MP_CURVE_CLIENT_KEY={secret_dir}/client.key_secret\n"
            f"(more clients: add their public .key files to {directory}/clients and restart the server)")
