"""The server's endpoint as a client sees it: what a valid URL looks like, and, when no server
answered, what is at that address (nothing, something that is not a ZeroMQ server, or a server
whose handshake this client failed: CURVE keys missing or wrong)."""

from __future__ import annotations

import os
import re
import socket
import time

import zmq

URL_FORMS = "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555) or ipc:///path/to/socket"


def check_url(url: str) -> str:
    """The URL if a client can connect to it, else ValueError saying what a valid one looks like
    (ZeroMQ's own errors, 'Protocol not supported' or 'Invalid argument', do not)."""
    if not isinstance(url, str):
        raise ValueError(f"the server's URL must be a string such as {URL_FORMS}, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a server URL: {url!r} has no scheme; use {URL_FORMS}")
    if scheme == "tcp":
        if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):[0-9]{1,5}", rest):
            raise ValueError(f"not a server URL: {url!r}; use tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555")
        port = int(rest.rsplit(":", 1)[1])
        if not 0 < port < 65536:  # ZeroMQ would wrap it round, to another port
            raise ValueError(f"port {port} of {url!r} is out of range (1-65535)")
    elif scheme == "ipc":
        if not rest:
            raise ValueError(f"not a server URL: {url!r} names no socket file; use ipc:///path/to/socket")
    elif scheme != "inproc":  # inproc: a server in this process's own ZeroMQ context (tests)
        raise ValueError(f"not a server URL: {url!r} (the server speaks ZeroMQ, not {scheme}); use {URL_FORMS}")
    return url


_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def unreachable_hint(ctx: zmq.Context, url: str, curve: bool, wait: float = 1.0) -> str:
    """Why a handshake got no reply, from the ZeroMQ events of a fresh connection to `url` (made
    in `ctx`, so with the client's CURVE keys if it has any), watched for up to `wait` seconds.
    '' when nothing tells more than the timeout did."""
    from zmq.utils.monitor import recv_monitor_message

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket()
    seen: set[int] = set()
    auth_status = 0
    try:
        sock.connect(url)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                break
            event = recv_monitor_message(monitor)
            seen.add(event["event"])
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                auth_status = event["value"]
            if event["event"] in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_CONNECT_RETRIED, *_FAILED):
                break  # (retried: the connection was refused)
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
    if zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen:
        return _refused(auth_status, curve)
    if seen & set(_FAILED):
        return _failed(curve)
    if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen:
        return ""  # a server is there now: it was only slow
    if zmq.EVENT_CONNECTED in seen:
        return "something accepts connections there but does not speak ZeroMQ (the server's HTTP port?)"
    if seen & {zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CLOSED}:
        return NOTHING_LISTENS
    return ""


NOTHING_LISTENS = "nothing listens there (is the server running, on this URL?)"


def _refused(status: int, curve: bool) -> str:
    if not curve:  # NULL on ipc:// with a ZAP handler: a server with tenants, by uid/gid
        return (f"the server refused this process (status {status}): its tenants file names neither this "
                f"user (uid {os.getuid()}) nor its group (gid {os.getgid()})")
    return (f"the server refused this client's CURVE key (status {status}): its --curve-clients folder "
            "or tenants file lacks this client's public key")


def _failed(curve: bool) -> str:
    if curve:
        return ("the ZeroMQ handshake failed: is the server's public key (curve_server_key, "
                "LMCACHE_MP_CURVE_SERVER_KEY) the one of this server, and does it use CURVE?")
    return ("the ZeroMQ handshake failed: the server probably requires CURVE. Give the client the server's "
            "public key (curve_server_key=DIR/server.key or LMCACHE_MP_CURVE_SERVER_KEY) and a client key "
            "(curve_client_key=, LMCACHE_MP_CURVE_CLIENT_KEY); see docs/OPERATIONS.md")


class HandshakeWatch:
    """The events of a client's socket while its first handshake is pending, for what makes
    waiting out the connect timeout pointless: the server refused the credential, the handshake
    failed (wrong keys), or a connection was refused with nothing listening at the address."""

    def __init__(self, sock: zmq.Socket, url: str, curve: bool):
        self.url, self.curve, self._sock = url, curve, sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def known(self) -> str:
        """Why no handshake will come ('': nothing known yet); never waits."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return _refused(event["value"], self.curve)
            if kind in _FAILED:
                return _failed(self.curve)
            if kind == zmq.EVENT_CONNECT_RETRIED and nothing_listens(self.url):
                return NOTHING_LISTENS
        return ""

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)


def nothing_listens(url: str, timeout: float = 0.5) -> bool:
    """True when a connection to the server's address is refused (nobody listens there): a
    client need not wait for a handshake that cannot come. False when something accepts it, or
    when that cannot be told within `timeout` (a slow network, an inproc:// URL)."""
    scheme, _, rest = url.partition("://")
    try:
        if scheme == "tcp":
            host, _, port = rest.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return False
        if scheme == "ipc":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect("\0" + rest[1:] if rest.startswith("@") else rest)
            return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except (OSError, ValueError):
        return False
    return False
