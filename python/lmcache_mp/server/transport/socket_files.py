"""The server's unix socket files (the ipc:// endpoint and its local lane): whose they are to take,
and who may connect to them."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat

logger = logging.getLogger(__name__)


def server_answers(path: str, sock_type: int, what: str) -> bool:
    """Whether a server listens on the socket file `path` (of `what`, for messages); False when
    there is no such file or nothing listens on it (a killed server's). OSError when the path is
    no socket or cannot be tried."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{what} {path} exists and is not a socket: not replacing it")
    except FileNotFoundError:
        return False
    with socket.socket(socket.AF_UNIX, sock_type) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except BlockingIOError:  # its backlog is full: it is very much alive
            return True
        except OSError as e:
            raise OSError(f"{what} {path}: cannot tell whether a server answers there ({e.strerror or e})") from None
    return True


def claim_socket_file(path: str, sock_type: int, what: str) -> None:
    """Before a server binds the socket file `path`: OSError while another server answers there
    (binding would pull the file from under it, leaving that server running on, out of reach); a
    file that nothing answers on, left by a server that was killed, is removed, saying so."""
    if server_answers(path, sock_type, what):
        raise OSError(f"another server answers on {what} {path}: stop it first, or give this one another url")
    if os.path.lexists(path):
        logger.warning("%s %s: no server answers there (one was killed?): taking the socket file over", what, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def socket_files_private():
    """Socket files made meanwhile are 0600 from their first moment (no window at the default
    mode before a chmod). The umask is the process's: only used while the server starts."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def share_with_group(path: str, group: str) -> None:
    """With a group (name or id), the socket file becomes 0660 of that group: its members' engines
    may connect. Without, it stays 0600 (this user's processes only)."""
    if not group:
        return
    import grp

    gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    os.chown(path, -1, gid)
    os.chmod(path, 0o660)
