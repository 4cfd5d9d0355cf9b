"""Training entry point: ``python -m flux_jax.train --config configs/X.py[:arg] --workdir DIR``.

train_and_evaluate runs the chain config -> mesh -> data -> model (+ fp8 state) -> step function ->
checkpoint, then the loop, top to bottom. The step functions themselves are in ``flux_jax.steps``.
"""

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from tqdm import tqdm

from flux_jax import (
    aot,
    checkpoint,
    choices,
    cli,
    config_check,
    config_cli,
    console,
    distributed,
    fp8,
    latents,
    metrics,
    preemption,
    setup,
    sharding,
)
from flux_jax.errors import UserError

log = logging.getLogger("flux_jax.train")  # also when run as __main__

_REMEDIES = (
    "a longer fp8_amax_history_len, fp8_amax_compute_algo='max', a larger fp8_margin, "
    "fp8_wgrad=False, first_last_layers_bf16=True, a lower lr or on_nonfinite='bf16'"
)


def _to_global(batch: dict, mesh) -> tuple[Any, dict]:
    """A host batch -> (its sample ids, the global batch the step takes: arrays only)."""
    ids = batch.get("id")
    arrays = {k: v for k, v in batch.items() if k != "id"}
    return ids, sharding.host_local_batch_to_global(arrays, mesh)


def _train_values(m, losses, steps_s: float, batch: int, flops: float, use_fp8: bool) -> dict[str, float]:
    """The logged scalars of one log interval: mean loss, throughput, MFU where the peak is known,
    memory; ``m`` holds the interval's last step's metrics, ``flops`` those of one sample."""
    images_s = steps_s * batch
    values = {
        "loss": float(np.mean(losses)),
        "grad_norm": float(m["grad_norm"]),
        "steps_per_sec": steps_s,
        "images_per_sec": images_s,
        "model_tflops_per_sec": images_s * flops / 1e12,
        **metrics.memory_metrics(),
    }
    peak = metrics.peak_flops(jax.devices()[0].device_kind, use_fp8)
    if peak:
        values["mfu"] = values["model_tflops_per_sec"] * 1e12 / (peak * jax.device_count())
    return values


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
    """Trains per config, writing checkpoints, metrics.jsonl, TensorBoard and config.json to workdir.

    Returns the final metrics: last train loss, last validation loss, steps run, skipped steps.
    """
    t_start = time.perf_counter()
    # ---- Config -------------------------------------------------------------------------------
    desc = fp8.describe_device()
    config_check.validate(config, jax.device_count(), jax.process_count(), desc=desc)
    fp = setup.flux_params(config)
    # "auto" attention / FP8 cast / FP8 dtypes become this platform's values, logged and in config.json.
    resolved = choices.resolve(config, fp, desc)
    is_main = jax.process_index() == 0
    _make_workdir(workdir)
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(json.loads(config.to_json_best_effort()), f, indent=2)

    # ---- Mesh, model (+ FP8 policy), optimizer: flux_jax.setup --------------------------------
    run = setup.build(config)
    fp, mesh, rules, use_fp8 = run.fp, run.mesh, run.rules, run.use_fp8

    # ---- Data ---------------------------------------------------------------------------------
    train_iter = setup.make_pipeline(config, "train", fp=fp)
    val_spec = None  # the global validation batch the eval step is compiled for
    if config.eval_interval:
        with _closing_pipeline(setup.make_pipeline(config, "val", fp=fp)) as val_iter:
            # A bad validation set fails before compiling.
            val_spec = aot.abstract_like(_to_global(next(val_iter), mesh)[1])

    # ---- State: the newest checkpoint, else a sharded init ------------------------------------
    abstract, state_shardings = setup.abstract_state(run)
    n_params = setup.parameter_count(abstract)
    init_rng, step_rng, eval_rng = jax.random.split(jax.random.key(config.seed), 3)
    ckpt = checkpoint.Checkpointer(workdir, config)
    start = ckpt.latest_step()
    if start is None:
        state = setup.init_state(run, init_rng, step_rng, state_shardings)
    else:
        fresh = setup.fresh_fp8_meta(run, state_shardings)
        state, data_state = ckpt.restore(start, abstract, train_iter.get_state(), fresh_fp8_meta=fresh)
        train_iter.set_state(data_state)
    log.info("%s", console.start_line(config, workdir, mesh, n_params, use_fp8, start))
    choices_line = ", ".join(f"{field}={value}" for field, value in resolved.items())
    log.info("Platform %s %s: %s", desc.platform, desc.device_kind, choices_line)

    # ---- Step functions, compiled before the loop ---------------------------------------------
    first = int(state["step"])
    # The first batch is drawn before the loop: the train step is compiled for its shapes.
    upcoming = [_to_global(next(train_iter), mesh)] if first < config.train_iters else []
    context = lambda: _compile_context(mesh, rules)  # noqa: E731
    eval_zeros = (np.zeros(latents.NUM_VAL_TIMESTEPS, np.float32),) * 2  # the totals of no batch
    eval_rng_spec = jax.ShapeDtypeStruct(eval_rng.shape, eval_rng.dtype)

    def compile_steps(fp8_on: bool, train_spec: tuple):
        return aot.compile_steps(run, state_shardings, fp8_on, train_spec, val_spec, eval_rng_spec, context)

    train_spec = aot.abstract_like((state, upcoming[0][1])) if upcoming else None
    train_step = eval_step = None  # compiled when the loop starts, under the preemption guard
    flops = metrics.train_flops_per_sample(fp, run.shapes["img"].shape[1], run.shapes["txt"].shape[1])
    writer = metrics.MetricWriter(workdir, enabled=is_main, resume_step=start or 0)
    ids_log = metrics.IdsLog(workdir, jax.process_index(), enabled=bool(config.data.get("log_ids", False)))

    watch = aot.CompileWatch()  # the loop runs programs compiled before it; this tells when it compiles

    def save(step: int, force: bool = False) -> None:
        """Checkpoints ``step`` when due (always with force), once every process agrees on the
        replicated state: step, fp8_meta and the data position the checkpoint stores once."""
        if not (force or ckpt.due(step)):
            return
        data_state = train_iter.get_state()
        agreed = {"step": state["step"], "fp8_meta": state["fp8_meta"]}
        agreed["data"] = np.frombuffer(json.dumps(data_state, sort_keys=True).encode(), np.uint8)
        with watch.during(f"the checkpoint save after step {step}"):
            distributed.check_replicas_agree(agreed, f"the train state at step {step}")
            ckpt.save(step, state, data_state, force=force)

    def run_eval(step: int) -> float:
        t0, totals = time.perf_counter(), eval_zeros
        val_iter = setup.make_pipeline(config, "val", fp=fp)
        with watch.during(f"validation after step {step}"), _closing_pipeline(val_iter):
            evaluate = eval_step.get()  # the background compile, done by now unless validation comes early
            for i in range(config.eval_iters):
                _, batch = _to_global(next(val_iter), mesh)
                args = (state["params"], state["fp8_meta"], batch, eval_rng, np.int32(i), totals)
                totals, val, per_t = evaluate(*args)
        val, per_t = jax.device_get((val, per_t))
        values = {"loss": float(val)} | {f"loss_t{k}": float(v) for k, v in enumerate(per_t)}
        writer.write(step, values, prefix="val")
        log.info("step %d: validation loss %.4f (%.1f s)", step, float(val), time.perf_counter() - t0)
        return float(val)

    def log_train(step: int, m) -> float:
        losses, steps_s = progress.interval(step)
        values = _train_values(m, losses, steps_s, config.global_batch_size, flops, use_fp8)
        values |= {"lr": float(m["lr"]), "nonfinite_skipped": progress.skipped}
        if use_fp8:
            values |= fp8.summarize(jax.device_get(state["fp8_meta"]))
        writer.write(step, values)
        mem = values.get("peak_memory_gib", values["host_peak_rss_gib"])
        bar.set_postfix(
            loss=f"{values['loss']:.4f}", img_s=f"{values['images_per_sec']:.1f}", mem_gib=f"{mem:.1f}"
        )
        return values["loss"]

    # ---- Train loop ---------------------------------------------------------------------------
    result = {"train_loss": None, "val_loss": None, "fp8": use_fp8, "preempted": False, "signal": None}
    if first >= config.train_iters:
        log.info("%s", console.finished_message(workdir, first, config.train_iters))
    progress = _Progress(first, config.max_nonfinite_steps)
    bar = tqdm(total=config.train_iters, initial=first, disable=not is_main, dynamic_ncols=True)
    # The host reads a step's metrics only after the next step is queued, so it fetches and
    # transfers the next batch while the device computes instead of waiting on each step.
    # Steps that log, save, evaluate or stop are read at once. Leaving the block (also by an error)
    # waits for checkpoint writes in flight.
    pending = None
    guard = preemption.install_handler()
    finish = contextlib.ExitStack()  # closes bar, checkpointer (waits for writes), writers, data
    finish.callback(_close_pipeline, train_iter)
    for closable in (writer, ids_log, ckpt, bar):
        finish.callback(closable.close)
    # A run that ends before the eval step's compile does waits for it here, not at interpreter exit.
    finish.callback(lambda: eval_step and eval_step.wait())
    # The guard is outermost: a second signal while the checkpoint is still being written is
    # caught by it too, instead of interrupting the write.
    with guard, finish, watch, context():
        if upcoming:
            with watch.expected():
                train_step, eval_step = compile_steps(use_fp8, train_spec)
        for step in range(first, config.train_iters):
            ids, batch = upcoming.pop() if upcoming else _to_global(next(train_iter), mesh)
            state, m = train_step(state, batch)
            done = step + 1
            watch.where = f"step {done}"
            ids_log.write(done, ids)
            last = done == config.train_iters
            evaluate = bool(config.eval_interval) and (done % config.eval_interval == 0 or last)
            due = last or evaluate or done % config.log_interval == 0 or ckpt.due(done)
            # SIGTERM / SIGINT / SIGHUP: keep this step, then stop; the same command resumes from it.
            preempted = guard.preempted(can_sync=due)
            read_now = due or preempted
            reads = ([pending] if pending else []) + ([(done, m)] if read_now else [])
            pending = None if read_now else (done, m)
            for d, md in reads:
                if progress.observe(md):
                    if not (config.on_nonfinite == "bf16" and use_fp8):
                        raise progress.error(d)
                    log.warning("Non-finite steps %s under FP8: switching to BF16.", progress.streak(d, "-"))
                    use_fp8, progress.consecutive = False, 0
                    with watch.expected():
                        train_step, eval_step = compile_steps(False, train_spec)
                if d % config.log_interval == 0 or d == config.train_iters:
                    result["train_loss"] = log_train(d, md)
            bar.update(1)
            if due and eval_step is not None:
                eval_step.raise_if_failed()
            save(done, force=preempted or last)
            if preempted:
                result["preempted"], result["signal"] = True, guard.signum
                break
            if evaluate:
                result["val_loss"] = run_eval(done)
                target = config.target_val_loss
                if target is not None and result["val_loss"] <= target:
                    log.info("Reached target validation loss %.4f at step %d.", target, done)
                    save(done, force=True)
                    break
    result |= {"steps": int(state["step"]), "nonfinite_skipped": progress.skipped, "fp8": use_fp8}
    result |= {"params": n_params, "seconds": time.perf_counter() - t_start, "loop_compiles": watch.compiles}
    if watch.compiles:
        log.warning("XLA compiled inside the train loop: %s.", watch.summary())
    if first < config.train_iters:
        log.info("%s", console.end_summary(result, first, workdir, ckpt.latest_step()))
    return result


@contextlib.contextmanager
def _compile_context(mesh, rules):
    """What the steps are traced and the loop runs under: the mesh and the logical-axis rules (both
    per thread, so the background compile enters them again)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def _close_pipeline(iterator) -> None:
    """Stops a data pipeline's worker processes and frees their shared memory (grain iterators have
    ``close``; the toy iterator has nothing to free). Unclosed, the workers die with the program and
    Python warns of leaked shared_memory objects."""
    if callable(close := getattr(iterator, "close", None)):
        close()


@contextlib.contextmanager
def _closing_pipeline(iterator):
    try:
        yield iterator
    finally:
        _close_pipeline(iterator)


class _Progress:
    """What the loop learns from the steps it reads, in step order: the losses of the current log
    interval, the run of consecutive non-finite steps and the interval's clock."""

    def __init__(self, first_step: int, max_nonfinite: int):
        self.max_nonfinite = max_nonfinite
        self.window: list[float] = []
        self.consecutive = self.skipped = 0
        self.t_last, self.step_last = time.perf_counter(), first_step

    def observe(self, m) -> bool:
        """Records one step's metrics; True when the non-finite run reaches max_nonfinite."""
        self.window.append(float(m["loss"]))
        if bool(m["finite"]):
            self.consecutive = 0
            return False
        self.consecutive, self.skipped = self.consecutive + 1, self.skipped + 1
        return self.consecutive >= self.max_nonfinite

    def streak(self, step: int, sep: str) -> str:
        """The non-finite run ending at ``step``, e.g. "3..4"."""
        return f"{step - self.consecutive + 1}{sep}{step}"

    def error(self, step: int) -> FloatingPointError:
        return FloatingPointError(
            f"{self.consecutive} consecutive non-finite steps ({self.streak(step, '..')}); updates were "
            f"skipped and the last checkpoint is intact. Try {_REMEDIES}."
        )

    def interval(self, step: int) -> tuple[list[float], float]:
        """The losses and steps/s of the log interval ending at ``step``; starts the next one."""
        now = time.perf_counter()
        losses, steps_s = self.window, (step - self.step_last) / max(now - self.t_last, 1e-9)
        self.window, self.t_last, self.step_last = [], now, step
        return losses, steps_s


def _make_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_test_{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise UserError(
            f"--workdir {workdir}: cannot write there ({err.strerror}). Pass a directory you can write to."
        ) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flux_jax.train",
        description="Trains a FLUX model per a config; rerunning the same command resumes from the "
        "last checkpoint in --workdir.",
        allow_abbrev=False,
    )
    config_cli.add_config_argument(p)
    p.add_argument("--workdir", required=True, help="directory for checkpoints, metrics and config.json")
    return p


def main(argv=None) -> int:
    """Exit status: 0 when done or stopped by SIGTERM (after a complete checkpoint), 130 for SIGINT,
    129 for SIGHUP (see flux_jax.preemption)."""
    args, config = config_cli.parse(parser(), sys.argv[1:] if argv is None else argv)
    # Progress goes to tqdm and the flux_jax loggers.
    console.setup_logging(logging.getLogger("flux_jax"))
    latest = checkpoint.latest_step_in(args.workdir)
    if latest is not None and latest >= config.train_iters:
        log.info("%s", console.finished_message(args.workdir, latest, config.train_iters))
        return 0
    result = train_and_evaluate(config, args.workdir)
    return preemption.exit_status(result["signal"])


if __name__ == "__main__":
    cli.run(main)
