"""The recipes comparison's summary and page (`distillspec.study.recipes_report`) on records
made by hand, whose answers are known; the pipeline itself runs in tests/test_cli.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from distillspec.study import recipes, recipes_report

PROMPTS = 8


def _grid(recipe, family, data, seed, alpha, temperature=1.0, gamma=5, noise=0.0):
    """One grid record of `alpha` over PROMPTS prompts (10 drafted tokens each), with a
    per-prompt wobble that cancels out, so the pooled alpha is exactly `alpha`."""
    wobble = noise * np.array([1, -1] * (PROMPTS // 2))
    accepted = (alpha + wobble) * 10
    return {
        "kind": "grid", "recipe": recipe, "family": family, "data": data, "seed": seed,
        "task": "stdlib_code", "temperature": temperature, "gamma": gamma,
        "divergence": recipe.split("-")[-2], "select": family == "adaspec",
        "alpha": alpha, "tau": 1 + 4 * alpha,
        "accepted_per_prompt": accepted.tolist(), "drafted_per_prompt": [10.0] * PROMPTS,
        "lengths_per_prompt": ((1 + 4 * alpha) * 10 * np.ones(PROMPTS)).tolist(),
        "target_calls_per_prompt": [10.0] * PROMPTS,
    }  # fmt: skip


def _train(recipe, family, data, seed, proxy, seconds=10.0, reference_seconds=0.0):
    return {"kind": "train", "recipe": recipe, "family": family, "data": data, "seed": seed,
            "divergence": recipe.split("-")[-2], "steps": 100, "seconds": seconds,
            "reference_seconds": reference_seconds, "acceptance_proxy": proxy}  # fmt: skip


# alpha per seed at T = 1 (and T = 0: 0.1 lower); the training proxy.
RECIPES = {
    "fkl-student": ("distillspec", "student", [0.50, 0.51, 0.49], 0.60),
    "lk_alpha-student": ("distillspec", "student", [0.60, 0.61, 0.59], 0.70),  # +20%, clear.
    "tvd-student": ("distillspec", "student", [0.50, 0.55, 0.44], 0.65),  # Noisy, near fkl.
    "fkl-teacher": ("distillspec", "teacher", [0.40, 0.41, 0.39], 0.50),
    "adaspec-fkl-fixed": ("adaspec", "fixed", [0.45, 0.46, 0.44], 0.55),
}


def _records():
    out = []
    for name, (family, data, alphas, proxy) in RECIPES.items():
        for seed, alpha in enumerate(alphas):
            ref = 7.0 if family == "adaspec" else 0.0
            out.append(_train(name, family, data, seed, proxy, reference_seconds=ref))
            out.append(_grid(name, family, data, seed, alpha, noise=0.05))
            out.append(_grid(name, family, data, seed, alpha - 0.1, temperature=0.0))
    return out


@pytest.fixture(scope="module")
def summary():
    return recipes_report.summarize(_records())


def test_the_summary_has_the_issues_keys_and_is_plain_json(summary):
    assert {"recipes", "train_seconds", "ranking", "adaspec_vs_distillspec_pct", "lk_vs_fkl_pct",
            "proxy_kendall"} <= set(summary)  # fmt: skip
    figure = summary["recipes"]["fkl-student"]["alpha"]["stdlib_code/1/5"]
    assert set(figure) == {"mean", "seed_sd", "interval_90", "seeds"}
    assert figure["mean"] == pytest.approx(0.5) and figure["seed_sd"] == pytest.approx(0.01)
    low, high = figure["interval_90"]
    assert low < 0.5 < high
    assert set(summary["recipes"]["fkl-student"]["tau"]) == {"stdlib_code/0/5", "stdlib_code/1/5"}
    json.loads(json.dumps(summary, allow_nan=False))  # No NaN: standard JSON.


def test_ranking_and_which_differences_exceed_the_spread(summary):
    assert summary["ranking"] == [
        "lk_alpha-student", "fkl-student", "tvd-student", "adaspec-fkl-fixed", "fkl-teacher",
    ]  # fmt: skip
    steps = {(s["better"], s["worse"]): s for s in summary["ranking_steps"]}
    clear = steps["lk_alpha-student", "fkl-student"]
    assert clear["pct"] == pytest.approx(100 * np.mean([0.6 / 0.5, 0.61 / 0.51, 0.59 / 0.49]) - 100)
    assert clear["exceeds_seed_spread"]
    assert clear["interval_90"][0] > 0
    assert not steps["fkl-student", "tvd-student"]["exceeds_seed_spread"]


def test_adaspec_lk_kendall_and_budget(summary):
    ada = summary["adaspec_vs_distillspec_pct"]
    assert (ada["adaspec"], ada["distillspec"]) == ("adaspec-fkl-fixed", "lk_alpha-student")
    assert ada["pct"] < 0 and ada["exceeds_seed_spread"]
    lk = summary["lk_vs_fkl_pct"]["lk_alpha-student"]
    assert set(lk) == {"stdlib_code/0/5", "stdlib_code/1/5"}
    assert all(c["pct"] > 0 and c["exceeds_seed_spread"] for c in lk.values())
    assert summary["train_seconds"]["adaspec-fkl-fixed"] == 17.0  # Its reference's 7 s counted.
    assert summary["train_seconds"]["fkl-student"] == 10.0
    kendall = summary["proxy_kendall"]["all"]
    # Proxy order: lk 0.70, tvd 0.65, fkl 0.60, adaspec 0.55, teacher 0.50; alpha order swaps
    # only fkl and tvd (tvd's mean is 0.4967): 9 concordant pairs, 1 discordant.
    assert kendall["recipes"] == 5 and kendall["tau"] == pytest.approx(0.8)
    default = summary["default"]
    assert default["best"] == "lk_alpha-student" and default["change"]


def test_the_page_answers_the_questions(summary):
    page = recipes_report.markdown(summary)
    headings = ("Which differences exceed the seed spread", "AdaSPEC's +15%",
                "Does LK beat FKL / TVD on-policy?", "training proxy", "The default")  # fmt: skip
    for heading in headings:
        assert heading in page
    assert "No: the best AdaSPEC recipe (adaspec-fkl-fixed)" in page
    assert "lk_alpha-student vs fkl-student, α stdlib_code/1/5: +20" in page
    assert "The default (fkl-student) changes" in page


def test_one_seed_gives_no_spread_and_no_claim():
    records = [r for r in _records() if r["seed"] == 0]
    summary = recipes_report.summarize(records)
    assert summary["recipes"]["fkl-student"]["alpha"]["stdlib_code/1/5"]["seed_sd"] is None
    assert not any(s["exceeds_seed_spread"] for s in summary["ranking_steps"])
    assert not summary["default"]["change"]
    assert "No:" in recipes_report.markdown(summary)


def test_recipe_lists_and_the_best_on_policy_divergence():
    grid = recipes.grid_recipes(["fkl", "lk_lambda"], ["student", "teacher"])
    assert [r.name for r in grid] == [
        "fkl-student", "fkl-teacher", "lk_lambda-student", "lk_lambda-teacher",
    ]  # fmt: skip
    extra = recipes.adaspec_recipes("fkl", "fixed", "lk_alpha")
    assert [(r.name, r.reference) for r in extra] == [
        ("fkl-fixed", None), ("adaspec-fkl-fixed", "fkl-fixed"),
        ("adaspec-lk_alpha-student", "lk_alpha-student"),
    ]  # fmt: skip
    assert recipes.best_on_policy(_records(), ["fkl", "lk_alpha", "tvd"]) == "lk_alpha"
    with pytest.raises(ValueError, match=r"recipes.divergences: 'kl' is not one of \("):
        recipes.grid_recipes(["kl"], ["student"])
    with pytest.raises(ValueError, match="no on-policy run was evaluated at stdlib_code/1/5"):
        recipes.best_on_policy([], ["fkl"])
