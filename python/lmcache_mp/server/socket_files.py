"""Who may connect to the server's unix socket files (the ipc:// endpoint and its local lane)."""

from __future__ import annotations

import contextlib
import os


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
