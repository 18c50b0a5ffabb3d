"""Speculation lookahead (SL) policies: how many tokens the draft proposes in each round.

A policy decides, after each draft token, whether the draft continues or the target verifies
(DISCO, Mamou et al., 2024). The decoder (`distillspec.decoding`) runs
every policy inside its one jitted loop with a fixed maximum `sl_max`: drafting is a
`lax.while_loop` that stops once every row has stopped, rows that stopped earlier are masked,
and verification treats masked positions as not drafted, so the output stays exactly the
target's (greedy token for token; sampled in distribution).

Policies (`Lookahead.kind`):
  static      every round drafts sl_max tokens (SL-k is static with sl_max = k).
  heuristic   Hugging Face assisted generation's schedule: start at `start`, +2 after a round
              whose drafts were all accepted, -1 otherwise, within [1, sl_max].
  confidence  stop after a draft token whose draft probability (softmax at T = 1) is below
              `threshold`.
  disco       stop after a draft token whose classifier confidence C_i = FFN(features) is below
              `threshold` (DISCO Eq. 2); trained by `distillspec.disco.classifier`.
  cumulative  SpecDec++'s rule (Huang et al., 2025): stop after the i-th draft token of a round
              once 1 - prod_{j<=i} p_j, the predicted probability that at least one of the
              round's drafts is rejected, exceeds `threshold`; p_j is the acceptance estimate of
              draft j: DISCO's classifier confidence (`source='classifier'`, the default) or the
              draft's own top probability (`source='draft'`, softmax at T = 1).
  oracle      greedy only: stop before the first draft token that differs from the target's
              greedy output (given as `oracle_tokens`), the per-round optimum of DISCO Sec. 2.

Features of a draft token (`features`): its top-k draft probabilities, the entropy of the draft
distribution, and log(1 + n) of its position n counted from the start of the generation (DISCO
App. D). We use the generation position and not the index inside the current round because the
classifier is trained on tokens that the draft predicts from the *target's* prefix: there the
label does not depend on any round, so an in-round index would be a feature the training data
cannot inform; the round is still capped by sl_max.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from distillspec import checks

KINDS = ("static", "heuristic", "confidence", "disco", "cumulative", "oracle")
# Where the cumulative rule reads each draft's acceptance estimate p_i.
SOURCES = ("classifier", "draft")
# Kinds whose rule compares a per-token estimate against `threshold` (tuned on validation data).
THRESHOLD_KINDS = ("confidence", "disco", "cumulative")


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """A lookahead policy (see the module docstring). Validated on construction."""

    kind: str = "static"
    sl_max: int = 5  # Drafts per round at most (static: exactly), >= 1.
    # confidence / disco: stop below this confidence; cumulative: stop once the predicted
    # probability that some draft of the round is rejected is above it. In [0, 1].
    threshold: float = 0.5
    start: int = 5  # heuristic: the first round's lookahead (clipped to sl_max).
    # confidence / disco / cumulative: the draft token at which the rule stopped is still
    # proposed (True, DISCO's and SpecDec++'s rule: stop drafting *after* it), or dropped (False:
    # the round may propose 0 tokens; cheaper where verifying a token costs real compute, as on
    # a CPU).
    keep_last: bool = True
    # cumulative only: 'classifier' (DISCO's classifier, the default) or 'draft' (see SOURCES).
    source: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"lookahead kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "sl_max", checks.check_int("SL_max (sl_max)", self.sl_max))
        try:
            in_range = 0.0 <= float(self.threshold) <= 1.0
        except (TypeError, ValueError):
            in_range = False
        if not in_range:
            raise ValueError(f"lookahead threshold must be in [0, 1], got {self.threshold!r}")
        object.__setattr__(self, "start", checks.check_int("heuristic start", self.start))
        if self.kind != "cumulative":
            if self.source is not None:
                raise ValueError(
                    f"lookahead source= is used by kind 'cumulative' only, not {self.kind!r} "
                    f"(got source={self.source!r})"
                )
        elif self.source is None:
            object.__setattr__(self, "source", SOURCES[0])
        elif self.source not in SOURCES:
            raise ValueError(
                f"cumulative lookahead source must be one of {SOURCES}, got {self.source!r}"
            )

    @property
    def static_part(self) -> Lookahead:
        """What the compiled program depends on (threshold and start are call inputs)."""
        return Lookahead(self.kind, self.sl_max, keep_last=self.keep_last, source=self.source)

    @property
    def uses_classifier(self) -> bool:
        """Whether the rule reads DISCO's classifier: disco, and cumulative from 'classifier'."""
        return self.kind == "disco" or self.source == "classifier"

    @property
    def name(self) -> str:
        """The policy's label in records: 'static-<k>' for static, else the kind."""
        return f"static-{self.sl_max}" if self.kind == "static" else self.kind


# --------------------------------------------------------------------------------------------
# DISCO's classifier.
# --------------------------------------------------------------------------------------------


def features(logits: jax.Array, position: jax.Array, top_k: int, vocab_size: int) -> jax.Array:
    """Classifier inputs for draft tokens: [..., top_k + 2].

    Args:
      logits: [..., V] raw draft logits of the distribution the token is drawn from.
      position: [...] tokens generated before this one (0 for the first generated token).
      top_k: how many of the largest probabilities to keep.
      vocab_size: ids >= vocab_size are ignored (padded embeddings).

    Returns:
      concat(top_k probabilities (descending), entropy in nats, log(1 + position)).
    """
    logp = jax.nn.log_softmax(logits[..., :vocab_size].astype(jnp.float32), axis=-1)
    probs = jnp.exp(logp)
    entropy = -jnp.sum(probs * logp, axis=-1)
    top = jax.lax.top_k(probs, top_k)[0]
    pos = jnp.log1p(jnp.asarray(position, jnp.float32))
    return jnp.concatenate([top, entropy[..., None], pos[..., None]], axis=-1)


class StopClassifier(nn.Module):
    """DISCO's 2-layer FFN: standardised features -> hidden ReLU layer -> acceptance logit."""

    hidden: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mean = self.variable("norm", "mean", jnp.zeros, x.shape[-1:])
        std = self.variable("norm", "std", jnp.ones, x.shape[-1:])
        x = (x - mean.value) / std.value
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(1, name="out")(x)[..., 0]


def num_features(top_k: int) -> int:
    return top_k + 2


def classifier_confidence(variables: Any, x: jax.Array) -> jax.Array:
    """sigmoid(FFN(x)) in [0, 1] for features x [..., F]; variables {'params', 'norm'}."""
    hidden = variables["params"]["hidden"]["kernel"].shape[-1]
    return jax.nn.sigmoid(StopClassifier(hidden).apply(variables, x))


def classifier_top_k(variables: Any) -> int:
    """The top_k the classifier was built for (from its input width)."""
    return int(variables["params"]["hidden"]["kernel"].shape[0]) - 2


# --------------------------------------------------------------------------------------------
# The stopping rule, as the decoder calls it.
# --------------------------------------------------------------------------------------------


def _acceptance_estimate(policy, inputs, index, logits, num_new, vocab_size) -> jax.Array:
    """[B] the rule's estimate that the token just drawn is accepted: the draft's top
    probability (confidence; cumulative from 'draft') or the classifier's confidence."""
    if policy.kind == "confidence" or policy.source == "draft":
        probs = jax.nn.softmax(logits[..., :vocab_size].astype(jnp.float32), axis=-1)
        return jnp.max(probs, axis=-1)
    variables = inputs["classifier"]
    x = features(logits, num_new + index, classifier_top_k(variables), vocab_size)
    return classifier_confidence(variables, x)


def stop_after(
    policy: Lookahead,
    inputs: dict[str, Any],
    index: int | jax.Array,
    logits: jax.Array,
    tokens: jax.Array,
    num_new: jax.Array,
    lookahead: jax.Array,
    vocab_size: int,
    survival: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Whether each row stops drafting at draft index `index`, and its drafts if it does.

    Args:
      policy: the static description (kind, sl_max, keep_last, source).
      inputs: dynamic values: 'threshold' (f32 scalar), 'classifier' (variables) for disco and
        cumulative from 'classifier', 'oracle_tokens' [B, N + sl_max] (padded with -1) for oracle.
      index: the draft index i in the round (0-based) of the token just drawn.
      logits: [B, V] raw draft logits the token was drawn from.
      tokens: [B] the token just drawn.
      num_new: [B] tokens generated before this round.
      lookahead: [B] heuristic's current lookahead.
      vocab_size: the shared vocabulary.
      survival: [B] float32, the cumulative rule's prod_{j<i} p_j over the round's earlier
        drafts (1 at i = 0); carried as is by the other kinds.

    Returns:
      (stop [B] bool, num_drafts [B] int32: the row's drafts in this round if it stops here,
      i + 1 (this token is proposed) or i (it is not: the oracle's mismatch, or the token the
      rule stopped at under keep_last=False), survival [B] for index i + 1).
    """
    last = index + 1 >= policy.sl_max
    keep = jnp.full(tokens.shape, index + 1, jnp.int32)
    if policy.kind == "static":
        return jnp.broadcast_to(last, tokens.shape), keep, survival
    if policy.kind == "heuristic":
        return last | (index + 1 >= lookahead), keep, survival
    if policy.kind == "oracle":
        want = jnp.take_along_axis(inputs["oracle_tokens"], (num_new + index)[:, None], axis=1)
        miss = tokens != want[:, 0]
        return last | miss, jnp.where(miss, index, index + 1).astype(jnp.int32), survival
    estimate = _acceptance_estimate(policy, inputs, index, logits, num_new, vocab_size)
    if policy.kind == "cumulative":  # P(some draft of the round is rejected) > threshold.
        survival = survival * estimate
        low = 1.0 - survival > inputs["threshold"]
    else:  # confidence, disco: this draft's estimate < threshold.
        low = estimate < inputs["threshold"]
    drop = low & (not policy.keep_last)
    return last | low, jnp.where(drop, index, index + 1).astype(jnp.int32), survival


def next_lookahead(policy: Lookahead, lookahead, num_drafts, num_accepted) -> jax.Array:
    """The heuristic's update: +2 after a fully accepted round, -1 otherwise, in [1, sl_max]."""
    if policy.kind != "heuristic":
        return lookahead
    grown = jnp.where(num_accepted >= num_drafts, lookahead + 2, lookahead - 1)
    return jnp.clip(grown, 1, policy.sl_max)


def verify_widths(policy: Lookahead) -> tuple[int, ...]:
    """Target call widths (drafts + 1) the decoder compiles; each round uses the smallest that
    fits its largest draft count. Static policies always use sl_max + 1; the others use every
    width up to 9, then powers of two, and sl_max + 1, so a short round does not pay for a long
    one (verification is not free where the target is compute-bound)."""
    if policy.kind == "static":
        return (policy.sl_max + 1,)
    widths = set(range(1, 10)) | {policy.sl_max + 1}
    widths |= {2**i for i in range(1, policy.sl_max.bit_length())}
    return tuple(sorted(w for w in widths if w <= policy.sl_max + 1))


def policy_inputs(policy: Lookahead, classifier, oracle_tokens, vocab_size: int, sampling,
                  max_new_tokens: int, batch: int) -> dict:  # fmt: skip
    """Checks the per-call values of a lookahead policy (its classifier, the oracle's tokens)
    against the call (vocabulary, sampling, length, batch); returns the decoder's `inputs`."""
    if policy.uses_classifier:
        if classifier is None:
            raise ValueError(
                f"lookahead kind {policy.kind!r}"
                + (" with source='classifier'" if policy.kind == "cumulative" else "")
                + " needs classifier= (variables from distillspec.disco.load_classifier; train "
                "one with python -m distillspec.disco)"
            )
        top_k = classifier_top_k(classifier)
        if not 1 <= top_k <= vocab_size:
            raise ValueError(
                f"the classifier reads the top {top_k} draft probabilities, but the vocabulary "
                f"has {vocab_size} ids"
            )
    elif classifier is not None:
        raise ValueError(
            "classifier= is used by lookahead kinds 'disco' and 'cumulative' (source="
            f"'classifier') only, not {policy.kind!r}"
            + (f" with source={policy.source!r}" if policy.source else "")
        )
    if policy.kind == "oracle":
        if not sampling.greedy:
            raise ValueError(
                "the oracle lookahead is defined for greedy decoding (temperature 0), got "
                f"temperature {sampling.temperature}"
            )
        shape = np.shape(oracle_tokens) if oracle_tokens is not None else None
        if shape is None or len(shape) != 2 or shape[0] != batch or shape[1] < max_new_tokens:
            raise ValueError(
                "lookahead kind 'oracle' needs oracle_tokens=[B, >= max_new_tokens], the target's "
                f"greedy output (generate(...).tokens) for B={batch}, got shape {shape}"
            )
        # Host input is cut on the host: a jnp slice here would be a dispatch of its own.
        xp = jnp if isinstance(oracle_tokens, jax.Array) else np
        oracle_tokens = xp.asarray(oracle_tokens, xp.int32)[:, :max_new_tokens]
    elif oracle_tokens is not None:
        raise ValueError(
            f"oracle_tokens= is used by lookahead kind 'oracle' only, not {policy.kind!r}"
        )
    return {
        "threshold": np.float32(policy.threshold),
        "start": np.int32(policy.start),
        "classifier": classifier,
        "oracle_tokens": oracle_tokens,
    }
