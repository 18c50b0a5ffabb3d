"""Data generation: Algorithm A.2 sources per step, packing, and the (seed, step) example store."""

from __future__ import annotations

import numpy as np
import pytest

from distillspec import datagen
from distillspec.datagen import DATASET, STUDENT, TEACHER, DataMixture, ExampleStore

# ------------------------------------------------------------------------------------------------
# step_sources: a pure function of (seed, step) with Algorithm A.2's frequencies.


def test_step_sources_is_a_pure_function_of_seed_and_step():
    mixture = DataMixture(fixed_data_fraction=0.3, student_data_fraction=0.5, per_example=True)
    first = [datagen.step_sources(7, s, 16, mixture) for s in range(20)]
    # Python's and NumPy's global RNGs must play no part.
    np.random.seed(123)
    second = [datagen.step_sources(7, s, 16, mixture) for s in reversed(range(20))][::-1]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
        assert a.shape == (16,) and a.dtype == np.int32
    # Different steps (and seeds) draw differently.
    assert len({a.tobytes() for a in first}) > 15
    other_seed = [datagen.step_sources(8, s, 16, mixture) for s in range(20)]
    assert any((a != b).any() for a, b in zip(first, other_seed))


@pytest.mark.parametrize("lambda1, lambda2", [(0.5, 1.0), (0.2, 0.25), (0.0, 0.6), (1.0, 0.0)])
def test_step_source_frequencies_follow_algorithm_a2(lambda1, lambda2):
    mixture = DataMixture(fixed_data_fraction=lambda1, student_data_fraction=lambda2)
    steps = 4000
    sources = np.array([datagen.step_sources(0, s, 4, mixture) for s in range(steps)])
    # Per batch: every row of a step shares its source.
    assert (sources == sources[:, :1]).all()
    frequency = np.bincount(sources[:, 0], minlength=3) / steps
    expected = [lambda1, (1 - lambda1) * lambda2, (1 - lambda1) * (1 - lambda2)]
    # 4 standard errors of a binomial proportion with n = 4000 is at most 0.032.
    np.testing.assert_allclose(frequency, expected, atol=0.032)
    # The endpoints are exact: a fraction of 0 never picks the source, 1 always does.
    for source, p in enumerate(expected):
        if p == 0:
            assert frequency[source] == 0
        if p == 1:
            assert frequency[source] == 1


def test_per_example_draws_differ_across_rows():
    mixture = DataMixture(fixed_data_fraction=0.4, student_data_fraction=0.5, per_example=True)
    sources = np.concatenate([datagen.step_sources(3, s, 32, mixture) for s in range(50)])
    assert len(set(datagen.step_sources(3, 0, 32, mixture).tolist())) > 1
    frequency = np.bincount(sources, minlength=3) / len(sources)
    np.testing.assert_allclose(frequency, [0.4, 0.3, 0.3], atol=0.05)


@pytest.mark.parametrize(
    "field, name",
    [("fixed_data_fraction", "lambda1"), ("student_data_fraction", "lambda2")],
)
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_mixture_fractions_outside_unit_interval_are_rejected(field, name, value):
    with pytest.raises(ValueError) as info:
        DataMixture(**{field: value})
    message = str(info.value)
    assert f"DataMixture.{field}" in message and name in message and "[0, 1]" in message


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_mixture_temperature_must_be_positive(temperature):
    with pytest.raises(ValueError, match=r"DataMixture\.temperature must be > 0"):
        DataMixture(temperature=temperature)


def test_mixture_needs_samples_flags():
    assert not DataMixture(fixed_data_fraction=1.0).needs_teacher_samples
    assert not DataMixture(fixed_data_fraction=1.0).needs_student_samples
    assert DataMixture(0.0, 0.0).needs_teacher_samples
    assert not DataMixture(0.0, 0.0).needs_student_samples
    assert DataMixture(0.0, 1.0).needs_student_samples
    assert not DataMixture(0.0, 1.0).needs_teacher_samples


# ------------------------------------------------------------------------------------------------
# Packing, checked by hand.

# Row 0: prompt (11, 12, 13), completion (21, 22). Row 1: prompt (14,), completion (23, 24, 25).
# Row 2: prompt (15, 16), empty completion. Junk beyond each length must not leak through.
PROMPTS = np.array([[11, 12, 13], [14, 99, 99], [15, 16, 99]])
PROMPT_LENGTHS = np.array([3, 1, 2])
COMPLETIONS = np.array([[21, 22, 98], [23, 24, 25], [98, 98, 98]])
COMPLETION_LENGTHS = np.array([2, 3, 0])


def test_pack_decoder_only_by_hand():
    out = datagen.pack_decoder_only(PROMPTS, PROMPT_LENGTHS, COMPLETIONS, COMPLETION_LENGTHS)
    tokens = np.array(
        [
            [11, 12, 13, 21, 22, 0],
            [14, 23, 24, 25, 0, 0],
            [15, 16, 0, 0, 0, 0],
        ]
    )
    # targets[t] = tokens[t + 1]: position t predicts the next token.
    targets = np.array(
        [
            [12, 13, 21, 22, 0, 0],
            [23, 24, 25, 0, 0, 0],
            [16, 0, 0, 0, 0, 0],
        ]
    )
    # 1 exactly where the next token is a completion token: row 0 at positions 2, 3 (predicting
    # 21, 22); row 1 at 0, 1, 2 (predicting 23, 24, 25); row 2 nowhere.
    weights = np.array(
        [
            [0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
        ],
        np.float32,
    )
    # The N = 3 positions from each row's prompt_length - 1: all that can carry weight.
    loss_positions = np.array([[2, 3, 4], [0, 1, 2], [1, 2, 3]])
    assert set(out) == {"decoder_input_tokens", "targets", "weights", "loss_positions"}
    np.testing.assert_array_equal(out["decoder_input_tokens"], tokens)
    np.testing.assert_array_equal(out["targets"], targets)
    np.testing.assert_array_equal(out["weights"], weights)
    np.testing.assert_array_equal(out["loss_positions"], loss_positions)
    assert out["weights"].dtype == np.float32
    # Weighted targets are exactly the completions.
    for row in range(3):
        picked = np.asarray(out["targets"][row])[weights[row] == 1]
        np.testing.assert_array_equal(picked, COMPLETIONS[row, : COMPLETION_LENGTHS[row]])


def test_pack_encoder_decoder_by_hand():
    out = datagen.pack_encoder_decoder(PROMPTS, PROMPT_LENGTHS, COMPLETIONS, COMPLETION_LENGTHS)
    targets = np.array([[21, 22, 0], [23, 24, 25], [0, 0, 0]])
    np.testing.assert_array_equal(out["encoder_input_tokens"], PROMPTS)
    np.testing.assert_array_equal(out["targets"], targets)
    # T5: the decoder starts from id 0 and reads the targets shifted right.
    np.testing.assert_array_equal(
        out["decoder_input_tokens"], [[0, 21, 22], [0, 23, 24], [0, 0, 0]]
    )
    np.testing.assert_array_equal(out["weights"], [[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert out["weights"].dtype == np.float32


def test_select_rows_picks_each_rows_source():
    data = (np.full((3, 2), 1), np.array([1, 1, 1]))
    student = (np.full((3, 2), 2), np.array([2, 2, 2]))
    teacher = (np.full((3, 2), 3), np.array([0, 1, 2]))
    tokens, lengths = datagen.select_rows(
        np.array([TEACHER, DATASET, STUDENT]), {DATASET: data, STUDENT: student, TEACHER: teacher}
    )
    np.testing.assert_array_equal(tokens, [[3, 3], [1, 1], [2, 2]])
    np.testing.assert_array_equal(lengths, [0, 1, 2])


# ------------------------------------------------------------------------------------------------
# ExampleStore: data order from (seed, step).


def _store(n: int) -> ExampleStore:
    ids = np.arange(n, dtype=np.int32)
    return ExampleStore(
        prompts=np.stack([ids + 1, ids + 1], axis=1),
        prompt_lengths=np.full(n, 2, np.int32),
        completions=ids[:, None] + 1000,
        completion_lengths=np.ones(n, np.int32),
    )


def _ids(batch: dict) -> np.ndarray:
    return batch["completion_tokens"][:, 0] - 1000


def test_example_store_batches_are_deterministic_by_seed_and_step():
    store = _store(10)
    a = [_ids(store.batch(5, s, 4)) for s in range(8)]
    # Any access order, and a fresh store, give the same batches.
    fresh = _store(10)
    b = [_ids(fresh.batch(5, s, 4)) for s in reversed(range(8))][::-1]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    other = [_ids(store.batch(6, s, 4)) for s in range(8)]
    assert any((x != y).any() for x, y in zip(a, other))
    # Rows stay aligned across the arrays.
    batch = store.batch(5, 3, 4)
    np.testing.assert_array_equal(batch["prompt_tokens"][:, 0], _ids(batch) + 1)


def test_example_store_sees_every_example_once_per_epoch_across_boundaries():
    n, batch_size = 10, 4  # 40 examples over 10 steps = 4 epochs; steps straddle epochs.
    store = _store(n)
    stream = np.concatenate([_ids(store.batch(0, s, batch_size)) for s in range(10)])
    epochs = stream.reshape(4, n)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(n))
    # Each epoch is reshuffled.
    assert len({e.tobytes() for e in epochs}) > 1
    # Step 2 covers global indices 8..11: the end of epoch 0 and the start of epoch 1.
    np.testing.assert_array_equal(_ids(store.batch(0, 2, 4)), np.r_[epochs[0, 8:], epochs[1, :2]])


def test_example_store_from_batches_keeps_valid_rows_and_stops_at_max_examples():
    def batches():
        for start in range(0, 12, 4):
            ids = np.arange(start, start + 4)
            yield {
                "prompt_tokens": np.stack([ids + 1, ids + 1], 1).astype(np.int32),
                # Example 5 has an empty prompt: unusable.
                "prompt_lengths": np.where(ids == 5, 0, 2).astype(np.int32),
                "completion_tokens": (ids[:, None] + 1000).astype(np.int32),
                "completion_lengths": np.ones(4, np.int32),
                "valid": ids < 10,  # The last two rows are batch padding.
            }

    store = ExampleStore.from_batches(batches())
    assert len(store) == 9
    assert sorted(store.completions[:, 0] - 1000) == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    consumed = []

    def counting():
        for b in batches():
            consumed.append(b)
            yield b

    small = ExampleStore.from_batches(counting(), max_examples=3)
    assert len(small) == 3 and small.prompts.shape == (3, 2)
    assert len(consumed) == 1  # Reading stopped once enough rows were in hand.
