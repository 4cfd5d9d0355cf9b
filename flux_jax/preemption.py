"""Preemption: SIGTERM/SIGINT ask the train loop to save a checkpoint and stop after this step.

with preemption.install_handler() as guard:
    for step in ...:
        ...
        if guard.preempted():   # agreed by every process: all hosts save the same step
            save(step, force=True); break

With one process ``preempted()`` reads a flag; with several every process publishes its flag through
the coordination service and waits for the others' (``distributed.any_process``: no device
collective), so the train loop passes ``can_sync=False`` except on steps it synchronises anyway (log,
save, eval), and a signal is honoured at the next of those.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)


class PreemptionGuard:
    """Context manager: SIGTERM/SIGINT set `requested` so the loop can save and exit cleanly.

    A second SIGINT falls through to the previous handler (Ctrl-C twice still interrupts).
    The previous handlers are restored on exit.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, callback: Callable[[int], None] | None = None):
        self.requested = False
        self._callback = callback
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            old = self._old.get(signum)
            if callable(old):
                old(signum, frame)
                return
            raise KeyboardInterrupt
        self.requested = True
        log.warning("Received signal %d: saving a checkpoint and stopping after this step.", signum)
        if self._callback is not None:
            self._callback(signum)

    def preempted(self, can_sync: bool = True) -> bool:
        """True on every process once any process got a signal (all hosts must save together).

        With several processes that takes a collective; ``can_sync=False`` skips it and returns
        False, so the caller asks again on a step where waiting for every host costs nothing.
        """
        if jax.process_count() == 1:
            return self.requested
        if not can_sync:
            return False
        from flux_jax import distributed

        return distributed.any_process(self.requested, "preempt")

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be installed from the main thread
        for sig in self._SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def install_handler(callback: Callable[[int], None] | None = None) -> PreemptionGuard:
    """`with install_handler() as guard: ... if guard.preempted(): save(force=True)`."""
    return PreemptionGuard(callback)
