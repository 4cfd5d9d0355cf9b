import json
import logging
import signal

from flux_jax import console


def _result(**overrides):
    base = {"steps": 300, "seconds": 151.2, "train_loss": 0.0412, "val_loss": 0.2291}
    return base | {"preempted": False, "signal": None} | overrides


def test_end_summary_done_and_stopped():
    done = console.end_summary(_result(), 0, "/w", 300)
    assert done == (
        "Done: steps 0..300 in 151 s; train loss 0.0412, validation loss 0.2291; "
        "latest checkpoint: step 300 in /w/checkpoints."
    )
    stopped = console.end_summary(
        _result(steps=120, preempted=True, signal=signal.SIGINT, val_loss=None), 100, "/w", 120
    )
    assert stopped.startswith("Stopped by SIGINT after step 120 (steps 100..120 in 151 s)")
    assert "validation loss n/a" in stopped and stopped.endswith("resume (exit status 130).")
    term = console.end_summary(_result(steps=7, preempted=True, signal=signal.SIGTERM), 0, "/w", 7)
    assert "Stopped by SIGTERM" in term and "(exit status 0)" in term


def test_finished_message_reads_the_last_losses(tmp_path):
    rows = [{"step": 10, "split": "train", "loss": 0.5}, {"step": 10, "split": "val", "loss": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = console.finished_message(str(tmp_path), 10, 10)
    assert "already holds a finished run: checkpoint at step 10, train_iters=10" in message
    assert "train loss 0.5000, validation loss 0.6000" in message and "--config.train_iters" in message


def test_log_lines_go_through_tqdm_write(monkeypatch):
    written = []
    monkeypatch.setattr(console.tqdm, "write", lambda text, file=None: written.append(text))
    logger = logging.getLogger("flux_jax_console_test")
    root_handlers = logging.getLogger().handlers[:]
    try:
        console.setup_logging(logger)
        logger.info("hello")
        logging.getLogger("some_library").warning("careful")
    finally:
        logger.handlers.clear()
        logging.getLogger().handlers[:] = root_handlers
    assert written[0].endswith(" hello") and written[1].endswith("WARNING some_library: careful")
