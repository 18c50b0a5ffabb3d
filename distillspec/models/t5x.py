"""T5X checkpoints <-> distillspec T5 v1.1 models, with flax's msgpack and TensorStore only.

`from_t5x` loads a T5LM and its params from a T5X step or model directory, `save_t5x` writes
one. The parts: `t5x_store` reads and writes the files (the msgpack file and its zarr
TensorStores; the format is described there), `t5x_layout` holds the T5X <-> ours rules
(parameter names, the 2-D vs per-head kernel layouts, the config inferred from shapes).

`from_t5x` with `shardings` reads each parameter slice by slice: every addressable device reads
its own index through TensorStore (`jax.make_array_from_callback`), so no host holds a full copy.
`save_t5x` writes from a single process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distillspec.models import t5x_layout, t5x_store
from distillspec.models.hf_interop import _check_shapes
from distillspec.models.t5 import T5LM, T5Config
from distillspec.models.t5x_layout import get_leaf, normalize, set_leaf

log = logging.getLogger(__name__)

Params = dict[str, Any]


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
      config: the architecture; None infers it from the parameter shapes (see
        `t5x_layout.infer_config`).
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
    step_dir = t5x_store.find_step_dir(checkpoint_dir)
    state = t5x_store.read_msgpack(step_dir)
    log.info("Reading T5X checkpoint %s (step %s).", step_dir, state.get("state", {}).get("step"))
    sources = t5x_store.open_sources(step_dir, state["target"])
    shapes = {name: source.shape for name, source in sources.items()}
    if config is None:
        config = t5x_layout.infer_config(shapes, dtype or "float32")
    elif dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    model = T5LM(config)
    expected = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    rules = t5x_layout.param_rules(config)
    t5x_layout.check_params(rules, shapes, expected)
    if callable(shardings):  # shardings(model, abstract params), as `from_pretrained` takes.
        shardings = shardings(model, expected)
    if shardings is not None and jax.tree.structure(shardings) != jax.tree.structure(expected):
        raise ValueError(
            "shardings must have the structure of the params: "
            f"{jax.tree.structure(shardings)} vs {jax.tree.structure(expected)}."
        )
    params: Params = {}
    for rule in _progress(rules, progress, "reading T5X"):
        shape = get_leaf(expected, rule.path).shape
        readers = [sources[name].read for name in rule.names()]
        read = t5x_layout.leaf_reader(rule, readers, shape)
        if shardings is None:
            value = jnp.asarray(read(normalize((), shape)))
        else:
            value = jax.make_array_from_callback(
                shape, get_leaf(shardings, rule.path), lambda i, r=read, s=shape: r(normalize(i, s))
            )
        set_leaf(params, rule.path, value)
    return model, params


def _progress(items: list, enabled: bool, description: str) -> Iterable:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, unit="param")


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
        for rule in _progress(t5x_layout.param_rules(config), progress, "writing T5X"):
            value = np.asarray(jax.device_get(get_leaf(params, rule.path)))
            if dtype is not None:
                value = value.astype(dtype)
            for layer, name in enumerate(rule.names()):
                array = rule.layout.to_t5x(value[layer] if rule.layers else value)
                spec = t5x_store.write_array(tmp, f"target/{name}", np.ascontiguousarray(array))
                set_leaf(target, tuple(name.split("/")), spec)
        t5x_store.write_msgpack(tmp, target, step)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("Wrote T5X checkpoint %s.", final)
    return final
