"""T5X checkpoint files: the msgpack file and its TensorStore (zarr) arrays, read and written.

The format (T5X `checkpoints.py`, checkpoint VERSION 3). A model directory holds step
directories `checkpoint_<step>/`; each holds

  * `checkpoint`: a flax msgpack file, {'version': 3, 'optimizer': {'target': params,
    'state': {'step': int32, 'param_states': ...}}} (version 0, a plain flax checkpoint, has no
    'optimizer' level). A leaf is one of
      - a numpy array stored inline (T5X does so for values without partitioning axes, e.g. the
        step);
      - a dict TensorStore spec (T5X's own Checkpointer): {'driver': 'zarr', 'dtype': 'float32',
        'kvstore': {'driver': 'file', 'path': 'target.encoder.layers_0.attention.query.kernel'},
        'metadata': {'shape', 'chunks', 'compressor': {'id': 'gzip'}}}, the path relative to the
        step directory ('gcs' kvstores name a dummy bucket and are read from the local copy);
      - the string 'PLACEHOLDER://<name>' (T5X on orbax): the array lies in directory <name>.
  * one zarr array per TensorStore leaf: a directory named by the leaf's path joined with '.',
    with `.zarray` and gzip-compressed chunks (at most 64 MiB each); bfloat16 is a native zarr
    dtype there (version 2 stored it as uint16, which is rejected).

What the arrays mean (names, layouts) is `t5x_layout`; this module knows files and arrays only.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16')
import numpy as np
import tensorstore as ts
from flax import serialization

from distillspec.models.weight_checks import CheckpointError, check_finite

log = logging.getLogger(__name__)

ArrayIndex = Any  # tuple of slices / int arrays, one per axis.
CHECKPOINT_FILE = "checkpoint"  # The msgpack file of a step directory.
VERSION = 3  # T5X's checkpoint version: bfloat16 stored natively in TensorStore.
_CHUNK_BYTES = 64 * 2**20  # T5X's target chunk size.
_PLACEHOLDER = "PLACEHOLDER://"
_STEP_DIR = re.compile(r"checkpoint_(\d+)")


def _local_spec(spec: dict[str, Any], step_dir: str, name: str) -> dict[str, Any]:
    """A msgpack TensorStore spec (path relative to the step directory) -> an openable spec.

    As T5X does when restoring: the path becomes absolute, a 'gcs' or 'gfile' kvstore is read
    from the local copy, and the write-time chunking / compressor are dropped from the spec
    (the array's own .zarray says them).
    """
    spec = {**spec, "kvstore": dict(spec.get("kvstore") or {})}
    kvstore = spec["kvstore"]
    # tensorstore < 0.1.14 wrote the path at the top level (joined to the kvstore's).
    relative = os.path.join(kvstore.get("path") or "", spec.pop("path", None) or "")
    if not relative or kvstore.get("driver", "file") not in ("file", "gfile", "gcs"):
        raise ValueError(f"T5X parameter {name!r} has an unsupported TensorStore spec: {spec}.")
    spec["kvstore"] = {"driver": "file", "path": os.path.join(step_dir, relative)}
    spec["metadata"] = {
        k: v for k, v in (spec.get("metadata") or {}).items() if k not in ("chunks", "compressor")
    }
    return spec


def _placeholder_spec(relative: str, step_dir: str, name: str) -> dict[str, Any]:
    """The spec of an orbax leaf written to directory `relative` (zarr, or zarr3 from orbax)."""
    path = os.path.join(step_dir, relative)
    if not os.path.isdir(path) and any(
        os.path.exists(os.path.join(step_dir, f)) for f in ("manifest.ocdbt", "ocdbt.process_0")
    ):
        raise ValueError(
            f"T5X parameter {name!r} lies in an OCDBT store ({step_dir}); OCDBT checkpoints are "
            "not supported: re-save them without OCDBT."
        )
    driver = "zarr3" if os.path.exists(os.path.join(path, "zarr.json")) else "zarr"
    return {"driver": driver, "kvstore": {"driver": "file", "path": path}}


class Source:
    """One leaf under optimizer/target: an array stored inline in the msgpack, or in TensorStore."""

    def __init__(self, name: str, leaf: Any, step_dir: str):
        self.name = name  # '/'-separated, relative to optimizer/target.
        self.inline: np.ndarray | None = None
        self.spec: dict[str, Any] | None = None
        self.store: ts.TensorStore | None = None
        if isinstance(leaf, dict):
            self.spec = _local_spec(leaf, step_dir, name)
        elif isinstance(leaf, str) and leaf.startswith(_PLACEHOLDER):
            self.spec = _placeholder_spec(leaf[len(_PLACEHOLDER) :], step_dir, name)
        elif isinstance(leaf, np.ndarray | np.generic | int | float):
            self.inline = np.asarray(leaf)
        else:
            raise ValueError(
                f"T5X parameter {name!r} has an unsupported msgpack value {type(leaf).__name__}."
            )

    @property
    def where(self) -> str:
        """Where the array lies, for error messages."""
        return self.spec["kvstore"]["path"] if self.spec else f"inline in {CHECKPOINT_FILE}"

    def _fail(self, error: Exception) -> CheckpointError:
        return CheckpointError(
            f"Cannot read T5X array {self.where!r} (parameter 'target/{self.name}'); the "
            f"checkpoint is truncated or corrupt: {error}"
        )

    def opened(self, future: Any) -> None:
        """Takes the result of `ts.open(self.spec)`."""
        try:
            self.store = future.result()
        except Exception as e:  # tensorstore raises ValueError and friends; report them alike.
            raise self._fail(e) from e
        if self.store.dtype == ts.uint16:  # T5X version 2 stored bfloat16 bits as uint16.
            raise ValueError(
                f"T5X array {self.where!r} is uint16 (a version-2 checkpoint's bfloat16); "
                "re-save it with a current T5X (bfloat16 stored natively)."
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.inline.shape if self.store is None else self.store.shape)

    def read(self, index: ArrayIndex) -> np.ndarray:
        """The array at `index` (slices, and at most one integer array, read outer-style)."""
        if self.store is None:
            return check_finite(self.inline[index], f"target/{self.name}", self.where)
        try:
            fancy = any(isinstance(i, np.ndarray) for i in index)
            view = self.store.oindex[index] if fancy else self.store[index]
            value = np.asarray(view.read().result())
        except Exception as e:
            raise self._fail(e) from e
        return check_finite(value, f"target/{self.name}", self.where)


def _is_spec(node: Any) -> bool:
    return isinstance(node, dict) and "driver" in node


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a/b/c': leaf} of a nested dict whose leaves are arrays, specs (dicts) or strings."""
    if not isinstance(tree, dict) or _is_spec(tree):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def checkpoint_steps(model_dir: str) -> list[int]:
    """Steps of the complete `checkpoint_<step>/` directories (with a msgpack file) in model_dir."""
    steps = []
    for name in os.listdir(model_dir):
        match = _STEP_DIR.fullmatch(name)  # Skips T5X's unfinished 'checkpoint_<step>.tmp-*'.
        if match and os.path.isfile(os.path.join(model_dir, name, CHECKPOINT_FILE)):
            steps.append(int(match[1]))
    return sorted(steps)


def find_step_dir(path: str) -> str:
    """The step directory of `path`: itself (a `checkpoint_<step>/` directory, or its msgpack
    file), or the latest step of a T5X model directory.

    Raises:
      FileNotFoundError: if `path` is none of these.
    """
    path = os.fspath(path)
    if os.path.basename(path) == CHECKPOINT_FILE and os.path.isfile(path):
        path = os.path.dirname(path)
    if os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
        return path
    steps = checkpoint_steps(path) if os.path.isdir(path) else []
    if not steps:
        raise FileNotFoundError(
            f"No T5X checkpoint at {path!r}: expected a checkpoint_<step>/ directory holding a "
            f"msgpack '{CHECKPOINT_FILE}' file, or a model directory holding such directories."
        )
    log.info("T5X model directory %s: loading its latest step, %d (of %s).", path, steps[-1], steps)
    return os.path.join(path, f"checkpoint_{steps[-1]}")


def read_msgpack(step_dir: str) -> dict[str, Any]:
    """The optimizer state dict of a step directory's msgpack file ({'target', 'state'})."""
    path = os.path.join(step_dir, CHECKPOINT_FILE)
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"model_checkpoint_path"):
        raise ValueError(f"{path} is a TensorFlow checkpoint index, not a T5X checkpoint.")
    try:
        contents = serialization.msgpack_restore(raw)
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable T5X msgpack checkpoint (truncated or corrupt): {e}"
        ) from e
    # Version 0 is a plain flax checkpoint; later versions nest the state under 'optimizer'.
    state = contents.get("optimizer", contents) if isinstance(contents, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get("target"), dict):
        raise ValueError(f"{path} holds no optimizer/target parameters.")
    return state


def open_sources(step_dir: str, target: dict[str, Any]) -> dict[str, Source]:
    """A `Source` per leaf of `target`, their TensorStores opened (concurrently)."""
    sources = {name: Source(name, leaf, step_dir) for name, leaf in _flatten(target).items()}
    futures = {
        name: ts.open(source.spec, open=True, read=True)
        for name, source in sources.items()
        if source.spec is not None
    }
    for name, future in futures.items():
        sources[name].opened(future)
    return sources


def _smallest_factor(n: int) -> int:
    return next((p for p in range(2, math.isqrt(n) + 1) if n % p == 0), n)


def chunk_shape(shape: tuple[int, ...], itemsize: int, target_bytes: int = _CHUNK_BYTES) -> list:
    """A chunk of at most target_bytes whose sides divide the array's (as T5X aims for):
    the longest side is divided by its smallest prime factor until the chunk fits."""
    chunk = list(shape)
    while chunk and math.prod(chunk) * itemsize > target_bytes:
        axis = int(np.argmax(chunk))
        chunk[axis] //= _smallest_factor(chunk[axis])
    return chunk


def write_array(step_dir: str, name: str, array: np.ndarray) -> dict[str, Any]:
    """Writes one zarr/gzip TensorStore; returns its msgpack spec (path relative to step_dir)."""
    spec = {
        "driver": "zarr",
        "dtype": array.dtype.name,
        "kvstore": {"driver": "file", "path": name.replace("/", ".")},
        "metadata": {
            "compressor": {"id": "gzip"},
            "shape": list(array.shape),
            "chunks": chunk_shape(array.shape, array.dtype.itemsize),
        },
    }
    local = {
        **spec,
        "kvstore": {"driver": "file", "path": os.path.join(step_dir, spec["kvstore"]["path"])},
    }
    store = ts.open(local, create=True).result()
    store.write(array).result()
    return spec


def write_msgpack(step_dir: str, target: dict[str, Any], step: int) -> None:
    """Writes the step directory's msgpack file: version, optimizer/target (specs) and the step
    (no optimizer state), synced to disk before the caller renames the directory into place."""
    contents = {
        "version": VERSION,
        "optimizer": {"target": target, "state": {"step": np.asarray(step, np.int32)}},
    }
    with open(os.path.join(step_dir, CHECKPOINT_FILE), "wb") as f:
        f.write(serialization.msgpack_serialize(contents))
        f.flush()
        os.fsync(f.fileno())
