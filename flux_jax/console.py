"""What the train and convergence commands tell the user: the start line, the end summary, the
finished-workdir notice, and logging that writes above the progress bar (tqdm.write)."""

import logging
import os
import signal
import sys

import jax
import jax.numpy as jnp
from absl import logging as absl_logging
from tqdm import tqdm

from flux_jax import fp8, metrics, preemption


def start_line(config, workdir: str, mesh, n_params: int, use_fp8: bool, start: int | None) -> str:
    """What the run is: workdir, where it starts, parameters, devices and mesh, precision."""
    devices = jax.devices()
    kind = devices[0].device_kind
    mesh_text = " x ".join(f"{name} {size}" for name, size in mesh.shape.items())
    if use_fp8:
        spec = fp8.spec_from_config(config)
        precision = (
            f"FP8 {config.fp8} (forward {jnp.dtype(spec.fwd_dtype).name}, gradients "
            f"{jnp.dtype(spec.bwd_dtype).name}), recipe {spec.recipe}, cast kernel {spec.cast_kernel}, "
            f"other math in {config.model.dtype}"
        )
    else:
        precision = f"FP8 off, math in {config.model.dtype}"
    where = f"resuming at step {start}" if start is not None else "starting at step 0"
    return (
        f"Training {config.model.preset} in {workdir} ({where} of {config.train_iters}): {n_params:,} "
        f"parameters; {len(devices)} x {kind} in {jax.process_count()} process(es), mesh {mesh_text}; "
        f"{precision}."
    )


def _loss(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def end_summary(result: dict, first: int, workdir: str, latest: int | None) -> str:
    """How the run ended: steps, final losses, time, the latest checkpoint, and what next."""
    ckpts = os.path.join(workdir, "checkpoints")
    saved = f"latest checkpoint: step {latest} in {ckpts}" if latest is not None else "no checkpoint saved"
    head = f"steps {first}..{result['steps']} in {result['seconds']:.0f} s"
    losses = f"train loss {_loss(result['train_loss'])}, validation loss {_loss(result['val_loss'])}"
    if result["signal"] is not None or result["preempted"]:
        name = "a signal" if result["signal"] is None else signal.Signals(result["signal"]).name
        code = preemption.exit_status(result["signal"])
        return (
            f"Stopped by {name} after step {result['steps']} ({head}); {losses}; {saved}. "
            f"Run the same command to resume (exit status {code})."
        )
    return f"Done: {head}; {losses}; {saved}."


def finished_message(workdir: str, step: int, train_iters: int) -> str:
    last = metrics.last_losses(os.path.join(workdir, "metrics.jsonl"))
    losses = f"train loss {_loss(last['train'])}, validation loss {_loss(last['val'])}"
    return (
        f"{workdir} already holds a finished run: checkpoint at step {step}, train_iters={train_iters} "
        f"({losses}). Nothing to train. To train further, raise --config.train_iters; to start over, "
        "pass a new --workdir."
    )


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines with tqdm.write, so they land above a progress bar instead of inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging's own contract: a failed write never raises)
            self.handleError(record)


def setup_logging(logger: logging.Logger) -> None:
    """CLI logging: INFO lines from ``logger``; library warnings (orbax, tensorboardX) with their
    logger's name; library INFO chatter is dropped. Everything goes through tqdm.write. In a job of
    several processes only process 0 reports; the others print errors only."""
    main = jax.process_index() == 0
    absl_logging.set_verbosity(absl_logging.WARNING if main else absl_logging.ERROR)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if main else logging.ERROR)
    logger.propagate = False
    # Root's plain stderr handler (set up by an imported library), or Python's last-resort one,
    # would write library warnings into the progress bar.
    root = logging.getLogger()
    for old in root.handlers[:]:
        if isinstance(old, _TqdmHandler) or (type(old) is logging.StreamHandler and old.stream is sys.stderr):
            root.removeHandler(old)
    library = _TqdmHandler()
    library.setLevel(logging.WARNING if main else logging.ERROR)
    library.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(library)
