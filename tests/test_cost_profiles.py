"""Cost profiles (a deployment's call costs), tuning for them, the modeled sweep and the
benchmark's intervals over prompts: counted calls priced by hand, no models."""

import json

import numpy as np
import pytest

from distillspec.benchmarks.disco import modeled_sweep, prompt_intervals
from distillspec.decoding.lookahead import Lookahead
from distillspec.disco.tuning import choose, tuning_grid
from distillspec.evaluation.costs import load_profile, profile_costs, synthetic_profile
from distillspec.evaluation.policies import priced


def counts(histogram, tokens, draft_calls=None, runs=1, switches=0):
    """A policy's counted calls: histogram[k] = rounds of k drafts."""
    if draft_calls is None:
        draft_calls = sum(k * n for k, n in enumerate(histogram))
    return {"sl_histogram": list(histogram), "draft_calls": draft_calls, "tokens": tokens,
            "runs": runs, "width_switches": switches}  # fmt: skip


def static_counts(k, rounds, tokens):
    return counts([0] * k + [rounds], tokens)


def test_a_static_policy_priced_by_hand():
    c, r = 0.1, 1.5
    profile = synthetic_profile(c, r, gamma=5)
    assert profile["target_ms"][6] == pytest.approx(r)  # r_gamma at width gamma + 1.
    policy = Lookahead("static", 4)
    costs = profile_costs(profile, [policy])
    width5 = 1 + (r - 1) * 4 / 5
    width2 = 1 + (r - 1) / 5
    # 10 rounds: a target call of width 5, the first draft call scoring 2 positions, 3 more.
    expected = (10 * width5 + 10 * c * width2 + 30 * c) / 37
    assert priced(static_counts(4, 10, 37), policy, costs) == pytest.approx(expected)
    plain = priced(counts([37], 37, 0), None, costs)  # The target alone: a width-1 call a token.
    assert plain == pytest.approx(1.0)


def test_profile_costs_interpolate_and_refuse_what_they_lack():
    profile = {"target_ms": {1: 2.0, 3: 4.0, 9: 10.0}, "draft_ms": {1: 0.5}}
    costs = profile_costs(profile, [Lookahead("static", 1), Lookahead("static", 5)])
    assert costs["target"] == {1: 2.0, 2: 3.0, 6: 7.0}
    assert costs["draft"] == {1: 0.5, 2: 0.5}  # No width-2 draft call: the width-1 cost.
    with pytest.raises(ValueError, match=r"widths \[1, 3, 9\]; .* up to 17"):
        profile_costs(profile, [Lookahead("disco", 16, threshold=0.5)])


def test_load_profile_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "profile.json"
    written = {"target_ms": {"1": 2.0, "2": 2.1}, "draft_ms": {"1": 0.1, "2": 0.12}, "pair": "x"}
    path.write_text(json.dumps(written))
    assert load_profile(str(path)) == {
        "target_ms": {1: 2.0, 2: 2.1},
        "draft_ms": {1: 0.1, 2: 0.12},
    }
    bad = {
        "no_target": ({"draft_ms": {"1": 0.1}}, "'target_ms' must map widths"),
        "no_width_1": ({"target_ms": {"2": 1.0}, "draft_ms": {"1": 0.1}}, "width 1 included"),
        "negative": ({"target_ms": {"1": -1.0}, "draft_ms": {"1": 0.1}}, r"target_ms\[1\] = -1.0"),
        "untimed": ({"target_ms": {"1": 1.0}, "draft_ms": {"1": None}}, r"draft_ms\[1\] = None"),
        "width": ({"target_ms": {"1": 1.0, "x": 2.0}, "draft_ms": {"1": 0.1}}, "width 'x'"),
    }
    for name, (content, message) in bad.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=message) as error:
            load_profile(str(path))
        assert str(path) in str(error.value)
    with pytest.raises(ValueError, match="want c > 0, r_gamma >= 1"):
        synthetic_profile(0.1, 0.9)


def _grid_and_counts():
    """Static SL-1 and SL-4 and one rule per dynamic kind, with counts of a run of 40 tokens:
    SL-4 needs 10 rounds of 4 drafts, SL-1 20 rounds of 1."""
    rules = tuning_grid((1, 4), (4,), (0.5,), (True,), (0.5,), ("draft",))
    fields = {
        "static-1": static_counts(1, 20, 40),
        "static-4": static_counts(4, 10, 40),
        "confidence@4/0.5/keep": counts([0, 0, 16], 40),
        "disco@4/0.5/keep": counts([0, 0, 0, 12], 40),
        "cumulative-draft@4/0.5/keep": counts([0, 0, 0, 0, 9], 40),
    }
    return rules, fields


def test_tuning_follows_the_deployments_costs():
    rules, fields = _grid_and_counts()
    grid = {label: p for configs in rules.values() for label, p in configs.items()}

    def tuned(c, r):
        costs = profile_costs(synthetic_profile(c, r), grid.values())
        return choose(rules, {n: priced(fields[n], grid[n], costs) for n in grid})

    # Cheap drafts and free verification (a memory-bound GPU): the long rounds win.
    assert tuned(0.01, 1.0)["static_opt"] == 4
    # Dear drafts and verification growing with width (a compute-bound CPU): SL-1 wins.
    assert tuned(0.4, 2.0)["static_opt"] == 1
    assert tuned(0.01, 1.0)["cumulative"] == {
        "threshold": 0.5, "sl_max": 4, "keep_last": True, "source": "draft"
    }  # fmt: skip


def test_modeled_sweep_by_hand():
    rules, fields = _grid_and_counts()
    fixed = {"heuristic": Lookahead("heuristic", 4), "oracle": Lookahead("oracle", 4)}
    test = dict(fields, heuristic=counts([0, 0, 20], 40), oracle=counts([0, 0, 0, 0, 8], 40))
    rows = modeled_sweep(rules, fixed, fields, test, cs=(0.01, 0.4), rs=(1.0, 2.0))
    assert [(row["c"], row["r_gamma"]) for row in rows] == [
        (0.01, 1.0), (0.01, 2.0), (0.4, 1.0), (0.4, 2.0)
    ]  # fmt: skip
    row = rows[0]
    assert row["static_opt"] == 4
    # Free verification, drafts at 0.01: the oracle's 8 rounds of 4 against SL-4's 10 rounds.
    oracle = (8 * 1.0 + 8 * 0.01 + 24 * 0.01) / 40
    opt = (10 * 1.0 + 10 * 0.01 + 30 * 0.01) / 40
    assert row["oracle_vs_static_opt_pct"] == pytest.approx(100 * (opt - oracle) / opt, abs=0.01)
    assert row["disco_vs_static_opt_pct"] < 0  # 12 rounds of 3 cost more than 10 of 4.


def test_prompt_intervals_over_prompts():
    rng = np.random.default_rng(0)
    opt = rng.uniform(1.0, 2.0, 12)
    measured = {
        "static-opt": {"prompt_seconds": list(opt)},
        "disco": {"prompt_seconds": list(0.9 * opt)},  # 10% faster on every prompt.
        "cumulative": {"prompt_seconds": list(opt * rng.uniform(0.8, 1.2, 12))},
        "oracle": {"prompt_seconds": list(1.1 * opt)},
    }
    out = prompt_intervals(measured)
    assert out["disco_vs_static_opt_pct_interval"] == pytest.approx([10.0, 10.0])
    assert out["oracle_vs_static_opt_pct_interval"] == pytest.approx([-10.0, -10.0])
    low, high = out["cumulative_vs_static_opt_pct_interval"]
    point = 100 * (opt.sum() - np.sum(measured["cumulative"]["prompt_seconds"])) / opt.sum()
    assert low < point < high and high - low > 1.0
    one = {name: {"prompt_seconds": m["prompt_seconds"][:1]} for name, m in measured.items()}
    assert prompt_intervals(one) == dict.fromkeys(out)


def test_several_drafts_share_one_timing_of_the_target(monkeypatch):
    from distillspec.evaluation import costs

    built = []

    def fake_timer(model, params, prompts, lengths, width, calls, max_new_tokens):
        built.append((model, width))
        seconds = {"target": 0.010 * (1 + 0.1 * (width - 1)), "a": 0.001, "b": 0.002}[model]
        return lambda: seconds

    monkeypatch.setattr(costs, "step_timer", fake_timer)
    prompts, lengths = np.zeros((2, 4), np.int32), np.full(2, 4)
    out = costs.measure_drafts("target", None, {"A": ("a", None), "B": ("b", None)}, prompts,
                               lengths, [3, 5], max_new_tokens=8, repeats=3)  # fmt: skip
    # The target's timers are built once per width (1, 4, 6) for both drafts; each draft once.
    assert sorted(built, key=str) == sorted(
        [("a", 1), ("b", 1), ("target", 1), ("target", 4), ("target", 6)], key=str
    )
    assert out["A"]["c"] == pytest.approx(0.1) and out["B"]["c"] == pytest.approx(0.2)
    assert out["A"]["r_gamma"] == out["B"]["r_gamma"] == pytest.approx({3: 1.3, 5: 1.5})
    single = costs.measure("target", None, "a", None, prompts, lengths, [3], 8, repeats=1)
    assert single == {"c": pytest.approx(0.1), "r_gamma": {3: pytest.approx(1.3)}}
