"""The PyTorch peer of benchmarks/step.py: the same Flux train step in diffusers + PyTorch.

diffusers' ``FluxTransformer2DModel`` at one of benchmarks/shapes.py's shapes, trained as a PyTorch user
would: float32 weights under BF16 autocast, ``torch.compile``, fused AdamW (weight decay 0.01), global-norm
clipping at 1.0, a flash SDPA kernel, and for ``tensorwise`` / ``rowwise`` torchao's float8 training on
the blocks' token linears (q / k / v / out and the MLPs; the per-sample modulation linears stay BF16, as
``fp8_modulation=False`` keeps ours). Each step is forward, flow-matching MSE, backward, clip, AdamW on a
fixed synthetic device-resident batch; the time is the median of synchronised steps after warm-up.

    python benchmarks/torch_peer.py --shape block --recipes bf16,tensorwise --out peer.json
    python benchmarks/step.py --shape block --recipes bf16,delayed --out ours.json   # same call, same GPU

Needs torch, diffusers and (for the float8 recipes) torchao; none of them is a flux_jax dependency.
"""

import argparse
import json
import statistics
import sys
import time

from benchmarks.shapes import SHAPES, params_for

FLOAT8_RECIPES = ("tensorwise", "rowwise")
BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.")


def model_for(shape: str, torch_device):
    from diffusers import FluxTransformer2DModel

    p = params_for(shape)  # the FLOP count reads the shape's depths from it
    model = FluxTransformer2DModel(
        in_channels=p.in_channels,
        num_layers=p.depth,
        num_single_layers=p.depth_single_blocks,
        attention_head_dim=p.hidden_size // p.num_heads,
        num_attention_heads=p.num_heads,
        joint_attention_dim=p.context_in_dim,
        pooled_projection_dim=p.vec_in_dim,
        guidance_embeds=p.guidance_embed,
        axes_dims_rope=tuple(p.axes_dim),
    )
    return model.to(torch_device), p


def is_block_token_linear(module, name: str) -> bool:
    """torchao's module filter: a Linear in a block, not a modulation (AdaLayerNorm*.linear), with the
    widths a float8 GEMM takes (multiples of 16)."""
    import torch

    return (
        isinstance(module, torch.nn.Linear)
        and name.startswith(BLOCK_PREFIXES)
        and ".norm" not in name
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def to_float8(model, recipe: str) -> int:
    """Converts the block token linears to torchao float8 training; returns how many it converted."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise SystemExit(f"--recipes {recipe} needs torchao (pip install torchao): {e}") from None
    before = {n for n, m in model.named_modules() if is_block_token_linear(m, n)}
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=is_block_token_linear
    )
    after = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    return len(before & after)


def synthetic_batch(p, batch: int, side: int, txt_len: int, torch_device):
    import torch

    g = torch.Generator().manual_seed(0)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(side * side, 3).float()
    data = torch.randn(batch, side * side, p.in_channels, generator=g)
    noise = torch.randn(data.shape, generator=g)
    t = torch.rand(batch, generator=g)
    batch_tensors = {
        "hidden_states": (1 - t[:, None, None]) * data + t[:, None, None] * noise,  # rectified flow x_t
        "encoder_hidden_states": torch.randn(batch, txt_len, p.context_in_dim, generator=g),
        "pooled_projections": torch.randn(batch, p.vec_in_dim, generator=g),
        "timestep": t,
        "img_ids": img_ids,
        "txt_ids": torch.zeros(txt_len, 3),
    }
    target = noise - data  # the velocity
    return {k: v.to(torch_device) for k, v in batch_tensors.items()}, target.to(torch_device)


def sdpa_context(kind: str):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return contextlib.nullcontext() if kind == "default" else sdpa_kernel(backends[kind])


def run_one(shape: str, recipe: str, args) -> dict:
    import torch
    import torch.nn.functional as F

    from flux_jax import metrics

    torch_device = torch.device(args.device)
    on_gpu = torch_device.type == "cuda"
    torch.manual_seed(0)
    depth, single, batch, side, txt_len = SHAPES[shape]
    batch = args.batch or batch
    model, p = model_for(shape, torch_device)
    converted = to_float8(model, recipe) if recipe in FLOAT8_RECIPES else 0
    decay = [q for n, q in model.named_parameters() if q.ndim > 1]
    no_decay = [q for n, q in model.named_parameters() if q.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.999),
        eps=1e-8,
        fused=on_gpu,
    )
    forward = torch.compile(model) if args.compile else model
    inputs, target = synthetic_batch(p, batch, side, txt_len, torch_device)
    params = list(model.parameters())

    def step():
        with sdpa_context(args.sdpa), torch.autocast(torch_device.type, dtype=torch.bfloat16):
            pred = forward(**inputs, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=on_gpu)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = step()
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(max(args.warmup - 1, 0)):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    flops = metrics.train_flops_per_sample(p, side * side, txt_len) * batch
    return {
        "shape": shape,
        "recipe": recipe,
        "framework": "torch",
        "batch": batch,
        "image_tokens": side * side,
        "text_tokens": txt_len,
        "depth": depth,
        "depth_single_blocks": single,
        "ms_per_step": ms,
        "ms_min": 1e3 * min(times),
        "images_per_sec": 1e3 * batch / ms,
        "model_tflops": flops / (ms / 1e3) / 1e12,
        "first_step_s": first_s,
        "float8_linears": converted,
        "allocator_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "loss": float(loss.detach()),
        "compiled": args.compile,
        "sdpa": args.sdpa,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="block", choices=sorted(SHAPES))
    p.add_argument("--recipes", default="bf16,tensorwise", help="comma list of bf16|tensorwise|rowwise")
    p.add_argument("--batch", type=int, default=0, help="batch (default: the shape's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing, the compiling one included")
    p.add_argument("--device", default="cuda", help="torch device (cpu: checks the script, times nothing)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile")
    p.add_argument("--sdpa", default="flash", choices=("flash", "cudnn", "efficient", "math", "default"))
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in ("bf16", *FLOAT8_RECIPES)]
    if unknown:
        p.error(f"--recipes: unknown {unknown}; use bf16, {', '.join(FLOAT8_RECIPES)}")
    results = []
    for recipe in recipes:
        results.append(run_one(args.shape, recipe, args))
        print(json.dumps(results[-1]), flush=True)
        if args.out:  # after each recipe: a run stopped during the next compile keeps this one
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    base = next((r for r in results if r["recipe"] == "bf16"), None)
    head = ("recipe", "ms/step", "img/s", "TFLOP/s", "x bf16", "peak GiB")
    print("{:<12} {:>8} {:>7} {:>8} {:>7} {:>9} float8 linears".format(*head))
    for r in results:
        speedup = f"{base['ms_per_step'] / r['ms_per_step']:.2f}" if base else "-"
        peak = f"{r['allocator_peak_gib']:.2f}" if r["allocator_peak_gib"] is not None else "-"
        row = (r["recipe"], r["ms_per_step"], r["images_per_sec"], r["model_tflops"], speedup, peak)
        print("{:<12} {:>8.2f} {:>7.1f} {:>8.1f} {:>7} {:>9} ".format(*row) + str(r["float8_linears"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
