"""Training entry point: ``python -m flux_jax.train --config configs/X.py[:arg] --workdir DIR``.

train_and_evaluate runs the chain config -> mesh -> data -> model (+ fp8 state) -> step function ->
checkpoint, top to bottom. The step differentiates the loss with respect to (params, fp8_meta); the
"gradient" of fp8_meta is its new value, and only params go through clipping and AdamW.
"""

import dataclasses
import json
import logging
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from tqdm import tqdm

from flux_jax import checkpoint, config_check, flow, fp8, metrics, model, optim, preemption, sharding

log = logging.getLogger(__name__)

_REMEDIES = (
    "a longer fp8_amax_history_len, fp8_amax_compute_algo='max', a larger fp8_margin, "
    "fp8_wgrad=False, first_last_layers_bf16=True, a lower lr or on_nonfinite='bf16'"
)


def flux_params(config) -> model.FluxParams:
    """The preset with every non-None config.model override applied."""
    overrides = {
        k: config.model[k]
        for k in ("depth", "depth_single_blocks", "hidden_size", "num_heads", "context_in_dim", "vec_in_dim")
        + ("guidance_embed",)
        if config.model.get(k) is not None
    }
    return dataclasses.replace(model.PRESETS[config.model.preset], **overrides)


def make_model(config, fp: model.FluxParams, use_fp8: bool) -> model.Flux:
    return model.Flux(
        params=fp,
        dtype=jnp.dtype(config.model.dtype),
        dot_general_policy=fp8.make_policy(config, fp) if use_fp8 else None,
        scan_blocks=config.model.scan_blocks,
        remat=config.recompute_granularity,
        attention_impl=config.model.attention,
    )


def _forward(net, params, fp8_meta, batch, t, x_t, guidance_scale):
    variables = {"params": params, **({fp8.FP8_COLLECTION: fp8_meta} if fp8_meta else {})}
    guidance = jnp.full(t.shape, guidance_scale, jnp.float32) if net.params.guidance_embed else None
    return net.apply(
        variables, x_t, batch["img_ids"], batch["txt"], batch["txt_ids"], t, batch["y"], guidance
    )


def make_train_step(config, net: model.Flux, tx: optax.GradientTransformation, num_micro: int, use_fp8: bool):
    """(state, batch) -> (state, metrics). Gradient accumulation scans over num_micro micro batches.

    A step with a non-finite loss or gradient norm leaves params, opt_state and fp8_meta untouched.
    """

    def loss_fn(params, fp8_meta, batch):
        x_t, target = flow.noise(batch["img"], batch["eps"], batch["t"])
        meta = fp8.as_max_grad(fp8_meta) if use_fp8 else {}
        pred = _forward(net, params, meta, batch, batch["t"], x_t, config.guidance_scale)
        return flow.loss(pred, target)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1))

    def micro_grads(params, fp8_meta, batch):
        loss, (g, new_meta) = grad_fn(params, fp8_meta, batch)
        return loss, g, (fp8.from_max_grad(new_meta) if use_fp8 else fp8_meta)

    def step(state, batch):
        params, fp8_meta = state["params"], state["fp8_meta"]
        batch = {k: v for k, v in batch.items() if k != "timestep"}
        # Timesteps and noise are drawn for the whole global batch, so accumulation over micro
        # batches computes the same loss as one large batch.
        t_rng, n_rng = jax.random.split(jax.random.fold_in(state["rng"], state["step"]))
        x0 = batch["img"]
        t = flow.sample_timesteps(
            t_rng,
            x0.shape[0],
            config.timestep_sampling,
            config.logit_mean,
            config.logit_std,
            config.mode_scale,
            config.timestep_shift,
        )
        batch = batch | {"t": t, "eps": jax.random.normal(n_rng, x0.shape, x0.dtype)}
        if num_micro == 1:
            loss, grads, new_meta = micro_grads(params, fp8_meta, batch)
        else:
            # Each device keeps its own rows: row block d of the global batch is device d's shard,
            # so micro batch k takes rows k*mb..(k+1)*mb of every block.
            def split(x):
                dp = x.shape[0] // (num_micro * config.micro_batch_size)
                x = x.reshape((dp, num_micro, config.micro_batch_size) + x.shape[1:])
                return x.swapaxes(0, 1).reshape((num_micro, dp * config.micro_batch_size) + x.shape[3:])

            def body(carry, inputs):
                loss_sum, g_sum, meta_max = carry
                loss, g, new_meta = micro_grads(params, fp8_meta, inputs)
                meta_max = fp8.merge_states(meta_max, new_meta) if use_fp8 else meta_max
                return (loss_sum + loss, jax.tree.map(jnp.add, g_sum, g), meta_max), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            init = (jnp.zeros((), jnp.float32), zeros, fp8_meta)
            if use_fp8:
                # Start below any real amax so the merge keeps only this step's values.
                init = (init[0], zeros, jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), fp8_meta))
            micro_batches = jax.tree.map(split, batch)
            (loss, grads, new_meta), _ = jax.lax.scan(body, init, micro_batches)
            loss = loss / num_micro
            grads = jax.tree.map(lambda g: g / num_micro, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        def keep(new, old):
            return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)

        new_state = {
            "step": state["step"] + 1,
            "params": keep(new_params, params),
            "opt_state": keep(opt_state, state["opt_state"]),
            "fp8_meta": keep(new_meta, fp8_meta) if use_fp8 else fp8_meta,
            "rng": state["rng"],
        }
        return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": finite}

    return step


def make_eval_step(config, net: model.Flux, use_fp8: bool):
    """(params, fp8_meta, batch, rng) -> (8,) loss sums and counts per validation timestep."""

    def step(params, fp8_meta, batch, rng):
        x0 = batch["img"]
        t = flow.validation_timesteps(batch["timestep"])
        x_t, target = flow.noise(x0, jax.random.normal(rng, x0.shape, x0.dtype), t)
        pred = _forward(net, params, fp8_meta if use_fp8 else {}, batch, t, x_t, config.guidance_scale)
        return flow.accumulate_by_timestep(flow.per_sample_loss(pred, target), batch["timestep"])

    return step


def _pipeline(config, split: str, fp: model.FluxParams):
    kwargs = dict(context_in_dim=fp.context_in_dim, vec_in_dim=fp.vec_in_dim)
    if config.data.source == "toy":
        from flux_jax import toy

        return toy.make_pipeline(config, split, jax.process_index(), jax.process_count(), **kwargs)
    from flux_jax import data

    return data.make_pipeline(config, split, jax.process_index(), jax.process_count(), **kwargs)


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
    fp = flux_params(config)
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
    net = make_model(config, fp, use_fp8)
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
    state = jax.device_put(state, state_shardings)
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
        step_net = make_model(config, fp, fp8_on)
        train = jax.jit(
            make_train_step(config, step_net, tx, num_micro, fp8_on),
            in_shardings=(state_shardings, batch_sh),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        )
        evaluate = jax.jit(make_eval_step(config, step_net, fp8_on))
        return train, evaluate

    train_step, eval_step = compile_steps(use_fp8)
    flops = metrics.train_flops_per_sample(fp, img_len, txt_len)
    writer = metrics.MetricWriter(workdir, enabled=is_main)

    def run_eval(step: int) -> float:
        sums = counts = 0.0
        val_iter = _pipeline(config, "val", fp)
        for i in range(config.eval_iters):
            batch = sharding.host_local_batch_to_global(next(val_iter), mesh)
            s, c = eval_step(state["params"], state["fp8_meta"], batch, jax.random.fold_in(eval_rng, i))
            sums, counts = sums + s, counts + c
        val, per_t = flow.validation_loss(sums, counts)
        values = {"loss": float(val)} | {f"loss_t{k}": float(v) for k, v in enumerate(per_t)}
        writer.write(step, values, prefix="val")
        log.info("step %d: validation loss %.4f", step, float(val))
        return float(val)

    # ---- Train loop ---------------------------------------------------------------------------
    first = int(state["step"])
    result = {
        "train_loss": None,
        "val_loss": None,
        "nonfinite_skipped": 0,
        "fp8": use_fp8,
        "preempted": False,
    }
    consecutive, skipped, window = 0, 0, []
    bar = tqdm(total=config.train_iters, initial=first, disable=not is_main, dynamic_ncols=True)
    t_last, step_last = time.perf_counter(), first
    # The host reads a step's metrics only after the next step is queued, so it fetches and
    # transfers the next batch while the device computes instead of waiting on each step.
    # Steps that log, save, evaluate or stop are read at once.
    pending = None
    guard = preemption.install_handler()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), guard:
        for step in range(first, config.train_iters):
            batch = sharding.host_local_batch_to_global(next(train_iter), mesh)
            state, m = train_step(state, batch)
            done = step + 1
            last = done == config.train_iters
            evaluate = bool(config.eval_interval) and (done % config.eval_interval == 0 or last)
            due = last or evaluate or done % config.log_interval == 0 or ckpt.due(done)
            # SIGTERM / SIGINT: keep this step, then stop; the same command resumes from it.
            preempted = guard.preempted(can_sync=due)
            read_now = due or preempted
            reads = ([pending] if pending else []) + ([(done, m)] if read_now else [])
            pending = None if read_now else (done, m)
            for d, md in reads:
                finite = bool(md["finite"])
                window.append(float(md["loss"]))
                if finite:
                    consecutive = 0
                else:
                    consecutive, skipped = consecutive + 1, skipped + 1
                    if consecutive >= config.max_nonfinite_steps:
                        if config.on_nonfinite == "bf16" and use_fp8:
                            log.warning(
                                "Non-finite steps %d-%d under FP8: switching to BF16.", d - consecutive + 1, d
                            )
                            use_fp8, consecutive = False, 0
                            train_step, eval_step = compile_steps(False)
                        else:
                            ckpt.close()
                            writer.close()
                            raise FloatingPointError(
                                f"{consecutive} consecutive non-finite steps ({d - consecutive + 1}..{d}); "
                                f"updates were skipped and the last checkpoint is intact. Try {_REMEDIES}."
                            )
                if d % config.log_interval == 0 or d == config.train_iters:
                    steps_s = (d - step_last) / max(time.perf_counter() - t_last, 1e-9)
                    values = _train_values(md, window, steps_s, config.global_batch_size, flops, use_fp8)
                    values |= {"lr": float(schedule(d - 1)), "nonfinite_skipped": skipped}
                    if use_fp8:
                        values |= fp8.summarize(jax.device_get(state["fp8_meta"]))
                    writer.write(d, values)
                    mem = values.get("peak_memory_gib", values["host_peak_rss_gib"])
                    bar.set_postfix(
                        loss=f"{values['loss']:.4f}",
                        img_s=f"{values['images_per_sec']:.1f}",
                        mem_gib=f"{mem:.1f}",
                    )
                    result["train_loss"] = values["loss"]
                    window, t_last, step_last = [], time.perf_counter(), d
            bar.update(1)
            ckpt.save(done, state, train_iter.get_state(), force=preempted or last)
            if preempted:
                log.warning("Stopped by a signal after step %d; checkpoint saved in %s.", done, workdir)
                result["preempted"] = True
                break
            if evaluate:
                result["val_loss"] = run_eval(done)
                target = config.target_val_loss
                if target is not None and result["val_loss"] <= target:
                    log.info("Reached target validation loss %.4f at step %d.", target, done)
                    ckpt.save(done, state, train_iter.get_state(), force=True)
                    break
    bar.close()
    ckpt.wait_until_finished()
    ckpt.close()
    writer.close()
    result |= {"steps": int(state["step"]), "nonfinite_skipped": skipped, "fp8": use_fp8, "params": n_params}
    return result


def setup_logging(logger: logging.Logger) -> None:
    """CLI logging: INFO lines from ``logger``; library INFO chatter (orbax) is dropped."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv) -> None:
    del argv
    # Progress goes to tqdm and this module's log.
    setup_logging(log)
    train_and_evaluate(config_check.none_from_command_line(flags.FLAGS.config), flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:arg].", lock_config=True)
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
