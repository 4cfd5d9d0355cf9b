"""FLUX.1-schnell 12B, MLPerf Training Flux.1 recipe (as Primus' MI355X MLPerf config).

Run (one host of 8 GPUs, FSDP over all of them; see launch/ for multi-host):

    python -m flux_jax.train --config configs/flux_12b.py --workdir runs/12b \
        --config.data.path=/data/cc12m_shards --config.data.val_path=/data/coco_shards
    python -m flux_jax.train --config configs/flux_12b.py:fp8 --workdir runs/12b_fp8 ...

AdamW lr 2e-4 constant after 1600 warmup steps, wd 0.1, betas (0.9, 0.95), eps 1e-8, clip 1.0,
uniform timesteps, CFG dropout 0.1, GBS 512, 256 px (256 image + 256 text tokens). Quality target:
validation loss <= 0.586 (mean over t in {0, 1/8, ..., 7/8}). The model costs about 20.3 TFLOP per
sample (MLPerf's MODEL_TFLOP_PER_SAMPLE); FP8 is hybrid (E4M3 forward, E5M2 gradients) delayed
scaling with history 1, i.e. per-step scales.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 42  # seeds init, timesteps/noise (folded with the step) and the data order

    c.model = ml_collections.ConfigDict()
    c.model.preset = "flux-schnell"  # key of flux_jax.model.PRESETS
    # None keeps the preset's value; set a number to override it.
    c.model.depth = ml_collections.config_dict.placeholder(int)  # double-stream blocks
    c.model.depth_single_blocks = ml_collections.config_dict.placeholder(int)  # single-stream blocks
    c.model.hidden_size = ml_collections.config_dict.placeholder(int)  # model width
    c.model.num_heads = ml_collections.config_dict.placeholder(int)  # attention heads
    c.model.context_in_dim = ml_collections.config_dict.placeholder(int)  # T5 embedding width
    c.model.vec_in_dim = ml_collections.config_dict.placeholder(int)  # pooled CLIP width
    c.model.guidance_embed = ml_collections.config_dict.placeholder(bool)  # dev-style guidance input
    c.model.dtype = "bfloat16"  # compute dtype: "bfloat16" | "float32"
    c.model.scan_blocks = True  # nn.scan over equal blocks: faster compiles for deep models
    c.model.attention = "cudnn"  # "xla" | "cudnn" (jax.nn.dot_product_attention on GPU)
    c.recompute_granularity = "full"  # activation checkpointing: None | "selective" | "full"

    c.fp8 = ml_collections.config_dict.placeholder(str)  # None = BF16 | "e4m3" | "hybrid" (E5M2 grads)
    c.fp8_recipe = "delayed"  # "delayed" | "tensorwise" | "rowwise" | "blockwise" | "mxfp8"
    c.fp8_margin = 0  # scale = max / amax / 2**margin
    c.fp8_amax_history_len = 1  # delayed scaling amax history length
    c.fp8_amax_compute_algo = "most_recent"  # "most_recent" | "max" over the history
    c.fp8_wgrad = True  # False keeps the weight-gradient GEMM in 16 bits
    c.fp8_dot_product_attention = False  # attention stays BF16 unless set
    c.fp8_format_family = "auto"  # "auto" (from the platform) | "ocp" | "fnuz"
    c.fp8_modulation = False  # FP8 also for the per-sample modulation GEMMs (M = batch size)
    c.fp8_cast_kernel = "auto"  # "auto" (jax-triton cast on one NVIDIA GPU, else xla) | "xla" | "triton"
    c.fp8_cache_weights = True  # accumulation: cast FP8 kernels once a step, not per micro batch (+2 B/param)
    c.first_last_layers_bf16 = False  # keep the first/last blocks out of FP8
    c.num_layers_at_start_in_bf16 = 1  # used when first_last_layers_bf16 (double then single blocks)
    c.num_layers_at_end_in_bf16 = 1  # used when first_last_layers_bf16

    c.micro_batch_size = 8  # per data-parallel replica per forward/backward
    c.global_batch_size = 512  # per optimizer step; > micro * dp means gradient accumulation
    c.train_iters = 5000  # optimizer steps
    c.lr = 2e-4  # peak learning rate
    c.min_lr = 2e-4  # unused with constant decay
    c.lr_warmup_iters = 1600  # linear warmup from 0
    c.lr_decay_style = "constant"  # "constant" | "cosine" (to min_lr at train_iters)
    c.weight_decay = 0.1  # AdamW decoupled decay, not applied to biases, norm scales, 1-D params
    c.adam_beta1 = 0.9  # AdamW beta1
    c.adam_beta2 = 0.95  # AdamW beta2
    c.adam_eps = 1e-8  # AdamW epsilon
    c.clip_grad = 1.0  # global-norm gradient clipping (0 disables)

    c.save_interval = 512  # steps between checkpoints (and one at the end)
    c.log_interval = 10  # steps between metrics.jsonl / TensorBoard lines
    c.eval_interval = 512  # steps between validation passes (and one at the end); 0 disables
    c.eval_iters = 10  # validation batches per pass (each spreads over the 8 timesteps)

    c.timestep_sampling = "uniform"  # "uniform" | "logit_normal" | "mode"
    c.logit_mean = 0.0  # logit_normal mean
    c.logit_std = 1.0  # logit_normal std
    c.mode_scale = 1.29  # "mode" sampling scale (SD3)
    c.timestep_shift = 1.0  # static SD3 shift of training timesteps (1 = none)
    c.guidance_scale = 1.0  # guidance value fed to guidance-embedding models during training

    c.max_nonfinite_steps = 10  # stop after this many consecutive non-finite steps
    c.on_nonfinite = "stop"  # "stop" | "bf16" (drop FP8 and carry on)
    c.target_val_loss = 0.586  # MLPerf quality target; stop once reached

    c.data = ml_collections.ConfigDict()
    c.data.source = "shards"  # "toy" (built in) | "shards" | "mock" (flux_jax.data)
    c.data.path = ""  # training shards (source="shards")
    c.data.val_path = ""  # validation shards (source="shards")
    c.data.image_size = 256  # pixels; latents are image_size / 8, tokens (image_size / 16) ** 2
    c.data.txt_len = 256  # text tokens (T5 length)
    c.data.cfg_dropout_prob = 0.1  # probability of an empty caption during training
    c.data.num_workers = 8  # loader worker processes (shards)
    c.data.shuffle = True  # shuffle shards
    c.data.log_ids = False  # write the sample ids of every step to WORKDIR/data_ids/process_<i>.jsonl

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel size (-1 = all remaining devices)
    c.mesh.fsdp = -1  # parameter/optimizer sharding size
    c.mesh.tensor = 1  # tensor-parallel size

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.max_to_keep = 3  # recent checkpoints kept
    c.checkpoint.keep_period = ml_collections.config_dict.placeholder(int)  # also keep every N steps
    c.checkpoint.async_save = True  # write checkpoints in the background
    c.init_from = ""  # converted weights to start from (empty = random init)

    if arg == "fp8":
        # MLPerf FP8: hybrid formats, delayed scaling with a one-step history.
        c.fp8 = "hybrid"
    elif arg:
        raise ValueError(f"configs/flux_12b.py: unknown argument {arg!r}; use nothing or 'fp8'.")
    return c
