"""A draft made for a target: from scratch at a smaller size, or from the target's own layers.

`DraftSpec` is what a run configures (`train.student = @DraftSpec()` with
`train.teacher_checkpoint` set); `make_draft` turns it into (model, params) for the target:

  from_target_layers = k > 0   early exit: the target's embedding, its first k layers (encoder
                               and decoder for T5), final norm(s) and head, copied; the rest of
                               the architecture as the target's.
  from_target_layers = 0       a fresh model of the target's family and vocabulary, with the
                               sizes given here (None = the target's own), initialised from seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from distillspec.models.decoder_only import DecoderOnlyLM
from distillspec.models.t5 import T5LM

# Size fields a fresh draft may override, per family (the rest is copied from the target).
_SIZES = {
    DecoderOnlyLM: ("num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"),
    T5LM: ("num_layers", "embed_dim", "num_heads", "head_dim", "mlp_dim"),
}


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """A draft for a given target; sizes left at None are the target's."""

    from_target_layers: int = 0  # k > 0: copy the target's embedding, first k layers and head.
    num_layers: int | None = None  # Blocks of a fresh draft (T5: encoder and decoder each).
    embed_dim: int | None = None  # Width of a fresh draft.
    num_heads: int | None = None  # Query heads of a fresh draft.
    num_kv_heads: int | None = None  # Key/value heads (decoder-only).
    head_dim: int | None = None  # Width of one head.
    mlp_dim: int | None = None  # Feed-forward width.

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            floor = 0 if field.name == "from_target_layers" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < floor):  # fmt: skip
                raise ValueError(
                    f"DraftSpec.{field.name} must be an integer >= {floor}, got {value!r}"
                )
        sizes = [f.name for f in dataclasses.fields(self)][1:]
        if self.from_target_layers and any(getattr(self, s) is not None for s in sizes):
            raise ValueError(
                "DraftSpec: from_target_layers copies the target's layers, so the sizes "
                f"{sizes} must stay None"
            )


def _num_layers(config) -> int:
    return getattr(config, "num_layers", None) or config.num_decoder_layers


def _fresh_config(spec: DraftSpec, target) -> Any:
    config = target.config
    sizes = {name: getattr(spec, name) for name in _SIZES[type(target)]}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if isinstance(target, T5LM) and "num_layers" in sizes:
        layers = sizes.pop("num_layers")
        sizes.update(num_encoder_layers=layers, num_decoder_layers=layers)
    return dataclasses.replace(config, **sizes)


def make_draft(spec: DraftSpec, target, target_params, seed: int = 0) -> tuple[Any, Any]:
    """(draft model, params) for `target` as `spec` says (see the module docstring)."""
    if type(target) not in _SIZES:
        raise ValueError(f"drafts can be made for DecoderOnlyLM and T5LM targets, not {target!r}")
    k = spec.from_target_layers
    if not k:
        model = type(target)(_fresh_config(spec, target))
        return model, model.init(jax.random.PRNGKey(seed))
    if k >= _num_layers(target.config):
        raise ValueError(
            f"DraftSpec.from_target_layers={k} must be below the target's "
            f"{_num_layers(target.config)} layers (the draft would be the target)"
        )
    cut = lambda tree: jax.tree.map(lambda x: x[:k], tree)
    if isinstance(target, T5LM):
        config = dataclasses.replace(target.config, num_encoder_layers=k, num_decoder_layers=k)
        params = dict(target_params)
        for stack in ("encoder", "decoder"):
            params[stack] = dict(params[stack], layers=cut(params[stack]["layers"]))
    else:
        config = dataclasses.replace(target.config, num_layers=k)
        params = dict(target_params, layers=cut(target_params["layers"]))
    # Copies: the draft is trained (its buffers donated), the target's must stay intact.
    return type(target)(config), jax.tree.map(lambda x: jnp.array(x, copy=True), params)
