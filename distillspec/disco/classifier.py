"""DISCO's stop classifier: its configuration, training (BCE, Adam) and F1 (App. D.2, Table 4).

train_classifier   the 2-layer FFN (`lookahead.StopClassifier`) on labelled examples.
classifier_f1      Table 4 "F1 DISCO": F1 of the accepted class at a threshold.
static_sl_f1       Table 4 "F1 static-SL": F1 of the rule "accepted iff the token's index in
                   the oracle's speculation round is < k" (see `in_round_index`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distillspec import checks
from distillspec.decoding import lookahead
from distillspec.disco.features import Examples

_STEPS_PER_CALL = 250  # Training steps per jitted lax.scan call.


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """What DISCO's classifier is trained on and how; validated when made, before any work."""

    num_train_prompts: int = 1024  # Prompts of the train set whose tokens are examples.
    num_validation_prompts: int = 32  # Prompts of the validation set (F1 and tuning).
    top_k: int = 8  # Top draft probabilities among the features (<= the vocabulary size).
    hidden: int = 32  # Width of the FFN's hidden layer.
    train_steps: int = 2000  # Adam steps.
    learning_rate: float = 1e-2  # Adam's step size, > 0.
    seed: int = 0  # Initialisation and minibatch order.

    def __post_init__(self):
        for field in ("num_train_prompts", "num_validation_prompts", "top_k", "hidden"):
            checks.check_int(field, getattr(self, field))
        checks.check_int("train_steps", self.train_steps)
        checks.check_int("seed", self.seed, minimum=0)
        if not float(self.learning_rate) > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")


def _check_examples(examples: Examples, what: str) -> None:
    if len(examples) == 0:
        raise ValueError(f"{what}: examples is empty (no labelled tokens)")
    if examples.top_k < 1:
        raise ValueError(
            f"{what}: examples.x must have top_k + 2 >= 3 columns, got shape {examples.x.shape}"
        )


def train_classifier(
    examples: Examples,
    *,
    hidden: int = 32,
    steps: int = 2000,
    learning_rate: float = 1e-2,
    batch_size: int = 1024,
    seed: int = 0,
) -> dict[str, Any]:
    """Trains DISCO's stop classifier (`lookahead.StopClassifier`) on labelled examples.

    The 'norm' collection holds the mean and standard deviation (floored at 1e-6) of the
    training features; the FFN minimises the binary cross-entropy of its logit against the
    labels with Adam, on minibatches drawn (with replacement) by a numpy RNG seeded with `seed`,
    which also seeds the initialisation: the result is a function of the arguments.

    Args:
      examples: training examples (`extract_features`), with both labels present.
      hidden: width of the hidden layer, >= 1.
      steps: optimisation steps, >= 1.
      learning_rate: Adam's step size, > 0.
      batch_size: examples per step, >= 1.
      seed: initialisation and minibatch order.

    Returns:
      variables {'params': ..., 'norm': {'mean': [F], 'std': [F]}} for
      `lookahead.classifier_confidence`.
    """
    _check_examples(examples, "train_classifier")
    for name, value in (("hidden", hidden), ("steps", steps), ("batch_size", batch_size)):
        checks.check_int(name, value)
    if not float(learning_rate) > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    labels = np.unique(examples.y)
    if not set(labels.tolist()) <= {0, 1}:
        raise ValueError(f"labels must be 0 or 1, got values {labels.tolist()}")
    if len(labels) < 2:
        raise ValueError(
            f"every training label is {int(labels[0])}: a classifier needs both accepted (1) "
            "and rejected (0) tokens; extract features from more prompts, or a draft that "
            "differs from the target"
        )
    x = np.asarray(examples.x, np.float32)
    y = np.asarray(examples.y, np.float32)
    norm = {"mean": x.mean(0), "std": np.maximum(x.std(0), 1e-6)}
    module = lookahead.StopClassifier(hidden)
    params = module.init(jax.random.PRNGKey(seed), jnp.zeros((1, x.shape[1])))["params"]
    optimizer = optax.adam(learning_rate)

    def step(params, opt_state, norm, xb, yb):
        def loss_fn(params):
            logits = module.apply({"params": params, "norm": norm}, xb)
            return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, yb))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def run(params, opt_state, norm, x, y, rows):  # rows [S, batch_size]: S steps in one call.
        def body(carry, batch_rows):
            params, opt_state = carry
            params, opt_state, loss = step(params, opt_state, norm, x[batch_rows], y[batch_rows])
            return (params, opt_state), loss

        return jax.lax.scan(body, (params, opt_state), rows)[0]

    rng = np.random.default_rng(seed)
    opt_state = optimizer.init(params)
    data = jnp.asarray(x), jnp.asarray(y)
    norm = jax.tree.map(jnp.asarray, norm)
    for start in range(0, steps, _STEPS_PER_CALL):
        rows = rng.integers(0, len(y), size=(min(_STEPS_PER_CALL, steps - start), batch_size))
        params, opt_state = run(params, opt_state, norm, *data, jnp.asarray(rows, jnp.int32))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _plain_dict(params))
    return {"params": params, "norm": norm}


def _plain_dict(tree: Any) -> Any:
    """Nested Mapping (flax FrozenDict included) -> nested dict."""
    if isinstance(tree, Mapping):
        return {k: _plain_dict(v) for k, v in tree.items()}
    return tree


# --------------------------------------------------------------------------------------------
# F1 scores (DISCO App. D.2, Table 4).
# --------------------------------------------------------------------------------------------


def f1_score(pred: np.ndarray, label: np.ndarray) -> float:
    """F1 of the positive class (1 = accepted): 2 TP / (2 TP + FP + FN).

    Args:
      pred, label: [M] arrays of 0/1 (or bool), the same shape.

    Returns:
      The F1 score; 0.0 when neither pred nor label holds a positive (as scikit-learn).
    """
    pred, label = np.asarray(pred), np.asarray(label)
    if pred.shape != label.shape or pred.ndim != 1:
        raise ValueError(
            f"pred and label must be [M] of one shape, got {pred.shape}, {label.shape}"
        )
    for name, a in (("pred", pred), ("label", label)):
        if not set(np.unique(a).tolist()) <= {0, 1}:
            raise ValueError(f"{name} must hold only 0/1 values, got {np.unique(a).tolist()}")
    pred, label = pred.astype(bool), label.astype(bool)
    tp = int(np.sum(pred & label))
    denominator = 2 * tp + int(np.sum(pred & ~label)) + int(np.sum(~pred & label))
    return 2.0 * tp / denominator if denominator else 0.0


@jax.jit
def _confidence(variables, x):
    return lookahead.classifier_confidence(variables, x)


def classifier_confidences(variables: Any, examples: Examples) -> np.ndarray:
    """[M] float32 classifier confidences C_i of the examples."""
    _check_examples(examples, "classifier_confidences")
    if lookahead.classifier_top_k(variables) != examples.top_k:
        raise ValueError(
            f"the classifier was built for top_k={lookahead.classifier_top_k(variables)} but "
            f"the examples have top_k={examples.top_k} (x has {examples.x.shape[1]} columns)"
        )
    return np.asarray(jax.device_get(_confidence(variables, jnp.asarray(examples.x))))


def classifier_f1(variables: Any, examples: Examples, threshold: float = 0.5) -> float:
    """F1 of the classifier's accepted class: a token is predicted accepted iff its confidence
    is >= threshold (the decoder keeps drafting exactly then; it stops below the threshold)."""
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    return f1_score(classifier_confidences(variables, examples) >= threshold, examples.y)


def in_round_index(examples: Examples) -> np.ndarray:
    """Each token's index inside the oracle's speculation round: [M] int64, in examples' order.

    Greedy speculative decoding with the oracle lookahead (DISCO Sec. 2) splits a continuation
    into rounds "accepted ... accepted rejected": the draft proposes until its first mismatch,
    and the next round starts at the token after the rejected one. Along each sequence, ordered
    by position, the index is 0 at the first token, resets to 0 on the token after each token
    with label 0, and otherwise grows by 1. For labels 1 1 0 1 0 0 1 1 it is 0 1 2 0 1 0 0 1.
    """
    _check_examples(examples, "in_round_index")
    order = np.lexsort((examples.position, examples.sequence))
    seq, pos, y = examples.sequence[order], examples.position[order], examples.y[order]
    same = seq[1:] == seq[:-1]
    if np.any(same & (pos[1:] == pos[:-1])):
        raise ValueError("examples hold two tokens with the same (sequence, position)")
    start = np.ones(len(order), bool)
    start[1:] = ~same | (y[:-1] == 0)
    index = np.arange(len(order))
    index = index - np.maximum.accumulate(np.where(start, index, 0))
    out = np.empty_like(index)
    out[order] = index
    return out


def static_sl_f1(examples: Examples, k: int) -> float:
    """F1 of static SL-k as a classifier: a token is predicted accepted iff its
    `in_round_index` is < k. Our operationalisation of DISCO Table 4's "F1 static-SL"."""
    checks.check_int("static SL k", k)
    return f1_score(in_round_index(examples) < k, examples.y)


def best_static_sl(examples: Examples, ks: Iterable[int] = range(1, 17)) -> tuple[int, float]:
    """The k of `ks` whose static SL-k rule has the highest F1 (the smallest k on ties), and
    that F1 (DISCO Table 4's "F1 static-SL", see `in_round_index`)."""
    ks = list(ks)
    if not ks:
        raise ValueError("ks is empty: pass at least one static SL k >= 1")
    index, y = in_round_index(examples), examples.y
    best_k, best = None, -1.0
    for k in ks:
        checks.check_int("static SL k in ks", k)
        f1 = f1_score(index < k, y)
        if f1 > best:
            best_k, best = int(k), f1
    return best_k, best
