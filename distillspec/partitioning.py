"""Logical-axis partitioning (T5X / flax style) over a 2-D ('data', 'model') device mesh.

Every parameter carries logical axis names (see `distillspec.models.layers`); a rule table maps
each logical name to a mesh axis, or to None for replication. Batches split their leading axis
over 'data'. With `model=1` this is plain data parallelism; with `data=1`, tensor parallelism
(Megatron style: heads, feed-forward width and vocabulary split over 'model').

Single process only: `shard_batch` places host arrays with `jax.device_put`.
"""

from __future__ import annotations

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


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all of `jax.devices()`).

    Raises:
      ValueError: if data * model differs from the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model != len(devices):
        raise ValueError(
            f"mesh data={data} x model={model} = {data * model} devices, but {len(devices)} "
            f"are available; choose data and model (each >= 1) whose product is {len(devices)}"
        )
    # create_device_mesh orders devices by physical topology on TPU; on CPU/GPU it reshapes.
    grid = mesh_utils.create_device_mesh((data, model), devices=devices)
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
