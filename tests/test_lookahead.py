"""Dynamic speculation lookahead (DISCO and its baselines) in the decoder: exactness, counters,
policy behaviour, no recompilation, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec.decoding import generate, speculative_generate
from distillspec.decoding.lookahead import (
    Lookahead,
    StopClassifier,
    classifier_confidence,
    features,
    num_features,
    verify_widths,
)
from distillspec.decoding.sampling import SamplingConfig
from tests.test_decoding import _chi2_pvalue, _exact_joint, _joint_counts
from tests.test_utils import TRACE_COUNTS, WritingMarkovStub, markov_pair, ragged_prompts


def random_classifier(top_k: int, seed: int = 0, bias: float = 0.0):
    """DISCO classifier variables with random weights; bias shifts every confidence."""
    variables = StopClassifier(8).init(
        jax.random.PRNGKey(seed), jnp.zeros((1, num_features(top_k)))
    )
    variables = jax.tree_util.tree_map(lambda x: x, dict(variables))
    params = dict(variables["params"])
    params["out"] = dict(params["out"], bias=params["out"]["bias"] + bias)
    return {"params": params, "norm": variables["norm"]}


def policies(vocab: int, sl_max: int, oracle: bool = True):
    """(lookahead, extra kwargs) for every kind, with thresholds that stop some rounds early."""
    out = [
        (Lookahead("static", sl_max), {}),
        (Lookahead("heuristic", sl_max, start=2), {}),
        (Lookahead("confidence", sl_max, threshold=0.6), {}),
        (Lookahead("confidence", sl_max, threshold=0.6, keep_last=False), {}),
        (Lookahead("disco", sl_max, threshold=0.5), {"classifier": random_classifier(2)}),
        (Lookahead("cumulative", sl_max, threshold=0.5, source="draft"), {}),
        (
            Lookahead("cumulative", sl_max, threshold=0.5, keep_last=False),
            {"classifier": random_classifier(2)},
        ),
    ]
    return out + ([(Lookahead("oracle", sl_max), {})] if oracle else [])


@pytest.fixture(scope="module")
def pair():
    return markov_pair(vocab=16, seed=0, noise=1.0)


def _spec(pair, prompts, lengths, policy, kwargs, n=24, plain=None, **extra):
    target, draft = pair
    if policy.kind == "oracle":
        kwargs = dict(kwargs, oracle_tokens=plain.tokens)
    return speculative_generate(
        target, draft, None, None, prompts, lengths, lookahead=policy, max_new_tokens=n,
        **kwargs, **extra,
    )  # fmt: skip


def _writing(pair):
    """The pair with a target that verifies by writing its cache inside each width's branch."""
    target, draft = pair
    return WritingMarkovStub(np.asarray(target.table), target.name + "-writing"), draft


@pytest.mark.parametrize(
    "sl_max,batch,writing", [(1, 4, False), (5, 1, False), (5, 4, False), (5, 4, True)]
)
def test_every_policy_keeps_greedy_output_exact(pair, sl_max, batch, writing):
    pair = _writing(pair) if writing else pair  # Both verify paths of `decoding._verify`.
    target, _ = pair
    prompts, lengths = ragged_prompts(batch, 5, target.vocab_size, seed=sl_max)
    plain = generate(target, None, prompts, lengths, max_new_tokens=24)
    for policy, kwargs in policies(target.vocab_size, sl_max):
        out = _spec(pair, prompts, lengths, policy, kwargs, plain=plain)
        np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=policy.name)
        np.testing.assert_array_equal(out.lengths, 24)
        # Every round is counted once in the histogram, at its number of drafts.
        np.testing.assert_array_equal(out.sl_histogram.sum(1), out.target_calls)
        # A width switch: a round verified at another width than the round before.
        assert np.all(out.width_switches <= out.target_calls - 1)
        if policy.kind == "static":
            np.testing.assert_array_equal(out.width_switches, 0)
        elif batch == 1:  # Every width used but the first is switched to at least once.
            widths = verify_widths(policy)
            used = {min(w for w in widths if w > n) for n in np.nonzero(out.sl_histogram[0])[0]}
            assert out.width_switches[0] >= len(used) - 1, policy.name
        drafts = (out.sl_histogram * np.arange(sl_max + 1)).sum(1)
        np.testing.assert_array_equal(drafts, out.drafted, err_msg=policy.name)
        assert np.all(out.accepted <= out.drafted)
        if policy.kind != "oracle" and policy.keep_last:  # n drafts cost n draft calls ...
            np.testing.assert_array_equal(out.draft_calls, out.drafted, err_msg=policy.name)
        else:  # ... plus the call of a token drawn but not proposed.
            assert np.all(out.draft_calls >= out.drafted)
            assert np.all(out.draft_calls <= out.drafted + out.target_calls)


def test_policies_stop_where_they_should(pair):
    target, draft = pair
    prompts, lengths = ragged_prompts(4, 5, target.vocab_size, seed=1)
    plain = generate(target, None, prompts, lengths, max_new_tokens=24)
    run = lambda policy, **kw: _spec(pair, prompts, lengths, policy, kw, plain=plain)
    static = run(Lookahead("static", 4))
    assert np.all(static.sl_histogram[:, :4] == 0)  # Always 4.
    # Threshold 0 never stops early: the static counters; threshold 1 always stops at 1 draft.
    for kind, kw in [("confidence", {}), ("disco", {"classifier": random_classifier(2)})]:
        never = run(Lookahead(kind, 4, threshold=0.0), **kw)
        np.testing.assert_array_equal(never.sl_histogram, static.sl_histogram)
        always = run(Lookahead(kind, 4, threshold=1.0), **kw)
        np.testing.assert_array_equal(always.sl_histogram[:, 1], always.target_calls)
        # Dropping the doubtful token: every round proposes nothing, i.e. plain decoding.
        none = run(Lookahead(kind, 4, threshold=1.0, keep_last=False), **kw)
        np.testing.assert_array_equal(none.sl_histogram[:, 0], none.target_calls)
        np.testing.assert_array_equal(none.target_calls, 24)
    # A confident classifier drafts to the cap; a doubtful one stops after the first draft.
    sure = run(Lookahead("disco", 4, threshold=0.5), classifier=random_classifier(2, bias=50.0))
    np.testing.assert_array_equal(sure.sl_histogram, static.sl_histogram)
    unsure = run(Lookahead("disco", 4, threshold=0.5), classifier=random_classifier(2, bias=-50.0))
    np.testing.assert_array_equal(unsure.sl_histogram[:, 1], unsure.target_calls)
    # The oracle proposes only what the target keeps, and needs no more target calls than static.
    oracle = run(Lookahead("oracle", 4))
    np.testing.assert_array_equal(oracle.accepted, oracle.drafted)
    np.testing.assert_array_equal(oracle.target_calls, static.target_calls)
    assert oracle.drafted.sum() < static.drafted.sum()
    assert oracle.sl_histogram[:, 0].sum() > 0  # Rounds where the first draft is already wrong.


def _cumulative_rounds(confidences: np.ndarray, threshold: float, sl_max: int) -> int:
    """Drafts of a keep_last round by hand: stop after draft i once 1 - prod(p_0..p_i) >
    threshold, or at sl_max."""
    survival = 1.0
    for i, p in enumerate(confidences[:sl_max]):
        survival *= p
        if 1.0 - survival > threshold:
            return i + 1
    return sl_max


def test_cumulative_rule_stops_where_it_should(pair):
    target, draft = pair
    prompts, lengths = ragged_prompts(4, 5, target.vocab_size, seed=1)
    plain = generate(target, None, prompts, lengths, max_new_tokens=24)
    run = lambda policy, **kw: _spec(pair, prompts, lengths, policy, kw, plain=plain)
    static = run(Lookahead("static", 4))
    for source, kw in [("draft", {}), ("classifier", {"classifier": random_classifier(2)})]:
        # Threshold 1: P(some rejection) never exceeds it, the static counters.
        never = run(Lookahead("cumulative", 4, threshold=1.0, source=source), **kw)
        np.testing.assert_array_equal(never.sl_histogram, static.sl_histogram)
        # Threshold 0: stops after the first draft (every estimate is < 1 here).
        always = run(Lookahead("cumulative", 4, threshold=0.0, source=source), **kw)
        np.testing.assert_array_equal(always.sl_histogram[:, 1], always.target_calls)
        none = run(Lookahead("cumulative", 4, threshold=0.0, keep_last=False, source=source), **kw)
        np.testing.assert_array_equal(none.sl_histogram[:, 0], none.target_calls)
    # A classifier sure of every token drafts to the cap at any threshold > 0.
    sure = Lookahead("cumulative", 4, threshold=0.1)
    sure = run(sure, classifier=random_classifier(2, bias=50.0))
    np.testing.assert_array_equal(sure.sl_histogram, static.sl_histogram)


def test_cumulative_rule_multiplies_the_estimates():
    """A draft of constant top probability p = 0.9: every round stops after the first draft
    i with 1 - p^(i+1) > threshold (a per-token rule would stop at the first draft or never)."""
    target, draft = markov_pair(vocab=8, seed=5, noise=0.0)
    prompts, lengths = ragged_prompts(1, 3, 8, seed=0)
    # Top probability 0.9 (token 0) in every context: e^a / (e^a + 7) = 0.9 for e^a = 63.
    draft.table = jnp.zeros_like(draft.table).at[..., 0].set(np.log(63.0))
    for threshold, want in [(0.05, 1), (0.15, 2), (0.25, 3), (0.3, 4), (0.5, 6), (0.99, 6)]:
        out = speculative_generate(
            target, draft, None, None, prompts, lengths, max_new_tokens=12,
            lookahead=Lookahead("cumulative", 6, threshold=threshold, source="draft"),
        )  # fmt: skip
        assert want == _cumulative_rounds(np.full(6, 0.9), threshold, 6)
        assert out.sl_histogram[0, want] == out.target_calls[0], (threshold, out.sl_histogram)


def test_heuristic_schedule():
    target, _ = markov_pair(vocab=16, seed=3, noise=0.0)  # A draft equal to the target: all kept.
    prompts, lengths = ragged_prompts(1, 3, 16, seed=0)
    out = speculative_generate(
        target, target, None, None, prompts, lengths, lookahead=Lookahead("heuristic", 8, start=1),
        max_new_tokens=40,
    )  # fmt: skip
    # 1, 3, 5, 7, then the cap 8: rounds emit 2, 4, 6, 8, 9, 9, ... tokens.
    assert out.sl_histogram[0, [1, 3, 5, 7]].tolist() == [1, 1, 1, 1]
    assert out.sl_histogram[0, 8] == out.target_calls[0] - 4
    # A draft that is never right: the lookahead shrinks to 1 and stays there.
    wrong_target, wrong_draft = markov_pair(vocab=16, seed=3, noise=0.0)
    wrong_draft.table = -wrong_target.table  # Its argmax is the target's argmin.
    out = speculative_generate(
        wrong_target, wrong_draft, None, None, prompts, lengths,
        lookahead=Lookahead("heuristic", 8, start=4), max_new_tokens=20,
    )  # fmt: skip
    assert out.accepted[0] == 0
    assert out.sl_histogram[0, [4, 3, 2]].tolist() == [1, 1, 1]
    assert out.sl_histogram[0, 1] == out.target_calls[0] - 3


@pytest.mark.parametrize("index", range(len(policies(4, 3, oracle=False)) - 1))
def test_dynamic_policies_keep_sampling_exact(index):
    target, draft = markov_pair(vocab=4, seed=11, noise=1.5, scale=1.0)
    policy, kwargs = policies(4, 3, oracle=False)[1:][index]  # All but static.
    if "classifier" in kwargs:  # Threshold at the median confidence over the stub's contexts.
        x = features(target.table.reshape(16, 4), jnp.arange(16) % 3, 2, 4)
        median = float(jnp.median(classifier_confidence(kwargs["classifier"], x)))
        # The cumulative rule: 1 - median, so its first draft stops in about half the contexts.
        threshold = median if policy.kind == "disco" else 1.0 - median
        policy = dataclasses.replace(policy, threshold=threshold)
    n_samples, n_tokens = 60_000, 3
    prompts = np.tile(np.array([[1, 2]], np.int32), (n_samples, 1))
    out = speculative_generate(
        target, draft, None, None, prompts, np.full(n_samples, 2, np.int32),
        jax.random.PRNGKey(index), lookahead=policy, max_new_tokens=n_tokens,
        sampling=SamplingConfig(temperature=1.0), **kwargs,
    )  # fmt: skip
    hist = out.sl_histogram.sum(0)
    assert np.count_nonzero(hist) >= 2, hist  # The policy really varies the lookahead.
    expected = _exact_joint(target, [1, 2], n_tokens)
    assert _chi2_pvalue(_joint_counts(out.tokens, 4, n_tokens), expected) > 1e-3


def test_changing_the_threshold_does_not_recompile(pair):
    target, draft = pair
    prompts, lengths = ragged_prompts(2, 5, 16, seed=0)
    classifier = random_classifier(2)
    for i, threshold in enumerate([0.2, 0.5, 0.8]):
        speculative_generate(
            target, draft, None, None, prompts, lengths, max_new_tokens=8, classifier=classifier,
            lookahead=Lookahead("disco", 5, threshold=threshold),
        )  # fmt: skip
        if i == 0:
            traces = dict(TRACE_COUNTS)
    assert TRACE_COUNTS[target.name] == traces[target.name]
    assert TRACE_COUNTS[draft.name] == traces[draft.name]


def test_verify_widths():
    assert verify_widths(Lookahead("static", 5)) == (6,)
    assert verify_widths(Lookahead("disco", 10)) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 11)
    assert verify_widths(Lookahead("disco", 32)) == (*range(1, 10), 16, 32, 33)
    assert verify_widths(Lookahead("oracle", 1)) == (1, 2)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Lookahead("static", 0), "SL_max"),
        (lambda: Lookahead("disco", 4, threshold=1.5), r"threshold must be in \[0, 1\]"),
        (lambda: Lookahead("disco", 4, threshold=-0.1), r"threshold must be in \[0, 1\]"),
        (lambda: Lookahead("greedy", 4), "kind must be one of"),
        (lambda: Lookahead("heuristic", 4, start=0), "start"),
        (lambda: Lookahead("cumulative", 4, source="target"), r"source must be one of .*'draft'"),
        (lambda: Lookahead("disco", 4, source="draft"), "source= is used by kind 'cumulative'"),
        (lambda: Lookahead("cumulative", 4, threshold="high"), "threshold must be in"),
    ],
)
def test_bad_lookahead(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gamma=3, lookahead=Lookahead("static", 3)), "exactly one of"),
        (dict(), "exactly one of"),
        (dict(lookahead=Lookahead("disco", 3)), "needs classifier"),
        (dict(lookahead=Lookahead("static", 3), classifier={}), "'cumulative' \\(source="),
        (dict(lookahead=Lookahead("cumulative", 3)), "source='classifier' needs classifier"),
        (
            dict(lookahead=Lookahead("cumulative", 3, source="draft"), classifier={}),
            "with source='draft'",
        ),
        (dict(lookahead=Lookahead("oracle", 3)), "needs oracle_tokens"),
        (dict(lookahead=Lookahead("oracle", 3), oracle_tokens=np.zeros((2, 3))), "needs oracle"),
        (
            dict(
                lookahead=Lookahead("oracle", 3),
                oracle_tokens=np.zeros((2, 8)),
                sampling=SamplingConfig(temperature=1.0),
            ),
            "greedy",
        ),
        (
            dict(lookahead=Lookahead("disco", 3), classifier=random_classifier(top_k=20)),
            "top 20",
        ),
    ],
)
def test_bad_policy_inputs(pair, kwargs, message):
    target, draft = pair
    prompts, lengths = ragged_prompts(2, 5, 16, seed=0)
    with pytest.raises(ValueError, match=message):
        speculative_generate(
            target, draft, None, None, prompts, lengths, max_new_tokens=8, **kwargs
        )
