"""ZeroMQ CURVE for the client: the server's public key and this client's key pair, set as
defaults of the client's ZeroMQ context so that every socket it opens uses them. From the
arguments of `Client`, else LMCACHE_MP_CURVE_SERVER_KEY and LMCACHE_MP_CURVE_CLIENT_KEY (files made
by `lmcache-mp-server keygen`). A server key without a client key: a fresh key pair (enough for a
server that lets in any client knowing its key)."""

from __future__ import annotations

import os

import zmq
import zmq.auth


def _load(path: str, setting: str, env: str, given: bool) -> tuple[bytes, bytes | None]:
    """A key file's keys; a ValueError naming the setting it came from (pyzmq says only "Invalid
    certificate file")."""
    where = setting if given else env
    if not os.path.isfile(path):
        raise ValueError(f"{where} {path}: no such file (`lmcache-mp-server keygen DIR` makes the keys: the server's "
                         "public key DIR/server.key, a client's secret key DIR/client-secret/NAME.key_secret)")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} {path}: not a CURVE key file ({e})") from None


def apply_curve(ctx: zmq.Context, server_key: str | None, client_key: str | None) -> bool:
    given_server, given_client = bool(server_key), bool(client_key)
    server_key = server_key or os.environ.get("LMCACHE_MP_CURVE_SERVER_KEY") or None
    client_key = client_key or os.environ.get("LMCACHE_MP_CURVE_CLIENT_KEY") or None
    if not server_key:
        if client_key:
            raise ValueError("a CURVE client key without the server's public key (curve_server_key)")
        return False
    server_public, _ = _load(server_key, "curve_server_key", "LMCACHE_MP_CURVE_SERVER_KEY", given_server)
    if client_key:
        public, secret = _load(client_key, "curve_client_key", "LMCACHE_MP_CURVE_CLIENT_KEY", given_client)
        if secret is None:
            raise ValueError(f"{client_key} holds no secret key (the client needs its .key_secret file)")
    else:
        public, secret = zmq.curve_keypair()
    ctx.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return True
