"""Device mesh, logical-axis rules and sharded initialisation.

The mesh has three axes: ``data`` (pure data parallelism, parameters replicated), ``fsdp``
(data parallelism with parameters and optimizer state sharded along the model width) and
``tensor`` (Megatron-style tensor parallelism: fused qkv / MLP-in kernels are column-parallel,
attention-out / MLP-out kernels row-parallel). The model names its parameter dimensions with
logical names; the rules below bind those names to mesh axes so the model never mentions the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

# Order matters: for each array dimension the first rule whose mesh axes are still free in that
# array (and divide the dimension) wins, so a name may appear twice with a fallback.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters.
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("qkv", "tensor"),
    ("heads", "tensor"),
    ("mod", "tensor"),
    ("in", None),
    ("layers", None),
    # Activations.
    ("act_batch", ("data", "fsdp")),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_qkv", "tensor"),
    ("act_mod", "tensor"),
    ("act_kv", None),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Fills the one -1 entry with the devices left over; checks the product."""
    unknown = [name for name in MESH_AXES if sizes[name] == -1]
    if len(unknown) > 1:
        raise UserError(
            f"config.mesh: at most one of data/fsdp/tensor may be -1, got {dict(sizes)}; "
            "set the others to explicit sizes."
        )
    for name in MESH_AXES:
        if sizes[name] != -1 and sizes[name] < 1:
            raise UserError(f"config.mesh.{name} must be a positive size or -1, got {sizes[name]}.")
    known = math.prod(sizes[name] for name in MESH_AXES if sizes[name] != -1)
    shape = dict(sizes)
    if unknown:
        if num_devices % known:
            raise UserError(
                f"config.mesh: the fixed sizes {dict(sizes)} multiply to {known}, which does not divide "
                f"the {num_devices} devices; choose sizes whose product divides {num_devices}."
            )
        shape[unknown[0]] = num_devices // known
    elif known != num_devices:
        raise UserError(
            f"config.mesh.data * config.mesh.fsdp * config.mesh.tensor = {known} ({dict(sizes)}) but "
            f"there are {num_devices} devices; make the product equal {num_devices} or set one to -1."
        )
    return shape["data"], shape["fsdp"], shape["tensor"]


def _split_over_hosts(shape: tuple[int, int, int], num_hosts: int) -> tuple[tuple, tuple]:
    """Splits (data, fsdp, tensor) into per-host (ICI) and across-host (DCN) factors.

    Hosts are spread over ``data`` first, then ``fsdp``: data-parallel gradient reductions are
    the cheapest traffic to send over the slower inter-host network. ``tensor`` stays in a host.
    """
    data, fsdp, tensor = shape
    dcn_data = math.gcd(data, num_hosts)
    dcn_fsdp = num_hosts // dcn_data
    if fsdp % dcn_fsdp:
        raise UserError(
            f"config.mesh: data={data} x fsdp={fsdp} cannot be split over {num_hosts} hosts (tensor "
            f"parallelism stays within a host); make data * fsdp a multiple of {num_hosts} with the "
            "host count dividing data, or data times a divisor of fsdp."
        )
    return (data // dcn_data, fsdp // dcn_fsdp, tensor), (dcn_data, dcn_fsdp, 1)


def mesh_shape(config: Any, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) from ``config.mesh`` with -1 resolved; ValueError naming config.mesh."""
    return resolve_mesh_shape({name: int(config.mesh[name]) for name in MESH_AXES}, num_devices)


def make_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ("data", "fsdp", "tensor") mesh from ``config.mesh``; -1 takes the rest."""
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    shape = mesh_shape(config, len(devices))
    num_hosts = len({d.process_index for d in devices})
    if num_hosts > 1:
        ici_shape, dcn_shape = _split_over_hosts(shape, num_hosts)
        local = len(devices) // num_hosts
        if shape[2] > local:
            raise UserError(
                f"config.mesh.tensor={shape[2]} exceeds the {local} devices of one host; tensor "
                "parallelism must stay within a host."
            )
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices=devices, process_is_granule=True, allow_split_physical_axes=True
        )
    else:
        try:
            device_array = mesh_utils.create_device_mesh(
                shape, devices=devices, allow_split_physical_axes=True
            )
        except (ValueError, NotImplementedError):
            # Topology-aware placement only exists for some platforms; a plain reshape is
            # what it would do on a single-host GPU or CPU anyway.
            device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, MESH_AXES)


def parse_rules(text: str) -> Rules:
    """``config.logical_axis_rules`` text -> rules: "name=axis,name=axis+axis,name=none".

    ``+`` joins several mesh axes for one dimension; ``none`` (or nothing after ``=``) replicates it.
    Raises one ValueError naming every bad entry.
    """
    known = {name for name, _ in DEFAULT_RULES}
    rules, bad = [], []
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        name, eq, value = (x.strip() for x in item.partition("="))
        axes = tuple(a.strip() for a in value.split("+")) if value.lower() not in ("", "none") else None
        if not eq or name not in known:
            bad.append(f"{item!r} (the name must be one of {sorted(known)}, as name=axis)")
        elif axes is not None and not set(axes) <= set(MESH_AXES):
            bad.append(f"{item!r} (mesh axes are {'/'.join(MESH_AXES)}, joined with '+', or none)")
        else:
            rules.append((name, None if axes is None else axes[0] if len(axes) == 1 else axes))
    if bad:
        raise UserError(
            f"logical_axis_rules={text!r}: bad entries {', '.join(bad)}; e.g. "
            "--config.logical_axis_rules='embed=none,act_batch=data+fsdp'"
        )
    return tuple(rules)


def rules_from_config(config: Any) -> Rules:
    """``config.logical_axis_rules`` before DEFAULT_RULES, whose rules for the names it binds drop out."""
    given = parse_rules(config.get("logical_axis_rules", "") or "")
    bound = {name for name, _ in given}
    return given + tuple(rule for rule in DEFAULT_RULES if rule[0] not in bound)


def _axis_size(mesh: Mesh, axes: str | tuple[str, ...]) -> int:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in names)


def logical_to_spec(
    names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """Maps one array's logical dimension names to a PartitionSpec for ``mesh``.

    A dimension whose size the mesh axis does not divide is replicated instead: XLA cannot
    shard such a parameter evenly and small layers (e.g. img_in's 64 inputs) are cheap to copy.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axis names {tuple(names)} do not match the array shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, size in zip(names, shape):
        chosen = None
        if name is not None:
            for rule_name, axes in rules:
                if rule_name != name or axes is None:
                    continue
                flat = (axes,) if isinstance(axes, str) else tuple(axes)
                if not set(flat) <= set(mesh.axis_names):
                    continue
                if used.intersection(flat) or size % _axis_size(mesh, axes):
                    continue
                chosen = axes
                used.update(flat)
                break
        spec.append(chosen)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation to the layout its logical dimension names map to on the current mesh.

    The mesh is the one set with ``jax.set_mesh`` and the rules those of ``nn.logical_axis_rules``,
    with DEFAULT_RULES for the names they leave out (rules that only rebind parameter axes must not
    replicate the batch); without a mesh this is the identity, so single-device code runs
    unchanged. Dimensions the mesh axis does not divide stay replicated, as for parameters.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    rules = tuple(nn.get_logical_axis_rules())
    bound = {name for name, _ in rules}
    rules += tuple(rule for rule in DEFAULT_RULES if rule[0] not in bound)
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def unbox(tree: Any) -> Any:
    """Strips logical-partitioning boxes without adding sharding constraints."""
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if _is_box(x) else x, tree, is_leaf=_is_box)


def param_shardings(abstract_variables: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """NamedSharding pytree matching ``unbox(abstract_variables)``.

    Leaves boxed with nn.with_logical_partitioning get their rule-mapped spec; everything else
    (fp8_meta amax histories and scales, scalars) is replicated.
    """

    def leaf(x: Any) -> NamedSharding:
        if isinstance(x, nn.LogicallyPartitioned):
            value = x.value
            names = x.names
            if len(names) < len(value.shape):
                # Boxes added inside nn.scan carry their names before the scan axis is inserted.
                names = (None,) * (len(value.shape) - len(names)) + tuple(names)
            return NamedSharding(mesh, logical_to_spec(names, value.shape, mesh, rules))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(leaf, abstract_variables, is_leaf=_is_box)


def sharded_init(
    init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> tuple[Any, Any]:
    """Initialises variables directly into their shards; returns (unboxed variables, shardings).

    The shapes come from eval_shape, so the full model never exists on one device.
    """
    abstract = jax.eval_shape(init_fn, rng)
    shardings = param_shardings(abstract, mesh, rules)

    def init(r):
        with nn.logical_axis_rules(rules):
            return unbox(init_fn(r))

    with jax.set_mesh(mesh):
        variables = jax.jit(init, out_shardings=shardings)(rng)
    return variables, shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over data and fsdp; the rest replicated (over tensor too)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def host_local_batch_to_global(batch: Any, mesh: Mesh) -> Any:
    """Assembles each host's slice of the batch (numpy) into global jax.Arrays."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)
