"""Ahead-of-time compile of a FLUX.1-dev training step (forward + backward) for a device mesh.

Nothing is allocated: parameters and inputs are abstract, so this runs on a CPU host and reports
what each device of the target mesh would need (XLA's memory_analysis of the compiled step).

  python benchmarks/aot_12b.py --devices 8 --fsdp 8 --batch 8                 # full 19+38 depth
  python benchmarks/aot_12b.py --devices 8 --fsdp 4 --tensor 2 --depth 2 --single 4
"""

import argparse
import os
import sys


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="host-platform devices to fake (CPU)")
    p.add_argument("--data", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=-1)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--image-size", type=int, default=512, help="pixels; latent tokens = (size/16)^2")
    p.add_argument("--txt-len", type=int, default=512)
    p.add_argument("--depth", type=int, default=None, help="double blocks (default: preset, 19)")
    p.add_argument("--single", type=int, default=None, help="single blocks (default: preset, 38)")
    p.add_argument("--remat", choices=["none", "selective", "full"], default="full")
    p.add_argument("--scan", action="store_true", help="scan over blocks (faster compile)")
    return p.parse_args(argv)


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    import dataclasses

    import jax
    import jax.numpy as jnp
    import ml_collections

    from flux_jax import sharding
    from flux_jax.model import PRESETS, Flux

    preset = PRESETS["flux-dev"]
    flux_params = dataclasses.replace(
        preset,
        depth=preset.depth if args.depth is None else args.depth,
        depth_single_blocks=preset.depth_single_blocks if args.single is None else args.single,
    )
    config = ml_collections.ConfigDict(
        {"mesh": {"data": args.data, "fsdp": args.fsdp, "tensor": args.tensor}}
    )
    mesh = sharding.make_mesh(config, jax.devices()[: args.devices])
    report = aot_step_memory(
        Flux(
            flux_params,
            dtype=jnp.bfloat16,
            remat=None if args.remat == "none" else args.remat,
            scan_blocks=args.scan,
        ),
        mesh,
        batch=args.batch,
        img_len=(args.image_size // 16) ** 2,
        txt_len=args.txt_len,
    )
    print(f"mesh {dict(mesh.shape)}  depth {flux_params.depth}+{flux_params.depth_single_blocks}")
    for key, value in report.items():
        print(f"  {key:28s} {value / 2**30:10.3f} GiB" if key.endswith("bytes") else f"  {key:28s} {value}")


def aot_step_memory(model, mesh, batch, img_len, txt_len):
    """Lowers and compiles value_and_grad of an MSE loss; returns per-device byte counts."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from flux_jax import sharding

    p = model.params
    f32 = jnp.float32
    shapes = {
        "img": (batch, img_len, p.in_channels),
        "img_ids": (batch, img_len, 3),
        "txt": (batch, txt_len, p.context_in_dim),
        "txt_ids": (batch, txt_len, 3),
        "timesteps": (batch,),
        "y": (batch, p.vec_in_dim),
        "guidance": (batch,),
    }
    if not p.guidance_embed:
        del shapes["guidance"]
    batch_sharding = sharding.batch_sharding(mesh)
    inputs = {k: jax.ShapeDtypeStruct(s, f32, sharding=batch_sharding) for k, s in shapes.items()}
    abstract = jax.eval_shape(lambda r, x: model.init(r, **x), jax.random.key(0), inputs)
    shardings = sharding.param_shardings(abstract, mesh)["params"]
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        sharding.unbox(abstract)["params"],
        shardings,
    )
    target = jax.ShapeDtypeStruct((batch, img_len, p.out_channels), f32, sharding=batch_sharding)

    def loss(params, inputs, target):
        out = model.apply({"params": params}, **inputs)
        return jnp.mean((out - target) ** 2)

    step = jax.jit(jax.value_and_grad(loss), out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings))
    with jax.set_mesh(mesh):
        compiled = step.lower(params, inputs, target).compile()
    mem = compiled.memory_analysis()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    report = {"params": n_params, "param_bytes_unsharded": 4 * n_params}
    for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        report[name.replace("_in_bytes", "_bytes")] = (
            int(getattr(mem, name, 0) or 0) if mem is not None else 0
        )
    return report


if __name__ == "__main__":
    main()
