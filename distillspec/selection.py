"""AdaSPEC's token selection (Hu et al., NeurIPS 2025, arXiv 2510.19779).

A reference model, a copy of the draft first distilled toward the target, tells the tokens the
draft can still learn from those it cannot fit: per token, the draft's loss minus the
reference's, both against the target (Delta L = L_draft - L_ref). Tokens where the reference
has fitted what the draft has not have a large Delta L; tokens hard for both (a large loss for
the reference too) have a small one. The draft is distilled on the `fraction` of a batch's
tokens with the largest Delta L only; the others get weight 0, so they add nothing to the
loss or its gradient. The paper's code keeps delta >= quantile(delta, 1 - k) over the batch's
tokens (forward KL, k = 0.4 by default in its runs); this keeps the ceil(k n) largest of the n
weighted tokens, and ties with the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from distillspec import heads, losses


def select_tokens(
    draft_loss: ArrayLike, reference_loss: ArrayLike, weights: ArrayLike, fraction: float
) -> jax.Array:
    """The weights of the tokens AdaSPEC distils the draft on; 0 elsewhere.

    Args:
      draft_loss: [B, L] the draft's per-token loss against the target.
      reference_loss: [B, L] the reference model's, the same loss.
      weights: [B, L] the tokens' weights (0: padding, prompt); the selection ranks only the
        weighted tokens, over the whole batch (not row by row).
      fraction: the fraction of weighted tokens kept, in (0, 1].

    Returns:
      [B, L] float32: `weights` where a token is selected, else 0. No gradient flows through
      the selection.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"AdaSPEC's selected fraction must be in (0, 1], got {fraction!r}")
    weights = jnp.asarray(weights, jnp.float32)
    keep = weights > 0
    delta = jax.lax.stop_gradient(jnp.asarray(draft_loss) - jnp.asarray(reference_loss))
    delta = jnp.where(keep, delta.astype(jnp.float32), -jnp.inf)
    count = jnp.ceil(fraction * jnp.sum(keep)).astype(jnp.int32)
    ranked = -jnp.sort(-delta.reshape(-1))  # Descending; the masked tokens (-inf) last.
    threshold = ranked[jnp.clip(count - 1, 0, ranked.size - 1)]
    return jnp.where(keep & (delta >= threshold), weights, 0.0)


def selected_chunks(
    student_head: heads.Head,
    target: Callable[..., jax.Array],
    loss: Any,
    params_pair: tuple[Any, Any],
    inputs_at: tuple[dict, Any],
    chunked: dict,
    consts: dict,
    size: int,
) -> dict:
    """The train step's chunked inputs with AdaSPEC's selected tokens as 'weights' and every
    token's weight as 'metric_weights' (which the acceptance metric keeps).

    Args:
      student_head: the draft's `heads.Head`; the reference model has the same architecture.
      target: (student logits, chunk, consts) -> the teacher's logits over a chunk.
      loss: the `trainer.LossConfig` (its divergence, beta, eta and select_fraction).
      params_pair: (the draft's parameters, the reference model's).
      inputs_at: (the models' inputs, the loss positions or None).
      chunked, consts, size: the train step's chunked arrays, constants and chunk positions.

    Returns:
      `chunked` with the two weights; the per-token losses are computed chunk by chunk
      (`heads.map_chunks`), without gradient.
    """
    names = ("draft", "reference")
    hidden = {
        name: jax.lax.stop_gradient(student_head.features(params, *inputs_at))
        for name, params in zip(names, params_pair, strict=True)
    }
    head_params = {n: student_head.select(p) for n, p in zip(names, params_pair, strict=True)}

    def token_losses(chunk: dict) -> dict:
        out = {}
        for name in names:
            logits = student_head.apply(head_params[name], chunk[name])
            out[name] = losses.token_divergence(
                logits, target(logits, chunk, consts), chunk["weights"], loss.divergence,
                loss.beta, loss.eta,
            )  # fmt: skip
        return out

    per_token = heads.map_chunks(token_losses, {**chunked, **hidden}, size)
    weights = select_tokens(
        per_token["draft"], per_token["reference"], chunked["weights"], loss.select_fraction
    )
    return {**chunked, "weights": weights, "metric_weights": chunked["weights"]}
