"""Tests for distillspec.disco: DISCO classifier data, training, F1 baselines and storage."""

from __future__ import annotations

import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec import gin_setup
from distillspec.decoding import generate, lookahead
from distillspec.decoding.lookahead import Lookahead
from distillspec.disco import classifier, storage
from distillspec.disco import features as disco_features
from distillspec.evaluation.policies import resolve_policies
from distillspec.models.t5 import T5LM, T5Config
from distillspec.runs.disco import disco as run_disco
from distillspec.runs.evaluate import evaluate as run_evaluate
from tests.test_utils import TEST_CONFIGS, perturbed, ragged_prompts, tiny_lm

VOCAB = 32
MAX_NEW = 8
TOP_K = 4


@pytest.fixture(scope="module")
def models():
    model, params = tiny_lm(VOCAB)
    return model, params, perturbed(params, 0.02, seed=3)


@pytest.fixture(scope="module")
def prompts():
    tokens, lengths = ragged_prompts(4, 5, VOCAB, seed=1)
    return {"prompt_tokens": tokens, "prompt_lengths": lengths, "valid": np.ones(4, bool)}


@pytest.fixture(scope="module")
def noisy_examples(models, prompts):
    model, params, noisy = models
    return disco_features.extract_features(
        model, params, model, noisy, [prompts], max_new_tokens=MAX_NEW, eos_id=None, top_k=TOP_K
    )


def _examples(y, sequence=None, position=None, x=None) -> disco_features.Examples:
    y = np.asarray(y, np.int32)
    sequence = np.zeros_like(y) if sequence is None else np.asarray(sequence, np.int32)
    position = np.arange(len(y), dtype=np.int32) if position is None else position
    x = np.zeros((len(y), 3), np.float32) if x is None else x
    return disco_features.Examples(x, y, sequence, np.asarray(position, np.int32))


# --------------------------------------------------------------------------------------------
# Features.
# --------------------------------------------------------------------------------------------


def test_features_by_hand():
    probs = np.array([0.125, 0.5, 0.125, 0.25])
    # A padded id with a huge logit: ignored, as the ids >= vocab_size are.
    logits = jnp.asarray(np.append(np.log(probs), 100.0), jnp.float32)
    x = np.asarray(lookahead.features(logits, jnp.asarray(3), 3, vocab_size=4))
    entropy = -np.sum(probs * np.log(probs))
    np.testing.assert_allclose(x, [0.5, 0.25, 0.125, entropy, math.log(4)], rtol=1e-5)
    uniform = np.asarray(lookahead.features(jnp.zeros((2, 8)), jnp.asarray([0, 9]), 2, 8))
    np.testing.assert_allclose(uniform[:, :2], 1 / 8, rtol=1e-6)
    np.testing.assert_allclose(uniform[:, 2], math.log(8), rtol=1e-6)
    np.testing.assert_allclose(uniform[:, 3], [0.0, math.log(10)], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# extract_features.
# --------------------------------------------------------------------------------------------


def test_extract_features_matches_step_by_step_draft(models, prompts, noisy_examples):
    model, params, noisy = models
    ex = noisy_examples
    plain = generate(
        model, params, prompts["prompt_tokens"], prompts["prompt_lengths"], max_new_tokens=MAX_NEW
    )
    assert ex.x.shape == (int(plain.lengths.sum()), TOP_K + 2) and ex.x.dtype == np.float32
    assert ex.y.dtype == ex.sequence.dtype == ex.position.dtype == np.int32
    assert 0 < ex.y.mean() < 1  # The noisy draft is sometimes right, sometimes wrong.
    for row in range(4):
        mine = ex.sequence == row
        np.testing.assert_array_equal(ex.position[mine], np.arange(plain.lengths[row]))
    # Independently: step the draft through one row with `extend`, one token at a time; the
    # prompt's last token (at position p - 1) predicts token 0.
    for row in (1, 2):
        p = int(prompts["prompt_lengths"][row])
        prompt = prompts["prompt_tokens"][row : row + 1, :p]
        last = jnp.full((1,), p - 1, jnp.int32)
        labels, features = _stepped(model, noisy, prompt, prompt[:, -1:], last, plain, row)
        np.testing.assert_array_equal(ex.y[ex.sequence == row], labels)
        np.testing.assert_allclose(ex.x[ex.sequence == row], features, rtol=1e-4, atol=1e-5)
    assert 0 < ex.y[ex.sequence == 1].mean() < 1  # Row 1 checks both labels.


def _stepped(model, params, prompt, start, position, plain, row):
    """(labels, features) of one row by feeding the draft one token at a time with `extend`:
    `start` [1, 1] at `position` [1] predicts token 0, token i at position + 1 + i predicts i+1."""
    prefill = jax.jit(model.prefill, static_argnums=3)
    extend, features_fn = jax.jit(model.extend), jax.jit(lookahead.features, static_argnums=(2, 3))
    cache, _, _ = prefill(params, prompt, jnp.array([prompt.shape[1]], jnp.int32), 32)
    labels, features, feed = [], [], start
    for i in range(int(plain.lengths[row])):
        logits, cache = extend(params, cache, jnp.asarray(feed), position + i)
        labels.append(int(np.argmax(logits[0, 0]) == plain.tokens[row, i]))
        features.append(np.asarray(features_fn(logits[0, 0], jnp.asarray(i), TOP_K, VOCAB)))
        feed = plain.tokens[row : row + 1, i : i + 1]
    return np.array(labels), np.array(features)


def test_extract_features_encoder_decoder(prompts):
    model = T5LM(T5Config(vocab_size=VOCAB, embed_dim=32, num_heads=4, head_dim=8, mlp_dim=64))
    params = model.init(jax.random.PRNGKey(0))
    noisy = perturbed(params, 0.3, seed=4)
    tokens, lengths = prompts["prompt_tokens"], prompts["prompt_lengths"]
    batch = {"prompt_tokens": tokens, "prompt_lengths": lengths}
    ex = disco_features.extract_features(
        model, params, model, noisy, [batch], max_new_tokens=MAX_NEW, eos_id=None, top_k=TOP_K
    )
    plain = generate(model, params, tokens, lengths, max_new_tokens=MAX_NEW)
    assert len(ex) == int(plain.lengths.sum())
    start = np.zeros((1, 1), np.int32)  # T5's decoder start token at position 0.
    for row in range(2):
        prompt, position = tokens[row : row + 1], jnp.zeros(1, jnp.int32)
        labels, features = _stepped(model, noisy, prompt, start, position, plain, row)
        np.testing.assert_array_equal(ex.y[ex.sequence == row], labels)
        np.testing.assert_allclose(ex.x[ex.sequence == row], features, rtol=1e-4, atol=1e-5)
    assert 0 < ex.y.mean() < 1, ex.y


def test_identical_draft_is_always_accepted(models, prompts):
    model, params, _ = models
    ex = disco_features.extract_features(
        model, params, model, params, [prompts], max_new_tokens=MAX_NEW, eos_id=None, top_k=TOP_K
    )
    assert len(ex) == 4 * MAX_NEW
    assert ex.y.tolist() == [1] * len(ex)


def test_invalid_rows_are_excluded(models, prompts, noisy_examples):
    model, params, noisy = models
    valid = np.array([True, False, True, False])
    padded = {
        # As prompt_batches pads a final batch: invalid rows have length 0.
        "prompt_tokens": np.where(valid[:, None], prompts["prompt_tokens"], 0),
        "prompt_lengths": np.where(valid, prompts["prompt_lengths"], 0).astype(np.int32),
        "valid": valid,
    }
    empty = {**padded, "valid": np.zeros(4, bool)}
    ex = disco_features.extract_features(
        model, params, model, noisy, [padded, empty, padded], max_new_tokens=MAX_NEW,
        eos_id=None, top_k=TOP_K,
    )  # fmt: skip
    full = noisy_examples
    # Sequences number the valid rows across batches: rows 0 and 2, then rows 0 and 2 again.
    assert sorted(set(ex.sequence.tolist())) == [0, 1, 2, 3]
    for seq, row in [(0, 0), (1, 2), (2, 0), (3, 2)]:
        mine, theirs = ex.sequence == seq, full.sequence == row
        np.testing.assert_array_equal(ex.y[mine], full.y[theirs])
        np.testing.assert_array_equal(ex.position[mine], full.position[theirs])
        np.testing.assert_allclose(ex.x[mine], full.x[theirs], rtol=1e-5, atol=1e-6)


def test_eos_ends_the_examples_of_a_row(models, prompts, noisy_examples):
    model, params, noisy = models
    full = noisy_examples
    plain = generate(
        model, params, prompts["prompt_tokens"], prompts["prompt_lengths"], max_new_tokens=MAX_NEW
    )
    eos = int(plain.tokens[0, 2])
    ex = disco_features.extract_features(
        model, params, model, noisy, [prompts], max_new_tokens=MAX_NEW, eos_id=eos, top_k=TOP_K
    )
    mine = ex.sequence == 0
    assert ex.position[mine].max() <= 2  # Row 0 emits EOS as its third token at the latest.
    np.testing.assert_array_equal(ex.y[mine], full.y[full.sequence == 0][: mine.sum()])


def test_extract_features_rejects_bad_inputs(models, prompts):
    model, params, noisy = models
    call = lambda batches, **kw: disco_features.extract_features(
        model, params, model, noisy, batches, **{"max_new_tokens": MAX_NEW, "eos_id": None, **kw}
    )
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, vocab_size=32\]"):
        call([prompts], top_k=VOCAB + 1)
    with pytest.raises(ValueError, match=r"top_k .* got 0"):
        call([prompts], top_k=0)
    with pytest.raises(ValueError, match="vocab_size must be in"):
        call([prompts], vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        call([prompts], max_new_tokens=0)
    with pytest.raises(ValueError, match="no valid prompt rows"):
        call([{**prompts, "valid": np.zeros(4, bool)}])
    with pytest.raises(ValueError, match="lacks 'prompt_tokens'"):
        call([{"prompt_lengths": prompts["prompt_lengths"]}])


# --------------------------------------------------------------------------------------------
# Training and F1.
# --------------------------------------------------------------------------------------------


def _synthetic(seed: int, num_sequences: int = 40, length: int = 50) -> disco_features.Examples:
    """Features of random draft distributions; accepted iff the top-1 probability > 0.5."""
    rng = np.random.default_rng(seed)
    m = num_sequences * length
    scale = rng.uniform(0.0, 4.0, size=(m, 1))
    logits = scale * rng.standard_normal((m, 16))
    position = np.tile(np.arange(length), num_sequences)
    x = np.asarray(lookahead.features(jnp.asarray(logits), jnp.asarray(position), 4, 16))
    y = (x[:, 0] > 0.5).astype(np.int32)
    sequence = np.repeat(np.arange(num_sequences), length)
    return disco_features.Examples(x.astype(np.float32), y, sequence.astype(np.int32), position)


@pytest.fixture(scope="module")
def synthetic_run():
    train, test = _synthetic(0), _synthetic(1)
    variables = classifier.train_classifier(train, steps=300, batch_size=256, seed=0)
    return train, test, variables


def test_classifier_learns_a_separable_rule_and_beats_static_sl(synthetic_run):
    train, test, variables = synthetic_run
    assert 0.2 < test.y.mean() < 0.8
    assert lookahead.classifier_top_k(variables) == 4
    assert variables["params"]["hidden"]["kernel"].shape == (6, 32)
    np.testing.assert_allclose(variables["norm"]["mean"], train.x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(variables["norm"]["std"], train.x.std(0), rtol=1e-5)
    f1 = classifier.classifier_f1(variables, test)
    k, static = classifier.best_static_sl(test)
    assert f1 > 0.9
    assert f1 > static + 0.05, (f1, k, static)
    # The threshold is where the decoder stops: 0 keeps every token, 1 (nearly) none.
    assert classifier.classifier_f1(variables, test, threshold=0.0) == pytest.approx(
        classifier.f1_score(np.ones(len(test)), test.y)
    )


def test_training_is_deterministic(synthetic_run):
    train, test, variables = synthetic_run
    again = classifier.train_classifier(train, steps=300, batch_size=256, seed=0)
    other = classifier.train_classifier(train, steps=300, batch_size=256, seed=1)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), variables, again)
    assert all(jax.tree.leaves(same))
    differs = jax.tree.map(lambda a, b: not np.array_equal(a, b), variables, other)
    assert any(jax.tree.leaves(differs["params"]))


def test_constant_feature_std_is_floored():
    ex = _examples([0, 1, 0, 1])  # x is all zeros: every feature is constant.
    variables = classifier.train_classifier(ex, steps=2, batch_size=4)
    np.testing.assert_array_equal(variables["norm"]["std"], np.full(3, 1e-6, np.float32))
    assert np.all(np.isfinite(classifier.classifier_confidences(variables, ex)))


def test_train_classifier_rejects_bad_inputs(synthetic_run):
    train, *_ = synthetic_run
    with pytest.raises(ValueError, match="every training label is 1"):
        classifier.train_classifier(_examples([1, 1, 1]))
    with pytest.raises(ValueError, match="every training label is 0"):
        classifier.train_classifier(_examples([0, 0]))
    with pytest.raises(ValueError, match="examples is empty"):
        classifier.train_classifier(_examples([]))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        classifier.train_classifier(_examples([0, 2]))
    with pytest.raises(ValueError, match="hidden must be an integer >= 1, got 0"):
        classifier.train_classifier(train, hidden=0)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        classifier.train_classifier(train, steps=0)
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        classifier.train_classifier(train, learning_rate=0.0)
    with pytest.raises(ValueError, match="Examples needs x"):
        disco_features.Examples(np.zeros((3, 4)), np.zeros(2), np.zeros(2), np.zeros(2))


def test_f1_score_by_hand():
    # TP = 2, FP = 1, FN = 1: 2 * 2 / (4 + 1 + 1).
    assert classifier.f1_score([1, 1, 1, 0, 0], [1, 1, 0, 1, 0]) == pytest.approx(4 / 6)
    assert classifier.f1_score([1, 0], [1, 0]) == 1.0
    assert classifier.f1_score([0, 0], [1, 1]) == 0.0
    assert classifier.f1_score([0, 0], [0, 0]) == 0.0  # Undefined: scikit-learn's 0.
    with pytest.raises(ValueError, match="one shape"):
        classifier.f1_score([1, 0], [1])
    with pytest.raises(ValueError, match="only 0/1"):
        classifier.f1_score([1, 2], [1, 0])


def test_classifier_f1_checks_width_and_threshold(synthetic_run):
    _, _, variables = synthetic_run
    with pytest.raises(ValueError, match="top_k=4 but the examples have top_k=1"):
        classifier.classifier_f1(variables, _examples([0, 1]))
    with pytest.raises(ValueError, match="threshold must be in"):
        classifier.classifier_f1(variables, _examples([0, 1]), threshold=1.5)


# --------------------------------------------------------------------------------------------
# Static-SL baseline.
# --------------------------------------------------------------------------------------------


def test_in_round_index_by_hand():
    y = [1, 1, 0, 1, 0, 0, 1, 1]
    #   rounds: [1 1 0] [1 0] [0] [1 1
    np.testing.assert_array_equal(classifier.in_round_index(_examples(y)), [0, 1, 2, 0, 1, 0, 0, 1])
    # Two sequences, stored shuffled: each starts a round, and the order is by position.
    seq = [0, 0, 0, 1, 1, 1, 1]
    pos = [0, 1, 2, 0, 1, 2, 3]
    lab = [1, 1, 1, 0, 1, 1, 0]
    perm = np.array([4, 0, 6, 2, 1, 5, 3])
    ex = _examples(np.take(lab, perm), np.take(seq, perm), np.take(pos, perm))
    expected = np.array([0, 1, 2, 0, 0, 1, 2])[perm]
    np.testing.assert_array_equal(classifier.in_round_index(ex), expected)
    with pytest.raises(ValueError, match="same \\(sequence, position\\)"):
        classifier.in_round_index(_examples([1, 0], position=[3, 3]))


def test_static_sl_f1_by_hand():
    ex = _examples([1, 1, 0, 1, 0, 0, 1, 1])  # in-round index 0 1 2 0 1 0 0 1.
    # SL-1 predicts 1 0 0 1 0 1 1 0: TP = 3 (0, 3, 6), FP = 1 (5), FN = 2 (1, 7) -> 6 / 9.
    assert classifier.static_sl_f1(ex, 1) == pytest.approx(6 / 9)
    # SL-2 predicts 1 1 0 1 1 1 1 1: TP = 5, FP = 2 (4, 5), FN = 0 -> 10 / 12.
    assert classifier.static_sl_f1(ex, 2) == pytest.approx(10 / 12)
    # SL-3 predicts everything accepted: TP = 5, FP = 3 -> 10 / 13.
    assert classifier.static_sl_f1(ex, 3) == pytest.approx(10 / 13)
    assert classifier.best_static_sl(ex) == (2, pytest.approx(10 / 12))
    assert classifier.best_static_sl(ex, ks=[3, 1]) == (3, pytest.approx(10 / 13))
    # Ties go to the smallest k: every k >= 3 predicts all three tokens of 1 1 1 correctly.
    assert classifier.best_static_sl(_examples([1, 1, 1])) == (3, 1.0)
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        classifier.static_sl_f1(ex, 0)
    with pytest.raises(ValueError, match="ks is empty"):
        classifier.best_static_sl(ex, ks=[])


# --------------------------------------------------------------------------------------------
# Fingerprint and storage.
# --------------------------------------------------------------------------------------------


def test_fingerprint_tracks_weights_and_vocabulary(models):
    model, params, noisy = models
    base = storage.fingerprint(model, params, VOCAB)
    assert base == storage.fingerprint(model, jax.tree.map(np.array, params), VOCAB)
    assert base == storage.fingerprint(model, params, None)  # None: the model's vocab_size.
    assert len(base) == 64 and int(base, 16) >= 0
    leaves, treedef = jax.tree.flatten(params)
    changed = [np.array(x) for x in leaves]
    changed[-1].flat[0] += 1e-3
    assert storage.fingerprint(model, jax.tree.unflatten(treedef, changed), VOCAB) != base
    assert storage.fingerprint(model, noisy, VOCAB) != base
    assert storage.fingerprint(model, params, VOCAB - 2) != base


def test_save_load_round_trip(tmp_path, models, synthetic_run):
    model, params, noisy = models
    _, test, variables = synthetic_run
    directory = storage.classifier_dir(str(tmp_path / "draft"))
    assert directory == str(tmp_path / "draft" / "disco")
    metadata = {"fingerprint": storage.fingerprint(model, noisy, VOCAB), "vocab_size": VOCAB}
    storage.save_classifier(directory, variables, {**metadata, "threshold": 0.4, "f1": 0.9})
    loaded, meta = storage.load_classifier(directory, model, noisy, vocab_size=VOCAB)
    assert meta == {**metadata, "threshold": 0.4, "f1": 0.9, "top_k": 4, "hidden": 32}
    np.testing.assert_array_equal(
        classifier.classifier_confidences(loaded, test),
        classifier.classifier_confidences(variables, test),
    )
    assert sorted(p.name for p in (tmp_path / "draft" / "disco").iterdir()) == [
        "classifier.json",
        "classifier.safetensors",
    ]  # No temporary files left behind.
    loaded, _ = storage.load_classifier(directory)  # No draft: no fingerprint check.
    with pytest.raises(ValueError, match="fingerprint"):
        storage.load_classifier(directory, model, params)
    with pytest.raises(ValueError, match="vocab_size=32.*vocab_size=30"):
        storage.load_classifier(directory, model, noisy, vocab_size=30)
    with pytest.raises(ValueError, match="both draft and draft_params"):
        storage.load_classifier(directory, model)


def test_load_missing_and_save_bad_metadata(tmp_path, synthetic_run):
    _, _, variables = synthetic_run
    with pytest.raises(FileNotFoundError, match="python -m distillspec.disco"):
        storage.load_classifier(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="metadata lacks 'fingerprint'"):
        storage.save_classifier(str(tmp_path), variables, {"vocab_size": VOCAB})
    with pytest.raises(ValueError, match="metadata\\['top_k'\\]=3 but the variables have"):
        storage.save_classifier(
            str(tmp_path), variables, {"fingerprint": "x", "vocab_size": VOCAB, "top_k": 3}
        )
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The run function end to end (tiny models, byte vocabulary, a handful of prompts).
# --------------------------------------------------------------------------------------------


def _tiny_run_dirs(tmp_path, noise_seed=1):
    from distillspec.models.hf_interop import save_pretrained

    model, params = tiny_lm(260)
    save_pretrained(model, params, str(tmp_path / "target"))
    save_pretrained(model, perturbed(params, 0.02, noise_seed), str(tmp_path / "draft"))
    return str(tmp_path / "target"), str(tmp_path / "draft")


def _run(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        target_checkpoint=str(tmp_path / "target"),
        drafts={"standard": str(tmp_path / "draft")},
        eval_sets=[("stdlib_code", "test")],
        task_feature_lengths={"inputs": 16, "targets": 8},
        num_train_prompts=16, num_validation_prompts=3, num_prompts=3, batch_size=8,
        train_steps=50, static_sl=(1, 2), sl_max_grid=(2,), threshold_grid=(0.5, 0.9),
        keep_last_grid=(True,), cumulative_threshold_grid=(0.5,), oracle_sl_max=8,
        vocabulary="byte",
    )  # fmt: skip
    kwargs.update(overrides)
    return run_disco(**kwargs)


def test_disco_run_end_to_end(tmp_path, capsys):
    """`python -m distillspec.disco` on configs/tests/tiny_disco.gin (the run's own gin file at
    toy size) with tiny byte-vocabulary models: every policy, the classifier and tuning saved
    and read back by the evaluate run, reuse checked."""
    target, draft = _tiny_run_dirs(tmp_path)
    gin.clear_config()
    records = gin_setup.main("disco", [
        f"--gin_file={TEST_CONFIGS / 'tiny_disco.gin'}", f"--gin.OUTPUT_DIR='{tmp_path / 'out'}'",
        f"--gin.TARGET_CHECKPOINT='{target}'", f"--gin.DRAFTS={{'standard': '{draft}'}}",
    ])  # fmt: skip
    gin.clear_config()
    policies = [r["policy"] for r in records]
    assert policies == [
        "target", "static-1", "static-2", "static-opt", "heuristic", "confidence", "disco",
        "cumulative", "oracle",
    ]  # fmt: skip
    assert all(r["exact"] for r in records)  # Identical to the target's greedy output.
    assert all(r["num_prompts"] == 2 and r["task"] == "humaneval" for r in records)
    by = {r["policy"]: r for r in records}
    variables, metadata = storage.load_classifier(str(tmp_path / "draft" / "disco"))
    assert by["static-opt"]["sl_max"] == metadata["tuning"]["static_opt"] in (1, 2)
    assert all(r["modeled_latency_ms"] > 0 for r in records)
    modeled = metadata["tuning"]["modeled_latency_ms"]  # The tuning picks the modeled optimum.
    assert modeled[f"static-{metadata['tuning']['static_opt']}"] == min(
        modeled["static-1"], modeled["static-2"]
    )
    assert by["disco"]["threshold"] == metadata["tuning"]["disco"]["threshold"]
    cumulative = metadata["tuning"]["cumulative"]  # Tuned over both sources.
    assert cumulative["source"] in ("classifier", "draft") and cumulative["threshold"] == 0.5
    assert (by["cumulative"]["source"], by["cumulative"]["sl_max"]) == (cumulative["source"], 3)
    assert {"cumulative-classifier@3/0.5/keep", "cumulative-draft@3/0.5/keep"} <= set(modeled)
    assert 0.0 <= metadata["f1_disco"] <= 1.0 and metadata["f1_static_sl_k"] >= 1
    out = tmp_path / "out"
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == len(records)
    assert (out / "disco_table.md").exists() and (out / "oracle_sl_hist.png").exists()
    assert "F1 DISCO" in (out / "disco_f1.md").read_text()
    # distillspec.evaluate's policy axis reads the saved classifier and tuning.
    again = run_evaluate(
        str(tmp_path / "eval"), str(tmp_path / "target"), {"standard": str(tmp_path / "draft")},
        eval_sets=[("stdlib_code", "test")], task_feature_lengths={"inputs": 16, "targets": 8},
        num_prompts=2, gammas=(), policies=["static-opt", "disco", "oracle"], oracle_sl_max=8,
        vocabulary="byte",
    )  # fmt: skip
    assert [r["policy"] for r in again] == ["target", "static-opt", "disco", "oracle"]
    assert all(r["exact"] and r["num_prompts"] == 2 for r in again)
    assert all((r["dtype"], r["cache_dtype"]) == ("float32", "float32") for r in again)
    assert again[2]["threshold"] == metadata["tuning"]["disco"]["threshold"]
    # The run's check before training (`_reusable`): the same draft reuses the saved
    # classifier and tuning; a different draft in the same directory no longer matches the
    # fingerprint, so the check says so and gives nothing to reuse.
    from distillspec.models.hf_interop import from_pretrained
    from distillspec.runs.disco import _reusable

    directory = storage.classifier_dir(str(tmp_path / "draft"))
    capsys.readouterr()
    draft, draft_params = from_pretrained(str(tmp_path / "draft"))
    reused = _reusable("standard", directory, draft, draft_params, None, None)
    assert reused is not None and reused[1]["tuning"] == metadata["tuning"]
    assert "reusing the classifier" in capsys.readouterr().err
    _tiny_run_dirs(tmp_path, noise_seed=2)
    draft, draft_params = from_pretrained(str(tmp_path / "draft"))
    assert _reusable("standard", directory, draft, draft_params, None, None) is None
    err = capsys.readouterr().err
    assert "fingerprint" in err and "reusing" not in err


@pytest.mark.parametrize(
    "override,message",
    [
        (dict(sl_max_grid=(0,)), "sl_max_grid"),
        (dict(threshold_grid=(1.5,)), r"threshold_grid must hold thresholds in \[0, 1\]"),
        (dict(cumulative_threshold_grid=()), r"cumulative_threshold_grid must hold thresholds"),
        (dict(cumulative_sources=("target",)), r"cumulative_sources must .*'classifier'"),
        (dict(oracle_sl_max=0), "SL_max"),
        (dict(drafts={}), "at least one draft"),
        # Classifier settings fail before any model is loaded or feature extracted.
        (dict(hidden=0, target_checkpoint="/nonexistent"), "hidden must be an integer >= 1"),
        (dict(learning_rate=0.0, target_checkpoint="/nonexistent"), "learning_rate must be > 0"),
    ],
)
def test_disco_run_bad_arguments(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, **override)


def test_resolve_policies():
    tuning = {
        "static_opt": 3,
        "confidence": {"threshold": 0.7, "sl_max": 8, "keep_last": True},
        "disco": {"threshold": 0.4, "sl_max": 4, "keep_last": False},
    }
    names = ["target", "static-2", "static-opt", "heuristic", "confidence", "disco", "oracle"]
    got = resolve_policies(names, tuning, heuristic_sl_max=6, heuristic_start=9)
    assert list(got) == names[1:]
    assert got["static-opt"] == Lookahead("static", 3)
    assert got["heuristic"] == Lookahead("heuristic", 6, start=6)
    assert got["disco"] == Lookahead("disco", 4, threshold=0.4, keep_last=False)
    assert got["oracle"].sl_max == 64
    with pytest.raises(ValueError, match="unknown lookahead policy 'greedy'"):
        resolve_policies(["greedy"], tuning)
    with pytest.raises(ValueError, match="python -m distillspec.disco"):
        resolve_policies(["disco"], None)
    with pytest.raises(ValueError, match="SL_max"):
        resolve_policies(["oracle"], oracle_sl_max=0)
    # A tuning saved before the cumulative rule existed: a clear error naming the command.
    with pytest.raises(ValueError, match="no 'cumulative' settings.*python -m distillspec.disco"):
        resolve_policies(["static-opt", "cumulative"], tuning)
    cumulative = {"threshold": 0.3, "sl_max": 8, "keep_last": True, "source": "draft"}
    got = resolve_policies(["cumulative"], {**tuning, "cumulative": cumulative})
    assert got["cumulative"] == Lookahead("cumulative", 8, threshold=0.3, source="draft")


def test_a_saved_tuning_without_the_cumulative_rule_is_made_anew(tmp_path, models, synthetic_run,
                                                                  capsys):  # fmt: skip
    from distillspec.runs.disco import _reusable

    model, _, noisy = models
    variables = synthetic_run[2]
    directory = str(tmp_path / "disco")
    tuned = {"threshold": 0.5, "sl_max": 4, "keep_last": True}
    old = {"static_opt": 2, "confidence": tuned, "disco": tuned}
    metadata = {"fingerprint": storage.fingerprint(model, noisy, VOCAB), "vocab_size": VOCAB}
    storage.save_classifier(directory, variables, {**metadata, "tuning": old})
    assert _reusable("standard", directory, model, noisy, VOCAB, None) is None
    assert "lacks ['cumulative']" in capsys.readouterr().err
    new = {**old, "cumulative": {**tuned, "source": "classifier"}}
    storage.save_classifier(directory, variables, {**metadata, "tuning": new})
    assert _reusable("standard", directory, model, noisy, VOCAB, None)[1]["tuning"] == new
    # Tuned for this machine's costs: a deployment's cost profile tunes it again, and a tuning
    # made for that profile is reused for it (the JSON file's widths are strings).
    profile = {"target_ms": {1: 2.0, 9: 2.4}, "draft_ms": {1: 0.1, 2: 0.1}}
    capsys.readouterr()
    assert _reusable("standard", directory, model, noisy, VOCAB, profile) is None
    assert "made for other call costs" in capsys.readouterr().err
    made = {**new, "cost_profile": profile}
    storage.save_classifier(directory, variables, {**metadata, "tuning": made})
    assert _reusable("standard", directory, model, noisy, VOCAB, profile) is not None
    assert _reusable("standard", directory, model, noisy, VOCAB, None) is None


def test_disco_run_tunes_for_a_cost_profile(tmp_path):
    """TuningConfig loads and checks the profile when made (before any model is loaded)."""
    from distillspec.disco.tuning import TuningConfig

    path = tmp_path / "gpu.json"
    path.write_text('{"target_ms": {"1": 2.0, "9": 2.4}, "draft_ms": {"1": 0.1}}')
    config = TuningConfig(cost_profile=str(path))
    assert config.profile == {"target_ms": {1: 2.0, 9: 2.4}, "draft_ms": {1: 0.1}}
    with pytest.raises(ValueError, match="missing.json' not found: write one with"):
        _run(tmp_path, cost_profile=str(tmp_path / "missing.json"))


def test_the_oracle_cap_is_tuned_on_its_grid():
    """With an oracle_sl_max_grid the oracle is a rule of the grid: its cap with the lowest
    modeled latency is chosen, as the other rules' SL_max are; without one it is not tuned."""
    from distillspec.disco.tuning import choose, tuning_grid

    args = ((1, 2), (4,), (0.5,), (True,), (0.5,), ("draft",))
    assert "oracle" not in tuning_grid(*args)
    rules = tuning_grid(*args, oracle_sl_max_grid=(4, 8, 16))
    assert rules["oracle"] == {f"oracle@{n}": Lookahead("oracle", n) for n in (4, 8, 16)}
    modeled = {label: 10.0 for configs in rules.values() for label in configs}
    modeled.update({"oracle@4": 9.0, "oracle@8": 7.5, "oracle@16": 8.0})
    assert choose(rules, modeled)["oracle"] == {"sl_max": 8}
    assert "oracle" not in choose(tuning_grid(*args), modeled)
