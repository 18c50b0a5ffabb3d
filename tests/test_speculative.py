"""The verification rule (accept_or_resample) and lenience, against exact distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from distillspec.decoding.acceptance import (
    Lenience,
    accept_greedy,
    accept_or_resample,
    acceptance_probability,
)
from distillspec.decoding.sampling import SamplingConfig, logits_to_probs

P = np.array([0.5, 0.25, 0.15, 0.10])
Q = np.array([0.3, 0.4, 0.2, 0.1])


def _one_step(p, q, n, seed, lenience=None):
    """n rounds of gamma = 1 with drafts from q: (accepted [n], first emitted token [n])."""
    rng_draft, rng_verify = jax.random.split(jax.random.PRNGKey(seed))
    draft = jax.random.categorical(rng_draft, jnp.log(jnp.asarray(q)), shape=(n,))
    draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, len(q)))
    target_probs = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 2, len(p)))
    accepted, nxt = accept_or_resample(
        rng_verify, draft[:, None], draft_probs, target_probs, lenience
    )
    accepted, draft, nxt = map(np.asarray, (accepted, draft, nxt))
    return accepted, np.where(accepted == 1, draft, nxt)


def _chi2_pvalue(samples, probs):
    counts = np.bincount(samples, minlength=len(probs))
    return stats.chisquare(counts, probs * len(samples)).pvalue


def test_worked_example_acceptance_and_output_distribution():
    # 000_d7a1de781601b3fa.txt: sum min(p, q) = 0.8, and outputs are distributed as p, not q.
    n = 200_000
    accepted, first = _one_step(P, Q, n, seed=1)
    assert abs(accepted.mean() - 0.8) < 5 * np.sqrt(0.8 * 0.2 / n)
    assert _chi2_pvalue(first, P) > 1e-3
    assert _chi2_pvalue(first, Q) < 1e-12  # The test has the power to tell p from q.


def _in_dtype(probs, dtype):
    """probs as a model decoding in dtype gives them: logits rounded to dtype, then processed
    in float32 (`logits_to_probs`), as the decoders do."""
    logits = jnp.log(jnp.asarray(probs, jnp.float32)).astype(dtype)
    return np.asarray(logits_to_probs(logits, SamplingConfig(temperature=1.0)), np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_acceptance_is_one_minus_tvd(seed, dtype):
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    p, q = _in_dtype(p, dtype), _in_dtype(q, dtype)
    p, q = p / p.sum(), q / q.sum()  # (float32 sums are off by ~1e-7; chisquare wants equal.)
    n = 100_000
    accepted, first = _one_step(p, q, n, seed)
    expected = np.minimum(p, q).sum()
    assert expected == pytest.approx(1 - 0.5 * np.abs(p - q).sum())
    assert abs(accepted.mean() - expected) < 5 * np.sqrt(expected * (1 - expected) / n)
    assert _chi2_pvalue(first, p) > 1e-3


@pytest.mark.parametrize(
    "kind,eps", [("linear", 0.5), ("square", 0.7), ("exp", 0.3), ("linear", 1.0)]
)
def test_lenient_acceptance_rate(kind, eps):
    rng = np.random.default_rng(7)
    p, q = rng.dirichlet(np.ones(5)), rng.dirichlet(np.ones(5))
    lenience = Lenience(kind, eps)
    f = {"linear": p / eps, "square": p / eps**2, "exp": p**eps}[kind]
    expected = np.sum(q * np.minimum(1, f / q))
    n = 100_000
    accepted, _ = _one_step(p, q, n, seed=3, lenience=lenience)
    assert abs(accepted.mean() - expected) < 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9


def test_draft_equal_target_accepts_everything():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7))
    accepted, first = _one_step(p, p, 50_000, seed=5)
    assert accepted.min() == 1
    assert _chi2_pvalue(first, p) > 1e-3


def test_greedy_one_hot_rule_is_deterministic():
    # Greedy decoding passes one-hot distributions: keep the draft iff it is the target's argmax.
    v, gamma = 5, 4
    draft = jnp.array([[1, 2, 3, 4], [1, 2, 0, 4]])
    target_argmax = jnp.array([[1, 2, 3, 4, 0], [1, 2, 3, 4, 2]])
    out = accept_or_resample(
        jax.random.PRNGKey(0), draft, jax.nn.one_hot(draft, v), jax.nn.one_hot(target_argmax, v)
    )
    np.testing.assert_array_equal(out[0], [gamma, 2])
    np.testing.assert_array_equal(out[1], [0, 3])


@pytest.mark.parametrize("lenience", [None, Lenience("linear", 0.3), Lenience("exp", 0.5)])
def test_greedy_rule_from_tokens_equals_the_one_hot_rule(lenience):
    # accept_greedy (tokens only, no draws) = accept_or_resample on one-hot distributions, under
    # lenience and with rows proposing fewer than G drafts; the decoder's greedy path relies on it.
    rng = np.random.default_rng(0)
    v, gamma, batch = 3, 4, 256  # Few ids, so that drafts often match.
    draft = jnp.asarray(rng.integers(0, v, (batch, gamma)), jnp.int32)
    target = jnp.asarray(rng.integers(0, v, (batch, gamma + 1)), jnp.int32)
    num_drafts = jnp.asarray(rng.integers(0, gamma + 1, batch), jnp.int32)
    # Jitted: one program each instead of every operation compiled on its own.
    sampled = jax.jit(lambda *args, **kw: accept_or_resample(*args, lenience, **kw))
    greedy = jax.jit(accept_greedy)
    for proposed in (None, num_drafts):
        want = sampled(
            jax.random.PRNGKey(1), draft, jax.nn.one_hot(draft, v), jax.nn.one_hot(target, v),
            num_drafts=proposed,
        )  # fmt: skip
        got = greedy(draft, target, proposed)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert len(set(np.asarray(got[0]).tolist())) == gamma + 1  # Every count occurs.


def test_acceptance_probability_formula():
    a = acceptance_probability(jnp.array([0.5, 0.2, 0.0]), jnp.array([0.25, 0.4, 0.1]))
    np.testing.assert_allclose(a, [0.5, 1.0, 1.0])
    a = acceptance_probability(jnp.array([0.5]), jnp.array([0.25]), Lenience("square", 0.5))
    np.testing.assert_allclose(a, [1.0])


@pytest.mark.parametrize("eps", [0.0, -0.1, 1.5, float("nan")])
def test_bad_epsilon(eps):
    with pytest.raises(ValueError, match="epsilon must be in \\(0, 1\\]"):
        Lenience("linear", eps)


def test_bad_lenience_kind():
    with pytest.raises(ValueError, match="linear.*'cubic'"):
        Lenience("cubic", 0.5)
