"""Safetensors checkpoint directories read one tensor at a time, and placed as they are read.

`read_tensors` maps each tensor name of a (possibly sharded) checkpoint directory to its data,
read from disk only when looked up, so a converter that handles one tensor at a time never
holds the whole model. `placer` turns each converted parameter straight into a sharded device
array (`jax.make_array_from_callback`: each process builds only its own devices' shards), which
is how a teacher too large for one host or device is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from distillspec.models.weight_checks import (
    CheckpointError,
    check_finite,
    safetensors_failure,
)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory: the index's, model.safetensors, or all.

    Raises:
      FileNotFoundError: if the directory holds none.
    """
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors files in {path!r} (PyTorch .bin is not supported)."
        )
    return [os.path.join(path, name) for name in files]


def open_file(file: str) -> Any:
    """safetensors' handle of one file (its header read).

    Raises:
      CheckpointError: naming the file, and saying 'truncated' when it is shorter than its
        header declares.
    """
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{file} is missing: the checkpoint {os.path.dirname(file)!r} "
            "lists it (model.safetensors.index.json) but it is not there"
        )
    try:
        return safe_open(file, framework="np")
    except Exception as e:  # SafetensorError (not importable by name) and OSError alike.
        raise safetensors_failure(file, e) from e


class LazyTensors(Mapping):
    """{tensor name: numpy array} over safetensors files; each array is read when looked up,
    and refused (`CheckpointError` naming the tensor and its file) if not finite."""

    def __init__(self, files: list[str]):
        self._handles, self._files = {}, {}
        for file in files:
            handle = open_file(file)
            for name in handle.keys():
                self._handles[name], self._files[name] = handle, file

    def __getitem__(self, name: str) -> np.ndarray:
        return check_finite(self._handles[name].get_tensor(name), name, self._files[name])

    def file_of(self, name: str) -> str:
        """The file holding tensor `name`."""
        return self._files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file's header (nothing read)."""
        return tuple(self._handles[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's stored dtype as safetensors names it ('F32', 'BF16', ...)."""
        return self._handles[name].get_slice(name).get_dtype()

    def __contains__(self, name: object) -> bool:
        return name in self._handles

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def read_tensors(path: str) -> LazyTensors:
    """The tensors of the checkpoint directory `path`, read lazily."""
    return LazyTensors(checkpoint_files(path))


def placer(
    model: Any, shardings: Callable[[Any, Any], Any]
) -> Callable[[tuple[str, ...], np.ndarray], jax.Array]:
    """`place(path, value)`: the parameter at `path` (keys into the params tree) as a device
    array in `shardings(model, abstract params)`'s sharding for it, after checking its shape.

    Raises (from `place`):
      ValueError: if `value`'s shape is not the model's for that parameter.
    """
    expected = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    tree = shardings(model, expected)

    def get(node: Any, path: tuple[str, ...]) -> Any:
        for key in path:
            node = node[key]
        return node

    def place(path: tuple[str, ...], value: np.ndarray) -> jax.Array:
        want = get(expected, path).shape
        if value.shape != want:
            raise ValueError(
                "Converted params do not fit the config; (path, expected, got): "
                f"{[('/'.join(path), want, value.shape)]}."
            )
        return jax.make_array_from_callback(value.shape, get(tree, path), lambda i: value[i])

    return place
