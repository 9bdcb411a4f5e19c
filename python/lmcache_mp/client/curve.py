"""ZeroMQ CURVE for the client: the server's public key and this client's key pair, set as
defaults of the client's ZeroMQ context so that every socket it opens uses them. From the
arguments of `Client`, else LMCACHE_MP_CURVE_SERVER_KEY and LMCACHE_MP_CURVE_CLIENT_KEY (files made
by `lmcache-mp-server keygen`). A server key without a client key: a fresh key pair (enough for a
server that lets in any client knowing its key)."""

from __future__ import annotations

import os

import zmq
import zmq.auth


def apply_curve(ctx: zmq.Context, server_key: str | None, client_key: str | None) -> bool:
    server_key = server_key or os.environ.get("LMCACHE_MP_CURVE_SERVER_KEY") or None
    client_key = client_key or os.environ.get("LMCACHE_MP_CURVE_CLIENT_KEY") or None
    if not server_key:
        if client_key:
            raise ValueError("a CURVE client key without the server's public key (curve_server_key)")
        return False
    server_public, _ = zmq.auth.load_certificate(server_key)
    if client_key:
        public, secret = zmq.auth.load_certificate(client_key)
        if secret is None:
            raise ValueError(f"{client_key} holds no secret key (the client needs its .key_secret file)")
    else:
        public, secret = zmq.curve_keypair()
    ctx.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return True
