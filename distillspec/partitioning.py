"""Logical-axis partitioning (T5X / flax style) over a 2-D ('data', 'model') device mesh.

Every parameter carries logical axis names (see `distillspec.models.layers`); a rule table maps
each logical name to a mesh axis, or to None for replication. Batches split their leading axis
over 'data'. With `model=1` this is plain data parallelism; with `data=1`, tensor parallelism
(Megatron style: heads, feed-forward width and vocabulary split over 'model'). `FSDP_RULES`
also split every parameter's 'embed' dimension over 'data' (T5X's 2-D parameter partitioning,
FSDP style): each device then holds about 1 / (data x model) of the parameters.

Multi-process: the mesh spans every process's devices, each process's devices a contiguous
block of batch rows (`process_rows`); `assemble_batch` builds global arrays from each process's
own rows, and `data_shards` says which data shards a process reads. `shard_batch` instead
places a whole host batch that every process holds.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

MESH_AXES = ("data", "model")

# Rules are tried in order; flax assigns each mesh axis at most once per array, so e.g. a
# [vocab, embed] table splits vocab over 'model' and leaves embed whole.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),
    ("mlp", "model"),
    # Under GQA there are often fewer kv heads than model shards; replicating K/V is the safe
    # choice and costs little (they are the small projections).
    ("kv_heads", None),
    ("embed", None),
    ("kv", None),
    ("layers", None),
    ("abspos", None),
    ("relpos_buckets", None),
    ("length", None),
)
# DEFAULT_RULES with parameters' 'embed' dimension also split over 'data' (FSDP style).
FSDP_RULES: tuple[tuple[str, str | None], ...] = tuple(
    (name, "data" if name == "embed" else axis) for name, axis in DEFAULT_RULES
)


def param_rules(fsdp: bool) -> Rules:
    """The parameter rules: FSDP_RULES with parameter sharding over 'data', else DEFAULT_RULES."""
    return FSDP_RULES if fsdp else DEFAULT_RULES


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all of `jax.devices()`).

    Raises:
      ValueError: if data * model differs from the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model != len(devices):
        processes = jax.process_count()
        where = (
            f" ({processes} processes x {jax.local_device_count()} local devices)"
            if processes > 1
            else ""
        )
        raise ValueError(
            f"mesh data={data} x model={model} = {data * model} devices, but {len(devices)} "
            f"are available{where}; choose data and model (each >= 1) whose product is "
            f"{len(devices)}"
        )
    if jax.process_count() > 1:
        # Each process's devices in one block (CPU and GPU reshape the list as given).
        devices.sort(key=lambda d: (d.process_index, d.id))
    # create_device_mesh orders devices by physical topology on TPU; on CPU/GPU it reshapes.
    grid = mesh_utils.create_device_mesh(
        (data, model), devices=devices, contiguous_submeshes=jax.process_count() > 1
    )
    return Mesh(grid, MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over 'data'; for [B, ...] arrays."""
    return NamedSharding(mesh, PartitionSpec("data"))


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Places each [B, ...] array of `batch` with `batch_sharding`; 0-d values are replicated.

    Raises:
      ValueError: if a batch dimension is not divisible by the mesh's 'data' size.
    """
    data = mesh.shape["data"]
    out = {}
    for name, value in batch.items():
        value = np.asarray(value) if not isinstance(value, jax.Array) else value
        if value.ndim == 0:
            out[name] = jax.device_put(value, replicated(mesh))
            continue
        if value.shape[0] % data:
            raise ValueError(
                f"batch[{name!r}] has batch size {value.shape[0]}, not divisible by the mesh's "
                f"data axis ({data}); use a batch size that is a multiple of {data}"
            )
        out[name] = jax.device_put(value, batch_sharding(mesh))
    return out


def _process_row_ranges(mesh: Mesh | None, batch_size: int) -> dict[int, tuple[int, int]]:
    """{process index: [start, stop) of the batch rows its devices hold}."""
    if mesh is None:
        return {jax.process_index(): (0, batch_size)}
    rows: dict[int, set[int]] = collections.defaultdict(set)
    for device, index in batch_sharding(mesh).devices_indices_map((batch_size,)).items():
        rows[device.process_index].update(range(*index[0].indices(batch_size)))
    ranges = {}
    for process, held in sorted(rows.items()):
        start, stop = min(held), max(held) + 1
        if len(held) != stop - start:
            raise ValueError(
                f"process {process} holds batch rows {sorted(held)} of mesh {dict(mesh.shape)}, "
                "not one block; choose a mesh whose 'model' axis divides (or is a multiple of) "
                "each process's number of devices"
            )
        ranges[process] = (start, stop)
    return ranges


def process_rows(mesh: Mesh | None, batch_size: int) -> tuple[int, int]:
    """[start, stop) of the rows of a [batch_size, ...] global batch this process holds."""
    return _process_row_ranges(mesh, batch_size)[jax.process_index()]


def data_shards(
    mesh: Mesh | None, batch_size: int, num_shards: int | None = None
) -> tuple[int, list[int]]:
    """How the training split is read: (shards in all, the shard indices this process reads).

    Shard k supplies rows [k B / K, (k + 1) B / K) of every global batch of B rows. By default
    K is the number of data-parallel process groups (processes that hold the same rows, being
    model-parallel replicas of each other, read the same shards): 1 in a single process.

    Raises:
      ValueError: if processes hold overlapping or unequal blocks of rows, or `num_shards` is
        not a multiple of the default that divides the batch size.
    """
    ranges = _process_row_ranges(mesh, batch_size)
    blocks = sorted(set(ranges.values()))
    if (
        any(a[1] > b[0] for a, b in zip(blocks, blocks[1:]))
        or len({stop - start for start, stop in blocks}) > 1
    ):
        raise ValueError(
            f"processes hold overlapping or unequal blocks of batch rows {ranges} of mesh "
            f"{dict(mesh.shape)}; choose a mesh whose 'model' axis divides (or is a multiple of) "
            "each process's number of devices"
        )
    default = len(blocks)
    shards = default if num_shards is None else num_shards
    if shards % default or batch_size % shards:
        raise ValueError(
            f"LoopConfig.data_shards ({shards}) must be a multiple of the {default} "
            f"data-parallel process group(s) and divide the batch size ({batch_size})"
        )
    start, stop = ranges[jax.process_index()]
    per_shard = batch_size // shards
    return shards, list(range(start // per_shard, stop // per_shard))


def assemble_batch(
    local: Mapping[str, np.ndarray], mesh: Mesh, batch_size: int
) -> dict[str, jax.Array]:
    """Global [batch_size, ...] arrays split over 'data' from this process's rows of each.

    Args:
      local: {name: this process's rows (`process_rows`) of a [batch_size, ...] array}.
      mesh: the device mesh.
      batch_size: the global batch size.
    """
    sharding = batch_sharding(mesh)
    return {
        name: jax.make_array_from_process_local_data(
            sharding, np.asarray(value), (batch_size, *np.shape(value)[1:])
        )
        for name, value in local.items()
    }


def init_sharded(model, rng: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """`model.init(rng)` created directly in its shardings: no device or host holds it whole."""
    abstract = jax.eval_shape(model.init, rng)
    shardings = shardings_for(abstract, model.logical_axes(), mesh, rules)
    return jax.jit(model.init, out_shardings=shardings)(rng)


def bytes_per_device(tree: PyTree) -> dict[jax.Device, int]:
    """Bytes of `tree`'s jax.Array leaves on each of this process's devices."""
    out: dict[jax.Device, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.device] += shard.data.nbytes
    return dict(out)


def describe_bytes(name: str, tree: PyTree) -> str:
    """'<name>: X MiB per device (largest of this process's N devices) of Y MiB in all'."""
    total = sum(
        math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )
    per_device = bytes_per_device(tree)
    largest = max(per_device.values(), default=0)
    share = f" (1/{total / largest:.1f})" if largest else ""
    return (
        f"{name}: {largest / 2**20:.3f} MiB per device (largest of this process's "
        f"{len(per_device)} devices) of {total / 2**20:.3f} MiB in all{share}"
    )


def _check_known(spec: PartitionSpec, rules: Rules) -> None:
    """Unknown logical names would silently replicate; a typo deserves an error instead."""
    known = {name for name, _ in rules}
    for name in spec:
        if isinstance(name, str) and name not in known:
            raise ValueError(
                f"logical axis {name!r} (in {spec}) has no partitioning rule; known axes: "
                f"{sorted(known)}. Add a rule ({name!r}, None) to replicate it."
            )


def _mesh_axis_size(mesh: Mesh, axis: str | tuple[str, ...] | None) -> int:
    if axis is None:
        return 1
    names = (axis,) if isinstance(axis, str) else axis
    return math.prod(mesh.shape[n] for n in names)


def logical_to_mesh_spec(
    logical: PartitionSpec,
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Mesh PartitionSpec for one array with logical axis names `logical`.

    If `shape` is given, a dimension whose size is not divisible by its mesh axis size is
    replicated instead (e.g. 2 kv heads on a 4-way 'model' axis), and this is logged.
    """
    _check_known(logical, rules)
    axes = list(nn.logical_to_mesh_axes(tuple(logical), rules))
    if shape is not None:
        for dim, axis in enumerate(axes):
            size = _mesh_axis_size(mesh, axis)
            if shape[dim] % size:
                logging.info(
                    "Replicating dim %d (%r, size %d) of a %s array: not divisible by mesh "
                    "axis %r of size %d.",
                    dim,
                    logical[dim],
                    shape[dim],
                    tuple(shape),
                    axis,
                    size,
                )
                axes[dim] = None
    return PartitionSpec(*axes)


def shardings_for(
    params: PyTree, logical_axes: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PyTree:
    """NamedShardings for `params`, replicating any dimension its mesh axis does not divide.

    Args:
      params: pytree of arrays or `jax.ShapeDtypeStruct`s (only shapes are read; use
        `jax.eval_shape(model.init, rng)` to avoid materialising the parameters).
      logical_axes: matching pytree of logical PartitionSpecs, e.g. `model.logical_axes()`.
      mesh: the device mesh.
      rules: logical-name -> mesh-axis rules.

    Raises:
      ValueError: if the trees differ in structure, or a spec's length differs from its
        array's rank.
    """
    specs, spec_tree = jax.tree.flatten(
        logical_axes, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    param_tree = jax.tree.structure(params)
    if spec_tree != param_tree:
        raise ValueError(
            f"params and logical_axes differ in structure:\n{param_tree}\nvs\n{spec_tree}"
        )
    shardings = []
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params), specs):
        if len(spec) != len(leaf.shape):
            raise ValueError(
                f"param {jax.tree_util.keystr(path)} has shape {leaf.shape} but logical axes "
                f"{spec} of a different rank"
            )
        shardings.append(NamedSharding(mesh, logical_to_mesh_spec(spec, mesh, rules, leaf.shape)))
    return jax.tree.unflatten(param_tree, shardings)
