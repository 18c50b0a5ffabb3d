"""Lossy speculative decoding's sweep (distillspec.evaluation.lenience) on a tiny pair."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from distillspec.evaluation import lenience
from tests.test_quality import VOCAB, _batch, _Letters
from tests.test_utils import tiny_lm


@pytest.fixture(scope="module")
def pair():
    target, target_params = tiny_lm(VOCAB)
    return target, target_params, {"d": (target, target.init(jax.random.PRNGKey(7)))}


def _run(pair, **kwargs):
    target, params, drafts = pair
    batches = [_batch(3, seed=1, valid=[True, True, False]), _batch(3, seed=5)]
    return lenience.lenience_records(
        target, params, drafts, batches, vocabulary=_Letters(), eos_id=None,
        max_new_tokens=6, num_prompts=4, **kwargs,
    )  # fmt: skip


def test_sweep_has_lossless_once_then_every_kind_and_eps_and_the_plain_target(pair):
    records = _run(pair, kinds=("linear", "exp"), epsilons=(1.0, 0.3), temperature=1.0)
    assert [(r["lenience"], r["epsilon"]) for r in records] == [
        ("none", 1.0),
        ("linear", 0.3),
        ("exp", 0.3),
        (None, None),
    ]
    assert records[-1]["draft"] == "target" and records[-1]["latency_speedup"] == 1.0
    for r in records:
        assert r["latency_prompts"] == 4 and r["latency_ms"] > 0
        assert 0 <= r["chrf"] <= 100 and np.isfinite(r["target_nll"])
    for r in records[:-1]:
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tau"] <= 4


def test_greedy_lossy_decoding_is_still_the_target_output(pair):
    """At T = 0 both distributions are one-hot: p / eps accepts exactly the target's argmax,
    so every lenience reproduces the plain target's output (same chrF and target NLL)."""
    records = _run(pair, kinds=("linear", "square", "exp"), epsilons=(0.1,), temperature=0.0)
    plain = records[-1]
    for r in records[:-1]:
        assert r["chrf"] == pytest.approx(plain["chrf"])
        assert r["target_nll"] == pytest.approx(plain["target_nll"], rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"kinds": ("cubic",)},
            r"lenience kind 'cubic' is not one of \('linear', 'square', 'exp'\)",
        ),
        ({"epsilons": (1.5,)}, r"epsilon must be in \(0, 1\]"),
        ({"gamma": 0}, r"gamma"),
    ],
)
def test_bad_sweeps_fail_before_decoding(pair, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _run(pair, **kwargs)
