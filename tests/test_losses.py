"""Property tests and hand-computed golden values for distillspec.losses.

Reference values are computed here in float64 numpy, independently of the implementation.
Convention under test: p = teacher, q = student; JSD[beta](p || q) with m = beta p + (1-beta) q,
so JSD / beta -> KL(p || q) (forward) as beta -> 0 and JSD / (1-beta) -> KL(q || p) (reverse)
as beta -> 1 (paper, Appendix A.1).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec import losses

ALL_KINDS = [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9)]
ALL_KINDS += [("lk_alpha", 0.5), ("lk_lambda", 0.5), ("lk_lambda_mean", 0.5)]


def _random_logits(seed, shape=(2, 3, 7), scale=3.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


def _np_probs(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_kl(a, b):
    return np.sum(np.where(a > 0, a * (np.log(np.where(a > 0, a, 1)) - np.log(b)), 0.0), -1)


def _total(kind, beta, student, teacher):
    loss, _ = losses.divergence(student, teacher, np.ones(student.shape[:-1]), kind, beta)
    return float(loss)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("kind,beta", ALL_KINDS)
def test_zero_for_identical_inputs(kind, beta):
    logits = _random_logits(0)
    loss, count = losses.divergence(logits, logits, np.ones((2, 3)), kind, beta)
    assert float(count) == 6.0
    assert abs(float(loss)) < 1e-5


@pytest.mark.parametrize("kind,beta", ALL_KINDS)
def test_non_negative_on_random_inputs(kind, beta):
    fn = {
        "fkl": losses.forward_kl,
        "rkl": losses.reverse_kl,
        "tvd": losses.total_variation,
        "jsd": lambda s, t: losses.generalized_jsd(s, t, beta),
        "lk_alpha": losses.lk_alpha,
        "lk_lambda": losses.lk_lambda,
        "lk_lambda_mean": lambda s, t: losses.token_divergence(s, t, np.ones((2, 3)), kind),
    }[kind]
    for seed in range(3):
        values = np.asarray(fn(_random_logits(seed), _random_logits(seed + 100)))
        assert values.shape == (2, 3)
        assert (values >= -1e-6).all()
        if kind == "tvd":
            assert (values <= 1.0 + 1e-6).all()


def test_kl_directions_match_numpy_reference():
    student, teacher = _random_logits(1), _random_logits(2, scale=1.0)
    p, q = _np_probs(teacher), _np_probs(student)
    fkl, rkl = _np_kl(p, q), _np_kl(q, p)
    assert np.abs(fkl - rkl).max() > 0.1  # the case distinguishes the directions
    np.testing.assert_allclose(losses.forward_kl(student, teacher), fkl, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses.reverse_kl(student, teacher), rkl, rtol=1e-4, atol=1e-5)
    tvd = 0.5 * np.abs(p - q).sum(-1)
    np.testing.assert_allclose(losses.total_variation(student, teacher), tvd, atol=1e-6)


# ---------------------------------------------------------------- golden values


P2 = np.log(np.array([[[0.9, 0.1]]], np.float32))  # teacher, [1, 1, 2]
Q2 = np.log(np.array([[[0.1, 0.9]]], np.float32))  # student


@pytest.mark.parametrize("kind", ["fkl", "rkl"])
def test_golden_two_way_kl(kind):
    expected = 0.8 * math.log(9.0)
    assert expected == pytest.approx(1.75778, abs=1e-5)
    assert _total(kind, 0.5, Q2, P2) == pytest.approx(expected, rel=1e-5)


def test_golden_two_way_tvd():
    assert _total("tvd", 0.5, Q2, P2) == pytest.approx(0.8, rel=1e-6)


def test_golden_two_way_jsd_half():
    # m = (0.5, 0.5); by symmetry KL(p||m) = KL(q||m) = 0.9 ln 1.8 + 0.1 ln 0.2.
    expected = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert expected == pytest.approx(0.36806, abs=1e-5)
    assert _total("jsd", 0.5, Q2, P2) == pytest.approx(expected, rel=1e-5)


def test_golden_asymmetric_jsd():
    p, q, beta = np.array([0.7, 0.2, 0.1]), np.array([0.2, 0.3, 0.5]), 0.3
    m = beta * p + (1 - beta) * q
    expected = beta * np.sum(p * np.log(p / m)) + (1 - beta) * np.sum(q * np.log(q / m))
    got = _total("jsd", beta, np.log(q)[None, None], np.log(p)[None, None])
    assert got == pytest.approx(expected, rel=1e-5)
    # Swapping teacher and student is JSD[1 - beta] (paper: JSD[b](P||Q) = JSD[1-b](Q||P)).
    swapped = _total("jsd", 1 - beta, np.log(p)[None, None], np.log(q)[None, None])
    assert swapped == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- JSD beta limits


# The limits are not uniform: near beta = 0 they need q >> beta p (near 1, p >> (1-beta) q), so the
# cases use moderate logits, for which forward and reverse KL still differ by 7-70 % per token.


def test_jsd_small_beta_scaled_is_forward_kl():
    student, teacher = _random_logits(3, scale=1.0), _random_logits(4, scale=1.0)
    fkl, rkl = np.asarray(losses.forward_kl(student, teacher)), losses.reverse_kl(student, teacher)
    beta = 1e-4
    scaled = np.asarray(losses.generalized_jsd(student, teacher, beta)) / beta
    np.testing.assert_allclose(scaled, fkl, rtol=5e-3)
    assert not np.allclose(scaled, rkl, rtol=5e-2)  # the backwards convention would match this


def test_jsd_large_beta_scaled_is_reverse_kl():
    student, teacher = _random_logits(3, scale=1.0), _random_logits(4, scale=1.0)
    fkl, rkl = losses.forward_kl(student, teacher), np.asarray(losses.reverse_kl(student, teacher))
    beta = 1 - 1e-4
    scaled = np.asarray(losses.generalized_jsd(student, teacher, beta)) / (1 - beta)
    np.testing.assert_allclose(scaled, rkl, rtol=5e-3)
    assert not np.allclose(scaled, fkl, rtol=5e-2)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_exact_endpoints_are_zero(beta):
    student, teacher = _random_logits(5), _random_logits(6)
    weights = np.ones((2, 3))

    def loss_fn(s):
        return losses.divergence(s, teacher, weights, "jsd", beta)[0]

    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(student))
    assert float(loss) == 0.0
    assert float(jnp.abs(grad).max()) == 0.0


# ---------------------------------------------------------------- masking and padding


@pytest.mark.parametrize("kind,beta", ALL_KINDS)
def test_masked_tokens_contribute_exactly_zero(kind, beta):
    student, teacher = _random_logits(7), _random_logits(8)
    weights = np.array([[1.0, 0.0, 2.0], [0.0, 0.5, 1.0]], np.float32)
    masked = weights == 0
    student2, teacher2 = student.copy(), teacher.copy()
    student2[masked] = _random_logits(9, (int(masked.sum()), 7), scale=50.0)
    teacher2[masked] = np.nan  # garbage at padding must not leak

    def loss_and_grad(s, t):
        fn = lambda s_: losses.divergence(s_, t, weights, kind, beta)[0]  # noqa: E731
        return jax.value_and_grad(fn)(jnp.asarray(s))

    loss1, grad1 = loss_and_grad(student, teacher)
    loss2, grad2 = loss_and_grad(student2, teacher2)
    assert float(loss1) == float(loss2)
    np.testing.assert_array_equal(np.asarray(grad1), np.asarray(grad2))
    assert float(jnp.abs(grad2[masked]).max()) == 0.0


@pytest.mark.parametrize("kind,beta", ALL_KINDS)
def test_padding_does_not_change_result(kind, beta):
    student, teacher = _random_logits(10), _random_logits(11)
    weights = np.array([[1.0, 1.0, 0.5], [1.0, 2.0, 1.0]], np.float32)
    pad = lambda x, v: np.concatenate([x, np.full_like(x[:, :2], v)], axis=1)  # noqa: E731
    loss, count = losses.divergence(student, teacher, weights, kind, beta)
    loss_p, count_p = losses.divergence(
        pad(student, 3.0), pad(teacher, -1.0), pad(weights, 0.0), kind, beta
    )
    assert float(count_p) == float(count) == 6.5
    assert float(loss_p) == pytest.approx(float(loss), rel=1e-6)


# ---------------------------------------------------------------- gradients


def _extreme_cases():
    rng = np.random.default_rng(12)
    student = np.where(rng.random((2, 3, 7)) < 0.5, 1e4, -1e4).astype(np.float32)
    one_hot = np.full((2, 3, 7), -1e4, np.float32)
    one_hot[..., 2] = 1e4
    minus_inf = _random_logits(13)
    minus_inf[..., 4:] = -np.inf  # padded vocabulary masked out in the teacher
    return [
        ("extreme student, one-hot-ish teacher", student, one_hot),
        ("random student, one-hot-ish teacher", _random_logits(14), one_hot),
        ("extreme student, random teacher", student, _random_logits(15)),
        ("random student, -inf teacher entries", _random_logits(16), minus_inf),
    ]


@pytest.mark.parametrize("kind,beta", ALL_KINDS + [("jsd", 1e-4), ("jsd", 1 - 1e-4)])
def test_gradients_finite(kind, beta):
    weights = np.ones((2, 3), np.float32)
    for name, student, teacher in _extreme_cases():
        if kind == "rkl" and np.isneginf(teacher).any():
            continue  # KL(q || p) is +inf where p = 0 < q, by definition
        fn = lambda s, t=teacher: losses.divergence(s, t, weights, kind, beta)[0]  # noqa: E731
        loss, grad = jax.value_and_grad(fn)(jnp.asarray(student))
        assert np.isfinite(float(loss)), name
        assert bool(jnp.isfinite(grad).all()), name


def test_cross_entropy_gradients_finite_with_extreme_logits():
    student = _extreme_cases()[0][1]
    targets = np.zeros((2, 3), np.int32)
    fn = lambda s: losses.cross_entropy(s, targets, np.ones((2, 3)))[0]  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(student))
    assert np.isfinite(float(loss)) and bool(jnp.isfinite(grad).all())


# ---------------------------------------------------------------- acceptance proxy


def test_acceptance_proxy_worked_example():
    p = np.log(np.array([[[0.5, 0.25, 0.15, 0.10]]], np.float32))
    q = np.log(np.array([[[0.3, 0.4, 0.2, 0.1]]], np.float32))
    total, count = losses.acceptance_proxy(q, p, np.ones((1, 1)))
    assert float(count) == 1.0
    assert float(total) == pytest.approx(0.8, rel=1e-6)


def test_acceptance_proxy_is_sum_min_and_one_minus_tvd():
    student, teacher = _random_logits(17), _random_logits(18)
    weights = np.array([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]], np.float32)
    expected = np.sum(np.minimum(_np_probs(teacher), _np_probs(student)).sum(-1) * weights)
    total, count = losses.acceptance_proxy(student, teacher, weights)
    assert float(total) == pytest.approx(expected, rel=1e-5)
    assert float(count) == pytest.approx(5.5)
    one_minus_tvd = np.sum((1 - np.asarray(losses.total_variation(student, teacher))) * weights)
    assert float(total) == pytest.approx(one_minus_tvd, rel=1e-5)


# ---------------------------------------------------------------- the train step's shared sums


def _separate_sums(student, teacher, weights, kind, beta):
    """The loss and the acceptance metric as separate computations (each its own log-softmax)."""
    loss, count = losses.divergence(student, teacher, weights, kind, beta)
    return loss, count, losses.acceptance_proxy(student, teacher, weights)[0]


@pytest.mark.parametrize("kind,beta", ALL_KINDS)
def test_distillation_sums_equal_the_separate_computations(kind, beta):
    student, teacher = _random_logits(30, (3, 5, 11)), _random_logits(31, (3, 5, 11), 2.0)
    weights = np.random.default_rng(32).choice([0.0, 0.5, 1.0, 2.0], size=(3, 5)).astype("f4")
    weights[0, 0] = 0.0  # A masked token: garbage there must not leak into values or gradients.
    student[0, 0], teacher[0, 0] = 1e30, np.nan
    shared = lambda s: losses.distillation_sums(s, teacher, weights, kind, beta)  # noqa: E731
    separate = lambda s: _separate_sums(s, teacher, weights, kind, beta)  # noqa: E731
    for fn in (lambda f: f, jax.jit):  # Eager and as the train step compiles it.
        sums = fn(shared)(student)
        loss, count, acceptance = fn(separate)(student)
        assert set(sums) == {"loss_sum", "weight_sum", "acceptance_sum"}
        assert float(sums["weight_sum"]) == float(count)
        assert float(sums["loss_sum"]) == pytest.approx(float(loss), rel=1e-6, abs=1e-7)
        assert float(sums["acceptance_sum"]) == pytest.approx(float(acceptance), rel=1e-6)
        grad = fn(jax.grad(lambda s: shared(s)["loss_sum"]))(jnp.asarray(student))
        want = fn(jax.grad(lambda s: separate(s)[0]))(jnp.asarray(student))
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-7)
        assert float(jnp.abs(grad[0, 0]).max()) == 0.0
        # The metric carries no gradient (it is logged, not trained on).
        no_grad = fn(jax.grad(lambda s: shared(s)["acceptance_sum"]))(jnp.asarray(student))
        assert float(jnp.abs(no_grad).max()) == 0.0


@pytest.mark.parametrize("kind,beta", ALL_KINDS)
def test_distillation_sums_gradients_finite(kind, beta):
    weights = np.ones((2, 3), np.float32)
    for name, student, teacher in _extreme_cases():
        if kind == "rkl" and np.isneginf(teacher).any():
            continue  # KL(q || p) is +inf where p = 0 < q, by definition

        def shared(s, t=teacher):
            return losses.distillation_sums(s, t, weights, kind, beta)["loss_sum"]

        loss, grad = jax.value_and_grad(shared)(jnp.asarray(student))
        want = jax.grad(lambda s, t=teacher: losses.divergence(s, t, weights, kind, beta)[0])
        assert np.isfinite(float(loss)) and bool(jnp.isfinite(grad).all()), name
        np.testing.assert_allclose(grad, want(jnp.asarray(student)), atol=1e-6, err_msg=name)


def test_distillation_sums_forward_kl_teacher_gradient_is_autodiffs():
    # The custom VJP's teacher side (training stops it; kept right for any other caller).
    student, teacher = _random_logits(33), _random_logits(34)
    weights = np.array([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]], np.float32)
    shared = jax.grad(lambda t: losses.distillation_sums(student, t, weights, "fkl")["loss_sum"])
    separate = jax.grad(lambda t: losses.divergence(student, t, weights, "fkl")[0])
    np.testing.assert_allclose(
        shared(jnp.asarray(teacher)), separate(jnp.asarray(teacher)), rtol=1e-5, atol=1e-7
    )


def test_distillation_sums_validate_like_divergence():
    logits = _random_logits(35)
    with pytest.raises(ValueError, match="'kl'"):
        losses.distillation_sums(logits, logits, np.ones((2, 3)), "kl")
    with pytest.raises(ValueError, match="beta"):
        losses.distillation_sums(logits, logits, np.ones((2, 3)), "jsd", 1.5)
    with pytest.raises(ValueError, match="weights"):
        losses.distillation_sums(logits, logits, np.ones((2, 4)), "fkl")


# ---------------------------------------------------------------- cross entropy, mean, errors


def test_cross_entropy_matches_hand_computation():
    logits = _random_logits(19)
    targets = np.array([[0, 6, 3], [2, 2, 5]], np.int32)
    weights = np.array([[1.0, 1.0, 0.0], [2.0, 1.0, 1.0]], np.float32)
    probs = _np_probs(logits)
    nll = -np.log(np.take_along_axis(probs, targets[..., None], -1)[..., 0])
    total, count = losses.cross_entropy(logits, targets, weights)
    assert float(total) == pytest.approx(np.sum(nll * weights), rel=1e-5)
    assert float(count) == 6.0


def test_cross_entropy_gradient_is_softmax_minus_onehot_and_zero_where_masked():
    # The custom VJP against autodiff of -log_softmax(z)[target] on the same logits, with NaN and
    # inf at masked positions: there the loss and the gradient are exactly 0.
    logits = jnp.asarray(_random_logits(23))
    targets = np.array([[0, 6, 3], [2, 2, 5]], np.int32)
    weights = np.array([[1.0, 0.0, 0.0], [2.0, 1.0, 0.5]], np.float32)
    poisoned = logits.at[0, 1].set(jnp.nan).at[0, 2, 4].set(jnp.inf)

    def plain(z):
        log_q = jax.nn.log_softmax(z, axis=-1)
        return -jnp.sum(jnp.take_along_axis(log_q, targets[..., None], -1)[..., 0] * weights)

    got = jax.value_and_grad(lambda z: losses.cross_entropy(z, targets, weights)[0])(poisoned)
    want = jax.value_and_grad(plain)(jnp.where(weights[..., None] != 0, logits, 0.0))
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(got[1])[0, 1:] == 0.0)


def test_mean():
    assert float(losses.mean(3.0, 2.0)) == 1.5
    assert float(losses.mean(0.0, 0.0)) == 0.0
    assert float(losses.mean(5.0, 0.0)) == 0.0
    grad = jax.grad(lambda s, w: losses.mean(s, w), argnums=(0, 1))(1.0, 0.0)
    assert all(np.isfinite(float(g)) for g in grad)


def test_divergence_under_jit_matches_eager():
    student, teacher = _random_logits(20), _random_logits(21)
    weights = np.ones((2, 3), np.float32)
    jitted = jax.jit(losses.divergence, static_argnames=("kind", "beta"))
    eager = losses.divergence(student, teacher, weights, "jsd", 0.3)
    compiled = jitted(student, teacher, weights, kind="jsd", beta=0.3)
    assert float(compiled[0]) == pytest.approx(float(eager[0]), rel=1e-5)


def test_bad_kind_raises():
    logits = _random_logits(22)
    with pytest.raises(ValueError, match="'kl'") as info:
        losses.divergence(logits, logits, np.ones((2, 3)), "kl")
    for kind in losses.KINDS:
        assert kind in str(info.value)


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan")])
def test_bad_beta_raises(beta):
    logits = _random_logits(23)
    with pytest.raises(ValueError, match=r"\[0, 1\]") as info:
        losses.divergence(logits, logits, np.ones((2, 3)), "jsd", beta)
    assert f"beta={beta}" in str(info.value)
    with pytest.raises(ValueError, match="beta"):
        losses.generalized_jsd(logits, logits, beta)


def test_mismatched_shapes_raise():
    student, teacher = _random_logits(24, (2, 3, 7)), _random_logits(25, (2, 3, 8))
    with pytest.raises(ValueError, match="same shape"):
        losses.divergence(student, teacher, np.ones((2, 3)), "fkl")
    with pytest.raises(ValueError, match="weights"):
        losses.divergence(student, student, np.ones((2, 4)), "fkl")


def test_bfloat16_inputs_are_computed_in_float32():
    student = jnp.asarray(_random_logits(26), jnp.bfloat16)
    teacher = jnp.asarray(_random_logits(27), jnp.bfloat16)
    weights = jnp.ones((2, 3), jnp.bfloat16)
    loss, count = losses.divergence(student, teacher, weights, "fkl")
    assert loss.dtype == count.dtype == jnp.float32
    reference = losses.divergence(np.float32(student), np.float32(teacher), np.ones((2, 3)), "fkl")
    assert float(loss) == pytest.approx(float(reference[0]), rel=1e-6)


# ---------------------------------------------------------------- LK losses (Samarin et al., 2026)

LK_KINDS = ("lk_alpha", "lk_lambda", "lk_lambda_mean")


def _np_lk(kind, student, teacher, weights, eta=3.0):
    """The LK losses' formulas in float64 numpy: per-token values [B, L]."""
    p, q = _np_probs(teacher), _np_probs(student)
    alpha = np.minimum(p, q).sum(-1)
    if kind == "lk_alpha":
        return -np.log(alpha)
    if kind == "lk_lambda_mean":
        alpha = np.full_like(alpha, np.sum(alpha * weights) / np.sum(weights))
    lam = np.exp(-eta * alpha)
    return lam * _np_kl(p, q) + (1 - lam) * 0.5 * np.abs(p - q).sum(-1)


@pytest.mark.parametrize("kind", LK_KINDS)
@pytest.mark.parametrize("eta", [3.0, 0.7])
def test_lk_losses_equal_numpy_formulas(kind, eta):
    student, teacher = _random_logits(40, (3, 4, 13)), _random_logits(41, (3, 4, 13), 2.0)
    weights = np.random.default_rng(42).choice([0.0, 0.5, 1.0, 2.0], size=(3, 4)).astype("f4")
    want = _np_lk(kind, student, teacher, weights, eta)
    loss, count = losses.divergence(student, teacher, weights, kind, eta=eta)
    assert float(count) == pytest.approx(weights.sum())
    assert float(loss) == pytest.approx(np.sum(want * weights), rel=1e-6, abs=1e-6)
    per_token = losses.token_divergence(student, teacher, weights, kind, eta=eta)
    np.testing.assert_allclose(per_token, np.where(weights != 0, want, 0), rtol=1e-6, atol=1e-6)
    sums = losses.distillation_sums(student, teacher, weights, kind, eta=eta)
    assert float(sums["loss_sum"]) == pytest.approx(float(loss), rel=1e-6, abs=1e-6)
    if kind != "lk_lambda_mean":  # The per-token functions of the same formulas.
        fn = losses.lk_alpha if kind == "lk_alpha" else functools.partial(losses.lk_lambda, eta=eta)
        np.testing.assert_allclose(fn(student, teacher), want, rtol=1e-6, atol=1e-6)


def test_lk_lambda_limits():
    student, teacher = _random_logits(43), _random_logits(44)
    ones = np.ones((2, 3), np.float32)
    fkl = losses.divergence(student, teacher, ones, "fkl")[0]
    assert float(losses.divergence(student, teacher, ones, "lk_lambda", eta=0.0)[0]) == (
        pytest.approx(float(fkl), rel=1e-6)
    )  # eta = 0: lambda = 1, forward KL.
    tvd = losses.divergence(student, teacher, ones, "tvd")[0]
    big = losses.divergence(student, teacher, ones, "lk_lambda", eta=1e4)[0]
    assert float(big) == pytest.approx(float(tvd), rel=1e-5)  # lambda -> 0: TVD.


def _np_lk_fixed_lambda(kind, student, teacher, weights, alpha_at):
    """`_np_lk`'s weighted sum with lambda's stopped alpha taken at the logits `alpha_at`:
    the function whose derivative the loss's gradient is (float64 numpy)."""
    if kind == "lk_alpha":
        return float(np.sum(_np_lk(kind, student, teacher, weights) * weights))
    p, q = _np_probs(teacher), _np_probs(student)
    alpha = np.minimum(p, _np_probs(alpha_at)).sum(-1)
    if kind == "lk_lambda_mean":
        alpha = np.full_like(alpha, np.sum(alpha * weights) / np.sum(weights))
    lam = np.exp(-3.0 * alpha)
    per_token = lam * _np_kl(p, q) + (1 - lam) * 0.5 * np.abs(p - q).sum(-1)
    return float(np.sum(per_token * weights))


@pytest.mark.parametrize("kind", LK_KINDS)
def test_lk_gradients_match_finite_differences(kind):
    # Central differences of the float64 numpy formulas, against autodiff of the float32 loss.
    student, teacher = _random_logits(45, (2, 2, 6), 1.5), _random_logits(46, (2, 2, 6), 1.5)
    weights = np.array([[1.0, 0.5], [0.0, 2.0]])
    fn = lambda s: losses.divergence(s, teacher, weights, kind)[0]  # noqa: E731
    grad = np.asarray(jax.grad(fn)(jnp.asarray(student)))
    base, eps = student.astype(np.float64), 1e-6
    numeric = np.zeros(student.shape)
    for index in np.ndindex(*student.shape):
        step = np.zeros(student.shape)
        step[index] = eps
        up = _np_lk_fixed_lambda(kind, base + step, teacher, weights, base)
        down = _np_lk_fixed_lambda(kind, base - step, teacher, weights, base)
        numeric[index] = (up - down) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)
    assert np.abs(grad[1, 0]).max() == 0.0  # The weight-0 token.
    assert np.abs(grad).max() > 1e-2


@pytest.mark.parametrize("kind", LK_KINDS)
def test_lk_losses_finite_as_alpha_goes_to_zero(kind):
    # Disjoint supports: alpha = e^-60 (underflows to 0 once exponentiated in float32).
    teacher = np.full((1, 2, 8), -60.0, np.float32)
    teacher[..., 0] = 60.0
    student = np.full((1, 2, 8), -60.0, np.float32)
    student[..., 1] = 60.0
    weights = np.ones((1, 2), np.float32)
    fn = lambda s: losses.divergence(s, teacher, weights, kind)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(student))
    assert np.isfinite(float(loss)) and bool(jnp.isfinite(grad).all())
    if kind == "lk_alpha":
        # alpha = 8 e^-120 per token (every id holds e^-120 in one of p, q).
        assert float(loss) == pytest.approx(2 * (120.0 - np.log(8)), rel=1e-5)
        assert float(jnp.abs(grad).max()) > 0.1  # Still a gradient to follow at alpha ~ 0.
    shared = losses.distillation_sums(student, teacher, weights, kind)["loss_sum"]
    assert float(shared) == pytest.approx(float(loss), rel=1e-6)


def test_bad_eta_raises():
    s = _random_logits(47)
    with pytest.raises(ValueError, match="LK eta must be >= 0, got eta=-1.0"):
        losses.divergence(s, s, np.ones((2, 3)), "lk_lambda", eta=-1.0)
