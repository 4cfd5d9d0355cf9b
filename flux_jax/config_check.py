"""Config validation: every invalid field of a run config in one UserError, before anything compiles.

The one validation entry for a run config: each message names the field (dotted, as on the command
line: ``--config.data.image_size=...``), the value given and what is allowed. FP8 fields are checked
against the device by ``fp8.config_problems`` and the logical-axis rules by ``sharding.parse_rules``;
their problems join the same error.
"""

from flux_jax import choices, flow, fp8, model, optim, sharding
from flux_jax.errors import UserError, block

_CHOICES = {
    "model.dtype": ("bfloat16", "float32"),
    "model.attention": choices.ATTENTION_CHOICES,
    "recompute_granularity": (None, "selective", "full"),
    "lr_decay_style": optim.DECAY_STYLES,
    "timestep_sampling": flow.TIMESTEP_METHODS,
    "on_nonfinite": ("stop", "bf16"),
    "data.source": ("toy", "shards", "mock"),
}


# Fields that may be None: their configs declare them placeholder(str) so that the command line
# can set them, which also means `--config.fp8=None` arrives as the string "None".
OPTIONAL_STR_FIELDS = ("fp8",) + tuple(field for field, choices in _CHOICES.items() if None in choices)


def none_from_command_line(config):
    """Turns the string "None" (``--config.fp8=None``) back into None in the optional fields."""
    for field in OPTIONAL_STR_FIELDS:
        if isinstance(config.get(field), str) and config[field].lower() == "none":
            config[field] = None
    return config


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def validate(
    config,
    num_devices: int | None = None,
    process_count: int = 1,
    platform: str | None = None,
    desc: fp8.DeviceDescription | None = None,
) -> None:
    """Raises one UserError listing every invalid field (FP8 ones too), before anything is compiled.

    With ``num_devices`` / ``process_count`` the batch is checked against the mesh; with ``desc`` (a
    platform description, ``fp8.describe_device()``) or just ``platform`` ("cuda", "rocm", "cpu", ...)
    the platform-bound choices: an explicit attention or FP8 choice the platform cannot run is an
    error, ``"auto"`` always passes (``choices.resolve`` picks what runs). FP8 fields are checked against
    ``desc``, else against this machine's device.
    """
    bad = []
    where = desc or (fp8.DeviceDescription(platform) if platform is not None else None)
    if where is not None and (reason := choices.attention_error(config.model.attention, where)):
        bad.append(reason)
    for field, allowed in _CHOICES.items():
        if field != "fp8" and _get(config, field) not in allowed:  # fp8: fp8.config_problems
            bad.append(f"{field}={_get(config, field)!r} must be one of {allowed}")
    if config.model.preset not in model.PRESETS:
        bad.append(f"model.preset={config.model.preset!r} must be one of {sorted(model.PRESETS)}")
    positive = ("micro_batch_size", "global_batch_size", "train_iters", "log_interval", "max_nonfinite_steps")
    for field in positive:
        if int(_get(config, field)) < 1:
            bad.append(f"{field}={_get(config, field)} must be >= 1")
    for field in ("lr_warmup_iters", "save_interval", "eval_interval", "weight_decay", "clip_grad", "min_lr"):
        if _get(config, field) < 0:
            bad.append(f"{field}={_get(config, field)} must be >= 0")
    if config.lr <= 0 or config.min_lr > config.lr:
        bad.append(f"lr={config.lr}, min_lr={config.min_lr}: need 0 < lr and min_lr <= lr")
    for field in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= _get(config, field) < 1.0:
            bad.append(f"{field}={_get(config, field)} must be in [0, 1)")
    if config.adam_eps <= 0 or config.logit_std <= 0 or config.timestep_shift <= 0:
        bad.append("adam_eps, logit_std and timestep_shift must be > 0")
    if config.get("adam_moments_dtype", "float32") not in optim.MOMENT_DTYPES:
        bad.append(f"adam_moments_dtype={config.adam_moments_dtype!r} must be one of {optim.MOMENT_DTYPES}")
    if config.eval_interval > 0 and config.eval_iters < 1:
        bad.append(f"eval_iters={config.eval_iters} must be >= 1 when eval_interval > 0")
    if config.data.image_size % 16:
        bad.append(f"data.image_size={config.data.image_size} must be a multiple of 16")
    if not 0.0 <= config.data.cfg_dropout_prob <= 1.0:
        bad.append(f"data.cfg_dropout_prob={config.data.cfg_dropout_prob} must be in [0, 1]")
    bad += [problem.removeprefix("config.") for problem in fp8.config_problems(config, desc)]
    try:
        sharding.parse_rules(config.get("logical_axis_rules", "") or "")
    except ValueError as err:
        bad.append(str(err))
    if num_devices is not None:
        try:
            dp = data_parallel_size(config, num_devices)
        except ValueError as err:
            bad.append(str(err).rstrip("."))
            dp = None
        if (
            dp is not None
            and config.micro_batch_size >= 1
            and (
                config.global_batch_size % (config.micro_batch_size * dp)
                or config.global_batch_size % process_count
            )
        ):
            bad.append(
                f"global_batch_size={config.global_batch_size} must be divisible by micro_batch_size "
                f"({config.micro_batch_size}) x data-parallel size ({dp}) and by the {process_count} hosts"
            )
    if bad:
        raise UserError(block("Invalid config", bad, "Set each with --config.FIELD=VALUE."))


def data_parallel_size(config, num_devices: int) -> int:
    """mesh.data x mesh.fsdp with -1 resolved against the device count (ValueError naming config.mesh
    when the sizes do not fit the devices)."""
    data, fsdp, _ = sharding.mesh_shape(config, num_devices)
    return data * fsdp
