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


def aot_config(args):
    """The flux_12b config at flux-dev (guidance) with this command's depth, mesh, remat and shapes."""
    from configs import flux_12b

    c = flux_12b.get_config()
    c.model.preset = "flux-dev"
    c.model.depth, c.model.depth_single_blocks = args.depth, args.single  # None: the preset's 19 + 38
    c.model.attention = "xla"  # compiled on the CPU host
    c.model.scan_blocks = args.scan
    c.recompute_granularity = None if args.remat == "none" else args.remat
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = args.data, args.fsdp, args.tensor
    c.data.image_size, c.data.txt_len = args.image_size, args.txt_len
    c.micro_batch_size = c.global_batch_size = args.batch
    return c


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    import jax

    from flux_jax import setup

    run = setup.build(aot_config(args), jax.devices()[: args.devices])
    report = aot_step_memory(run, batch=args.batch)
    print(f"mesh {dict(run.mesh.shape)}  depth {run.fp.depth}+{run.fp.depth_single_blocks}")
    for key, value in report.items():
        print(f"  {key:28s} {value / 2**30:10.3f} GiB" if key.endswith("bytes") else f"  {key:28s} {value}")


def aot_step_memory(run, batch: int):
    """Lowers and compiles value_and_grad of an MSE loss at the run's shapes; returns per-device byte
    counts."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from flux_jax import setup, sharding

    model, mesh, p = run.net, run.mesh, run.fp
    img_len, txt_len = run.shapes["img"].shape[1], run.shapes["txt"].shape[1]
    batch_sharding = sharding.batch_sharding(mesh)
    shapes = setup.input_shapes(p, batch, img_len, txt_len)
    shapes |= {"timesteps": jax.ShapeDtypeStruct((batch,), jnp.float32)}
    if p.guidance_embed:
        shapes["guidance"] = jax.ShapeDtypeStruct((batch,), jnp.float32)
    inputs = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=batch_sharding) for k, s in shapes.items()}
    abstract, shardings = setup.abstract_state(run)
    params, shardings = abstract["params"], shardings["params"]
    target = jax.ShapeDtypeStruct((batch, img_len, p.out_channels), jnp.float32, sharding=batch_sharding)

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
