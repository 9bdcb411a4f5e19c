"""What /proc says of processes: which pid namespace this one is in, and when a process started
(with its pid, what names one process: a pid is reused, a pid and a start time are not)."""

from __future__ import annotations

import os


def own_pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of a live, not zombie, process; None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])
