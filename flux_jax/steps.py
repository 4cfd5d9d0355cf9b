"""The jitted step functions of training: model construction, train step, eval step.

The train step differentiates the loss with respect to (params, fp8_meta); the "gradient" of
fp8_meta is its new value (the FP8 dot returns its updated scaling state as the cotangent), and only
params go through clipping and AdamW.
"""

import jax
import jax.numpy as jnp
import optax

from flux_jax import choices, flow, fp8, model, optim


def make_model(config, fp: model.FluxParams, use_fp8: bool) -> model.Flux:
    return model.Flux(
        params=fp,
        dtype=jnp.dtype(config.model.dtype),
        dot_general_policy=fp8.make_policy(config, fp) if use_fp8 else None,
        scan_blocks=config.model.scan_blocks,
        remat=config.recompute_granularity,
        attention_impl=choices.attention_for(config, fp),
        attention_fp8=fp8.attention_spec(config) if use_fp8 else None,
    )


def forward(net, params, fp8_meta, batch, t, x_t, guidance_scale, fp8_weights=None):
    """The model's velocity prediction for ``x_t`` at times ``t``; fp8_meta {} for BF16.

    ``fp8_weights``: kernel casts made once for the step (``fp8.cast_kernels``), or None.
    """
    variables = {"params": params, **({fp8.FP8_COLLECTION: fp8_meta} if fp8_meta else {})}
    if fp8_weights:
        variables[fp8.FP8_WEIGHTS] = fp8_weights
    guidance = jnp.full(t.shape, guidance_scale, jnp.float32) if net.params.guidance_embed else None
    return net.apply(
        variables, x_t, batch["img_ids"], batch["txt"], batch["txt_ids"], t, batch["y"], guidance
    )


def split_micro_batches(batch: dict, num_micro: int, micro_batch_size: int) -> dict:
    """(B, ...) arrays -> (num_micro, B / num_micro, ...) micro batches. Each device keeps its own
    rows: row block d of the global batch is device d's shard, so micro batch k takes rows
    k*mb..(k+1)*mb of every block."""

    def split(x):
        dp = x.shape[0] // (num_micro * micro_batch_size)
        x = x.reshape((dp, num_micro, micro_batch_size) + x.shape[1:])
        return x.swapaxes(0, 1).reshape((num_micro, dp * micro_batch_size) + x.shape[3:])

    return jax.tree.map(split, batch)


def make_train_step(config, net: model.Flux, tx: optax.GradientTransformation, num_micro: int, use_fp8: bool):
    """(state, batch) -> (state, metrics). Gradient accumulation scans over num_micro micro batches.

    The metrics are the loss, the gradient norm, whether both were finite and the step's scheduled
    learning rate (``optim.lr_schedule`` at the step count), so logging needs no computation of its own.

    A step with a non-finite loss or gradient norm leaves params, opt_state and fp8_meta untouched.
    With accumulation and ``config.fp8_cache_weights``, each FP8 kernel is cast once per step, not
    once per micro batch (Transformer Engine's ``is_first_microbatch``); the result is the same.
    """
    cache_weights = use_fp8 and num_micro > 1 and bool(config.get("fp8_cache_weights", True))
    spec = fp8.spec_from_config(config) if cache_weights else None
    schedule = optim.lr_schedule(config)

    def loss_fn(params, fp8_meta, batch, fp8_weights):
        x_t, target = flow.noise(batch["img"], batch["eps"], batch["t"])
        meta = fp8.as_max_grad(fp8_meta) if use_fp8 else {}
        pred = forward(net, params, meta, batch, batch["t"], x_t, config.guidance_scale, fp8_weights)
        return flow.loss(pred, target)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1))

    def micro_grads(params, fp8_meta, batch, fp8_weights=None):
        loss, (g, new_meta) = grad_fn(params, fp8_meta, batch, fp8_weights)
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
            weights = fp8.cast_kernels(params, fp8_meta, spec, net.dtype) if cache_weights else None

            def body(carry, inputs):
                loss_sum, g_sum, meta_max = carry
                loss, g, new_meta = micro_grads(params, fp8_meta, inputs, weights)
                meta_max = fp8.merge_states(meta_max, new_meta) if use_fp8 else meta_max
                return (loss_sum + loss, jax.tree.map(jnp.add, g_sum, g), meta_max), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            init = (jnp.zeros((), jnp.float32), zeros, fp8_meta)
            if use_fp8:
                # Start below any real amax so the merge keeps only this step's values.
                init = (init[0], zeros, jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), fp8_meta))
            micro_batches = split_micro_batches(batch, num_micro, config.micro_batch_size)
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
        lr = schedule(state["step"])
        return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": finite, "lr": lr}

    return step


def make_eval_step(config, net: model.Flux, num_micro: int, use_fp8: bool):
    """(params, fp8_meta, batch, rng, index, totals) -> (totals, loss, per_timestep_loss).

    ``totals`` = ((8,) loss sums, (8,) counts) per validation timestep over the pass so far (zeros
    before its first batch); the noise of batch ``index`` is drawn from ``fold_in(rng, index)``. The
    returned loss and (8,) per-timestep losses are ``flow.validation_loss`` of the new totals, so a
    pass reads two small arrays after its last batch and runs nothing else.

    The forward runs over the train step's micro batches (``num_micro`` of ``micro_batch_size`` rows
    per data-parallel replica), so its GEMMs have the shapes the train step's forward has and the
    compiler meets them again (GPU autotuning results are reused) instead of tuning a second set.
    """

    def body(params, fp8_meta, totals, mb):
        x_t, target = flow.noise(mb["img"], mb["eps"], mb["t"])
        pred = forward(net, params, fp8_meta if use_fp8 else {}, mb, mb["t"], x_t, config.guidance_scale)
        sums, counts = flow.accumulate_by_timestep(flow.per_sample_loss(pred, target), mb["timestep"])
        return (totals[0] + sums, totals[1] + counts)

    def step(params, fp8_meta, batch, rng, index, totals):
        x0 = batch["img"]
        eps = jax.random.normal(jax.random.fold_in(rng, index), x0.shape, x0.dtype)
        batch = batch | {"t": flow.validation_timesteps(batch["timestep"]), "eps": eps}
        if num_micro == 1:
            totals = body(params, fp8_meta, totals, batch)
        else:
            micro_batches = split_micro_batches(batch, num_micro, config.micro_batch_size)
            totals, _ = jax.lax.scan(
                lambda tot, mb: (body(params, fp8_meta, tot, mb), None), totals, micro_batches
            )
        return (totals, *flow.validation_loss(*totals))

    return step
