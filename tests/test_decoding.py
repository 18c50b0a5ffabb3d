"""Plain and speculative decoding against stub models with exactly known distributions."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from distillspec.decoding import generate, speculative_generate
from distillspec.decoding.acceptance import Lenience
from distillspec.decoding.fixed_rounds import fixed_round_decoder
from distillspec.decoding.lookahead import Lookahead
from distillspec.decoding.sampling import SamplingConfig, logits_to_probs, sample_categorical
from tests.test_utils import TRACE_COUNTS, MarkovStub, markov_pair, ragged_prompts

SAMPLE = SamplingConfig(temperature=1.0)


DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def pair():
    return markov_pair(vocab=16, seed=0, noise=1.0)


@functools.cache
def _pair(dtype):
    return markov_pair(vocab=16, seed=0, noise=1.0, dtype=dtype)


# Every gamma in float32; a spread of them in bfloat16 (stubs with bfloat16 logits; the plain
# reference is the same bfloat16 target).
GREEDY_CASES = [(g, b, "float32") for g in range(1, 9) for b in (1, 4)]
GREEDY_CASES += [(1, 1, "bfloat16"), (4, 4, "bfloat16"), (8, 4, "bfloat16")]


@pytest.mark.parametrize("gamma,batch,dtype", GREEDY_CASES)
def test_greedy_speculative_equals_greedy_target(gamma, batch, dtype):
    target, draft = _pair(dtype)
    prompts, lengths = ragged_prompts(batch, 5, target.vocab_size, seed=gamma)
    plain = generate(target, None, prompts, lengths, max_new_tokens=24)
    # Odd gammas record the target's top-4 (`record_top_k`): the output must not change.
    spec = speculative_generate(
        target, draft, None, None, prompts, lengths, gamma=gamma, max_new_tokens=24,
        record_top_k=4 if gamma % 2 else 0,
    )  # fmt: skip
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, 24)
    assert 0 < spec.alpha < 1  # The draft is neither perfect nor useless: both paths are hit.
    np.testing.assert_array_equal(spec.draft_calls, gamma * spec.target_calls)
    np.testing.assert_array_equal(spec.drafted, gamma * spec.target_calls)
    assert spec.tau == pytest.approx(spec.lengths.sum() / spec.target_calls.sum())
    # Rows in one batch advance independently: tokens per call = accepted + 1 except the last.
    assert np.all(spec.lengths <= spec.accepted + spec.target_calls)


def _expected_records(target, prompts, lengths, tokens, out_lengths, k):
    """The target's exact top-k log-probabilities at every generated token (MarkovStub)."""
    log_probs = np.zeros(tokens.shape + (k,))
    for b in range(len(prompts)):
        seq = [0] + list(prompts[b, : lengths[b]]) + list(tokens[b, : out_lengths[b]])
        for i in range(out_lengths[b]):
            here = lengths[b] + i  # Index in seq of the token that token i follows (seq[0] = 0).
            log_probs[b, i] = np.sort(np.log(target.next_probs(seq[here - 1], seq[here])))[::-1][:k]
    return log_probs


RECORDED = [
    ("static", Lookahead("static", 3), SamplingConfig()),
    ("dynamic", Lookahead("confidence", 6, threshold=0.5), SamplingConfig()),
    ("sampled", Lookahead("static", 4), SAMPLE),
    ("sampled-dynamic", Lookahead("confidence", 5, threshold=0.4), SamplingConfig(0.7, top_k=5)),
]


@pytest.mark.parametrize("late", [True, False], ids=["late-top-k", "top-k-per-round"])
@pytest.mark.parametrize("name,policy,sampling", RECORDED, ids=[r[0] for r in RECORDED])
def test_recording_changes_no_output_and_keeps_the_targets_top_k(
    pair, name, policy, sampling, late, monkeypatch
):
    """record_top_k: the same tokens and counters as without it (same key, so sampled runs
    draw the same numbers), and at each generated token the target's exact top-k
    log-probabilities of its raw distribution (before temperature / top-k), with their ids;
    both ways of recording (raw logits and one top-k after the loop, or a top-k per round)."""
    import distillspec.decoding.loop

    monkeypatch.setattr(distillspec.decoding.loop, "RECORD_LOGITS_BYTES", 2**30 if late else 0)
    target, draft = pair
    prompts, lengths = ragged_prompts(4, 5, target.vocab_size, seed=3)
    call = functools.partial(
        speculative_generate, target, draft, None, None, prompts, lengths, jax.random.PRNGKey(7),
        lookahead=policy, max_new_tokens=20, sampling=sampling, eos_id=2,
    )  # fmt: skip
    plain, recorded = call(), call(record_top_k=3)
    for field in ("tokens", "lengths", "drafted", "accepted", "target_calls", "sl_histogram"):
        np.testing.assert_array_equal(getattr(recorded, field), getattr(plain, field))
    assert plain.record_log_probs is None and recorded.record_log_probs.shape == (4, 20, 3)
    if sampling.greedy:
        np.testing.assert_array_equal(
            recorded.tokens,
            generate(target, None, prompts, lengths, max_new_tokens=20, eos_id=2).tokens,
        )
    expected = _expected_records(target, prompts, lengths, recorded.tokens, recorded.lengths, 3)
    np.testing.assert_allclose(recorded.record_log_probs, expected, atol=1e-5)
    for b in range(4):  # The ids are those of the log-probabilities, and past a row's end 0.
        n = recorded.lengths[b]
        assert np.all(recorded.record_ids[b, n:] == 0) and np.all(
            recorded.record_log_probs[b, n:] == 0
        )
        seq = [0] + list(prompts[b, : lengths[b]]) + list(recorded.tokens[b, :n])
        for i in range(n):
            probs = target.next_probs(seq[lengths[b] + i - 1], seq[lengths[b] + i])
            np.testing.assert_allclose(
                np.log(probs[recorded.record_ids[b, i]]), recorded.record_log_probs[b, i], atol=1e-5
            )


@pytest.mark.parametrize("k", [-1, 17, 2.0])
def test_bad_record_top_k(pair, k):
    target, draft = pair
    prompts, lengths = ragged_prompts(1, 3, target.vocab_size)
    with pytest.raises(ValueError, match=r"record_top_k must be an integer in \[0, 16\]"):
        speculative_generate(target, draft, None, None, prompts, lengths, gamma=2,
                             max_new_tokens=4, record_top_k=k)  # fmt: skip


def test_plain_decoding_counts_one_call_per_token(pair):
    target, _ = pair
    prompts, lengths = ragged_prompts(3, 4, target.vocab_size)
    out = generate(target, None, prompts, lengths, max_new_tokens=7)
    np.testing.assert_array_equal(out.target_calls, 7)
    np.testing.assert_array_equal(out.draft_calls, 0)
    assert out.tau == 1.0 and out.alpha == 0.0


def test_plain_greedy_follows_the_table(pair):
    target, _ = pair
    prompt = np.array([[3, 5]], np.int32)
    out = generate(target, None, prompt, np.array([2]), max_new_tokens=6)
    seq = [3, 5]
    for _ in range(6):
        seq.append(int(np.argmax(target.next_probs(seq[-2], seq[-1]))))
    assert out.tokens[0].tolist() == seq[2:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLE])
def test_draft_equal_to_target_accepts_every_draft(sampling, dtype):
    target, _ = _pair(dtype)
    prompts, lengths = ragged_prompts(4, 3, target.vocab_size)
    out = speculative_generate(
        target,
        target,
        None,
        None,
        prompts,
        lengths,
        jax.random.PRNGKey(1),
        gamma=3,
        max_new_tokens=16,
        sampling=sampling,
    )
    np.testing.assert_array_equal(out.accepted, out.drafted)
    np.testing.assert_array_equal(out.target_calls, 4)  # 16 tokens, 4 per round.


def test_fixed_round_decoder_runs_exactly_the_rounds_asked_for(pair):
    # The timing calibration of a round (`timing.decoder_round_timers`) needs every round full.
    target, draft = pair
    prompts, lengths = ragged_prompts(4, 3, target.vocab_size)
    static = Lookahead("static", 3)
    same = fixed_round_decoder(target, target, static, room=24)
    for rounds in (1, 6):  # Every draft accepted: 4 tokens per round, no row done early.
        out = same(None, None, prompts, lengths, rounds)
        np.testing.assert_array_equal(out["lengths"], 4 * rounds)
        np.testing.assert_array_equal(out["draft_calls"], 3 * rounds)
    with pytest.raises(ValueError, match=r"7 rounds of \(0,\) drafts overrun room=24"):
        same(None, None, prompts, lengths, 7)
    # A draft that is sometimes wrong: 1 to 4 tokens per round, still exactly 6 rounds.
    other = fixed_round_decoder(target, draft, static, room=24)(None, None, prompts, lengths, 6)
    assert (other["lengths"] >= 6).all() and (other["lengths"] <= 24).all()
    assert (other["lengths"] < 24).any()
    np.testing.assert_array_equal(other["sl_histogram"][:, 3], 6)
    # Sampled rounds (a plan serving at T = 1 is priced with them): the target as its own draft
    # accepts every draft, the other one 1 to 4 tokens per round, in exactly 6 rounds.
    for the_draft, full in ((target, True), (draft, False)):
        run = fixed_round_decoder(target, the_draft, static, 24, sampling=SAMPLE)
        out = run(None, None, prompts, lengths, 6)
        assert (out["lengths"] == 24).all() if full else (out["lengths"] >= 6).all()
        np.testing.assert_array_equal(out["sl_histogram"][:, 3], 6)
    for kind in ("confidence", "cumulative", "oracle", "heuristic"):
        policy = Lookahead(kind, 8, source="draft" if kind == "cumulative" else None)
        run = fixed_round_decoder(target, target, policy, room=20)  # One program.
        if kind != "heuristic":
            # Confidence, cumulative and oracle rounds are held to one draft call, even with a
            # draft that is always right (the oracle's then proposes none: its reference
            # matches no draft).
            proposed = 0 if kind == "oracle" else 1
            out = run(None, None, prompts, lengths, 5)
            np.testing.assert_array_equal(out["draft_calls"], 5)
            np.testing.assert_array_equal(out["sl_histogram"][:, proposed], 5)
            np.testing.assert_array_equal(out["lengths"], 5 * (proposed + 1))
        # drafts=: dynamic rounds propose exactly the scheduled counts (the rule's verdict
        # replaced), every round the same or cycling through the schedule.
        out = run(None, None, prompts, lengths, 5, drafts=(3,))
        np.testing.assert_array_equal(out["draft_calls"], 3 * 5)
        np.testing.assert_array_equal(out["sl_histogram"][:, 3], 5)
        np.testing.assert_array_equal(out["lengths"], 4 * 5)
        np.testing.assert_array_equal(out["width_switches"], 0)  # Always 4 wide.
        out = run(None, None, prompts, lengths, 5, drafts=(1, 3))  # Rounds of 1, 3, 1, 3, 1.
        np.testing.assert_array_equal(out["draft_calls"], 9)
        np.testing.assert_array_equal(out["sl_histogram"][:, [1, 3]], [[3, 2]] * 4)
        np.testing.assert_array_equal(out["lengths"], 3 * 2 + 2 * 4)
        np.testing.assert_array_equal(out["width_switches"], 4)  # 2, 4, 2, 4, 2 wide.
        for bad in ((9,), (1, 2, 3)):  # Past sl_max; a schedule not dividing the program's 2.
            with pytest.raises(ValueError, match=r"counts in \[0, sl_max=8\].*dividing 2"):
                run(None, None, prompts, lengths, 1, drafts=bad)
    with pytest.raises(ValueError, match=r"got \(2,\)"):  # Schedules are for dynamic rules.
        same(None, None, prompts, lengths, 1, drafts=(2,))


def test_eos_and_max_length_per_row():
    # A target that always emits 3 after 2 and 2 otherwise: rows hit EOS (3) at different times.
    table = np.full((5, 5, 5), -10.0)
    table[:, :, 2] = 10.0
    table[:, 2, :] = -10.0
    table[:, 2, 3] = 10.0
    target, draft = MarkovStub(table, "eos_t"), MarkovStub(np.zeros_like(table), "eos_d")
    prompts = np.array([[1, 1, 0], [1, 2, 0], [4, 4, 4]], np.int32)
    lengths = np.array([1, 2, 3], np.int32)
    for gamma in (1, 4):
        out = speculative_generate(
            target, draft, None, None, prompts, lengths, gamma=gamma, max_new_tokens=6, eos_id=3
        )
        assert out.tokens.tolist() == [[2, 3, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0], [2, 3, 0, 0, 0, 0]]
        assert out.lengths.tolist() == [2, 1, 2]
    out = generate(target, None, prompts, lengths, max_new_tokens=6, eos_id=None)
    assert out.lengths.tolist() == [6, 6, 6]


def _joint_counts(tokens, vocab, n):
    index = np.ravel_multi_index(tuple(tokens[:, :n].T), (vocab,) * n)
    return np.bincount(index, minlength=vocab**n)


def _chi2_pvalue(counts, probs):
    """Pearson chi-square p-value of counts against probs (cells of probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


def _exact_joint(target, prompt, n):
    """Exact probability of every continuation of length n under the target stub."""
    vocab = target.vocab_size
    probs = np.zeros((vocab,) * n)
    for cont in itertools.product(range(vocab), repeat=n):
        seq, pr = list(prompt), 1.0
        for tok in cont:
            pr *= target.next_probs(seq[-2], seq[-1])[tok]
            seq.append(tok)
        probs[cont] = pr
    return probs.ravel()


@pytest.mark.parametrize(
    "gamma,sampling,dtype,record",
    [
        (1, SAMPLE, "float32", 0),
        (2, SAMPLE, "float32", 0),
        (3, SamplingConfig(1.0, top_k=3), "float32", 0),
        (2, SAMPLE, "bfloat16", 0),  # Against the exact distribution of the bfloat16 target.
        (3, SAMPLE, "float32", 2),  # With the target's top-2 recorded (`record_top_k`).
    ],
)
def test_sampling_reproduces_target_distribution(gamma, sampling, dtype, record):
    target, draft = markov_pair(vocab=4, seed=11, noise=1.5, scale=1.0, dtype=dtype)
    n_samples, n_tokens = 60_000, 3
    prompts = np.tile(np.array([[1, 2]], np.int32), (n_samples, 1))
    lengths = np.full(n_samples, 2, np.int32)
    out = speculative_generate(
        target,
        draft,
        None,
        None,
        prompts,
        lengths,
        jax.random.PRNGKey(gamma),
        gamma=gamma,
        max_new_tokens=n_tokens,
        sampling=sampling,
        record_top_k=record,
    )
    counts = _joint_counts(out.tokens, 4, n_tokens)
    if sampling.top_k:
        # The reference is the processed target: re-normalised top-3 of each exact distribution.
        with np.errstate(divide="ignore"):  # log(0) = -inf outside the top 3 is intended.
            processed = MarkovStub(
                np.log(np.asarray(logits_to_probs(target.table, sampling))), "ref"
            )
        expected = _exact_joint(processed, [1, 2], n_tokens)
    else:
        expected = _exact_joint(target, [1, 2], n_tokens)
    assert _chi2_pvalue(counts, expected) > 1e-3
    assert 0.2 < out.alpha < 0.95


def test_sample_categorical_draws_each_id_with_its_probability_and_never_an_id_of_mass_0():
    # Unnormalised rows with zeros (a residual max(0, p - q) looks like this), many draws.
    rng = np.random.default_rng(0)
    probs = rng.random((3, 12)) * (rng.random((3, 12)) < 0.6)
    probs[:, 0], probs[2, 5:] = 0.0, 0.0  # The first id and a row's tail have mass 0.
    probs = np.float32(probs) * np.float32([[1.0], [0.3], [2.5]])
    keys = jax.random.split(jax.random.PRNGKey(0), 40_000)
    draws = np.asarray(jax.vmap(lambda k: sample_categorical(k, jnp.asarray(probs)))(keys))
    for row in range(3):
        counts = np.bincount(draws[:, row], minlength=12)
        assert counts[probs[row] == 0].sum() == 0, counts
        assert _chi2_pvalue(counts, np.float64(probs[row]) / probs[row].sum()) > 1e-3


def test_distribution_test_has_power_against_a_wrong_rule():
    # Near-total lenience keeps almost every draft: outputs follow the draft, and the test says so.
    target, draft = markov_pair(vocab=4, seed=11, noise=1.5, scale=1.0)
    n_samples, n_tokens = 60_000, 3
    prompts = np.tile(np.array([[1, 2]], np.int32), (n_samples, 1))
    out = speculative_generate(
        target,
        draft,
        None,
        None,
        prompts,
        np.full(n_samples, 2, np.int32),
        jax.random.PRNGKey(0),
        gamma=2,
        max_new_tokens=n_tokens,
        sampling=SAMPLE,
        lenience=Lenience("linear", 1e-6),
    )
    counts = _joint_counts(out.tokens, 4, n_tokens)
    expected = _exact_joint(target, [1, 2], n_tokens)
    assert stats.chisquare(counts, expected / expected.sum() * n_samples).pvalue < 1e-9


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_plain_decoding_reproduces_target_distribution(dtype):
    target, _ = markov_pair(vocab=4, seed=11, noise=1.5, scale=1.0, dtype=dtype)
    n_samples = 40_000
    prompts = np.tile(np.array([[1, 2]], np.int32), (n_samples, 1))
    out = generate(
        target,
        None,
        prompts,
        np.full(n_samples, 2, np.int32),
        jax.random.PRNGKey(3),
        max_new_tokens=2,
        sampling=SAMPLE,
    )
    expected = _exact_joint(target, [1, 2], 2)
    assert _chi2_pvalue(_joint_counts(out.tokens, 4, 2), expected) > 1e-3


def test_no_recompilation_for_new_prompts_of_the_same_shape():
    target, draft = markov_pair(vocab=8, seed=5, noise=0.5)
    kwargs = dict(gamma=3, max_new_tokens=8)
    for seed in range(3):
        prompts, lengths = ragged_prompts(2, 6, 8, seed=seed)
        speculative_generate(target, draft, None, None, prompts, lengths, **kwargs)
        if seed == 0:
            traces = dict(TRACE_COUNTS)
    assert TRACE_COUNTS[target.name] == traces[target.name]
    assert TRACE_COUNTS[draft.name] == traces[draft.name]


def test_padded_vocabularies_work_with_explicit_vocab_size():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((12, 12, 12)) * 2
    target = MarkovStub(table, "pad_t")
    draft = MarkovStub(table[:10, :10, :10] + rng.standard_normal((10, 10, 10)) * 0 + 0.3, "pad_d")
    prompts, lengths = ragged_prompts(3, 4, 10)
    with pytest.raises(ValueError, match="vocab_size=<the tokenizer's size>"):
        speculative_generate(target, draft, None, None, prompts, lengths, gamma=2, max_new_tokens=8)
    plain = generate(target, None, prompts, lengths, max_new_tokens=8, vocab_size=10)
    spec = speculative_generate(
        target, draft, None, None, prompts, lengths, gamma=2, max_new_tokens=8, vocab_size=10
    )
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.tokens.max() < 10
    with pytest.raises(ValueError, match="vocab_size must be in \\[1, 10\\], got 11"):
        speculative_generate(
            target, draft, None, None, prompts, lengths, gamma=2, max_new_tokens=8, vocab_size=11
        )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gamma=0), "gamma must be an integer >= 1, got 0"),
        (dict(gamma=2.5), "gamma must be an integer >= 1, got 2.5"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    ],
)
def test_bad_decoding_arguments(pair, kwargs, message):
    target, draft = pair
    prompts, lengths = ragged_prompts(2, 3, 16)
    args = dict(gamma=2, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, draft, None, None, prompts, lengths, **args)


def test_bad_prompt_lengths(pair):
    target, _ = pair
    with pytest.raises(ValueError, match=r"prompt_lengths must be in \[1, 3\], got \[0, 3\]"):
        generate(target, None, np.ones((2, 3), np.int32), np.array([0, 3]), max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_k=-2), "top_k must be an integer >= 0"),
        (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    ],
)
def test_bad_sampling_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_top_k_and_top_p_filters():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]]))
    np.testing.assert_allclose(
        logits_to_probs(logits, SamplingConfig(1.0, top_k=2)), [[4 / 7, 3 / 7, 0, 0]], rtol=1e-6
    )
    np.testing.assert_allclose(
        logits_to_probs(logits, SamplingConfig(1.0, top_p=0.75)),
        [[4 / 9, 3 / 9, 2 / 9, 0]],
        rtol=1e-6,
    )
    np.testing.assert_allclose(logits_to_probs(logits, SamplingConfig()), [[1, 0, 0, 0]])
    np.testing.assert_allclose(logits_to_probs(logits, SamplingConfig(2.0)).sum(), 1.0, rtol=1e-6)
