import os
import signal

import pytest

from flux_jax import preemption


def test_guard_sets_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    seen = []
    with preemption.install_handler(seen.append) as guard:
        assert not guard.preempted()
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.preempted()
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_sigint_falls_through_to_the_previous_handler():
    # The first Ctrl-C asks for a save; the second goes to the handler that was there before.
    calls = []
    outer = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with preemption.install_handler() as guard:
            os.kill(os.getpid(), signal.SIGINT)
            assert guard.requested and calls == []
            os.kill(os.getpid(), signal.SIGINT)
            assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, outer)


def test_second_sigint_without_a_callable_previous_handler_interrupts():
    outer = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        with preemption.install_handler():
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, outer)


def test_several_processes_agree_only_when_the_caller_can_sync(monkeypatch):
    from flux_jax import distributed

    exchanged = []

    def exchange(name, value):
        exchanged.append((name, value))
        return [value, "0"]  # this host's flag and another host's

    monkeypatch.setattr(preemption.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "exchange", exchange)
    guard = preemption.PreemptionGuard()
    guard.requested = True
    assert not guard.preempted(can_sync=False) and exchanged == []
    assert guard.preempted(can_sync=True) and exchanged == [("preempt", "1")]
    guard.requested = False
    assert not guard.preempted(can_sync=True)
