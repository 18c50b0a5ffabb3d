"""Tests for distillspec.evaluation: records of alpha, tau, tau_theory and speed-up."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from distillspec import datagen, records
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation import drafts as evaluation
from distillspec.evaluation import timing
from distillspec.evaluation.drafts import GridConfig
from distillspec.evaluation.policies import (
    POLICY_RECORD_KEYS,
    measure_policies,
    policy_records,
)
from distillspec.feature_converters import single_prompts
from distillspec.models.decoder_only import DecoderOnlyLM, TransformerConfig
from distillspec.models.t5 import T5LM, T5Config
from tests.test_utils import perturbed, ragged_prompts, tiny_lm

VOCAB = 32
GAMMAS = (1, 3)
TEMPERATURES = (0.0, 1.0)
MAX_NEW = 12  # A multiple of every gamma + 1, so no round is cut short.

GRID_2 = GridConfig(max_new_tokens=2)


@pytest.fixture(scope="module")
def setup():
    model, params = tiny_lm(VOCAB)
    tokens, lengths = ragged_prompts(4, 5, VOCAB, seed=1)
    second_tokens, second_lengths = ragged_prompts(4, 5, VOCAB, seed=2)
    prompts = [
        {"prompt_tokens": tokens, "prompt_lengths": lengths, "valid": np.ones(4, bool)},
        # A padded final batch as prompt_batches yields it: invalid rows have length 0.
        {
            "prompt_tokens": np.where(np.arange(4)[:, None] < 2, second_tokens, 0),
            "prompt_lengths": np.where(np.arange(4) < 2, second_lengths, 0).astype(np.int32),
            "valid": np.arange(4) < 2,
        },
    ]
    drafts = {"same": (model, params), "noisy": (model, perturbed(params, 0.1, seed=3))}
    grid = GridConfig(gammas=GAMMAS, temperatures=TEMPERATURES, max_new_tokens=MAX_NEW)
    records = evaluation.evaluate_drafts(
        model, params, drafts, prompts, grid, eos_id=None, task="toy", split="validation"
    )
    return model, params, prompts, drafts, records


def _find(records, draft, gamma, temperature):
    (match,) = [
        r
        for r in records
        if (r["draft"], r["gamma"], r["temperature"]) == (draft, gamma, temperature)
    ]
    return match


def test_one_record_per_grid_point_with_exact_keys(setup):
    *_, records = setup
    assert len(records) == 2 * len(GAMMAS) * len(TEMPERATURES)
    points = {(r["draft"], r["gamma"], r["temperature"]) for r in records}
    assert len(points) == len(records)
    for r in records:
        assert set(r) == set(evaluation.RECORD_KEYS)
        assert r["num_prompts"] == 6  # 4 + 2 valid rows.
        assert (r["task"], r["split"], r["max_new_tokens"]) == ("toy", "validation", MAX_NEW)
        assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["target_tokens_per_s"] > 0
        # Batch-1 latency over every valid prompt (latency_prompts None = all).
        assert r["latency_prompts"] == 6 and r["latency_ms"] > 0 and r["target_latency_ms"] > 0
        assert r["latency_speedup"] == pytest.approx(r["target_latency_ms"] / r["latency_ms"])
        json.dumps(r)  # Plain JSON types only.


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_draft_equal_to_target_is_always_accepted(setup, gamma, temperature):
    *_, records = setup
    r = _find(records, "same", gamma, temperature)
    assert r["alpha"] == pytest.approx(1.0, abs=1e-6)
    assert r["tau"] == pytest.approx(gamma + 1)
    assert r["mean_tvd"] == pytest.approx(0.0, abs=1e-5)
    assert r["tau_theory"] == pytest.approx(gamma + 1, abs=1e-3)
    # Every prompt gives gamma + 1 tokens per call: no spread over prompts.
    assert r["tau_ci95"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_perturbed_draft_is_sometimes_rejected(setup, temperature):
    *_, records = setup
    for gamma in GAMMAS:
        r = _find(records, "noisy", gamma, temperature)
        assert 0.0 < r["alpha"] < 1.0
        assert 1.0 <= r["tau"] <= gamma + 1
        assert 0.0 < r["mean_tvd"] < 1.0
        assert r["tau_theory"] == pytest.approx(evaluation.tau_from_tvd(r["mean_tvd"], gamma))
        assert 0.0 < r["tau_ci95"] < gamma and 0.0 < r["alpha_ci95"] < 1.0


def test_bootstrap_ci95_of_a_mean_is_1_96_standard_errors():
    values = np.random.default_rng(1).normal(3.0, 2.0, 400)
    se = np.std(values) / np.sqrt(len(values))
    ci = evaluation.bootstrap_ci95(values, np.ones_like(values))
    assert ci == pytest.approx(1.96 * se, rel=0.1)
    assert evaluation.bootstrap_ci95(np.full(9, 4.0), np.full(9, 2.0)) == 0.0
    assert evaluation.bootstrap_ci95(np.array([5.0]), np.array([1.0])) == 0.0


def test_tau_theory_formula_by_hand():
    # alpha = 1 - 0.25 = 0.75, gamma = 3: 1 + 0.75 + 0.5625 + 0.421875 = 2.734375.
    assert evaluation.tau_from_tvd(0.25, 3) == pytest.approx(2.734375)
    assert evaluation.tau_from_tvd(0.0, 5) == 6.0
    assert evaluation.tau_from_tvd(1.0, 7) == 1.0
    assert evaluation.tau_from_alpha(0.5, 1) == pytest.approx(1.5)


def test_mean_tvd_greedy_is_argmax_disagreement(setup):
    """T = 0: the TVD at a position is 1 if the argmaxes differ, else 0."""
    model, params, prompts, drafts, _ = setup
    noisy = drafts["noisy"][1]
    batch = prompts[0]
    plain = evaluation.plain_call(
        model, params, jax.random.PRNGKey(0), SamplingConfig(), dict(max_new_tokens=4),
        0, batch,
    )  # fmt: skip
    packed, weights = datagen.pack_teacher_forcing(
        model, batch["prompt_tokens"], batch["prompt_lengths"], plain.tokens, plain.lengths
    )
    logits = jax.jit(model.logits)  # One compiled program (not op by op).
    target_argmax = np.argmax(logits(params, packed), -1)
    draft_argmax = np.argmax(logits(noisy, packed), -1)
    expected = np.sum((target_argmax != draft_argmax) * weights) / np.sum(weights)
    got = evaluation.mean_tvd(model, params, model, noisy, [batch], [plain], SamplingConfig())
    assert got == pytest.approx(expected)


def test_pack_teacher_forcing_layouts():
    prompt = np.array([[5, 6, 7], [8, 0, 0]], np.int32)
    completion = np.array([[1, 2], [3, 0]], np.int32)
    decoder_only, encoder_decoder = (SimpleNamespace(encoder_decoder=e) for e in (False, True))
    batch, weights = datagen.pack_teacher_forcing(decoder_only, prompt, [3, 1], completion, [2, 1])
    np.testing.assert_array_equal(batch["decoder_input_tokens"], [[5, 6, 7, 1, 2], [8, 3, 0, 0, 0]])
    # Position t predicts token t + 1: the completion tokens are predicted at p-1 .. p+n-2.
    np.testing.assert_array_equal(weights, [[0, 0, 1, 1, 0], [1, 0, 0, 0, 0]])
    batch, weights = datagen.pack_teacher_forcing(
        encoder_decoder, prompt, [3, 1], completion, [2, 1]
    )
    np.testing.assert_array_equal(batch["encoder_input_tokens"], prompt)
    # T5X's shift-right: the position after a row's end holds its last token (weight 0 there).
    np.testing.assert_array_equal(batch["decoder_input_tokens"], [[0, 1], [0, 3]])
    np.testing.assert_array_equal(weights, [[1, 1], [1, 0]])


@pytest.fixture(scope="module")
def t5():
    model = T5LM(T5Config(vocab_size=VOCAB, embed_dim=32, num_heads=4, head_dim=8, mlp_dim=64))
    return model, model.init(jax.random.PRNGKey(0))


@pytest.mark.parametrize("family", ["decoder_only", "t5"])
def test_packing_aligns_with_greedy_generation(setup, t5, family):
    """Teacher-forced greedy argmaxes at the weighted positions are the generated tokens."""
    model, params = t5 if family == "t5" else setup[:2]
    batch = setup[2][0]
    plain = evaluation.plain_call(
        model, params, jax.random.PRNGKey(0), SamplingConfig(), dict(max_new_tokens=4),
        0, batch,
    )  # fmt: skip
    packed, weights = datagen.pack_teacher_forcing(
        model, batch["prompt_tokens"], batch["prompt_lengths"], plain.tokens, plain.lengths
    )
    argmax = np.asarray(np.argmax(jax.jit(model.logits)(params, packed), -1))
    predicted = [row[w > 0] for row, w in zip(argmax, weights)]
    expected = [tokens[:n] for tokens, n in zip(plain.tokens, plain.lengths)]
    for got, want in zip(predicted, expected):
        np.testing.assert_array_equal(got, want)


def test_t5_records(setup, t5):
    model, params = t5
    drafts = {"same": (model, params), "noisy": (model, perturbed(params, 0.3, seed=4))}
    grid = GridConfig(gammas=(2,), temperatures=(0.0,), max_new_tokens=4)
    records = evaluation.evaluate_drafts(model, params, drafts, setup[2], grid, eos_id=None)
    same, noisy = _find(records, "same", 2, 0.0), _find(records, "noisy", 2, 0.0)
    assert same["alpha"] == pytest.approx(1.0) and same["mean_tvd"] == pytest.approx(0.0)
    assert same["tau_theory"] == pytest.approx(3.0)
    assert 0.0 <= noisy["alpha"] < 1.0 and 0.0 < noisy["mean_tvd"] <= 1.0


def test_records_round_trip(tmp_path, setup):
    *_, all_records = setup
    path = tmp_path / "new" / "dir" / "records.jsonl"
    records.append_records(path, all_records[:2])
    records.append_records(path, all_records[2:])
    assert records.read_jsonl(path) == all_records


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(drafts={}), "drafts is empty"),
        (dict(prompts=[]), "prompts is empty"),
        (dict(gammas=(3, 0)), "gammas"),
        (dict(gammas=()), "gammas"),
        (dict(temperatures=(1.0, -0.5)), "temperatures"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(timing_repeats=0), "timing_repeats"),
        (dict(latency_prompts=-1), "latency_prompts must be an integer >= 0, got -1"),
        (dict(latency_prompts=2.5), "latency_prompts"),
    ],
)
def test_bad_inputs_fail_before_decoding(setup, change, message):
    model, params, prompts, drafts, _ = setup
    kwargs = dict(drafts=drafts, prompts=prompts, max_new_tokens=MAX_NEW)
    kwargs.update(change)
    grid = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("drafts", "prompts")}
    with pytest.raises(ValueError, match=message):
        evaluation.evaluate_drafts(model, params, **kwargs, grid=GridConfig(**grid), eos_id=None)


def test_vocabulary_mismatch_fails_before_decoding(setup):
    model, params, prompts, drafts, _ = setup
    small = DecoderOnlyLM(TransformerConfig(vocab_size=VOCAB - 4, embed_dim=8, num_heads=1,
                                            num_kv_heads=1, head_dim=8, mlp_dim=8))  # fmt: skip
    bad = {**drafts, "small": (small, None)}  # Never initialised: the check comes first.
    with pytest.raises(ValueError, match="small.*vocab"):
        evaluation.evaluate_drafts(model, params, bad, prompts, GRID_2, eos_id=None)


def test_timing_interleaves_and_excludes_warmup():
    calls = []
    plain = lambda i, b: calls.append(("plain", i)) or f"p{i}"
    spec = lambda i, b: calls.append(("spec", i)) or f"s{i}"
    shape = {"prompt_tokens": np.zeros((2, 3))}
    batches = [shape, shape, {"prompt_tokens": np.zeros((2, 5))}]
    plain_out, spec_out, t_plain, t_spec = evaluation._measure(plain, spec, batches, 2)
    pair = lambda i: [("plain", i), ("spec", i)]
    # One warm-up pair per distinct shape, then timing_repeats interleaved pairs per batch.
    assert calls == pair(0) * 3 + pair(1) * 2 + pair(2) * 3
    assert plain_out == ["p0", "p1", "p2"] and spec_out == ["s0", "s1", "s2"]
    assert t_plain >= 0 and t_spec >= 0


def test_one_plain_run_per_batch_serves_every_speculative_configuration():
    calls = []
    fn = lambda name: lambda i, b: calls.append((name, i)) or f"{name}{i}"
    shape = {"prompt_tokens": np.zeros((2, 3))}
    plain_out, spec_out, t_plain, t_spec = evaluation._measure_many(
        fn("p"), {("d", 1): fn("a"), ("d", 3): fn("b")}, [shape, shape], 2
    )
    round_of = lambda i: [("p", i), ("a", i), ("b", i)]
    # One warm-up round for the shape, then timing_repeats rounds per batch: plain once each.
    assert calls == round_of(0) * 3 + round_of(1) * 2
    assert plain_out == ["p0", "p1"]
    assert spec_out == {("d", 1): ["a0", "a1"], ("d", 3): ["b0", "b1"]}
    assert set(t_spec) == {("d", 1), ("d", 3)} and t_plain >= 0


def test_the_grid_measured_together_gives_each_configurations_own_figures(setup, capsys):
    # Measured one temperature's configurations at a time beside one plain decoding, each
    # record's decoding figures equal those of a grid of that configuration alone.
    model, params, prompts, drafts, records = setup
    for name, gamma, temperature in [("noisy", 3, 1.0), ("noisy", 1, 0.0), ("same", 3, 0.0)]:
        grid = GridConfig(gammas=(gamma,), temperatures=(temperature,), max_new_tokens=MAX_NEW,
                          latency_prompts=0)  # fmt: skip
        (alone,) = evaluation.evaluate_drafts(
            model, params, {name: drafts[name]}, prompts, grid, eos_id=None
        )
        together = _find(records, name, gamma, temperature)
        for key in ("alpha", "tau", "mean_tvd", "tau_theory", "alpha_ci95", "num_prompts"):
            assert together[key] == pytest.approx(alone[key], abs=1e-12), key
    # Each temperature's measurement says what it decodes before it starts (one line).
    assert (
        "[evaluate] T=0: decoding 1 configurations (1 drafts x 1 gammas) beside the plain "
        "target on 2 batches, then 0 prompts at batch 1" in capsys.readouterr().err
    )


def test_timed_calls_run_with_the_garbage_collector_off():
    # A collection landing inside one timed call would add its pause to that call alone.
    assert gc.isenabled()
    assert timing.timed(gc.isenabled)[0] is False
    assert gc.isenabled()  # Restored after the call, also when it raises.
    with pytest.raises(ZeroDivisionError):
        timing.timed(lambda: 1 / 0)
    assert gc.isenabled()


def test_latency_prompts_are_the_first_valid_rows_at_batch_1(setup):
    *_, prompts, _, _ = setup
    singles = evaluation.latency_batches(prompts, 3)
    assert len(singles) == 3 and len(evaluation.latency_batches(prompts, None)) == 6
    for single, (batch, row) in zip(singles, [(0, 0), (0, 1), (0, 2)]):
        assert single["prompt_tokens"].shape == (1, 5)
        np.testing.assert_array_equal(
            single["prompt_tokens"][0], prompts[batch]["prompt_tokens"][row]
        )
        assert single["prompt_lengths"][0] == prompts[batch]["prompt_lengths"][row]
    # The padded batch's invalid rows are never timed.
    assert len(evaluation.latency_batches(prompts[1:], None)) == 2
    assert evaluation.latency_batches(prompts, 0) == []


def test_latency_fields_by_hand_with_a_fake_clock(monkeypatch):
    # Plain decoding takes 3 clock units per call, speculative 1; each prompt yields 4 tokens
    # plain and 4 speculative: latency speed-up 3 exactly, ms per token = 1000 * units / 4.
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls = []

    def fake(name, cost):
        def run(index, batch):
            calls.append((name, index))
            clock[0] += cost
            return SimpleNamespace(lengths=np.array([4]))

        return run

    singles = [{"prompt_tokens": np.zeros((1, 5))} for _ in range(2)]
    fields, plain, spec = evaluation.batch1_latency(
        fake("plain", 3.0), fake("spec", 1.0), singles, 3
    )
    assert len(plain) == len(spec) == 2  # One result per prompt, for the outputs' quality.
    assert fields == {
        "latency_speedup": pytest.approx(3.0),
        "latency_ms": pytest.approx(1000.0 * 2 / 8),
        "target_latency_ms": pytest.approx(1000.0 * 6 / 8),
        "latency_prompts": 2,
    }
    # One untimed warm-up for the one compiled shape, then 3 interleaved pairs per prompt.
    assert calls == [("plain", 0), ("spec", 0)] * 4 + [("plain", 1), ("spec", 1)] * 3
    # Several configurations: the plain decoder once per prompt, each ratio to its time.
    calls.clear()
    fields, _, _ = evaluation.batch1_latencies(
        fake("plain", 3.0), {"a": fake("a", 1.0), "b": fake("b", 2.0)}, singles, 1
    )
    assert calls == [("plain", 0), ("a", 0), ("b", 0)] * 2 + [("plain", 1), ("a", 1), ("b", 1)]
    assert fields["a"]["latency_speedup"] == pytest.approx(3.0)
    assert fields["b"]["latency_speedup"] == pytest.approx(1.5)
    assert fields["a"]["target_latency_ms"] == fields["b"]["target_latency_ms"]
    none, _, _ = evaluation.batch1_latency(fake("plain", 3.0), fake("spec", 1.0), [], 3)
    assert none == dict(latency_speedup=None, latency_ms=None, target_latency_ms=None,
                        latency_prompts=0)  # fmt: skip


def test_latency_prompts_limits_the_batch_1_timing(setup):
    model, params, prompts, drafts, _ = setup
    grid = GridConfig(gammas=(2,), temperatures=(0.0,), max_new_tokens=4, latency_prompts=2)
    (record,) = evaluation.evaluate_drafts(
        model, params, {"same": drafts["same"]}, prompts, grid, eos_id=None
    )
    assert record["latency_prompts"] == 2 and record["num_prompts"] == 6
    assert record["latency_speedup"] > 0
    grid = dataclasses.replace(grid, latency_prompts=0)
    (record,) = evaluation.evaluate_drafts(
        model, params, {"same": drafts["same"]}, prompts, grid, eos_id=None
    )
    assert record["latency_prompts"] == 0 and record["latency_speedup"] is None
    assert record["speedup"] > 0  # The throughput speed-up is measured all the same.


def test_all_rows_invalid_is_an_error(setup):
    model, params, prompts, drafts, _ = setup
    empty = dict(prompts[1], valid=np.zeros(4, bool))
    with pytest.raises(ValueError, match="no valid rows"):
        evaluation.evaluate_drafts(model, params, drafts, [empty], GRID_2, eos_id=None)


def test_policy_latency_records(setup):
    from distillspec.decoding.lookahead import Lookahead

    model, params, prompts, drafts, _ = setup
    singles = single_prompts(prompts)
    assert len(singles) == 6 and all(t.shape == (1, 5) for t, _ in singles)  # Valid rows only.
    policies = {
        "static-1": Lookahead("static", 1),
        "static-3": Lookahead("static", 3),
        "heuristic": Lookahead("heuristic", 4, start=2),
        "confidence": Lookahead("confidence", 4, threshold=0.3),
        "oracle": Lookahead("oracle", 8),
    }
    measured, costs = measure_policies(
        model, params, *drafts["noisy"], singles, policies, max_new_tokens=MAX_NEW, eos_id=None
    )
    assert costs is None  # No cost timers, no cost model.
    made = policy_records(measured, draft="noisy", task="toy", split="test", max_new_tokens=MAX_NEW)
    assert [r["policy"] for r in made] == ["target", *policies]
    for r in made:
        assert tuple(r) == POLICY_RECORD_KEYS
        assert r["exact"] and r["num_prompts"] == 6 and r["tokens"] == 6 * MAX_NEW
        assert sum(r["sl_histogram"]) == r["target_calls"]
        assert r["speedup"] == pytest.approx(r["target_latency_ms"] / r["latency_ms"])
        assert r["latency_ms"] > 0
    by_name = {r["policy"]: r for r in made}
    assert by_name["target"]["mean_sl"] == 0 and by_name["target"]["tau"] == 1
    assert by_name["target"]["speedup"] == pytest.approx(1.0)
    assert by_name["static-3"]["mean_sl"] == 3 and by_name["static-3"]["sl_histogram"][3] > 0
    assert by_name["oracle"]["alpha"] == 1.0  # It drafts only what the target keeps.
    assert by_name["oracle"]["target_calls"] <= by_name["static-3"]["target_calls"]
    assert by_name["confidence"]["threshold"] == 0.3 and by_name["static-1"]["threshold"] is None
    with pytest.raises(ValueError, match="'target'"):
        measure_policies(
            model, params, *drafts["noisy"], singles, {"target": Lookahead()},
            max_new_tokens=MAX_NEW, eos_id=None,
        )  # fmt: skip


def test_modeled_latency_by_hand():
    from distillspec.decoding.lookahead import Lookahead

    costs = {
        "target": {1: 1.0, 2: 1.5, 4: 2.5, 6: 3.5},
        "draft": {1: 0.1, 2: 0.2},
        "round": 0.3,
        "per_draft": {"static": 0.01, "disco-5": 0.02},
        "spec_round": {"static": 0.5, "disco-5": 0.7},
        "switch": {"static": 0.0, "disco-5": 0.3},
        "fixed": {"plain": 2.0, "static": 3.0, "disco-5": 4.0},
    }
    # Plain decoding: 10 rounds of one target step and its own work, and the run's fixed part.
    assert timing.modeled_latency_ms(None, [10], 0, 10, costs) == pytest.approx(1.5)
    # Static SL-5: every round verifies 6 positions; 2 rounds, 10 draft calls, 8 tokens.
    static = timing.modeled_latency_ms(Lookahead("static", 5), [0] * 5 + [2], 10, 8, costs)
    assert static == pytest.approx((3.0 + 2 * (3.5 + 0.5) + 2 * 0.2 + 8 * 0.1 + 10 * 0.01) / 8)
    # A static program timed whole prices its rounds at its timed round; others as above.
    timed = {**costs, "static_round": {5: 7.0, 2: 1.0}}
    static = timing.modeled_latency_ms(Lookahead("static", 5), [0] * 5 + [2], 10, 8, timed)
    assert static == pytest.approx((3.0 + 2 * 7.0) / 8)
    assert timing.modeled_latency_ms(Lookahead("static", 5), [0] * 5 + [2], 10, 8, costs) == (
        timing.modeled_latency_ms(Lookahead("static", 5), [0] * 5 + [2], 10, 8,
                                  {**costs, "static_round": {2: 1.0}})
    )  # fmt: skip
    # DISCO rounds of 0, 1 and 3 drafts use widths 1, 2 and 4 (verify_widths of SL_max 5), and
    # its own program's per-round, per-draft and per-switch work and fixed part; two runs pay
    # the fixed part twice.
    hist = [1, 1, 0, 1, 0, 0]
    disco = timing.modeled_latency_ms(Lookahead("disco", 5), hist, 6, 7, costs, 2, switches=2)
    assert disco == pytest.approx(
        (2 * 4.0 + 1.0 + 1.5 + 2.5 + 3 * 0.7 + 3 * 0.2 + 3 * 0.1 + 6 * 0.02 + 2 * 0.3) / 7
    )
    # A program the costs did not measure is an error that names it, not a silent guess.
    with pytest.raises(ValueError, match="'oracle-8' loop .* pass its policy"):
        timing.modeled_latency_ms(Lookahead("oracle", 8), [1], 1, 1, costs)


def test_evaluate_run_rejects_a_bad_dtype_before_loading(tmp_path):
    from distillspec.runs.evaluate import evaluate

    with pytest.raises(
        ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\), got 'f16'"
    ):
        evaluate(str(tmp_path), str(tmp_path / "missing"), {"d": str(tmp_path / "missing")},
                 dtype="f16")  # fmt: skip


def test_call_cost_timers_decode_over_the_vocabulary_differently_padded_models_share():
    from distillspec.decoding.lookahead import Lookahead

    target, params = tiny_lm(32)
    draft, draft_params = tiny_lm(36)  # The same tokenizer, an embedding padded further.
    prompt = (np.ones((1, 4), np.int32), np.array([4], np.int32))
    policies = [Lookahead("confidence", 2), Lookahead("heuristic", 2, start=2)]
    call = lambda **kw: timing.call_cost_timers(
        target, params, draft, draft_params, prompt, policies, max_new_tokens=6, **kw
    )
    with pytest.raises(ValueError, match="vocab_size=<the tokenizer's size>"):
        call()
    timers, calls, gamma = call(vocab_size=32)
    # One compiled program per dynamic policy, timed held, in rounds of 2, and of 1 and 2.
    assert gamma == 2 and {"confidence-2", "confidence-2/2", "confidence-2/1,2"} <= set(calls)
    assert [calls[k]["switches"] for k in ("confidence-2/2", "confidence-2/1,2")] == [0, 1]
    # Each dynamic program's base rounds are forced to one draft, not left to its rule: the
    # heuristic's own rounds would draft and switch as its 1,2 rounds do (a singular fit).
    for kind in ("confidence", "heuristic"):
        rows = [[calls[k]["draft_calls"], calls[k]["switches"]]
                for k in (f"{kind}-2", f"{kind}-2/2", f"{kind}-2/1,2")]  # fmt: skip
        assert rows[0] == [1, 0] and np.linalg.matrix_rank(np.c_[np.ones(3), rows]) == 3
    assert np.isfinite(np.hstack([t() for t in timers.values()])).all()  # Every timer runs.


def test_call_costs_price_the_draft_in_the_loops_context_and_every_policys_own_loop():
    from distillspec.decoding.lookahead import Lookahead

    target, params = tiny_lm(32)
    draft_params = perturbed(params, 0.05, seed=1)
    prompt = (np.ones((1, 4), np.int32), np.array([4], np.int32))
    policies = [Lookahead("static", 3), Lookahead("confidence", 4), Lookahead("oracle", 4)]
    # Per-call costs are differences of a long and a short loop of calls; 48 new tokens give
    # each width >= 9 calls, so that a second process on the 2 cores (pytest -n 2) cannot
    # bring a tiny model's difference to <= 0 (it did with 8: one or two calls per width).
    costs = timing.measure_call_costs(
        target, params, target, draft_params, prompt, policies, max_new_tokens=48, repeats=3
    )
    assert sorted(costs["target"]) == [1, 2, 3, 4, 5]  # Every verify width (and 1, 2).
    assert all(v > 0 for v in costs["target"].values())
    assert costs["draft"][1] >= 0 and costs["draft"][2] >= 0  # In context: later, first.
    assert sorted(costs["draft_isolated"]) == [1, 2]
    assert all(v > 0 for v in costs["draft_isolated"].values())
    assert costs["round"] >= 0
    programs = ["static", "confidence-4", "oracle-4"]
    assert sorted(costs["spec_round"]) == sorted(costs["per_draft"]) == sorted(programs)
    # Calibrations that may be < 0, but a round and a draft call each cost >= 0.
    assert all(costs["spec_round"][p] >= -min(costs["target"].values()) for p in programs)
    assert all(costs["per_draft"][p] >= -min(costs["draft"].values()) for p in programs)
    # A run's prefill and dispatch: a difference of timings of a tiny pair, which noise can
    # bring to the floor of 0 for one program, but not for all.
    fixed = [costs["fixed"][p] for p in ["plain", *programs]]
    assert min(fixed) >= 0 and sum(fixed) > 0
    # The static-3 program is timed whole (with static-1 and -gamma); a run of it is priced
    # at its rounds as timed; without that timing, from its calls and the loop's own work.
    assert sorted(costs["static_round"]) == [1, 3, 4]
    assert all(v > 0 for v in costs["static_round"].values())
    modeled = timing.modeled_latency_ms(policies[0], [0, 0, 0, 2], 6, 8, costs)
    assert modeled == pytest.approx((costs["fixed"]["static"] + 2 * costs["static_round"][3]) / 8)
    costs = {**costs, "static_round": {}}
    modeled = timing.modeled_latency_ms(policies[0], [0, 0, 0, 2], 6, 8, costs)
    expected = (
        costs["fixed"]["static"]
        + 2 * (costs["target"][4] + costs["spec_round"]["static"])
        + 2 * costs["draft"][2]
        + 4 * costs["draft"][1]
        + 6 * costs["per_draft"]["static"]
    ) / 8
    assert modeled == pytest.approx(expected)  # fmt: skip


# The rounds of the static programs (1 and gamma = 4 drafts) and of a DISCO program with
# SL_max 8: one draft verifying 2 positions, 4 drafts verifying 5, 1 and 4 in turn.
_BY_HAND_CALLS = {
    "plain": {}, "static-1": {}, "static-4": {},
    "disco-8": {"draft_calls": 1.0, "verify": {2: 1.0}, "switches": 0.0},
    "disco-8/4": {"draft_calls": 4.0, "verify": {5: 1.0}, "switches": 0.0},
    "disco-8/1,4": {"draft_calls": 2.5, "verify": {2: 0.5, 5: 0.5}, "switches": 1.0},
}  # fmt: skip


def test_call_costs_from_interleaved_seconds_by_hand():
    # Per repeat (s); the second repeat is a slower stretch of the machine, everything x 2.
    def slow(value):
        return [value, 2 * value, value]

    gamma = 4
    seconds = {
        ("target", 1): slow(1.0), ("target", 2): slow(1.5), ("target", 5): slow(3.0),
        ("draft", 1): slow(0.05), ("draft", 2): slow(0.06),
        ("round", 1): slow(1.5 + 0.2), ("round", 4): slow(3.0 + 4 * 0.2),
        # Decoder rounds (s, fixed s): a plain step does 0.5 s of its own work, a static round
        # 0.3 s plus 0.1 s per draft; a dynamic round 0.65 s plus 0.25 s per draft plus 0.4 s
        # per width switch: 0.9 s with 1 draft verifying 2 positions, 1.65 s with 4 drafts
        # verifying 5, 1.675 s with 1 and 4 in turn (2.5 drafts, a switch every round).
        ("decoder", "plain"): [(1.5, 7.0), (3.0, 14.0), (1.5, 7.0)],
        ("decoder", "static-1"): [(2.1, 8.0), (4.2, 16.0), (2.1, 8.0)],
        ("decoder", "static-4"): [(4.5, 8.5), (9.0, 17.0), (4.5, 8.5)],
        ("decoder", "disco-8"): [(2.6, 9.0), (5.2, 18.0), (2.6, 9.0)],
        ("decoder", "disco-8/4"): [(5.45, 9.5), (10.9, 19.0), (5.45, 9.5)],
        ("decoder", "disco-8/1,4"): [(4.425, 9.2), (8.85, 18.4), (4.425, 9.2)],
    }  # fmt: skip
    calls = _BY_HAND_CALLS
    costs = timing.call_costs(seconds, calls, gamma)
    assert costs["target"] == pytest.approx({1: 1e3, 2: 1.5e3, 5: 3e3})
    assert costs["draft"][1] == costs["draft"][2] == pytest.approx(200.0)  # In context.
    assert costs["draft_isolated"] == pytest.approx({1: 50.0, 2: 60.0})
    assert costs["round"] == pytest.approx(500.0)
    assert costs["per_draft"] == pytest.approx({"static": 100.0, "disco-8": 250.0})
    assert costs["spec_round"] == pytest.approx({"static": 300.0, "disco-8": 650.0})
    assert costs["switch"] == pytest.approx({"static": 0.0, "disco-8": 400.0})
    assert costs["fixed"] == pytest.approx({"plain": 7e3, "static": 8.5e3, "disco-8": 9e3})
    assert costs["static_round"] == pytest.approx({1: 2.1e3, 4: 4.5e3})  # Timed whole.
    # Means instead (for totals over prompts): the slow repeat counts, a third of the time.
    means = timing.call_costs(seconds, calls, gamma, statistics.mean)
    assert means["target"][1] == pytest.approx(4e3 / 3)
    assert means["per_draft"] == pytest.approx({"static": 400 / 3, "disco-8": 1e3 / 3})
    # Without its rounds of 4 drafts, a dynamic program's work per draft is the static loop's.
    held = timing.call_costs(seconds, {k: v for k, v in calls.items() if "/" not in k}, gamma)
    assert held["per_draft"] == pytest.approx({"static": 100.0, "disco-8": 100.0})
    assert held["spec_round"] == pytest.approx({"static": 300.0, "disco-8": 800.0})
    assert held["switch"] == pytest.approx({"static": 0.0, "disco-8": 0.0})
    # A round timed faster than its verify call alone (noise) prices the draft at 0, not < 0.
    noisy = timing.call_costs({**seconds, ("round", 4): [2.9] * 3}, calls, gamma)
    assert noisy["draft"][1] == 0.0
    # A static round timed <= 0 (noise) is dropped: that program is priced from its calls.
    noisy = timing.call_costs({**seconds, ("decoder", "static-4"): [(-0.1, 8.5)] * 3}, calls,
                              gamma)  # fmt: skip
    assert noisy["static_round"] == pytest.approx({1: 2.1e3})


def test_dynamic_rounds_are_priced_at_their_timed_cost_when_their_calls_priced_apart_cost_more():
    from distillspec.decoding.lookahead import Lookahead

    gamma = 4
    seconds = {
        ("target", 1): [1.0], ("target", 2): [1.5], ("target", 5): [3.0],
        ("draft", 1): [0.05], ("draft", 2): [0.06], ("round", 1): [1.7], ("round", 4): [3.8],
        ("decoder", "plain"): [(1.5, 7.0)], ("decoder", "static-1"): [(2.1, 8.0)],
        ("decoder", "static-4"): [(4.5, 8.5)],
        # Each round 0.2 s cheaper than its calls priced apart (target, then 0.2 s per draft).
        ("decoder", "disco-8"): [(1.5, 9.0)], ("decoder", "disco-8/4"): [(3.6, 9.5)],
        ("decoder", "disco-8/1,4"): [(2.55, 9.2)],
    }  # fmt: skip
    calls = _BY_HAND_CALLS
    costs = timing.call_costs(seconds, calls, gamma)
    assert costs["spec_round"]["disco-8"] == pytest.approx(-200.0)  # A calibration, not 0.
    assert costs["per_draft"]["disco-8"] == pytest.approx(0.0, abs=1e-9)
    assert costs["switch"]["disco-8"] == pytest.approx(0.0, abs=1e-9)
    # A run of a round of 1 draft, then one of 4 (a switch): 9 s fixed + the two timed rounds.
    policy = Lookahead("disco", 8)
    modeled = timing.modeled_latency_ms(policy, [0, 1, 0, 0, 1], 5, 7, costs, switches=1)
    assert modeled == pytest.approx((9e3 + 1.5e3 + 3.6e3) / 7)
    # Rounds timed absurdly cheap (noise) are floored: a draft call and a round cost >= 0.
    cheap = {**seconds, **{("decoder", k): [(0.1, 9.0)] for k in calls if "disco" in k}}
    costs = timing.call_costs(cheap, calls, gamma)
    assert costs["per_draft"]["disco-8"] == pytest.approx(-200.0)  # -(a draft call).
    assert costs["spec_round"]["disco-8"] == pytest.approx(-1e3)  # -(the cheapest target call).
    assert costs["switch"]["disco-8"] >= 0.0
    assert timing.modeled_latency_ms(policy, [0, 1, 0, 0, 1], 5, 7, costs, switches=1) > 0


def test_progress_line_reads_batch1_latency_first_and_names_the_throughput_batch(capsys):
    from distillspec.evaluation.drafts import _report_progress

    record = dict(draft="d", gamma=5, temperature=0.0, alpha=0.4, tau=3.0, tau_theory=3.1,
                  speedup=0.57, latency_speedup=1.52)  # fmt: skip
    _report_progress(record, 1, 12, batch=16)
    line = capsys.readouterr().err
    assert "batch-1 latency 1.52x, throughput at batch 16 0.57x" in line
    _report_progress(dict(record, latency_speedup=None), 2, 12, batch=16)
    assert "batch-1 latency not measured" in capsys.readouterr().err


def test_disturbed_timings_are_named_not_passed_silently():
    """A verify call timed cheaper than one position, or a plain target whose batch-1 latency
    jumps between temperatures (a slow stretch of the machine, seen on a 2-core VM: 1.19 against
    0.36 ms per token), each give a warning naming the values; consistent timings none."""

    def record(temperature, target_ms, gamma=3, r_gamma=1.4):
        return {"draft": "standard", "gamma": gamma, "temperature": temperature,
                "target_latency_ms": target_ms, "r_gamma": r_gamma}  # fmt: skip

    steady = [record(0.0, 0.33), record(1.0, 0.36), record(0.0, 0.33, 5, 2.0)]
    assert records.timing_warnings(steady) == []
    disturbed = [record(0.0, 0.33, 3, 0.62), record(1.0, 0.36, 3, 0.62), record(0.0, 0.33, 5)]
    (cost,) = records.timing_warnings(disturbed)
    assert "'standard'" in cost and "0.62 at gamma 3" in cost and "gamma 5" not in cost
    (plain,) = records.timing_warnings([record(0.0, 1.19), record(1.0, 0.36)])
    assert "1.190 ms at T=0" in plain and "0.360 ms at T=1" in plain and "speed-ups" in plain
    # Unmeasured latencies (no batch-1 prompts) and costs are not compared.
    assert records.timing_warnings([record(0.0, None, r_gamma=None)]) == []
