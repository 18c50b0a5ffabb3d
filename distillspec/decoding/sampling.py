"""Turning logits into next-token distributions, and drawing from them.

Both decoders (plain and speculative) work on *probabilities that are already processed*
(temperature, top-k, top-p, shared vocabulary): speculative sampling is exact with respect to the
processed target distribution, so draft and target must be processed the same way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How a next token is chosen from a model's logits."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(logits / T).
    top_k: int = 0  # Keep only the k most likely tokens; 0 disables the filter.
    top_p: float = 1.0  # Keep the smallest set with total probability >= top_p; 1.0 disables.

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(
    logits: jax.Array, config: SamplingConfig, vocab_size: int | None = None
) -> jax.Array:
    """Processed next-token distribution.

    Args:
      logits: [..., V] raw logits.
      config: temperature / top-k / top-p.
      vocab_size: if given, ids >= vocab_size are dropped (a model whose embedding is padded past
        the tokenizer's size never proposes or emits those ids).

    Returns:
      [..., vocab_size or V] float32 probabilities; one-hot at the argmax when greedy.
    """
    logits = logits[..., :vocab_size].astype(jnp.float32)
    if config.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    logits = logits / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if config.top_p < 1:
        probs = _nucleus(probs, config.top_p)
    return probs


def _nucleus(probs: jax.Array, top_p: float) -> jax.Array:
    """Zeroes every token outside the smallest most-likely set of mass >= top_p; renormalises."""
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    # A token is kept if the mass strictly before it is still below top_p (the first always is).
    keep_sorted = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    probs = jnp.where(keep, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


def sample_categorical(rng: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws one id per row of probs [..., V] (unnormalised is fine; ids of probability 0 are
    never drawn) by inverting the cumulative distribution at one uniform draw per row.

    Exact up to float32 rounding of the running sum (about 1e-7 of the total per id), as the
    Gumbel-max trick is up to the rounding of its V uniforms; but it draws one random number per
    row instead of V: on a CPU, Gumbel-max over 2048 ids cost a decoding step about 80 us, most of
    the step's own work outside the model call (README section 3, the round's profile).
    """
    cdf = jnp.cumsum(probs, axis=-1)
    point = jax.random.uniform(rng, probs.shape[:-1] + (1,)) * cdf[..., -1:]
    # The first id whose running sum passes the point; `probs > 0` keeps an id of mass 0 out
    # even where rounding lifts its running sum. With none (measure zero), the most likely id.
    hit = (cdf > point) & (probs > 0)
    first = jnp.argmax(hit, axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), first, jnp.argmax(probs, axis=-1)).astype(jnp.int32)
