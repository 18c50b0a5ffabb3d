"""Distillation losses for DistillSpec: pure functions of logits and weights.

Conventions (paper, Appendix A.1):
  * P = p_teacher (the target model M_p), Q = q_student (the draft model M_q).
  * Per-token functions take ``student_logits`` and ``teacher_logits`` of shape [..., V]
    (usually [B, L, V]) and return one value per token, shape [...] (usually [B, L]).
  * Reductions return ``(loss_sum, weight_sum)``: sums over all tokens of ``value * weight``
    and of ``weight``. Normalisation happens once, on the host at logging time, via `mean`.

Beside DistillSpec's four divergences, the LK losses (Samarin et al., arXiv 2602.23881) train
for the acceptance rate alpha(p, q) = sum_v min(p_v, q_v) itself: 'lk_alpha' = -log alpha,
'lk_lambda' = lambda KL(p || q) + (1 - lambda) TVD(p, q) with a per-token lambda =
exp(-eta sg[alpha]), 'lk_lambda_mean' the same with one lambda from the mean alpha of the
tokens the call sees (the paper's batch-level weight).

Everything is computed in float32 from ``log_softmax`` of the logits; masking is by
multiplication (shapes stay fixed, no boolean indexing), so a weight-0 token contributes exactly
0 to the loss and to the gradient. Both temperatures are 1.0, as in the paper.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

KINDS = ("fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda", "lk_lambda_mean")
LK_ETA = 3.0  # The LK^lambda paper's eta: lambda = exp(-eta alpha).


def _log_probs(logits: ArrayLike) -> jax.Array:
    """float32 log-softmax over the last (vocabulary) axis: [..., V] -> [..., V]."""
    return jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)


def _kl_from_log_probs(log_a: jax.Array, log_b: jax.Array) -> jax.Array:
    """KL(a || b) = sum_v a (log a - log b), with 0 * log 0 = 0: [..., V] -> [...].

    The double ``where`` keeps the value and the gradient finite where a = 0 even if
    log a or log b is -inf there (e.g. vocabulary padding masked with -inf logits).
    """
    a = jnp.exp(log_a)
    diff = jnp.where(a > 0, log_a - log_b, 0.0)
    return jnp.sum(a * diff, axis=-1)


def forward_kl(student_logits: ArrayLike, teacher_logits: ArrayLike) -> jax.Array:
    """Forward KL per token: KL(p_teacher || q_student) = sum_v p (log p - log q).

    Mass-covering: the student is penalised wherever the teacher has mass it lacks.

    Args:
      student_logits: [B, L, V] logits of the student q.
      teacher_logits: [B, L, V] logits of the teacher p.

    Returns:
      [B, L] float32 divergences, >= 0.
    """
    return _kl_from_log_probs(_log_probs(teacher_logits), _log_probs(student_logits))


def reverse_kl(student_logits: ArrayLike, teacher_logits: ArrayLike) -> jax.Array:
    """Reverse KL per token: KL(q_student || p_teacher) = sum_v q (log q - log p).

    Mode-seeking: the student is penalised for mass where the teacher has little.

    Args:
      student_logits: [B, L, V] logits of the student q.
      teacher_logits: [B, L, V] logits of the teacher p.

    Returns:
      [B, L] float32 divergences, >= 0.
    """
    return _kl_from_log_probs(_log_probs(student_logits), _log_probs(teacher_logits))


def generalized_jsd(
    student_logits: ArrayLike, teacher_logits: ArrayLike, beta: float = 0.5
) -> jax.Array:
    """Generalized Jensen-Shannon divergence per token, paper Eq. (A.3).

    JSD[beta](p || q) = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q,
    with p = p_teacher and q = q_student. beta = 0.5 is the symmetric JS divergence (A.2).

    Limits (Appendix A.1, Huszar 2015), the convention the tests pin down:
      * beta -> 0: JSD[beta](p || q) / beta -> KL(p || q), i.e. forward KL;
      * beta -> 1: JSD[beta](p || q) / (1 - beta) -> KL(q || p), i.e. reverse KL,
        since JSD[beta](p || q) = JSD[1 - beta](q || p).
    At the exact endpoints beta = 0 and beta = 1 the formula gives m = q resp. m = p, so the
    divergence is identically 0 (and so is its gradient); use 'fkl' / 'rkl' for the limits.

    Args:
      student_logits: [B, L, V] logits of the student q.
      teacher_logits: [B, L, V] logits of the teacher p.
      beta: mixture weight of the teacher in m, a Python float in [0, 1].

    Returns:
      [B, L] float32 divergences, >= 0.

    Raises:
      ValueError: if beta is outside [0, 1].
    """
    beta = _check_beta(beta)
    return _jsd_from_log_probs(_log_probs(teacher_logits), _log_probs(student_logits), beta)


def _jsd_from_log_probs(log_p: jax.Array, log_q: jax.Array, beta: float) -> jax.Array:
    """`generalized_jsd` of teacher and student log-probabilities [..., V] -> [...]."""
    log_beta = math.log(beta) if beta > 0 else -math.inf
    log_one_minus_beta = math.log1p(-beta) if beta < 1 else -math.inf
    log_m = jnp.logaddexp(log_beta + log_p, log_one_minus_beta + log_q)
    # Terms with weight 0 are skipped (not multiplied by 0) so that inf * 0 cannot give NaN.
    result = jnp.zeros(log_p.shape[:-1], jnp.float32)
    if beta > 0:
        result += beta * _kl_from_log_probs(log_p, log_m)
    if beta < 1:
        result += (1.0 - beta) * _kl_from_log_probs(log_q, log_m)
    return result


def total_variation(student_logits: ArrayLike, teacher_logits: ArrayLike) -> jax.Array:
    """Total variation distance per token: TVD(p, q) = 1/2 sum_v |p - q| (symmetric).

    Args:
      student_logits: [B, L, V] logits of the student q.
      teacher_logits: [B, L, V] logits of the teacher p.

    Returns:
      [B, L] float32 distances in [0, 1].
    """
    return tvd_of_probs(jnp.exp(_log_probs(teacher_logits)), jnp.exp(_log_probs(student_logits)))


def tvd_of_probs(p: ArrayLike, q: ArrayLike) -> jax.Array:
    """TVD(p, q) = 1/2 sum_v |p - q| of two [..., V] distributions (e.g. processed with a
    sampling temperature, as the evaluation compares them); [...] float32."""
    return 0.5 * jnp.sum(jnp.abs(jnp.asarray(p) - jnp.asarray(q)), axis=-1)


def log_acceptance(log_p: ArrayLike, log_q: ArrayLike) -> jax.Array:
    """log alpha(p, q) = log sum_v min(p_v, q_v) from log-probabilities [..., V] -> [...].

    Computed as logsumexp(min(log p, log q)), so it stays finite (with a finite gradient)
    however small alpha is: no probability is exponentiated before the log, and no clamp is
    needed (alpha = 1e-60 is log alpha = -138, well inside float32)."""
    return jax.nn.logsumexp(jnp.minimum(jnp.asarray(log_p), jnp.asarray(log_q)), axis=-1)


def lk_alpha(student_logits: ArrayLike, teacher_logits: ArrayLike) -> jax.Array:
    """LK^alpha per token: -log alpha(p, q), alpha = sum_v min(p_v, q_v) the probability that
    speculative decoding accepts a token drafted from q for target p (Samarin et al., 2026).

    Args:
      student_logits: [B, L, V] logits of the student q.
      teacher_logits: [B, L, V] logits of the teacher p.

    Returns:
      [B, L] float32 losses, >= 0 (0 where q = p).
    """
    return -log_acceptance(_log_probs(teacher_logits), _log_probs(student_logits))


def lk_lambda(
    student_logits: ArrayLike, teacher_logits: ArrayLike, eta: float = LK_ETA
) -> jax.Array:
    """LK^lambda per token: lambda KL(p || q) + (1 - lambda) TVD(p, q), lambda =
    exp(-eta stop_gradient(alpha(p, q))): mostly KL while the draft is far from the target
    (alpha small, where TVD's gradient vanishes), mostly TVD = 1 - alpha once it is close.

    Args:
      student_logits: [B, L, V] logits of the student q.
      teacher_logits: [B, L, V] logits of the teacher p.
      eta: lambda's decay rate, >= 0 (0: forward KL alone).

    Returns:
      [B, L] float32 losses, >= 0.
    """
    log_p, log_q = _log_probs(teacher_logits), _log_probs(student_logits)
    return _lk_lambda_from_log_probs(log_p, log_q, _check_eta(eta), mean_weights=None)


def _lk_lambda_from_log_probs(log_p, log_q, eta: float, mean_weights) -> jax.Array:
    """`lk_lambda` of log-probabilities [..., V] -> [...]; with `mean_weights` [...], one
    lambda for all tokens, from their weighted mean alpha ('lk_lambda_mean')."""
    alpha = jax.lax.stop_gradient(jnp.exp(log_acceptance(log_p, log_q)))
    if mean_weights is not None:
        alpha = mean(*_weighted_sum(alpha, mean_weights))
    lam = jnp.exp(-eta * alpha)
    tvd = tvd_of_probs(jnp.exp(log_p), jnp.exp(log_q))
    return lam * _kl_from_log_probs(log_p, log_q) + (1.0 - lam) * tvd


def _per_token(kind: str, log_p, log_q, beta: float, eta: float, weights) -> jax.Array:
    """The per-token divergence `kind` (any but the 'fkl' custom-VJP path of
    `distillation_sums`) of teacher and student log-probabilities [..., V] -> [...]."""
    if kind == "fkl":
        return _kl_from_log_probs(log_p, log_q)
    if kind == "rkl":
        return _kl_from_log_probs(log_q, log_p)
    if kind == "jsd":
        return _jsd_from_log_probs(log_p, log_q, beta)
    if kind == "tvd":
        return tvd_of_probs(jnp.exp(log_p), jnp.exp(log_q))
    if kind == "lk_alpha":
        return -log_acceptance(log_p, log_q)
    mean_weights = weights if kind == "lk_lambda_mean" else None
    return _lk_lambda_from_log_probs(log_p, log_q, eta, mean_weights)


def divergence(
    student_logits: ArrayLike,
    teacher_logits: ArrayLike,
    weights: ArrayLike,
    kind: str,
    beta: float = 0.5,
    eta: float = LK_ETA,
) -> tuple[jax.Array, jax.Array]:
    """Weighted sum of a per-token divergence between teacher p and student q.

    kind: 'fkl' = KL(p_teacher || q_student), 'rkl' = KL(q_student || p_teacher),
    'jsd' = JSD[beta](p_teacher || q_student) (see `generalized_jsd`), 'tvd' = TVD(p, q),
    'lk_alpha' = -log alpha(p, q) (`lk_alpha`), 'lk_lambda' = `lk_lambda` (per-token lambda),
    'lk_lambda_mean' = the same with lambda = exp(-eta sg[mean alpha]), the weighted mean over
    this call's tokens (one chunk of the train step's, the whole batch when it fits one).

    Args:
      student_logits: [B, L, V] logits of the student q (gradients flow here).
      teacher_logits: [B, L, V] logits of the teacher p (callers stop gradients).
      weights: [B, L] non-negative token weights; 0 masks a token (padding, prompt).
      kind: one of `KINDS`.
      beta: JSD mixture weight in [0, 1]; validated for every kind, used only by 'jsd'.
      eta: LK^lambda's decay rate, >= 0; validated for every kind, used only by the lk_lambda
        kinds.

    Returns:
      (loss_sum, weight_sum): float32 scalars, sum_{b,l} D_{b,l} w_{b,l} and sum_{b,l} w_{b,l}.

    Raises:
      ValueError: on an unknown kind, beta outside [0, 1], eta < 0, or mismatched shapes.
    """
    per_token = token_divergence(student_logits, teacher_logits, weights, kind, beta, eta)
    return _weighted_sum(per_token, weights)


def token_divergence(
    student_logits: ArrayLike,
    teacher_logits: ArrayLike,
    weights: ArrayLike,
    kind: str,
    beta: float = 0.5,
    eta: float = LK_ETA,
) -> jax.Array:
    """`divergence`'s per-token values [B, L] before the weighted sum (0 where the weight is
    0), e.g. for AdaSPEC's token selection (`distillspec.selection`); same arguments."""
    beta, eta = _check_arguments(student_logits, teacher_logits, weights, kind, beta, eta)
    log_q = _log_probs(_zero_masked(student_logits, weights))
    log_p = _log_probs(_zero_masked(teacher_logits, weights))
    per_token = _per_token(kind, log_p, log_q, beta, eta, weights)
    return jnp.where(jnp.asarray(weights) != 0, per_token, 0.0)


def _check_arguments(student_logits, teacher_logits, weights, kind: str, beta: float,
                     eta: float) -> tuple[float, float]:  # fmt: skip
    """Validates a divergence's arguments (see `divergence`); returns (beta, eta) as floats."""
    if kind not in KINDS:
        raise ValueError(f"Unknown divergence kind {kind!r}; valid kinds are {KINDS}.")
    _check_shapes(student_logits, teacher_logits, weights)
    return _check_beta(beta), _check_eta(eta)


def distillation_sums(
    student_logits: ArrayLike,
    teacher_logits: ArrayLike,
    weights: ArrayLike,
    kind: str,
    beta: float = 0.5,
    eta: float = LK_ETA,
    metric_weights: ArrayLike | None = None,
) -> dict[str, jax.Array]:
    """The distillation step's loss and metric sums from one log-softmax per distribution.

    The same values as `divergence` (the loss, with its gradient with respect to the student's
    logits) and `acceptance_proxy` (the metric), but the teacher's and the student's
    log-probabilities are computed once each and shared by the loss and the metric. For 'fkl'
    the student's gradient is the closed form w (softmax(student) - p_teacher) per token (a
    custom VJP) rather than autodiff through the log-softmax; it equals autodiff's
    w (softmax(student) sum_v p - p) up to float32 rounding of sum_v p = 1.

    Args:
      student_logits: [B, L, V] logits of the student q (gradients flow here).
      teacher_logits: [B, L, V] logits of the teacher p (callers stop gradients).
      weights: [B, L] non-negative token weights; 0 masks a token.
      kind: one of `KINDS`.
      beta: JSD mixture weight in [0, 1]; validated for every kind, used only by 'jsd'.
      eta: LK^lambda's decay rate, >= 0 (used only by the lk_lambda kinds).
      metric_weights: [B, L] the acceptance metric's own weights (non-zero wherever `weights`
        is), e.g. every token where the loss keeps a selection of them; None: `weights`.

    Returns:
      float32 scalars {'loss_sum', 'weight_sum', 'acceptance_sum'}: sum D w, sum w and
      sum (1 - TVD) w (w: metric_weights when given, with their sum as 'metric_weight_sum');
      the acceptance sum carries no gradient.

    Raises:
      ValueError: on an unknown kind, beta outside [0, 1], eta < 0, or mismatched shapes.
    """
    beta, eta = _check_arguments(student_logits, teacher_logits, weights, kind, beta, eta)
    seen = weights if metric_weights is None else metric_weights
    student_logits = _zero_masked(student_logits, seen)
    log_p = _log_probs(_zero_masked(teacher_logits, seen))
    p = jnp.exp(log_p)
    if kind == "fkl":
        per_token, q = _forward_kl_and_probs(student_logits, log_p)
    else:
        log_q = _log_probs(student_logits)
        q = jnp.exp(log_q)
        per_token = _per_token(kind, log_p, log_q, beta, eta, weights)
    loss_sum, weight_sum = _weighted_sum(per_token, weights)
    accepted = jnp.sum(jnp.minimum(p, jax.lax.stop_gradient(q)), axis=-1)
    acceptance_sum, seen_sum = _weighted_sum(accepted, seen)
    sums = {"loss_sum": loss_sum, "weight_sum": weight_sum, "acceptance_sum": acceptance_sum}
    if metric_weights is not None:
        sums["metric_weight_sum"] = seen_sum
    return sums


@jax.custom_vjp
def _forward_kl_and_probs(student_logits: jax.Array, log_p: jax.Array):
    """(KL(p || q) per token [...], q = softmax(student_logits) [..., V]) for float32 student
    logits and teacher log-probabilities [..., V]. q carries no gradient (as if under
    stop_gradient): it is there for metrics, so that the student's softmax is computed once."""
    return _forward_kl_fwd(student_logits, log_p)[0]


def _forward_kl_fwd(student_logits, log_p):
    log_q = _log_probs(student_logits)
    q = jnp.exp(log_q)
    return (_kl_from_log_probs(log_p, log_q), q), (log_q, q, log_p)


def _forward_kl_bwd(residuals, cotangents):
    """d KL / d student_logits = q - p; d KL / d log_p = p (log p - log q + 1) where p > 0 (the
    teacher's side, for completeness: training stops it). q's cotangent is ignored."""
    log_q, q, log_p = residuals
    g = cotangents[0][..., None]
    p = jnp.exp(log_p)
    d_log_p = jnp.where(p > 0, p * (log_p - log_q + 1.0), 0.0)
    return g * (q - p), g * d_log_p


_forward_kl_and_probs.defvjp(_forward_kl_fwd, _forward_kl_bwd)


def topk_teacher_logits(
    log_probs: ArrayLike, ids: ArrayLike, vocab_size: int, student_logits: ArrayLike | None = None
) -> jax.Array:
    """The teacher's distribution from its top-k log-probabilities (`distillspec.teacher_cache`,
    `distillspec.served`).

    The k ids keep their exact probabilities p_1..p_k; the tail mass r = 1 - sum_i p_i (at
    least 1e-12, so every id keeps a finite log-probability) goes to the other V - k ids in
    the student's own proportions (`student_logits`, gradient stopped), or uniformly without
    them. The result is normalised log-probabilities, usable as teacher logits by every
    divergence; with k = V it is the teacher's distribution itself. With the student's tail
    shape, a divergence sees exactly what was recorded: FKL becomes
    sum_i p_i log(p_i / q_i) + r log(r / Q) (Q: the student's tail mass), so the student
    learns the top k and the tail's mass, and is not pushed towards a flat tail (a uniform
    tail is what a small k otherwise teaches it: measured on served data, the acceptance
    proxy against it rose while the real acceptance rate fell).

    Args:
      log_probs: [..., k] the teacher's k largest log-probabilities; ids: [..., k] their ids
        (distinct along the last axis).
      vocab_size: V.
      student_logits: [..., V'] (V' >= V) the student's logits at the same positions, or None.

    Returns:
      [..., V] float32 log-probabilities.
    """
    log_probs = jnp.asarray(log_probs, jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    k = log_probs.shape[-1]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-k teacher: k = {k} must be in [1, vocab_size = {vocab_size}]")
    tail = jnp.log(jnp.maximum(1.0 - jnp.sum(jnp.exp(log_probs), axis=-1), 1e-12))[..., None]
    shape = (*log_probs.shape[:-1], vocab_size)
    if student_logits is None:
        dense = jnp.broadcast_to(tail - math.log(max(vocab_size - k, 1)), shape)
    else:
        student = jax.lax.stop_gradient(jnp.asarray(student_logits, jnp.float32)[..., :vocab_size])
        in_top = jnp.put_along_axis(jnp.zeros(shape, bool), ids, True, axis=-1, inplace=False)
        student = jnp.where(in_top, -jnp.inf, student)
        dense = tail + student - jax.nn.logsumexp(student, axis=-1, keepdims=True)
        dense = jnp.where(in_top, 0.0, dense)  # Overwritten below; keeps -inf out of the sum.
    return jnp.put_along_axis(dense, ids, log_probs, axis=-1, inplace=False)


def cross_entropy(
    student_logits: ArrayLike, target_tokens: ArrayLike, weights: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """Token-level negative log-likelihood of given targets, for supervised baselines.

    NLL_{b,l} = -log q_student(target_{b,l}); equals forward KL to a one-hot teacher.

    Args:
      student_logits: [B, L, V] logits of the student q.
      target_tokens: [B, L] integer token ids in [0, V).
      weights: [B, L] non-negative token weights; 0 masks a token.

    Returns:
      (loss_sum, weight_sum): float32 scalars, sum NLL * w and sum w.
    """
    logits = jnp.asarray(student_logits, jnp.float32)
    targets = jnp.asarray(target_tokens, jnp.int32)
    keep = jnp.asarray(weights) != 0
    return _weighted_sum(_masked_nll(logits, targets, keep), weights)


@jax.custom_vjp
def _masked_nll(logits: jax.Array, targets: jax.Array, keep: jax.Array) -> jax.Array:
    """logsumexp(z) - z[target] per position where `keep`, else 0: [..., V], [...], [...] -> [...].

    The value and gradient of -log_softmax(z)[target] at kept positions, and exactly 0 at the
    others whatever their logits hold (as `_zero_masked` guarantees the divergences), in two
    passes over the logits forward and one backward: the gradient softmax(z) - onehot(target)
    is written in one elementwise pass (autodiff's take_along_axis builds a scatter and
    log_softmax's own backward instead).
    """
    return _masked_nll_fwd(logits, targets, keep)[0]


def _masked_nll_fwd(logits, targets, keep):
    top = jnp.max(logits, axis=-1, keepdims=True)  # Not differentiated: the VJP is below.
    lse = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1)) + top[..., 0]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.where(keep, lse - picked, 0.0), (logits, targets, keep, lse)


def _masked_nll_bwd(residuals, g):
    logits, targets, keep, lse = residuals
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
    grad = jnp.exp(logits - lse[..., None]) - onehot
    grad = jnp.where(keep[..., None], grad * g[..., None], 0.0)
    return grad, None, None


_masked_nll.defvjp(_masked_nll_fwd, _masked_nll_bwd)


def acceptance_proxy(
    student_logits: ArrayLike, teacher_logits: ArrayLike, weights: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """Training-time proxy of the speculative acceptance rate.

    The probability that one token drafted from q is accepted by target p is
    alpha(p, q) = sum_v min(p, q) = 1 - TVD(p, q) (Leviathan et al., 2023); this sums it
    over tokens: sum_{b,l} (1 - TVD(p_{b,l}, q_{b,l})) w_{b,l}.

    Args:
      student_logits: [B, L, V] logits of the student (draft) q.
      teacher_logits: [B, L, V] logits of the teacher (target) p.
      weights: [B, L] non-negative token weights; 0 masks a token.

    Returns:
      (acceptance_sum, weight_sum): float32 scalars; their ratio is the mean acceptance.
    """
    _check_shapes(student_logits, teacher_logits, weights)
    p = jnp.exp(_log_probs(_zero_masked(teacher_logits, weights)))
    q = jnp.exp(_log_probs(_zero_masked(student_logits, weights)))
    # sum min(p, q) is the same quantity as 1 - TVD without the cancellation near TVD = 1.
    return _weighted_sum(jnp.sum(jnp.minimum(p, q), axis=-1), weights)


def mean(loss_sum: ArrayLike, weight_sum: ArrayLike) -> jax.Array:
    """loss_sum / weight_sum, or 0 when weight_sum is 0 (never divides by zero).

    Args:
      loss_sum: scalar (or any shape) sum of weighted values.
      weight_sum: matching sum of weights.

    Returns:
      float32 array of the broadcast shape.
    """
    loss_sum = jnp.asarray(loss_sum, jnp.float32)
    weight_sum = jnp.asarray(weight_sum, jnp.float32)
    nonzero = weight_sum != 0
    return jnp.where(nonzero, loss_sum / jnp.where(nonzero, weight_sum, 1.0), 0.0)


def _zero_masked(logits: ArrayLike, weights: ArrayLike) -> jax.Array:
    """float32 logits [..., V] with weight-0 positions set to 0 (a uniform distribution).

    Whatever sits at padding (huge values, inf, NaN) then cannot leak into the loss or, through
    0 * inf in a backward pass, into the gradient; the gradient there is exactly 0.
    """
    keep = jnp.asarray(weights)[..., None] != 0
    return jnp.where(keep, jnp.asarray(logits, jnp.float32), 0.0)


def _weighted_sum(per_token: jax.Array, weights: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """(sum per_token * w, sum w) over all tokens, in float32; masking is by multiplication."""
    weights = jnp.asarray(weights, jnp.float32)
    return jnp.sum(per_token * weights), jnp.sum(weights)


def _check_beta(beta: float) -> float:
    """Returns beta as a float, or raises ValueError unless 0 <= beta <= 1."""
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:  # also rejects NaN
        raise ValueError(f"JSD beta must be in [0, 1], got beta={beta}.")
    return beta


def _check_eta(eta: float) -> float:
    """Returns eta as a float, or raises ValueError unless eta >= 0."""
    eta = float(eta)
    if not eta >= 0.0:  # also rejects NaN
        raise ValueError(f"LK eta must be >= 0, got eta={eta}.")
    return eta


def _check_shapes(student_logits: ArrayLike, teacher_logits: ArrayLike, weights: ArrayLike):
    """Raises ValueError unless logits are [..., V] alike and weights are [...]."""
    s_shape, t_shape = jnp.shape(student_logits), jnp.shape(teacher_logits)
    w_shape = jnp.shape(weights)
    if s_shape != t_shape:
        raise ValueError(
            f"student_logits {s_shape} and teacher_logits {t_shape} must have the same "
            "shape [B, L, V] (same vocabulary size V)."
        )
    if w_shape != s_shape[:-1]:
        raise ValueError(f"weights {w_shape} must have shape {s_shape[:-1]} (logits [B, L, V]).")
