"""The verification rule of speculative decoding (DistillSpec, Algorithm A.1), with lenience.

Draft token x at position i is kept with probability min(1, f(p_i(x), eps) / q_i(x)); the first
rejected position is replaced by a draw from norm(max(0, p_i - q_i)); when all gamma drafts are
kept, one more token is drawn from the target's extra position p_gamma. With f(p, 1) = p (no
lenience) the emitted tokens are distributed exactly as the target's
(Leviathan et al., 2023, Theorem 1; Chen et al., 2023).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distillspec.decoding.sampling import sample_categorical

LENIENCE_KINDS = ("linear", "square", "exp")


@dataclasses.dataclass(frozen=True)
class Lenience:
    """Lenience function f(p, eps) of lossy speculative decoding (DistillSpec Section 4).

    linear: p / eps;  square: p / eps**2;  exp: p ** eps.  eps = 1 is lossless for all three.
    """

    kind: str = "linear"  # One of LENIENCE_KINDS.
    epsilon: float = 1.0  # In (0, 1]; smaller accepts more drafts (faster, further from target).

    def __post_init__(self):
        if self.kind not in LENIENCE_KINDS:
            raise ValueError(f"lenience kind must be one of {LENIENCE_KINDS}, got {self.kind!r}")
        if not 0 < self.epsilon <= 1:
            raise ValueError(
                f"lenience epsilon must be in (0, 1] (1 = lossless), got {self.epsilon!r}"
            )

    def __call__(self, p: jax.Array) -> jax.Array:
        if self.kind == "linear":
            return p / self.epsilon
        if self.kind == "square":
            return p / self.epsilon**2
        return p**self.epsilon


def acceptance_probability(
    draft_token_prob: jax.Array, target_token_prob: jax.Array, lenience: Lenience | None = None
) -> jax.Array:
    """min(1, f(p(x)) / q(x)) for a drafted token x; 1 where q(x) = 0 (x cannot be drafted)."""
    f = target_token_prob if lenience is None else lenience(target_token_prob)
    ratio = f / jnp.where(draft_token_prob > 0, draft_token_prob, 1.0)
    return jnp.where(draft_token_prob > 0, jnp.minimum(1.0, ratio), 1.0)


def accept_or_resample(
    rng: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    lenience: Lenience | None = None,
    num_drafts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Verifies a block of drafts against the target (one round of Algorithm A.1).

    Args:
      rng: PRNG key.
      draft_tokens: [B, G] int32, the drafted tokens (G = gamma >= 0).
      draft_probs: [B, G, V] processed draft distributions the drafts were drawn from.
      target_probs: [B, G + 1, V] processed target distributions at the same positions, plus
        one after the last draft.
      lenience: f(p, eps); None is lossless.
      num_drafts: [B] int32 in [0, G], drafts row b really proposed (a dynamic lookahead); the
        positions from num_drafts on are not drafts: never accepted, and the first of them is
        drawn from p as after a full block. None = all G.

    Returns:
      num_accepted: [B] int32 in [0, G], drafts kept before the first rejection.
      next_token: [B] int32, the replacement at the first rejection, or the token drawn from the
        target's extra position when all drafts are kept.
    """
    rng_accept, rng_next = jax.random.split(rng)
    if num_drafts is not None:
        proposed = jnp.arange(draft_tokens.shape[1]) < num_drafts[:, None]  # [B, G]
        draft_probs = jnp.where(proposed[..., None], draft_probs, 0.0)
    take = lambda probs: jnp.take_along_axis(probs, draft_tokens[..., None], axis=-1)[..., 0]
    accept_prob = acceptance_probability(take(draft_probs), take(target_probs[:, :-1]), lenience)
    # u < a (not <=) so that a = 0 always rejects and a = 1 always accepts: greedy stays exact.
    kept = jax.random.uniform(rng_accept, accept_prob.shape) < accept_prob
    if num_drafts is not None:
        kept = kept & proposed
    num_accepted = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=-1), axis=-1)
    # q is taken as 0 at the extra position, so the same residual formula yields p_gamma there.
    q_padded = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))
    pick = lambda probs: jnp.take_along_axis(probs, num_accepted[:, None, None], axis=1)[:, 0]
    p, q = pick(target_probs), pick(q_padded)
    residual = jnp.maximum(p - q, 0.0)
    # An all-zero residual has probability 0 when lossless (lossy edge cases): fall back to p.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
    return num_accepted.astype(jnp.int32), sample_categorical(rng_next, residual)


def accept_greedy(
    draft_tokens: jax.Array, target_tokens: jax.Array, num_drafts: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """`accept_or_resample` for greedy decoding, from tokens alone.

    Greedy draft and target distributions are one-hot, so a draft is kept exactly when it is the
    target's argmax (under any lenience: f(0) = 0 and min(1, f(1)) = 1), and the replacement or
    extra token is the target's argmax at the first position not kept. Same results as
    `accept_or_resample` on the one-hot distributions, without their [B, G, V] buffers or any
    random draws.

    Args:
      draft_tokens: [B, G] int32 drafts; target_tokens: [B, G + 1] the target's argmax at the
        last token and each draft; num_drafts: as in `accept_or_resample`.

    Returns:
      (num_accepted [B] int32, next_token [B] int32), as `accept_or_resample`.
    """
    kept = draft_tokens == target_tokens[:, :-1]
    if num_drafts is not None:
        kept = kept & (jnp.arange(draft_tokens.shape[1]) < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=-1), axis=-1)
    next_token = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted.astype(jnp.int32), next_token.astype(jnp.int32)
