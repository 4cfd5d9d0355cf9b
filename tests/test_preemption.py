import os
import signal

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


def test_a_second_signal_while_saving_is_logged_not_raised(caplog):
    # A second Ctrl-C (or the terminal closing) must not interrupt the checkpoint being written:
    # no KeyboardInterrupt, no call to the handler that was there before; the first signal counts.
    calls = []
    outer = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with caplog.at_level("WARNING"), preemption.install_handler() as guard:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGHUP)
            assert guard.requested and guard.signum == signal.SIGINT and calls == []
        assert "Received SIGINT again: still saving" in caplog.text
        assert "Received SIGHUP again" in caplog.text
    finally:
        signal.signal(signal.SIGINT, outer)


def test_sighup_is_handled_like_sigterm_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGHUP)
    with preemption.install_handler() as guard:
        os.kill(os.getpid(), signal.SIGHUP)
        assert guard.preempted() and guard.signum == signal.SIGHUP
    assert signal.getsignal(signal.SIGHUP) is before


def test_sighup_stays_ignored_under_nohup():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with preemption.install_handler() as guard:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            assert not guard.requested
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_exit_status_per_signal():
    # SIGTERM (a scheduler's preemption) exits 0 after the checkpoint: the job is requeued and resumes.
    # A person's Ctrl-C or a closed terminal exits like a shell reports them, so `train && sample` stops.
    assert preemption.exit_status(None) == 0
    assert preemption.exit_status(signal.SIGTERM) == 0
    assert preemption.exit_status(signal.SIGINT) == 130
    assert preemption.exit_status(signal.SIGHUP) == 129


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
