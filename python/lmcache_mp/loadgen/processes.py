"""The bench's own processes (workers, the echo peer, the stall probe): started deaf to Ctrl-C and
ended by the bench alone, with what they leave in shared memory.

A Ctrl-C reaches every process of the terminal's process group. Were the helpers to take it, each
would die with a traceback of its own while the bench cleans up after them; so they ignore it, and
the bench, which alone decides, ends them (once, each).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from lmcache_mp.shm import remove_shared_files


@contextlib.contextmanager
def deaf_to_ctrl_c():
    """Processes started meanwhile ignore SIGINT: an ignored signal stays ignored across exec, and
    a Python that starts with SIGINT ignored installs no KeyboardInterrupt of its own."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def end_processes(procs, grace: float) -> None:
    """Give each multiprocessing process up to `grace` seconds (all together) to exit, then kill
    it; the shared-memory files of one killed (its KV cache) are removed for it."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
            remove_shared_files(p.pid)
