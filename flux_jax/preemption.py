"""Preemption: SIGTERM, SIGINT and SIGHUP ask the train loop to save a checkpoint and stop after this step.

with preemption.install_handler() as guard:
    for step in ...:
        ...
        if guard.preempted():   # agreed by every process: all hosts save the same step
            save(step, force=True); break

With one process ``preempted()`` reads a flag; with several every process publishes its flag through
the coordination service and waits for the others' (``distributed.any_process``: no device
collective), so the train loop passes ``can_sync=False`` except on steps it synchronises anyway (log,
save, eval), and a signal is honoured at the next of those.

Repeated signals (a second Ctrl-C, the terminal closing) do not interrupt the save: they are logged
and the run still stops once the checkpoint is written. The exit status then tells how the run
stopped (``exit_status``): 0 for SIGTERM, the scheduler's requeue signal (the checkpoint is complete
and the job resumes), 128 + signal number for SIGINT (130) and SIGHUP (129), so that
``train && sample`` does not go on after a run a person stopped.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)


def exit_status(signum: int | None) -> int:
    """The exit status of a run stopped by ``signum`` after a complete checkpoint (None: not stopped,
    or, with several processes, stopped because another process received the signal)."""
    if signum is None or signum == signal.SIGTERM:
        return 0
    return 128 + int(signum)


class PreemptionGuard:
    """Context manager: SIGTERM/SIGINT/SIGHUP set `requested` so the loop can save and exit cleanly.

    `signum` is the first signal this process received. Later signals are logged and otherwise
    ignored until the guard exits, so a second Ctrl-C cannot abort the checkpoint being written.
    The previous handlers are restored on exit.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, callback: Callable[[int], None] | None = None):
        self.requested = False
        self.signum: int | None = None
        self._callback = callback
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            log.warning(
                "Received %s again: still saving this step's checkpoint; the run stops when it is written "
                "(kill -9 stops at once and loses the steps since the last checkpoint).",
                name,
            )
            return
        self.requested, self.signum = True, signum
        log.warning("Received %s: saving a checkpoint and stopping after this step.", name)
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
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: closing the terminal must not stop the run
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def install_handler(callback: Callable[[int], None] | None = None) -> PreemptionGuard:
    """`with install_handler() as guard: ... if guard.preempted(): save(force=True)`."""
    return PreemptionGuard(callback)
