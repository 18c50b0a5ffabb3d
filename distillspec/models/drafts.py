"""A draft made for a target: from scratch at a smaller size, or from the target's own layers.

`DraftSpec` is what a run configures (`train.student = @DraftSpec()` with
`train.teacher_checkpoint` set); `make_draft` turns it into (model, params) for the target:

  from_target_layers = k > 0   early exit: the target's embedding, its first k layers (encoder
                               and decoder for T5), final norm(s) and head, copied; the rest of
                               the architecture as the target's.
  from_target_layers = 0       a fresh model of the target's family and vocabulary, with the
                               sizes given here, initialised from seed.

Sizes left at None are chosen *relative to the target* (`fresh_sizes`): the draft keeps the
target's family, vocabulary and head width, and takes a quarter of its layers (at least 1) and
the widest of width / 2, width / 4, ... (MLP and heads scaled with it) whose parameters,
embedding and head included, are at most `max_param_fraction` of the target's (default 1/10).
Why a fraction of the parameters: at batch 1 decoding reads every weight once per call, so a
draft call costs about its share of the target's bytes, c. The ideal speed-up at lookahead
gamma is S* = tau / (gamma * c + r_gamma) (docs/evaluation.md): at gamma = 5 and r_gamma = 1, a
draft with c = 0.1 keeps 2/3 of its block efficiency tau; one with c = 0.4 (what keeping the
target's width gives a 4-layer target) needs tau > 3 to break even, an acceptance rate no draft
of that size reaches. The paper's T5-Small drafts are 1/3 of T5-Base, 1/10 of T5-Large and
1/40 of T5-XL; 1/10 is the middle of that range.
"""

from __future__ import annotations

import dataclasses
import math
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
    """A draft for a given target; sizes left at None are chosen for it (`fresh_sizes`)."""

    from_target_layers: int = 0  # k > 0: copy the target's embedding, first k layers and head.
    # Sizes left at None make a fresh draft with at most this share of the target's parameters.
    max_param_fraction: float = 0.1
    num_layers: int | None = None  # Blocks of a fresh draft (T5: encoder and decoder each).
    embed_dim: int | None = None  # Width of a fresh draft.
    num_heads: int | None = None  # Query heads of a fresh draft.
    num_kv_heads: int | None = None  # Key/value heads (decoder-only).
    head_dim: int | None = None  # Width of one head.
    mlp_dim: int | None = None  # Feed-forward width.

    def __post_init__(self):
        if not (isinstance(self.max_param_fraction, (int, float)) and
                0 < self.max_param_fraction < 1):  # fmt: skip
            raise ValueError(
                f"DraftSpec.max_param_fraction must be in (0, 1), got {self.max_param_fraction!r}"
            )
        for field in dataclasses.fields(self):
            if field.name == "max_param_fraction":
                continue
            value = getattr(self, field.name)
            floor = 0 if field.name == "from_target_layers" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < floor):  # fmt: skip
                raise ValueError(
                    f"DraftSpec.{field.name} must be an integer >= {floor}, got {value!r}"
                )
        sizes = [f.name for f in dataclasses.fields(self)][2:]
        if self.from_target_layers and any(getattr(self, s) is not None for s in sizes):
            raise ValueError(
                "DraftSpec: from_target_layers copies the target's layers, so the sizes "
                f"{sizes} must stay None"
            )


def _num_layers(config) -> int:
    return getattr(config, "num_layers", None) or config.num_decoder_layers


def num_params(model) -> int:
    """Parameters of a model (embedding and head included), counted without allocating them."""
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _sized(config, width: int, sizes: dict[str, int]) -> dict[str, int]:
    """The target `config`'s sizes scaled to `width`, with the explicit `sizes` kept."""
    out = dict(sizes)
    out.setdefault("embed_dim", width)
    width = out["embed_dim"]
    out.setdefault("mlp_dim", max(1, round(config.mlp_dim * width / config.embed_dim)))
    # Heads as wide as the target's where they fit, and heads x head width = width (GPT-2's
    # Hugging Face config derives the head width from the two).
    head_dim = out.setdefault("head_dim", math.gcd(config.head_dim, width))
    heads = out.setdefault("num_heads", max(1, width // head_dim))
    if hasattr(config, "num_kv_heads"):  # Keep the target's grouping where it divides.
        group = config.num_heads // config.num_kv_heads
        out.setdefault("num_kv_heads", heads // group if heads % group == 0 else heads)
    return out


def fresh_sizes(spec: DraftSpec, target) -> dict[str, int]:
    """A fresh draft's sizes: those `spec` sets, the rest chosen for `target` (module docstring).

    Widths tried: the target's, then halved down to 8 (an even head width for rotary
    positions); the first whose draft has at most spec.max_param_fraction of the target's
    parameters wins, else the narrowest (a vocabulary so large that even its embedding and head
    exceed the budget; the run then says what c that costs).
    """
    config = target.config
    sizes = {name: getattr(spec, name) for name in _SIZES[type(target)]}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    sizes.setdefault("num_layers", max(1, _num_layers(config) // 4))
    budget = spec.max_param_fraction * num_params(target)
    widths = [config.embed_dim >> k for k in range(16) if config.embed_dim >> k >= 8]
    for width in widths if "embed_dim" not in sizes else [sizes["embed_dim"]]:
        candidate = _sized(config, width, sizes)
        if num_params(type(target)(_config(config, candidate))) <= budget:
            return candidate
    return candidate


def _config(config, sizes: dict[str, int]) -> Any:
    sizes = dict(sizes)
    if "num_encoder_layers" in {f.name for f in dataclasses.fields(config)}:
        layers = sizes.pop("num_layers")
        sizes.update(num_encoder_layers=layers, num_decoder_layers=layers)
    return dataclasses.replace(config, **sizes)


def make_draft(spec: DraftSpec, target, target_params, seed: int = 0) -> tuple[Any, Any]:
    """(draft model, params) for `target` as `spec` says (see the module docstring)."""
    if type(target) not in _SIZES:
        raise ValueError(f"drafts can be made for DecoderOnlyLM and T5LM targets, not {target!r}")
    k = spec.from_target_layers
    if not k:
        model = type(target)(_config(target.config, fresh_sizes(spec, target)))
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
