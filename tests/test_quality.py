"""Tests for distillspec.evaluation.quality: NLL of reference completions, distinct-n, loops."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from distillspec.evaluation import quality
from tests.test_utils import ragged_prompts, tiny_lm

VOCAB = 40


def _batch(rows: int, seed: int, valid=None) -> dict:
    prompts, prompt_lengths = ragged_prompts(rows, 6, VOCAB, seed)
    completions, completion_lengths = ragged_prompts(rows, 5, VOCAB, seed + 1)
    batch = {
        "prompt_tokens": prompts, "prompt_lengths": prompt_lengths,
        "completion_tokens": completions, "completion_lengths": completion_lengths,
    }  # fmt: skip
    if valid is not None:
        batch["valid"] = np.asarray(valid)
    return batch


def test_completion_nll_by_hand_and_padding_rows_weighted_out():
    model, params = tiny_lm(VOCAB)
    batch = _batch(3, seed=2)
    nll = quality.completion_nll(model, params, [batch])
    # By hand: log-softmax of the logits at the position before each completion token (each
    # row's sequence right-padded to one length, one compiled program: the model is causal).
    total, count = 0.0, 0
    width = int(np.max(batch["prompt_lengths"] + batch["completion_lengths"]))
    logits_fn = jax.jit(model.logits)
    for b in range(3):
        p, n = int(batch["prompt_lengths"][b]), int(batch["completion_lengths"][b])
        seq = np.concatenate([batch["prompt_tokens"][b, :p], batch["completion_tokens"][b, :n]])
        padded = np.pad(seq, (0, width - len(seq)))[None]
        logits = logits_fn(params, {"decoder_input_tokens": padded})[0]
        logp = np.asarray(jax.nn.log_softmax(logits))
        for i in range(n):
            total -= logp[p - 1 + i, seq[p + i]]
            count += 1
    assert nll == pytest.approx(total / count, rel=1e-5)
    # A padding row (valid=False) of other tokens changes nothing.
    padded = _batch(4, seed=2, valid=[True, True, True, False])
    for key in ("prompt_tokens", "prompt_lengths", "completion_tokens", "completion_lengths"):
        padded[key][:3] = batch[key]
    assert quality.completion_nll(model, params, [padded]) == pytest.approx(nll, rel=1e-6)


def test_distinct_ngrams_golden():
    tokens = np.array([[1, 2, 3, 4, 1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 0, 0, 0, 0, 0]])
    # Row 0 (8 tokens): 1234 2341 3412 4123 1234 -> 4 distinct; row 1 (5 tokens): 5555 5555.
    assert quality.distinct_ngrams(tokens, np.array([8, 5]), 4) == pytest.approx(5 / 7)
    assert quality.distinct_ngrams(tokens, np.array([3, 2]), 4) != quality.distinct_ngrams(
        tokens, np.array([8, 5]), 4
    )


def test_repeating_outputs_are_detected_and_stopped_ones_are_not():
    loop = np.array([7, 3] + [11, 12, 13] * 10)  # 32 tokens ending in a period-3 run.
    varied = np.random.default_rng(0).permutation(np.arange(1, 33))
    assert quality.is_repeating(loop) and not quality.is_repeating(varied)
    assert not quality.is_repeating(loop[:20])  # Shorter than the 32-token window.
    variants = np.array([4, 5, 6, 9, 4, 5, 7, 9, 4, 6, 5, 9] * 3)  # A loop of variants.
    assert quality.is_repeating(variants)
    eos = 13  # The loop's last token is EOS: the output stopped, it is not stuck.
    tokens = np.stack([loop, varied])
    assert quality.repeating_share(tokens, np.array([32, 32]), eos_id=None) == 0.5
    assert quality.repeating_share(tokens, np.array([32, 32]), eos_id=eos) == 0.0


def test_quality_records_of_every_model():
    model, params = tiny_lm(VOCAB)
    batch = _batch(4, seed=3, valid=[True, True, True, False])
    records = quality.quality_records(
        {"a": (model, params), "b": (model, params)}, [batch], max_new_tokens=8, eos_id=None
    )
    assert [r["model"] for r in records] == ["a", "b"]
    for r in records:
        assert r["num_prompts"] == 3
        assert r["nll"] == pytest.approx(quality.completion_nll(model, params, [batch]))
        assert 0 < r["distinct_4"] <= 1 and 0 <= r["repeating_share"] <= 1


class _Letters:
    """A vocabulary decoding id i to chr(ord('a') + i), for texts that can be checked by eye."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_chrf_is_100_for_identical_texts_lower_for_others_and_checks_pairing():
    assert quality.chrf(["def f(x): return x"], ["def f(x): return x"]) == pytest.approx(100.0)
    near = quality.chrf(["def f(y): return y"], ["def f(x): return x"])
    far = quality.chrf(["while True: pass"], ["def f(x): return x"])
    assert 0 <= far < near < 100
    with pytest.raises(ValueError, match="one reference per output, got 2 outputs and 1"):
        quality.chrf(["a", "b"], ["a"])


def test_detokenize_cuts_each_row_at_its_length_and_first_eos():
    tokens = np.array([[0, 1, 2, 3], [3, 9, 2, 1]])
    assert quality.detokenize(_Letters(), tokens, np.array([3, 4]), eos_id=9) == ["abc", "d"]


def test_output_quality_scores_outputs_against_the_references_and_under_the_scorer():
    model, params = tiny_lm(VOCAB)
    batch = _batch(3, seed=4, valid=[True, True, False])
    refs = batch["completion_tokens"][:2], batch["completion_lengths"][:2]
    same = quality.output_quality([batch], *refs, vocabulary=_Letters(), eos_id=None,
                                  scorer=(model, params))  # fmt: skip
    assert same["chrf"] == pytest.approx(100.0)
    # The outputs are the references, so the scorer's NLL of them is the references' NLL.
    valid_only = {k: v[:2] for k, v in batch.items() if k != "valid"}
    assert same["target_nll"] == pytest.approx(
        quality.completion_nll(model, params, [valid_only]), rel=1e-6
    )
    other = quality.output_quality([batch], refs[0][::-1], refs[1][::-1],
                                   vocabulary=_Letters(), eos_id=None)  # fmt: skip
    assert other["chrf"] < 100 and "target_nll" not in other
