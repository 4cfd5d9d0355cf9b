"""Config validation: every invalid field of a run config in one ValueError, before anything compiles.

Each message names the field (dotted, as on the command line: ``--config.data.image_size=...``),
the value given and what is allowed; FP8 fields are checked against the platform by
``fp8.validate_config``.
"""

from flux_jax import flow, fp8, model, optim, sharding

_CHOICES = {
    "model.dtype": ("bfloat16", "float32"),
    "model.attention": ("xla", "cudnn"),
    "recompute_granularity": (None, "selective", "full"),
    "fp8": (None, "e4m3", "hybrid"),
    "lr_decay_style": optim.DECAY_STYLES,
    "timestep_sampling": flow.TIMESTEP_METHODS,
    "on_nonfinite": ("stop", "bf16"),
    "data.source": ("toy", "shards", "mock"),
}


# Fields that may be None: their configs declare them placeholder(str) so that the command line
# can set them, which also means `--config.fp8=None` arrives as the string "None".
OPTIONAL_STR_FIELDS = tuple(field for field, choices in _CHOICES.items() if None in choices)


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
    config, num_devices: int | None = None, process_count: int = 1, platform: str | None = None
) -> None:
    """Raises one ValueError listing every invalid field, before anything is compiled.

    With ``num_devices`` / ``process_count`` the batch is checked against the mesh; with ``platform``
    (``fp8.describe_device().platform``: "cuda", "rocm", "cpu", ...) the platform-bound choices.
    """
    bad = []
    if platform is not None and config.model.attention == "cudnn" and platform != "cuda":
        bad.append(
            f"model.attention='cudnn' needs an NVIDIA GPU with cuDNN, and this platform is {platform!r}: "
            "use --config.model.attention=xla"
        )
    for field, choices in _CHOICES.items():
        if _get(config, field) not in choices:
            bad.append(f"{field}={_get(config, field)!r} must be one of {choices}")
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
    if config.fp8 is not None and int(config.fp8_amax_history_len) < 1:
        bad.append(f"fp8_amax_history_len={config.fp8_amax_history_len} must be >= 1 (e.g. 1024)")
    if config.fp8 is not None and config.fp8_recipe not in fp8.RECIPES:
        bad.append(f"fp8_recipe={config.fp8_recipe!r} must be one of {fp8.RECIPES}")
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
        raise ValueError("Invalid config: " + "; ".join(bad) + ".")
    fp8.validate_config(config)


def data_parallel_size(config, num_devices: int) -> int:
    """mesh.data x mesh.fsdp with -1 resolved against the device count (ValueError naming config.mesh
    when the sizes do not fit the devices)."""
    data, fsdp, _ = sharding.mesh_shape(config, num_devices)
    return data * fsdp
