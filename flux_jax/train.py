"""Training entry point: ``python -m flux_jax.train --config configs/X.py[:arg] --workdir DIR``.

train_and_evaluate runs the chain config -> mesh -> data -> model (+ fp8 state) -> step function ->
checkpoint, then the loop, top to bottom. The step functions themselves are in ``flux_jax.steps``.
"""

import contextlib
import json
import logging
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from tqdm import tqdm

from flux_jax import (
    checkpoint,
    cli,
    config_check,
    distributed,
    flow,
    fp8,
    metrics,
    model,
    optim,
    preemption,
    sharding,
    steps,
)

log = logging.getLogger(__name__)

_REMEDIES = (
    "a longer fp8_amax_history_len, fp8_amax_compute_algo='max', a larger fp8_margin, "
    "fp8_wgrad=False, first_last_layers_bf16=True, a lower lr or on_nonfinite='bf16'"
)


def _pipeline(config, split: str, fp: model.FluxParams):
    kwargs = dict(context_in_dim=fp.context_in_dim, vec_in_dim=fp.vec_in_dim)
    if config.data.source == "toy":
        from flux_jax import toy

        return toy.make_pipeline(config, split, jax.process_index(), jax.process_count(), **kwargs)
    from flux_jax import data

    return data.make_pipeline(config, split, jax.process_index(), jax.process_count(), **kwargs)


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
    # ---- Config -------------------------------------------------------------------------------
    config_check.validate(config, jax.device_count(), jax.process_count(), fp8.describe_device().platform)
    fp = steps.flux_params(config)
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(json.loads(config.to_json_best_effort()), f, indent=2)

    # ---- Mesh ---------------------------------------------------------------------------------
    mesh = sharding.make_mesh(config)
    rules = sharding.rules_from_config(config)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    num_micro = config.global_batch_size // (config.micro_batch_size * dp)

    # ---- Data ---------------------------------------------------------------------------------
    train_iter = _pipeline(config, "train", fp)
    sample = next(_pipeline(config, "val", fp))
    img_len, txt_len = sample["img"].shape[1], sample["txt"].shape[1]

    # ---- Model and FP8 state ------------------------------------------------------------------
    use_fp8 = config.fp8 is not None
    net = steps.make_model(config, fp, use_fp8)
    dummy = {k: jnp.zeros((1,) + v.shape[1:], jnp.float32) for k, v in sample.items() if k != "timestep"}

    def init_variables(rng):
        t = jnp.zeros((1,), jnp.float32)
        g = t if fp.guidance_embed else None
        args = (dummy["img"], dummy["img_ids"], dummy["txt"], dummy["txt_ids"], t, dummy["y"], g)
        return net.init(rng, *args)

    root = jax.random.key(config.seed)
    init_rng, step_rng, eval_rng = jax.random.split(root, 3)
    variables, _ = sharding.sharded_init(init_variables, init_rng, mesh, rules)
    params, fp8_meta = variables["params"], dict(variables.get(fp8.FP8_COLLECTION, {}))
    if config.init_from:
        params = checkpoint.load_init_from(config.init_from, fp, params, scan_blocks=config.model.scan_blocks)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    # ---- Optimizer and state ------------------------------------------------------------------
    tx = optim.make_optimizer(config)
    schedule = optim.lr_schedule(config)
    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init)(params)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}
    state |= {"fp8_meta": fp8_meta, "rng": step_rng}
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # Scalars (step, rng, optimizer counts) start on one device; every leaf must live on the mesh.
    state_shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else replicated, state
    )
    # jit places them on the global mesh (device_put cannot reach other processes' devices).
    state = jax.jit(lambda s: s, out_shardings=state_shardings)(state)
    batch_sh = sharding.batch_sharding(mesh)

    # ---- Checkpoint ---------------------------------------------------------------------------
    ckpt = checkpoint.Checkpointer(workdir, config)
    start = ckpt.latest_step()
    if start is not None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state, data_state = ckpt.restore(start, abstract, train_iter.get_state(), fresh_fp8_meta=fp8_meta)
        train_iter.set_state(data_state)
        log.info("Resumed from step %d", start)

    # ---- Step functions -----------------------------------------------------------------------
    def compile_steps(fp8_on: bool):
        step_net = steps.make_model(config, fp, fp8_on)
        train = jax.jit(
            steps.make_train_step(config, step_net, tx, num_micro, fp8_on),
            in_shardings=(state_shardings, batch_sh),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        )
        evaluate = jax.jit(steps.make_eval_step(config, step_net, fp8_on))
        return train, evaluate

    train_step, eval_step = compile_steps(use_fp8)
    flops = metrics.train_flops_per_sample(fp, img_len, txt_len)
    writer = metrics.MetricWriter(workdir, enabled=is_main)
    ids_log = metrics.IdsLog(workdir, jax.process_index(), enabled=bool(config.data.get("log_ids", False)))

    def save(step: int, force: bool = False) -> None:
        """Checkpoints ``step`` when due (always with force), once every process agrees on the
        replicated state: step, fp8_meta and the data position the checkpoint stores once."""
        if not (force or ckpt.due(step)):
            return
        data_state = train_iter.get_state()
        replicated = {"step": state["step"], "fp8_meta": state["fp8_meta"]}
        replicated["data"] = np.frombuffer(json.dumps(data_state, sort_keys=True).encode(), np.uint8)
        distributed.check_replicas_agree(replicated, f"the train state at step {step}")
        ckpt.save(step, state, data_state, force=force)

    def run_eval(step: int) -> float:
        sums = counts = 0.0
        val_iter = _pipeline(config, "val", fp)
        for i in range(config.eval_iters):
            _, batch = _to_global(next(val_iter), mesh)
            s, c = eval_step(state["params"], state["fp8_meta"], batch, jax.random.fold_in(eval_rng, i))
            sums, counts = sums + s, counts + c
        val, per_t = flow.validation_loss(sums, counts)
        values = {"loss": float(val)} | {f"loss_t{k}": float(v) for k, v in enumerate(per_t)}
        writer.write(step, values, prefix="val")
        log.info("step %d: validation loss %.4f", step, float(val))
        return float(val)

    def log_train(step: int, m) -> float:
        losses, steps_s = progress.interval(step)
        values = _train_values(m, losses, steps_s, config.global_batch_size, flops, use_fp8)
        values |= {"lr": float(schedule(step - 1)), "nonfinite_skipped": progress.skipped}
        if use_fp8:
            values |= fp8.summarize(jax.device_get(state["fp8_meta"]))
        writer.write(step, values)
        mem = values.get("peak_memory_gib", values["host_peak_rss_gib"])
        bar.set_postfix(
            loss=f"{values['loss']:.4f}", img_s=f"{values['images_per_sec']:.1f}", mem_gib=f"{mem:.1f}"
        )
        return values["loss"]

    # ---- Train loop ---------------------------------------------------------------------------
    first = int(state["step"])
    result = {"train_loss": None, "val_loss": None, "fp8": use_fp8, "preempted": False}
    progress = _Progress(first, config.max_nonfinite_steps)
    bar = tqdm(total=config.train_iters, initial=first, disable=not is_main, dynamic_ncols=True)
    # The host reads a step's metrics only after the next step is queued, so it fetches and
    # transfers the next batch while the device computes instead of waiting on each step.
    # Steps that log, save, evaluate or stop are read at once. Leaving the block (also by an error)
    # waits for checkpoint writes in flight.
    pending = None
    guard = preemption.install_handler()
    finish = contextlib.ExitStack()  # closes bar, checkpointer (waits for writes) and writer
    for closable in (writer, ids_log, ckpt, bar):
        finish.callback(closable.close)
    with finish, jax.set_mesh(mesh), nn.logical_axis_rules(rules), guard:
        for step in range(first, config.train_iters):
            ids, batch = _to_global(next(train_iter), mesh)
            state, m = train_step(state, batch)
            done = step + 1
            ids_log.write(done, ids)
            last = done == config.train_iters
            evaluate = bool(config.eval_interval) and (done % config.eval_interval == 0 or last)
            due = last or evaluate or done % config.log_interval == 0 or ckpt.due(done)
            # SIGTERM / SIGINT: keep this step, then stop; the same command resumes from it.
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
                    train_step, eval_step = compile_steps(False)
                if d % config.log_interval == 0 or d == config.train_iters:
                    result["train_loss"] = log_train(d, md)
            bar.update(1)
            save(done, force=preempted or last)
            if preempted:
                log.warning("Stopped by a signal after step %d; checkpoint saved in %s.", done, workdir)
                result["preempted"] = True
                break
            if evaluate:
                result["val_loss"] = run_eval(done)
                target = config.target_val_loss
                if target is not None and result["val_loss"] <= target:
                    log.info("Reached target validation loss %.4f at step %d.", target, done)
                    save(done, force=True)
                    break
    result |= {"steps": int(state["step"]), "nonfinite_skipped": progress.skipped, "fp8": use_fp8}
    return result | {"params": n_params}


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


def setup_logging(logger: logging.Logger) -> None:
    """CLI logging: INFO lines from ``logger``; library INFO chatter (orbax) is dropped. In a job of
    several processes only process 0 reports; the others print errors only."""
    main = jax.process_index() == 0
    absl_logging.set_verbosity(absl_logging.WARNING if main else absl_logging.ERROR)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if main else logging.ERROR)
    logger.propagate = False


def main(argv) -> None:
    del argv
    # Progress goes to tqdm and this module's log.
    for logger in (log, distributed.log):
        setup_logging(logger)
    train_and_evaluate(config_check.none_from_command_line(flags.FLAGS.config), flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:arg].", lock_config=True)
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(lambda argv: cli.run(lambda: main(argv)))
