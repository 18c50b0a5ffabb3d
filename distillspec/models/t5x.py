"""T5X checkpoints <-> distillspec T5 v1.1 models, with flax's msgpack and TensorStore only.

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

Parameter layout. T5X's DenseGeneral stores kernels 2-D: query/key/value [embed, heads*head_dim]
(heads major), out [heads*head_dim, embed]; ours keep the heads axis ([embed, heads, head_dim],
[heads, head_dim, embed]) and stack the layers on a leading axis. `rel_embedding` is
[heads, buckets] (ours [buckets, heads]). T5 v1.1 has no 1/sqrt(head_dim) in attention, in T5X as
here (its query init absorbs it). Without `decoder/logits_dense` the head is the embedding,
with logits scaled by embed_dim**-0.5 (T5X's logits_via_embedding).

`from_t5x` with `shardings` reads each parameter slice by slice: every addressable device reads
its own index through TensorStore (`jax.make_array_from_callback`), so no host holds a full copy.
`save_t5x` writes from a single process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16')
import numpy as np
import tensorstore as ts
from flax import serialization

from distillspec.models.hf_interop import _check_shapes
from distillspec.models.t5 import T5LM, T5Config

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint"  # The msgpack file of a step directory.
VERSION = 3  # T5X's checkpoint version: bfloat16 stored natively in TensorStore.
_CHUNK_BYTES = 64 * 2**20  # T5X's target chunk size.
_PLACEHOLDER = "PLACEHOLDER://"
_STEP_DIR = re.compile(r"checkpoint_(\d+)")
_ARRAY_INDEX = Any  # tuple of slices / int arrays, one per axis.
Params = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Name and layout rules.
# --------------------------------------------------------------------------------------------


def _index_count(s: slice | np.ndarray) -> int:
    return len(s) if isinstance(s, np.ndarray) else len(range(s.start, s.stop, s.step))


def _merged_axis(heads: slice, dims: slice, head_dim: int) -> slice | np.ndarray:
    """Index into a fused [heads * head_dim] axis picking heads x dims (a slice if contiguous)."""
    if dims == slice(0, head_dim, 1) and heads.step == 1:
        return slice(heads.start * head_dim, heads.stop * head_dim, 1)
    rows = np.arange(heads.start, heads.stop, heads.step)[:, None] * head_dim
    return (rows + np.arange(dims.start, dims.stop, dims.step)[None, :]).ravel()


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one (per-layer) leaf of ours maps to its T5X array."""

    to_t5x: Callable[[np.ndarray], np.ndarray]  # A full array of ours -> the T5X array.
    t5x_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # Our shape -> T5X shape.
    # (read, our index of normalised slices, our shape) -> our array at that index, where
    # read(t5x_index) returns the T5X array at t5x_index.
    read: Callable[[Callable[[_ARRAY_INDEX], np.ndarray], tuple, tuple[int, ...]], np.ndarray]


def _read_heads_last(read, index, shape):
    """Ours [E, H, D] <- T5X [E, H*D]."""
    e, h, d = index
    out = read((e, _merged_axis(h, d, shape[2])))
    return out.reshape(_index_count(e), _index_count(h), _index_count(d))


def _read_heads_first(read, index, shape):
    """Ours [H, D, E] <- T5X [H*D, E]."""
    h, d, e = index
    out = read((_merged_axis(h, d, shape[1]), e))
    return out.reshape(_index_count(h), _index_count(d), _index_count(e))


_SAME = _Layout(lambda x: x, lambda s: tuple(s), lambda read, index, shape: read(index))
_TRANSPOSED = _Layout(
    lambda x: x.T, lambda s: tuple(s[::-1]), lambda read, index, shape: read(index[::-1]).T
)
_HEADS_LAST = _Layout(
    lambda x: x.reshape(x.shape[0], -1), lambda s: (s[0], s[1] * s[2]), _read_heads_last
)
_HEADS_FIRST = _Layout(
    lambda x: x.reshape(-1, x.shape[-1]), lambda s: (s[0] * s[1], s[2]), _read_heads_first
)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One T5X parameter (per layer if `layers` > 0) <-> one leaf of our params."""

    t5x: str  # Name under optimizer/target, '/'-separated; '{i}' stands for the layer index.
    path: tuple[str, ...]  # Path of the leaf in our params.
    layout: _Layout = _SAME
    layers: int = 0  # Number of stacked layers; 0 for a parameter outside the layer stack.

    def names(self) -> list[str]:
        return [self.t5x.format(i=i) for i in range(self.layers)] if self.layers else [self.t5x]


def _stack_rules(stack: str, n: int, attentions: dict[str, tuple[str, str]]) -> list[_Rule]:
    """One T5 stack; `attentions` maps our attention name -> (T5X module, T5X norm before it)."""
    t5x, ours = f"{stack}/layers_{{i}}/", f"{stack}/layers/"

    def rule(t5x_name: str, our_path: str, layout: _Layout = _SAME, layers: int = n) -> _Rule:
        return _Rule(t5x_name, tuple(our_path.split("/")), layout, layers)

    rules = [
        rule(f"{stack}/{stack}_norm/scale", f"{stack}/final_norm/scale", layers=0),
        rule(f"{stack}/relpos_bias/rel_embedding", f"{stack}/relpos/embedding", _TRANSPOSED, 0),
        rule(f"{t5x}pre_mlp_layer_norm/scale", f"{ours}mlp_norm/scale"),
    ]
    for name, (module, norm) in attentions.items():
        rules.append(rule(f"{t5x}{norm}/scale", f"{ours}{name}_norm/scale"))
        for projection, short in (("query", "q"), ("key", "k"), ("value", "v")):
            kernel = f"{t5x}{module}/{projection}/kernel"
            rules.append(rule(kernel, f"{ours}{name}/{short}/kernel", _HEADS_LAST))
        rules.append(rule(f"{t5x}{module}/out/kernel", f"{ours}{name}/o/kernel", _HEADS_FIRST))
    for dense in ("wi_0", "wi_1", "wo"):
        rules.append(rule(f"{t5x}mlp/{dense}/kernel", f"{ours}mlp/{dense}/kernel"))
    return rules


def _rules(config: T5Config) -> list[_Rule]:
    """The T5X <-> ours table of a T5 v1.1 model (T5X / flaxformer names)."""
    rules = [_Rule("token_embedder/embedding", ("embed", "embedding"))]
    if not config.tie_embeddings:
        rules.append(_Rule("decoder/logits_dense/kernel", ("lm_head", "kernel")))
    rules += _stack_rules(
        "encoder", config.num_encoder_layers, {"attn": ("attention", "pre_attention_layer_norm")}
    )
    return rules + _stack_rules(
        "decoder",
        config.num_decoder_layers,
        {
            "self_attn": ("self_attention", "pre_self_attention_layer_norm"),
            "cross_attn": ("encoder_decoder_attention", "pre_cross_attention_layer_norm"),
        },
    )


# --------------------------------------------------------------------------------------------
# Reading.
# --------------------------------------------------------------------------------------------


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


class _Source:
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

    def _fail(self, error: Exception) -> ValueError:
        return ValueError(
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

    def read(self, index: _ARRAY_INDEX) -> np.ndarray:
        """The array at `index` (slices, and at most one integer array, read outer-style)."""
        if self.store is None:
            return self.inline[index]
        try:
            fancy = any(isinstance(i, np.ndarray) for i in index)
            view = self.store.oindex[index] if fancy else self.store[index]
            return np.asarray(view.read().result())
        except Exception as e:
            raise self._fail(e) from e


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


def _read_msgpack(step_dir: str) -> dict[str, Any]:
    """The optimizer state dict of a step directory's msgpack file ({'target', 'state'})."""
    path = os.path.join(step_dir, CHECKPOINT_FILE)
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"model_checkpoint_path"):
        raise ValueError(f"{path} is a TensorFlow checkpoint index, not a T5X checkpoint.")
    try:
        contents = serialization.msgpack_restore(raw)
    except Exception as e:
        raise ValueError(f"{path} is not a readable T5X msgpack checkpoint: {e}") from e
    # Version 0 is a plain flax checkpoint; later versions nest the state under 'optimizer'.
    state = contents.get("optimizer", contents) if isinstance(contents, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get("target"), dict):
        raise ValueError(f"{path} holds no optimizer/target parameters.")
    return state


def _open_sources(step_dir: str, target: dict[str, Any]) -> dict[str, _Source]:
    """A `_Source` per leaf of `target`, their TensorStores opened (concurrently)."""
    sources = {name: _Source(name, leaf, step_dir) for name, leaf in _flatten(target).items()}
    futures = {
        name: ts.open(source.spec, open=True, read=True)
        for name, source in sources.items()
        if source.spec is not None
    }
    for name, future in futures.items():
        sources[name].opened(future)
    return sources


def infer_config(shapes: dict[str, tuple[int, ...]], dtype: str = "float32") -> T5Config:
    """A T5 v1.1 config from the shapes of T5X parameters (names relative to optimizer/target).

    relative_max_distance (128) and the norm epsilon (1e-6) are not stored in checkpoints; T5X's
    values are assumed.

    Raises:
      ValueError: if the shapes do not determine a config (the head count needs the shared
        relative-position bias).
    """
    hint = "pass config=T5Config(...) (Python) or --config configs/models/t5_1_1_<size>.gin (CLI)"
    if "token_embedder/embedding" not in shapes:
        raise ValueError(f"Not a T5 v1.1 T5X checkpoint: no token_embedder/embedding; {hint}.")
    if "encoder/layers_0/mlp/wi/kernel" in shapes:
        raise ValueError("This T5X checkpoint has a ReLU MLP (T5 1.0); only T5 v1.1 is supported.")
    vocab, width = shapes["token_embedder/embedding"]
    relpos = shapes.get("encoder/relpos_bias/rel_embedding")
    query = shapes.get("encoder/layers_0/attention/query/kernel")
    mlp = shapes.get("encoder/layers_0/mlp/wi_0/kernel")
    if relpos is None or query is None or mlp is None or query[1] % relpos[0]:
        raise ValueError(
            "Cannot infer the number of attention heads of this T5X checkpoint (it needs "
            "encoder/relpos_bias/rel_embedding [heads, buckets] and the encoder's attention "
            f"kernels); {hint}."
        )
    heads, buckets = relpos

    def count(stack: str) -> int:
        found = [re.match(rf"{stack}/layers_(\d+)/", name) for name in shapes]
        return 1 + max((int(m[1]) for m in found if m), default=-1)

    tied = "decoder/logits_dense/kernel" not in shapes
    config = T5Config(
        vocab_size=vocab, embed_dim=width, num_encoder_layers=count("encoder"),
        num_decoder_layers=count("decoder"), num_heads=heads, head_dim=query[1] // heads,
        mlp_dim=mlp[1], relative_buckets=buckets, tie_embeddings=tied,
        scale_decoder_outputs=tied, dtype=dtype,
    )  # fmt: skip
    log.info("T5X config inferred from the parameter shapes: %s", config)
    return config


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _check(rules: list[_Rule], shapes: dict[str, tuple[int, ...]], expected: Any) -> None:
    """Every parameter the config needs is present with its shape, and nothing else is."""
    used = set()
    for rule in rules:
        ours = _get(expected, rule.path).shape
        want = rule.layout.t5x_shape(ours[1:] if rule.layers else ours)
        for name in rule.names():
            if name not in shapes:
                raise ValueError(
                    f"The T5X checkpoint lacks parameter 'target/{name}' (for our "
                    f"{'/'.join(rule.path)}); does the config match the checkpoint?"
                )
            if tuple(shapes[name]) != tuple(want):
                raise ValueError(
                    f"Shape mismatch of T5X parameter 'target/{name}': the checkpoint has "
                    f"{tuple(shapes[name])}, the config needs {tuple(want)}."
                )
            used.add(name)
    unexpected = sorted(set(shapes) - used)
    if unexpected:
        raise ValueError(
            f"The T5X checkpoint has {len(unexpected)} parameter(s) a T5 v1.1 model of this "
            f"config does not have: {unexpected[:5]}."
        )


def _normalize(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices with explicit start/stop/step for every axis of `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def _leaf_reader(rule: _Rule, sources: list[_Source], shape: tuple[int, ...]):
    """index over our leaf (normalised slices) -> float32 numpy array of that block."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not rule.layers:
            return rule.layout.read(sources[0].read, index, shape).astype(np.float32)
        layers = range(index[0].start, index[0].stop, index[0].step)
        out = np.empty((len(layers), *(_index_count(s) for s in index[1:])), np.float32)
        for row, layer in enumerate(layers):
            out[row] = rule.layout.read(sources[layer].read, index[1:], shape[1:])
        return out

    return read


def from_t5x(
    checkpoint_dir: str,
    config: T5Config | None = None,
    *,
    shardings: Any = None,
    dtype: str | None = None,
    progress: bool = False,
) -> tuple[T5LM, Params]:
    """Loads a T5 v1.1 encoder-decoder from a T5X checkpoint.

    Args:
      checkpoint_dir: a `checkpoint_<step>/` directory, or a T5X model directory (its latest
        step is read, and logged at INFO).
      config: the architecture; None infers it from the parameter shapes (see `infer_config`).
      shardings: optional pytree of `jax.sharding.Sharding` with the structure of the params;
        each addressable device then reads only its own slice of every array.
      dtype: compute dtype of the model ('float32' or 'bfloat16'); None keeps config.dtype (or
        'float32' for an inferred config). Params are float32, whatever the stored dtype.
      progress: show a progress bar over the parameters.

    Returns:
      (T5LM, params) with the structure of `T5LM(config).init(...)`.

    Raises:
      ValueError: on a missing, unexpected or misshapen parameter, or an unreadable array.
    """
    step_dir = find_step_dir(checkpoint_dir)
    state = _read_msgpack(step_dir)
    log.info("Reading T5X checkpoint %s (step %s).", step_dir, state.get("state", {}).get("step"))
    sources = _open_sources(step_dir, state["target"])
    shapes = {name: source.shape for name, source in sources.items()}
    if config is None:
        config = infer_config(shapes, dtype or "float32")
    elif dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    model = T5LM(config)
    expected = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    rules = _rules(config)
    _check(rules, shapes, expected)
    if shardings is not None and jax.tree.structure(shardings) != jax.tree.structure(expected):
        raise ValueError(
            "shardings must have the structure of the params: "
            f"{jax.tree.structure(shardings)} vs {jax.tree.structure(expected)}."
        )
    params: Params = {}
    for rule in _progress(rules, progress, "reading T5X"):
        shape = _get(expected, rule.path).shape
        read = _leaf_reader(rule, [sources[name] for name in rule.names()], shape)
        if shardings is None:
            value = jnp.asarray(read(_normalize((), shape)))
        else:
            value = jax.make_array_from_callback(
                shape, _get(shardings, rule.path), lambda i, r=read, s=shape: r(_normalize(i, s))
            )
        _set(params, rule.path, value)
    return model, params


def _progress(items: list, enabled: bool, description: str) -> Iterable:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, unit="param")


# --------------------------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------------------------


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


def _t5x_head(model: T5LM, params: Params) -> np.ndarray | None:
    """The logits_dense kernel to write; None when T5X's logits_via_embedding expresses the head."""
    c = model.config
    if c.tie_embeddings and c.scale_decoder_outputs:
        return None
    if c.scale_decoder_outputs:
        raise ValueError(
            "T5X has no untied output layer with scaled decoder outputs "
            "(scale_decoder_outputs=True needs tie_embeddings=True)."
        )
    if c.tie_embeddings:  # An unscaled tied head: an explicit copy of the embedding.
        return np.asarray(jax.device_get(params["embed"]["embedding"])).T
    return None


def save_t5x(
    model: T5LM,
    params: Params,
    directory: str,
    step: int = 0,
    *,
    dtype: str | None = None,
    progress: bool = False,
) -> str:
    """Writes `directory/checkpoint_<step>/` in T5X's format (msgpack + zarr/gzip TensorStores).

    The arrays and the msgpack file go to a temporary sibling directory that is renamed at the
    end, so an interrupted save never leaves a `checkpoint_<step>/` that looks complete. The
    optimizer state is not written (only optimizer/target and state/step).

    Args:
      model: a T5LM.
      params: its parameters (host or device arrays; gathered to this process).
      directory: the T5X model directory (created if needed).
      step: the step number of the checkpoint.
      dtype: stored dtype ('float32', 'bfloat16'); None keeps each parameter's own dtype.
      progress: show a progress bar over the parameters.

    Returns:
      The path of the step directory written.

    Raises:
      FileExistsError: if the step directory exists already.
      ValueError: if the model is not a T5LM or params do not fit its config.
    """
    if not isinstance(model, T5LM):
        raise ValueError(f"T5X export supports T5LM models only, got {type(model).__name__}.")
    _check_shapes(model, params)
    config = model.config
    head = _t5x_head(model, params)
    if head is not None:
        config = dataclasses.replace(config, tie_embeddings=False)
        params = {**params, "lm_head": {"kernel": head}}
    final = os.path.join(os.fspath(directory), f"checkpoint_{int(step)}")
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists already; choose another step or directory.")
    tmp = f"{final}.tmp-{os.getpid()}-{time.time_ns()}"
    os.makedirs(tmp)
    try:
        target: Params = {}
        for rule in _progress(_rules(config), progress, "writing T5X"):
            value = np.asarray(jax.device_get(_get(params, rule.path)))
            if dtype is not None:
                value = value.astype(dtype)
            for layer, name in enumerate(rule.names()):
                array = rule.layout.to_t5x(value[layer] if rule.layers else value)
                spec = _write_array(tmp, f"target/{name}", np.ascontiguousarray(array))
                _set(target, tuple(name.split("/")), spec)
        contents = {
            "version": VERSION,
            "optimizer": {"target": target, "state": {"step": np.asarray(step, np.int32)}},
        }
        with open(os.path.join(tmp, CHECKPOINT_FILE), "wb") as f:
            f.write(serialization.msgpack_serialize(contents))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("Wrote T5X checkpoint %s.", final)
    return final


def _write_array(step_dir: str, name: str, array: np.ndarray) -> dict[str, Any]:
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
