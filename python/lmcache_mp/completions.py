"""Waiting for the GPU transfers of a transfer engine (`_C.cuda.TransferEngine`), one direction
per thread: the server's registrations and the client's own copies use it alike."""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class CompletionWaiter:
    """Answers one direction's GPU transfers as they finish, on its own thread.

    The thread waits inside the engine (`wait_next`, without the GIL) for the oldest transfer of
    its direction, so nobody has to hand it a ticket: the submitting thread only files the
    callback. With spin_us it polls for the next transfer that long before it sleeps, so a short
    copy is seen done at once instead of after a wake-up. Whichever of the two (the callback filed,
    the transfer finished) comes second runs the callback."""

    def __init__(self, name: str, mover_of: Callable[[], object], direction: str, spin_us: int = 0):
        self._mover_of = mover_of  # the transfer engine is reached through its context, never kept here
        self._direction = direction
        self._spin = spin_us
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable] = {}
        self._finished: dict[int, tuple] = {}  # ticket -> (error, stamps), done before its callback came
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, ticket: int, done: Callable[[BaseException | None, tuple], None]) -> None:
        """done(error or None, stamps) once the ticket's copies finished; stamps are (stage,
        monotonic ns) pairs for request traces."""
        with self._lock:
            result = self._finished.pop(ticket, None)
            if result is None:
                self._callbacks[ticket] = done
                return
        done(*result)

    def wait_here(self, ticket: int) -> bool:
        """Wait for the ticket on the calling thread and run its callback here (a caller blocked
        on the result is then not woken by this thread: one hand-off less). False when the
        completion thread had it first (its callback runs there)."""
        try:
            self._mover_of().wait(ticket)
            error = None
        except ValueError:  # claimed by the completion thread, or collected already
            return False
        except RuntimeError as e:  # the copy failed
            error = e
        with self._lock:
            done = self._callbacks.pop(ticket, None)
            if done is None:  # filed only after it finished: add() runs it
                self._finished[ticket] = (error, ())
                return True
        done(error, ())
        return True

    def _run(self) -> None:
        mover = self._mover_of()
        while True:
            ticket, seen, error = mover.wait_next(self._direction, self._spin)
            if not ticket:
                return
            result = (RuntimeError(error), ()) if error else (None, (("gpu done", seen),))
            with self._lock:
                done = self._callbacks.pop(ticket, None)
                if done is None:
                    self._finished[ticket] = result
                    continue
            try:
                done(*result)
            except Exception:  # a callback answers its own errors; this is a last resort
                logger.exception("unhandled error in %s", self._thread.name)

    def stop(self, timeout: float | None = None) -> None:
        """Answer every transfer submitted so far, then end the thread (stops both directions'
        waiters of the engine)."""
        self._mover_of().stop_waiting()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
