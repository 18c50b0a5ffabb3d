"""The T5X <-> distillspec rules for T5 v1.1 parameters: names, layouts, shapes, the config.

Parameter layout. T5X's DenseGeneral stores kernels 2-D: query/key/value [embed, heads*head_dim]
(heads major), out [heads*head_dim, embed]; ours keep the heads axis ([embed, heads, head_dim],
[heads, head_dim, embed]) and stack the layers on a leading axis. `rel_embedding` is
[heads, buckets] (ours [buckets, heads]). T5 v1.1 has no 1/sqrt(head_dim) in attention, in T5X as
here (its query init absorbs it). Without `decoder/logits_dense` the head is the embedding,
with logits scaled by embed_dim**-0.5 (T5X's logits_via_embedding).

T5X names are '/'-separated and relative to optimizer/target ('encoder/layers_0/mlp/wi_0/kernel').
Nothing here touches files: reading and writing them is `t5x_store`, the loader `t5x`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from distillspec.models.t5 import T5Config

log = logging.getLogger(__name__)

ArrayIndex = Any  # tuple of slices / int arrays, one per axis.
Reader = Callable[[ArrayIndex], np.ndarray]  # T5X index -> the T5X array's block at it.
Params = dict[str, Any]


def index_count(s: slice | np.ndarray) -> int:
    return len(s) if isinstance(s, np.ndarray) else len(range(s.start, s.stop, s.step))


def _merged_axis(heads: slice, dims: slice, head_dim: int) -> slice | np.ndarray:
    """Index into a fused [heads * head_dim] axis picking heads x dims (a slice if contiguous)."""
    if dims == slice(0, head_dim, 1) and heads.step == 1:
        return slice(heads.start * head_dim, heads.stop * head_dim, 1)
    rows = np.arange(heads.start, heads.stop, heads.step)[:, None] * head_dim
    return (rows + np.arange(dims.start, dims.stop, dims.step)[None, :]).ravel()


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one (per-layer) leaf of ours maps to its T5X array."""

    to_t5x: Callable[[np.ndarray], np.ndarray]  # A full array of ours -> the T5X array.
    t5x_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # Our shape -> T5X shape.
    # (read, our index of normalised slices, our shape) -> our array at that index, where
    # read(t5x_index) returns the T5X array at t5x_index.
    read: Callable[[Reader, tuple, tuple[int, ...]], np.ndarray]


def _read_heads_last(read, index, shape):
    """Ours [E, H, D] <- T5X [E, H*D]."""
    e, h, d = index
    out = read((e, _merged_axis(h, d, shape[2])))
    return out.reshape(index_count(e), index_count(h), index_count(d))


def _read_heads_first(read, index, shape):
    """Ours [H, D, E] <- T5X [H*D, E]."""
    h, d, e = index
    out = read((_merged_axis(h, d, shape[1]), e))
    return out.reshape(index_count(h), index_count(d), index_count(e))


_SAME = Layout(lambda x: x, lambda s: tuple(s), lambda read, index, shape: read(index))
_TRANSPOSED = Layout(
    lambda x: x.T, lambda s: tuple(s[::-1]), lambda read, index, shape: read(index[::-1]).T
)
_HEADS_LAST = Layout(
    lambda x: x.reshape(x.shape[0], -1), lambda s: (s[0], s[1] * s[2]), _read_heads_last
)
_HEADS_FIRST = Layout(
    lambda x: x.reshape(-1, x.shape[-1]), lambda s: (s[0] * s[1], s[2]), _read_heads_first
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One T5X parameter (per layer if `layers` > 0) <-> one leaf of our params."""

    t5x: str  # Name under optimizer/target, '/'-separated; '{i}' stands for the layer index.
    path: tuple[str, ...]  # Path of the leaf in our params.
    layout: Layout = _SAME
    layers: int = 0  # Number of stacked layers; 0 for a parameter outside the layer stack.

    def names(self) -> list[str]:
        return [self.t5x.format(i=i) for i in range(self.layers)] if self.layers else [self.t5x]


def _stack_rules(stack: str, n: int, attentions: dict[str, tuple[str, str]]) -> list[Rule]:
    """One T5 stack; `attentions` maps our attention name -> (T5X module, T5X norm before it)."""
    t5x, ours = f"{stack}/layers_{{i}}/", f"{stack}/layers/"

    def rule(t5x_name: str, our_path: str, layout: Layout = _SAME, layers: int = n) -> Rule:
        return Rule(t5x_name, tuple(our_path.split("/")), layout, layers)

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


def param_rules(config: T5Config) -> list[Rule]:
    """The T5X <-> ours table of a T5 v1.1 model (T5X / flaxformer names)."""
    rules = [Rule("token_embedder/embedding", ("embed", "embedding"))]
    if not config.tie_embeddings:
        rules.append(Rule("decoder/logits_dense/kernel", ("lm_head", "kernel")))
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


def get_leaf(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def set_leaf(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def check_params(rules: list[Rule], shapes: dict[str, tuple[int, ...]], expected: Any) -> None:
    """Every parameter the config needs is present with its shape, and nothing else is."""
    used = set()
    for rule in rules:
        ours = get_leaf(expected, rule.path).shape
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


def normalize(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices with explicit start/stop/step for every axis of `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def leaf_reader(rule: Rule, readers: list[Reader], shape: tuple[int, ...]):
    """index over our leaf (normalised slices) -> float32 numpy array of that block, where
    readers[i](t5x_index) reads the T5X array `rule.names()[i]` at t5x_index."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not rule.layers:
            return rule.layout.read(readers[0], index, shape).astype(np.float32)
        layers = range(index[0].start, index[0].stop, index[0].step)
        out = np.empty((len(layers), *(index_count(s) for s in index[1:])), np.float32)
        for row, layer in enumerate(layers):
            out[row] = rule.layout.read(readers[layer], index[1:], shape[1:])
        return out

    return read
