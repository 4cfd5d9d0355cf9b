"""Every run-config field with its meaning and default; the shipped configs are short variants of it.

``configs/toy.py``, ``flux_535m.py`` and ``flux_12b.py`` start from ``base_config()`` and set only what
their recipe changes, as big_vision and the Flax examples do. A field is added here, once, with its
comment; ``tests/test_config_fields.py`` then asks what it changes. This file is not a run config
itself (it has no ``get_config``).
"""

import ml_collections
from ml_collections.config_dict import placeholder


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, timesteps/noise (folded with the step) and the data order

    c.model = ml_collections.ConfigDict()
    c.model.preset = "flux-schnell"  # key of flux_jax.model.PRESETS
    # None keeps the preset's value; set a number to override it.
    c.model.depth = placeholder(int)  # double-stream blocks
    c.model.depth_single_blocks = placeholder(int)  # single-stream blocks
    c.model.hidden_size = placeholder(int)  # model width
    c.model.num_heads = placeholder(int)  # attention heads
    c.model.context_in_dim = placeholder(int)  # T5 embedding width
    c.model.vec_in_dim = placeholder(int)  # pooled CLIP width
    c.model.guidance_embed = placeholder(bool)  # dev-style guidance input
    c.model.dtype = "bfloat16"  # compute dtype: "bfloat16" | "float32"
    c.model.scan_blocks = False  # nn.scan over equal blocks: faster compiles for deep models
    c.model.attention = "auto"  # "auto" (per platform: flux_jax.choices) | "xla" | "cudnn" | "pallas"
    c.recompute_granularity = placeholder(str)  # activation checkpointing: None | "selective" | "full"

    c.fp8 = placeholder(str)  # None = BF16 | "e4m3" | "hybrid" (E5M2 grads)
    c.fp8_recipe = "delayed"  # "delayed" | "tensorwise" | "rowwise" | "mxfp8" (block-scaled GEMMs only)
    c.fp8_margin = 0  # scale = max / amax / 2**margin
    c.fp8_amax_history_len = 1024  # delayed scaling amax history length
    c.fp8_amax_compute_algo = "most_recent"  # "most_recent" | "max" over the history
    c.fp8_wgrad = True  # False keeps the weight-gradient GEMM in 16 bits
    c.fp8_dot_product_attention = False  # cuDNN FP8 attention; True is refused (RESULTS.md eleventh run)
    c.fp8_format_family = "auto"  # "auto" (from the platform) | "ocp" | "fnuz"
    c.fp8_modulation = False  # FP8 also for the per-sample modulation GEMMs (M = batch size)
    c.fp8_cast_kernel = "auto"  # "auto" (jax-triton cast on NVIDIA, else xla) | "xla" | "triton"
    c.fp8_cache_weights = True  # accumulation: cast FP8 kernels once a step, not per micro batch (+2 B/param)
    c.first_last_layers_bf16 = False  # keep the first/last blocks out of FP8
    c.num_layers_at_start_in_bf16 = 1  # used when first_last_layers_bf16 (double then single blocks)
    c.num_layers_at_end_in_bf16 = 1  # used when first_last_layers_bf16

    c.micro_batch_size = 2  # per data-parallel replica per forward/backward
    c.global_batch_size = 16  # per optimizer step; > micro * dp means gradient accumulation
    c.train_iters = 1000  # optimizer steps
    c.lr = 1e-4  # peak learning rate
    c.min_lr = 1e-5  # cosine floor
    c.lr_warmup_iters = 100  # linear warmup from 0
    c.lr_decay_style = "cosine"  # "constant" | "cosine" (to min_lr at train_iters)
    c.weight_decay = 0.01  # AdamW decoupled decay, not applied to biases, norm scales, 1-D params
    c.adam_beta1 = 0.9  # AdamW beta1
    c.adam_beta2 = 0.999  # AdamW beta2
    c.adam_eps = 1e-8  # AdamW epsilon
    c.adam_moments_dtype = "float32"  # AdamW moments: "float32" | "bfloat16" (stochastic rounding)
    c.clip_grad = 1.0  # global-norm gradient clipping (0 disables)

    c.save_interval = 500  # steps between checkpoints (and one at the end)
    c.log_interval = 10  # steps between metrics.jsonl / TensorBoard lines
    c.eval_interval = 250  # steps between validation passes (and one at the end); 0 disables
    c.eval_iters = 8  # validation batches per pass (each spreads over the 8 timesteps)

    c.timestep_sampling = "logit_normal"  # "uniform" | "logit_normal" | "mode"
    c.logit_mean = 0.0  # logit_normal mean
    c.logit_std = 1.0  # logit_normal std
    c.mode_scale = 1.29  # "mode" sampling scale (SD3)
    c.timestep_shift = 1.0  # static SD3 shift of training timesteps (1 = none)
    c.guidance_scale = 1.0  # guidance value fed to guidance-embedding models during training

    c.max_nonfinite_steps = 10  # stop after this many consecutive non-finite steps
    c.on_nonfinite = "stop"  # "stop" | "bf16" (drop FP8 and carry on)
    c.target_val_loss = placeholder(float)  # stop early once reached

    c.data = ml_collections.ConfigDict()
    c.data.source = "shards"  # "toy" (built in) | "shards" | "mock" (flux_jax.data)
    c.data.path = ""  # training shards (source="shards")
    c.data.val_path = ""  # validation shards (source="shards")
    c.data.image_size = 256  # pixels; latents are image_size / 8, tokens (image_size / 16) ** 2
    c.data.txt_len = 256  # text tokens (T5 length)
    c.data.cfg_dropout_prob = 0.1  # probability of an empty caption during training
    c.data.num_workers = 4  # loader worker processes (shards)
    c.data.shuffle = True  # shuffle shards
    c.data.log_ids = False  # each process writes the sample ids it read to WORKDIR/ids/ (checks)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data-parallel size (-1 = all remaining devices)
    c.mesh.fsdp = 1  # parameter/optimizer sharding size
    c.mesh.tensor = 1  # tensor-parallel size
    # Logical-axis rules put before flux_jax.sharding.DEFAULT_RULES, replacing the defaults of the names
    # they bind: "name=axis,name=axis+axis,name=none", e.g. "embed=none" replicates the model width.
    c.logical_axis_rules = ""  # empty: DEFAULT_RULES alone

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.max_to_keep = 2  # recent checkpoints kept
    c.checkpoint.keep_period = placeholder(int)  # also keep every N steps
    c.checkpoint.async_save = True  # write checkpoints in the background
    c.init_from = ""  # converted weights to start from (empty = random init)
    return c
