"""The speculative benchmark's measurement on a tiny pair (the reference pair is too big for
tests), its cost model from fake interleaved timings, and its --dtype option; the train-step
benchmark's record on the tiny distillation pair."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec.benchmarks import speculative as bench
from distillspec.benchmarks import train_step as step_bench
from distillspec.decoding import DecodeResult
from distillspec.evaluation import timing
from tests.test_utils import perturbed, tiny_lm

NEW_KEYS = (
    "c", "c_isolated", "r_gamma", "target_ms", "verify_ms", "draft_ms", "draft_ms_isolated",
    "loop_ms", "spec_loop_ms", "plain_fixed_ms", "spec_fixed_ms",
    "speedup_ideal", "efficiency", "speedup_ideal_isolated", "efficiency_isolated",
    "plain_latency_ms", "speculative_latency_ms", "plain_modeled_latency_ms",
    "speculative_modeled_latency_ms", "plain_modeled_over_measured",
    "speculative_modeled_over_measured",
)  # fmt: skip


def _tiny_pair(dtype: str):
    """A tiny target and its perturbed copy as draft, decoding in dtype."""
    model, params = tiny_lm(32)
    return bench.in_dtype((model, params, model, perturbed(params, 0.05, seed=1), "tiny"), dtype)


def test_measure_in_bfloat16_reports_its_dtype_and_stays_exact():
    pair = _tiny_pair("bfloat16")
    prompts = bench.random_prompts(32, 1, 4)
    record = bench.measure(pair, gamma=2, batch=1, max_new_tokens=8, prompts=prompts, repeats=1)
    assert record["dtype"] == "bfloat16"
    assert pair[0].config.kv_cache_dtype == jnp.float32  # 'auto' on the CPU.
    assert record["exact_greedy"] and record["speedup"] > 0
    assert record["efficiency_interval"] == [None, None]  # One repeat: no interval.


def test_measure_reports_the_in_context_cost_model():
    pair = _tiny_pair("float32")
    prompts = bench.random_prompts(32, 2, 4)
    # (32 new tokens: >= 10 calls per timer, so that the per-call differences of this tiny
    # pair stay clear of noise under a second test process.)
    record = bench.measure(pair, gamma=2, batch=2, max_new_tokens=32, prompts=prompts, repeats=3)
    assert record["dtype"] == "float32" and record["exact_greedy"] and record["speedup"] > 0
    assert record["untimed"] == []
    missing = [key for key in NEW_KEYS if key not in record]
    assert not missing, missing
    assert all(math.isfinite(record[key]) for key in NEW_KEYS)
    for key in ("efficiency", "speedup_ideal", "plain_modeled_over_measured",
                "speculative_modeled_over_measured", "target_ms", "verify_ms"):  # fmt: skip
        assert record[key] > 0, (key, record[key])
    assert record["c"] >= 0 and record["loop_ms"] >= 0
    assert record["efficiency"] == pytest.approx(
        record["speedup"] / record["speedup_ideal"], rel=1e-2
    )
    assert record["spec_loop_ms"] >= 0
    assert record["plain_fixed_ms"] > 0 and record["spec_fixed_ms"] > 0  # Prefill at least.
    for key in bench.INTERVALS:  # Bootstrap intervals over the 3 repeats.
        # (Not > 0: a resample of one repeat timed under the other worker's load can give this
        # tiny pair a per-call difference below 0, as the interval then says.)
        low, high = record[f"{key}_interval"]
        assert math.isfinite(low) and math.isfinite(high) and low <= high, (key, low, high)


def test_until_timed_measures_again_while_a_cost_is_untimed():
    results = iter([{"ms": -0.1}, {"ms": 0.0}, {"ms": 2.0}, {"ms": 3.0}])
    untimed = lambda r: ["ms"] if r["ms"] <= 0 else []
    assert timing.until_timed(lambda: next(results), untimed) == ({"ms": 2.0}, [])
    results = iter([{"ms": -1.0}] * 3 + [{"ms": 1.0}])
    assert timing.until_timed(lambda: next(results), untimed) == ({"ms": -1.0}, ["ms"])
    assert next(results) == {"ms": 1.0}  # Three attempts in all, then it stops.


def test_repeats_interval_resamples_whole_repeats():
    # Per repeat: a slow stretch slows both timings alike, so their ratio stays 2 while each
    # timing alone spreads 4-fold.
    slow = [1.0, 4.0, 1.5, 2.0, 3.0, 1.2, 2.5]
    a, b = [2.0 * x for x in slow], slow
    ratio = lambda i: [
        float(np.median([a[k] / b[k] for k in i])),
        float(np.median([a[k] for k in i])),
    ]
    (low_ratio, high_ratio), (low_a, high_a) = timing.repeats_interval(ratio, len(slow)).T
    assert low_ratio == high_ratio == 2.0  # Paired: the stretches cancel in every resample.
    assert low_a < np.median(a) < high_a and min(a) <= low_a and high_a <= max(a)
    again = timing.repeats_interval(ratio, len(slow))  # The same timings, the same interval.
    np.testing.assert_array_equal(again, timing.repeats_interval(ratio, len(slow)))


def test_in_context_costs_are_the_records_view_of_the_call_costs():
    gamma = 2
    # Per repeat (s): the second repeat is a slower stretch of the machine, everything x 2.
    seconds = {
        ("target", 1): [1.0, 2.0, 1.0],
        ("target", 3): [2.0, 4.0, 2.0],
        ("round", 2): [2.4, 4.8, 2.4],  # 2 draft steps of 0.2 s after the verify call's 2 s.
        ("draft", 1): [0.05, 0.1, 0.05],  # Alone, cache-hot: 4x cheaper than in the round.
    }
    costs = {"target": {1: 1e3, 3: 2e3}, "draft": {1: 200.0, 2: 200.0},
             "draft_isolated": {1: 50.0, 2: 60.0}, "round": 500.0, "per_draft": {"static": 100.0},
             "spec_round": {"static": 300.0}, "fixed": {"plain": 7e3, "static": 8e3}}  # fmt: skip
    record = bench.in_context_costs(seconds, costs, gamma, gamma)
    assert record["c"] == pytest.approx(0.2)
    assert record["c_isolated"] == pytest.approx(0.05)
    assert record["r_gamma"] == pytest.approx(2.0)
    assert (record["target_ms"], record["verify_ms"]) == (1e3, 2e3)
    assert (record["draft_ms"], record["draft_ms_isolated"]) == (200.0, 50.0)
    assert record["loop_ms"] == 500.0
    assert record["spec_loop_ms"] == pytest.approx(300.0 + gamma * 100.0)
    assert (record["plain_fixed_ms"], record["spec_fixed_ms"]) == (7e3, 8e3)


def _result(target_calls, draft_calls, lengths) -> DecodeResult:
    rows = len(lengths)
    zeros = np.zeros(rows, np.int32)
    return DecodeResult(
        tokens=np.zeros((rows, max(lengths)), np.int32), lengths=np.array(lengths),
        drafted=zeros, accepted=zeros, target_calls=np.array(target_calls),
        draft_calls=np.array(draft_calls), width_switches=zeros,
        sl_histogram=np.zeros((rows, 1), np.int32),
    )  # fmt: skip


def test_modeled_latency_prices_the_busiest_row_of_a_lockstep_batch():
    costs = {"target": {1: 1.0, 5: 2.0}, "draft": {1: 0.2, 2: 0.2}, "round": 0.5,
             "per_draft": {"static": 0.05}, "spec_round": {"static": 0.5},
             "fixed": {"plain": 3.0, "static": 4.0}}  # fmt: skip
    # Rows in lockstep: the batch runs 5 rounds (the busiest row's), each of one verify call,
    # 4 draft calls and the speculative loop's own work, plus the run's fixed part, for 2 x 16
    # tokens.
    spec = _result([3, 5], [12, 20], [16, 16])
    want = (4.0 + 5 * 2.5 + 20 * (0.2 + 0.05)) / 32
    assert bench.modeled_ms_per_token(spec, 4, costs) == pytest.approx(want)
    plain = _result([8, 8], [0, 0], [8, 8])
    assert bench.modeled_ms_per_token(plain, 0, costs) == pytest.approx((3.0 + 8 * 1.5) / 16)


def test_bad_dtype_names_the_value_and_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dtype", "float32", "fp16"])
    err = capsys.readouterr().err
    assert "--dtype" in err and "'fp16'" in err and "('float32', 'bfloat16')" in err
    with pytest.raises(SystemExit):
        bench.main(["--dtype", "bfloat16", "--cache_dtype", "int8"])
    err = capsys.readouterr().err
    assert "--cache_dtype" in err and "'int8'" in err and "'auto'" in err


TRAIN_STEP_TIMES = (
    "teacher_forward_ms", "student_fwd_bwd_ms", "packing_ms", "sampling_ms", "batch_fixed_ms",
    "kd_step_fixed_ms", "kd_step_onpolicy_ms", "pretrain_step_ms",
)  # fmt: skip
IDEAL_PARTS = (
    "teacher_forward", "sampling", "student_fwd_bwd", "kd_step_onpolicy", "pretrain_step",
)  # fmt: skip


def test_matmul_flops_match_a_hand_count():
    from distillspec.benchmarks import flops

    # The tiny student: E = 16, one layer, H = Hkv = 2 heads of D = 8, gated MLP of 32, V = 260.
    # Per position and layer: q, k, v, o 4 x 2*16*16 = 2048; MLP 3 x 2*16*32 = 3072; attention
    # over 5 keys 2 x 2*2*8*5 = 320. The head 2*16*260 = 8320. 2 rows x 3 positions:
    assert flops.forward_flops(step_bench.TINY_STUDENT, 2, 3, 5) == 6 * (2048 + 3072 + 320 + 8320)
    # The head on 1 of each row's 3 positions (a distillation step's loss positions):
    assert flops.forward_flops(step_bench.TINY_STUDENT, 2, 3, 5, 1) == (
        6 * (2048 + 3072 + 320) + 2 * 8320
    )
    # The tiny teacher: E = 32, two layers, H = 4 query and Hkv = 2 key/value heads of D = 8 (GQA),
    # gated MLP of 64: q 2*32*32 = 2048, k and v 2*32*16 = 1024 each, o 2048; MLP 3 x 2*32*64 =
    # 12288; attention 2 x 2*4*8*5 = 640; head 2*32*260 = 16640.
    per_layer = 2048 + 1024 + 1024 + 2048 + 12288 + 640
    assert flops.forward_flops(step_bench.TINY_TEACHER, 2, 3, 5) == 6 * (2 * per_layer + 16640)
    # Sampling N = 3 after P = 4: a cache of S = 8 slots; the prefill's 4 positions see S + 4
    # keys, each of the 3 steps S + 1.
    prefill, steps = (2 * 4 * (2048 + 3072 + 2 * 2 * 2 * 8 * 12 + 8320),
                      2 * 3 * (2048 + 3072 + 2 * 2 * 2 * 8 * 9 + 8320))  # fmt: skip
    assert flops.sampling_flops(step_bench.TINY_STUDENT, 2, 4, 3) == prefill + steps
    parts = flops.part_flops(step_bench.TINY_TEACHER, step_bench.TINY_STUDENT, 2, 4, 3, 5, 6)
    assert parts["teacher_forward"] == flops.forward_flops(step_bench.TINY_TEACHER, 2, 7, 7, 3)
    assert parts["student_fwd_bwd"] == 3 * flops.forward_flops(step_bench.TINY_STUDENT, 2, 7, 7, 3)
    assert parts["pretrain_step"] == 3 * flops.forward_flops(step_bench.TINY_TEACHER, 5, 6, 6)
    assert parts["kd_step_onpolicy"] == (
        parts["teacher_forward"] + parts["sampling"] + parts["student_fwd_bwd"]
    )
    # 2 GFLOP at 100 GFLOP/s: 20 ms ideal; measured in 40 ms: utilisation 0.5.
    record = flops.utilisation({"x": 2 * 10**9, "t5": None}, {"x_ms": 40.0, "t5_ms": 1.0}, 100.0)
    assert record == {"x_gflop": 2.0, "x_ideal_ms": 20.0, "x_utilisation": 0.5,
                      "t5_gflop": None, "t5_ideal_ms": None, "t5_utilisation": None}  # fmt: skip
    from distillspec.models import T5Config

    assert flops.forward_flops(T5Config(), 1, 1, 1) is None  # No formula: None, not a guess.


def test_compiled_products_count_every_product_the_program_runs():
    from distillspec import trainer
    from distillspec.benchmarks import flops
    from distillspec.models import DecoderOnlyLM

    # One batched product, [3, 4, 5] x [3, 5, 6] over batch dimension 0: 2 x 3 x 4 x 5 x 6.
    dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))))
    hlo = dot.lower(jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6))).compile().as_text()
    [product] = flops.compiled_products(hlo)
    assert (product.lhs, product.rhs, product.count) == ((3, 4, 5), (3, 5, 6), 1)
    assert product.dimension_numbers == (((2,), (1,)), ((0,), (0,))) and product.flops == 720
    # A loop's body runs its products an unknown number of times: no count rather than a wrong
    # one (a scanned layer stack).
    looped = jax.jit(lambda a: jax.lax.fori_loop(0, 3, lambda i, x: x @ a, a))
    with pytest.raises(ValueError, match="loop"):
        flops.compiled_products(looped.lower(jnp.ones((4, 4))).compile().as_text())
    # The same with the product in a branch that the loop's body calls.
    branch = lambda i, x, a: jax.lax.cond(i > 0, lambda x: x @ a, lambda x: x, x)
    branched = jax.jit(lambda a: jax.lax.fori_loop(0, 3, lambda i, x: branch(i, x, a), a))
    with pytest.raises(ValueError, match="loop"):
        flops.compiled_products(branched.lower(jnp.ones((4, 4))).compile().as_text())
    # The tiny teacher's compiled pretraining step (unrolled: a straight-line program): its
    # products are the formula's, forward (per layer q, k, v, o, the two attention products and
    # the three of the gated MLP; then the head) and backward (two per forward product).
    teacher = DecoderOnlyLM(step_bench.TINY_TEACHER)
    optimizer = trainer.make_optimizer(trainer.OptimizerConfig(name="adamw"), 10)
    step = trainer.compile_train_step(teacher, None, trainer.LossConfig("ce"), optimizer)
    state = trainer.init_state(teacher.init(jax.random.PRNGKey(1)), optimizer)
    tokens = jnp.ones((5, 6), jnp.int32)
    batch = {"decoder_input_tokens": tokens, "targets": tokens, "weights": jnp.ones((5, 6))}
    products = flops.compiled_products(step.lower(state, None, batch).compile().as_text())
    assert sum(p.count for p in products) == 3 * (2 * 9 + 1)
    parts = flops.part_flops(step_bench.TINY_TEACHER, step_bench.TINY_STUDENT, 2, 4, 3, 5, 6)
    assert sum(p.flops * p.count for p in products) == parts["pretrain_step"]


def test_train_step_benchmark_reports_every_part_of_the_step(tmp_path):
    out = tmp_path / "benchmarks" / "train_step.json"  # Its folder made by the benchmark.
    flags = ["--tiny", "--repeats", "3", "--batch_size", "4", "--prompt_length", "16",
             "--completion_length", "8", "--max_examples", "16", "--json", str(out),
             "--teacher_top_k", "5", "--pretrain_batch_size", "4",
             "--pretrain_length", "16"]  # fmt: skip
    record = step_bench.main(flags)
    assert json.loads(out.read_text()) == record
    ratios = ("kd_step_fixed_over_sum", "kd_step_onpolicy_over_sum")
    ideal = tuple(
        f"{part}_{what}" for part in IDEAL_PARTS for what in ("gflop", "ideal_ms", "utilisation")
    )
    keys = TRAIN_STEP_TIMES + ratios + ideal + ("matmul_gflops", "matmul_ms")
    missing = [key for key in keys if key not in record]
    assert not missing, missing
    for key in keys:
        assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
    for part in IDEAL_PARTS:  # The figures are their definitions (no speed threshold).
        ideal_ms = 1e3 * record[f"{part}_gflop"] / record["matmul_gflops"]
        assert record[f"{part}_ideal_ms"] == pytest.approx(ideal_ms, rel=1e-2, abs=1e-3)
        assert record[f"{part}_utilisation"] == pytest.approx(
            record[f"{part}_ideal_ms"] / record[f"{part}_ms"], rel=1e-2, abs=1e-3
        )
    assert (record["pretrain_batch_size"], record["pretrain_length"]) == (4, 16)
    # The pretraining step's products timed alone: all of its FLOPs, each product's figures.
    products = record["pretrain_step_products"]
    assert record["pretrain_step_products_gflop"] == pytest.approx(record["pretrain_step_gflop"])
    assert record["pretrain_step_products_count"] == sum(p["count"] for p in products) == 57
    assert record["pretrain_step_products_ms"] == pytest.approx(
        sum(p["count"] * p["ms"] for p in products), rel=1e-3, abs=5e-3
    )
    assert record["pretrain_step_products_share"] == pytest.approx(
        record["pretrain_step_products_ms"] / record["pretrain_step_ms"], rel=1e-2, abs=1e-3
    )
    assert record["pretrain_step_products_utilisation"] == pytest.approx(
        record["pretrain_step_ideal_ms"] / record["pretrain_step_products_ms"], rel=1e-2, abs=1e-3
    )
    assert record["empty_call_ms"] > 0 and all(p["ms"] > 0 for p in products)
    # No speed threshold (timed assertions are not allowed); the ratio is its definition.
    parts = record["teacher_forward_ms"] + record["student_fwd_bwd_ms"]
    assert record["kd_step_fixed_over_sum"] == pytest.approx(
        record["kd_step_fixed_ms"] / parts, rel=1e-2
    )
    assert (record["batch_size"], record["prompt_length"], record["repeats"]) == (4, 16, 3)
    assert 0 < record["sampled_tokens_per_row"] <= 8
    assert record["teacher_top_k"] == 5 and record["kd_step_fixed_cached_ms"] > 0
    assert record["teacher_cache_saving"] == pytest.approx(
        record["kd_step_fixed_ms"] / record["kd_step_fixed_cached_ms"], rel=1e-2
    )


def _versus_trl() -> dict:
    import runpy

    return runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "versus_trl.py"))


def test_trl_comparison_runs_both_trainers_on_the_same_exported_pair(tmp_path):
    out = tmp_path / "versus_trl.json"
    flags = ["--tiny", "--repeats", "2", "--batch_size", "4", "--prompt_length", "16",
             "--completion_length", "8", "--max_examples", "16", "--json", str(out)]  # fmt: skip
    record = _versus_trl()["main"](flags)
    assert json.loads(out.read_text()) == record
    times = ("trl_step_ms", "distillspec_step_ms", "trl_generate_ms", "distillspec_sampling_ms")
    for key in times:
        assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
    # The ratios are their definitions, inside their intervals (no speed threshold).
    assert record["speedup"] == pytest.approx(
        record["trl_step_ms"] / record["distillspec_step_ms"], rel=1e-2
    )
    for key in ("speedup", "sampling_speedup"):
        low, high = record[f"{key}_interval"]
        assert low <= record[key] <= high
    # transformers computes the same logits from the exported models as we do.
    assert record["teacher_logits_max_abs_diff"] < 1e-4
    assert record["student_logits_max_abs_diff"] < 1e-4
    assert record["trl_version"] == "1.16.0" and record["batch_size"] == 4


def test_trl_comparison_stops_when_the_exported_models_differ(tmp_path):
    from distillspec import trainer

    versus_trl = _versus_trl()

    teacher = step_bench.DecoderOnlyLM(step_bench.TINY_TEACHER)
    student = step_bench.DecoderOnlyLM(step_bench.TINY_STUDENT)
    teacher_params = teacher.init(jax.random.PRNGKey(1))
    params = student.init(jax.random.PRNGKey(0))
    models = trainer.Models(student, teacher, teacher_params)
    from distillspec.vocabularies import load_tokenizer

    teacher_hf, student_hf, _ = versus_trl["_hf_pair"](
        models, params, load_tokenizer("byte"), str(tmp_path)
    )
    local = {"prompt_tokens": np.full((2, 5), 7, np.int32), "prompt_lengths": np.array([5, 3])}
    assert versus_trl["_check_logits"](models, params, teacher_hf, student_hf, local)
    with pytest.raises(SystemExit, match="student's logits differ"):
        versus_trl["_check_logits"](models, perturbed(params, 0.5, seed=2), teacher_hf, student_hf,
                                 local)  # fmt: skip


def test_train_step_benchmark_names_the_flags_when_the_quickstart_pair_is_missing(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # No runs/quickstart here.
    with pytest.raises(SystemExit) as e:
        step_bench.main([])
    assert "--teacher" in str(e.value) and "--student" in str(e.value) and "--tiny" in str(e.value)


def test_sampler_cost_benchmark_times_every_draw():
    from distillspec.benchmarks import sampler_cost

    # 5000 draws of ~2 us: a difference of 10 ms, clear of a second test process's noise (200
    # draws, timed once, came out < 0 under it).
    record = sampler_cost.main(["--vocab", "16", "--repeats", "3", "--steps", "5000"])
    for key in ("gumbel_max_us", "sampler_us", "argmax_us", "gumbel_over_sampler"):
        assert math.isfinite(record[key]) and record[key] > 0, (key, record)


def test_profile_train_step_puts_each_op_in_a_category():
    from distillspec.benchmarks import profile_train_step as script

    a, b = jnp.ones((64, 32)), jnp.ones((32, 48))
    hlo = jax.jit(lambda a, b: jnp.tanh(a @ b).T * 2.0).lower(a, b).compile().as_text()
    kinds = script.categories(hlo)
    assert kinds and {category for category, _ in kinds.values()} <= set(script.CATEGORIES)
    assert "matmul" in {category for category, _ in kinds.values()}


# --------------------------------------------------------------------------------------------
# The trained memory-bound pair: a target padded with blocks that add exactly 0.
# --------------------------------------------------------------------------------------------

GPT2_STYLE = dict(
    position_embedding="learned", norm="layernorm", activation="gelu_new", gated_mlp=False,
    qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True,
)  # fmt: skip


@pytest.mark.parametrize("style", [{}, GPT2_STYLE], ids=["llama", "gpt2"])
def test_padded_target_logits_are_bit_identical(style):
    from distillspec.benchmarks.padded_target import padded_target
    from distillspec.models import DecoderOnlyLM, TransformerConfig

    config = TransformerConfig(
        vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        mlp_dim=64, init_std=0.3, **style,
    )  # fmt: skip
    model = DecoderOnlyLM(config)
    params = model.init(jax.random.PRNGKey(0))
    padded, padded_params = padded_target(model, params, 3, seed=1)
    assert padded.config.num_layers == 5
    layers, trained = padded_params["layers"], params["layers"]
    for path in (("attn", "q"), ("attn", "o"), ("mlp", "wo")):
        new, old = layers[path[0]][path[1]]["kernel"], trained[path[0]][path[1]]["kernel"]
        assert new.dtype == old.dtype and np.array_equal(new[:2], old)  # Trained blocks first.
        # The added blocks' residual outputs are zero, their other weights random.
        assert np.all(new[2:] == 0) if path[1] in ("o", "wo") else np.all(new[2:] != 0), path
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)
    batch = {"decoder_input_tokens": tokens}
    full = jax.jit(model.logits)(params, batch)
    assert np.array_equal(full, jax.jit(padded.logits)(padded_params, batch))
    # Incremental decoding with the KV cache: prefill, then calls of 2 tokens at ragged starts.
    lengths = jnp.asarray([4, 3], jnp.int32)
    cache, _, _ = model.prefill(params, tokens[:, :4], lengths, 16)
    padded_cache, _, _ = padded.prefill(padded_params, tokens[:, :4], lengths, 16)
    extend, padded_extend = jax.jit(model.extend), jax.jit(padded.extend)
    for step in range(5):
        fed, starts = tokens[:, 4 + step : 6 + step], lengths + step
        logits, cache = extend(params, cache, fed, starts)
        padded_logits, padded_cache = padded_extend(padded_params, padded_cache, fed, starts)
        assert np.array_equal(logits, padded_logits), step
    assert padded_cache["k"].shape[0] == 5  # The added blocks keep caches too.


def test_padded_target_sizes_and_bad_input():
    from distillspec.benchmarks.padded_target import layers_to_reach, padded_target

    model, params = tiny_lm(32)
    nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    per_block = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params["layers"])) / 2
    assert layers_to_reach(model, params, nbytes / 1e6) == 0
    assert layers_to_reach(model, params, (nbytes + 2.5 * per_block) / 1e6) == 3
    assert padded_target(model, params, 0) == (model, params)
    with pytest.raises(ValueError, match="extra_layers must be an integer >= 0, got -1"):
        padded_target(model, params, -1)
    with pytest.raises(ValueError, match="decoder-only target .* got MarkovStub"):
        from tests.test_utils import markov_pair

        padded_target(markov_pair(4, 0, 0.0)[0], None, 1)


def test_disco_benchmark_on_a_tiny_trained_pair(tmp_path):
    """--pair trained end to end on a tiny 'main job' (a random target and a perturbed draft
    saved where the quickstart saves its models): every policy exact, the cumulative rule
    tuned and reported, c and r_gamma measured."""
    from distillspec.benchmarks import disco as disco_bench
    from distillspec.models.hf_interop import save_pretrained

    model, params = tiny_lm(260)
    save_pretrained(model, params, str(tmp_path / "target" / "export"))
    save_pretrained(model, perturbed(params, 0.02, 1), str(tmp_path / "distilled" / "export"))
    pair = [
        "--pair", "trained", "--run_dir", str(tmp_path), "--vocabulary", "byte",
        "--pad_layers", "2", "--train_prompts", "8", "--validation_prompts", "2",
        "--test_prompts", "2", "--prompt_length", "16", "--max_new_tokens", "4",
        "--static_sl", "1", "2", "--sl_max_grid", "2", "--threshold_grid", "0.5",
        "--cumulative_threshold_grid", "0.5", "--oracle_sl_max", "4", "--timing_repeats", "1",
        "--oracle_sl_max_grid", "2", "4",
    ]  # fmt: skip
    profile = disco_bench.main(pair + ["--write_profile", str(tmp_path / "profile.json")])
    assert set(profile["target_ms"]) == {1, 2, 3, 4, 5} and set(profile["draft_ms"]) == {1, 2}
    assert "padded with 2 blocks" in profile["pair"]
    result = disco_bench.main(pair + [
        "--profile", str(tmp_path / "profile.json"), "--sweep_c", "0.05", "0.4",
        "--sweep_r", "1.0", "2.0", "--json", str(tmp_path / "out.json"),
    ])  # fmt: skip
    assert result["all_exact"] and result["pair_kind"] == "trained"
    assert [(row["c"], row["r_gamma"]) for row in result["sweep"]] == [
        (0.05, 1.0), (0.05, 2.0), (0.4, 1.0), (0.4, 2.0)
    ]  # fmt: skip
    for key in ("disco", "cumulative", "oracle"):
        low, high = result[f"{key}_vs_static_opt_pct_interval"]  # Over the 2 test prompts.
        assert low <= high
        assert math.isfinite(result[f"profile_{key}_vs_static_opt_pct"])
    assert "padded with 2 blocks" in result["pair"]
    assert {"cumulative", "disco", "oracle", "static-opt"} <= set(result["policies"])
    for key in ("disco", "cumulative", "oracle"):
        assert isinstance(result[f"{key}_vs_static_opt_pct"], float)
    assert result["cumulative"]["source"] in ("classifier", "draft")
    # The oracle's cap tuned on the grid, every cap measured; the model-free check of every
    # dynamic policy's rounds (and of static-opt, the noise) reported per policy.
    assert result["oracle_best_sl_max"] in (2, 4)
    assert set(result["oracle_sl_max_latency_ms"]) == {2, 4}
    assert {"oracle-2", "oracle-4"} <= set(result["policies"])
    assert set(result["round_overhead_pct"]) == {
        "static-opt", "heuristic", "confidence", "disco", "cumulative", "oracle", "oracle-2",
        "oracle-4",
    }  # fmt: skip
    assert all(math.isfinite(v) for v in result["round_overhead_pct"].values())
    assert result["oracle_round_overhead_pct"] == result["round_overhead_pct"]["oracle"]
    # Measured, not checked for size: a tiny pair's call costs are differences of timings under
    # load, noise that can come out 0 or below.
    assert all(math.isfinite(result[key]) for key in ("c", "r_gamma"))
    assert result["r_gamma_width"] == result["static_opt"] + 1
    assert isinstance(result["memory_bound"], bool)
    saved = json.loads((tmp_path / "out.json").read_text())  # JSON keys: strings.
    assert {k: saved[k] for k in ("c", "r_gamma", "cumulative", "pair")} == {
        k: result[k] for k in ("c", "r_gamma", "cumulative", "pair")
    }
    with pytest.raises(SystemExit):  # No main job there: a message naming the quickstart.
        disco_bench.main(["--pair", "trained", "--run_dir", str(tmp_path / "none")])
    (tmp_path / "bad.json").write_text('{"target_ms": {"1": 0}, "draft_ms": {"1": 1}}')
    with pytest.raises(SystemExit):  # A bad profile stops before any model is loaded.
        disco_bench.main(pair + ["--profile", str(tmp_path / "bad.json")])
