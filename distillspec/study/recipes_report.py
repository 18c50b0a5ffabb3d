"""The recipes comparison's summary (`--json OUT` of `python -m distillspec.study
--gin_file=experiments/recipes_quickstart.gin`) and its page, docs/results/recipes.md, from the
run's records (`study.recipes`); no JAX.

Every figure is keyed 'set/T/gamma' (e.g. 'stdlib_code/1/5') and holds the mean over training
seeds of the per-seed figure, the sample standard deviation over seeds (`seed_sd`) and a 90%
interval (`interval_90`): the 5th and 95th percentiles of the pooled ratio (accepted / drafted
for alpha, tokens / target calls for tau) over 2,000 resamplings of the (seed, prompt) rows. A
difference between two recipes is in percent of the second's figure, with the same bootstrap over
their paired rows (same seed index, same prompts), and "exceeds the seed spread" when the mean of
the per-seed differences is more than twice their standard deviation (as the seeds page says).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats

from distillspec.seed_spread import mean_sd

PRIMARY = "stdlib_code/1/5"  # The headline figure: alpha at gamma 5, T 1, stdlib_code.
DEFAULT = "fkl-student"  # runs/distill.gin's and the main job's recipe (on-policy FKL).
COUNTS = {"alpha": ("accepted", "drafted"), "tau": ("lengths", "target_calls")}
RESAMPLES = 2000


def figure_key(task: str, temperature: float, gamma: int) -> str:
    return f"{task}/{float(temperature):g}/{int(gamma)}"


def _grid(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict[int, dict]]:
    """{(recipe, figure key): {seed: grid record}}."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        if r.get("kind") == "grid" and r.get("recipe") is not None:
            key = figure_key(r["task"], r["temperature"], r["gamma"])
            out.setdefault((r["recipe"], key), {})[r["seed"]] = r
    return out


def _pooled(rows: Sequence[Mapping], metric: str) -> tuple[np.ndarray, np.ndarray]:
    num, den = COUNTS[metric]
    return (
        np.concatenate([np.asarray(r[f"{num}_per_prompt"], float) for r in rows]),
        np.concatenate([np.asarray(r[f"{den}_per_prompt"], float) for r in rows]),
    )


def _ratios(num: np.ndarray, den: np.ndarray, picks: np.ndarray) -> np.ndarray:
    return num[picks].sum(1) / np.maximum(den[picks].sum(1), 1.0)


def _picks(rows: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, rows, (RESAMPLES, rows))


def _percentiles(values: np.ndarray) -> list[float]:
    return [float(np.percentile(values, 5)), float(np.percentile(values, 95))]


def figure(by_seed: Mapping[int, Mapping], metric: str) -> dict[str, Any]:
    """{'mean', 'seed_sd', 'interval_90', 'seeds'} of one recipe's figure (see the module)."""
    rows = [by_seed[s] for s in sorted(by_seed)]
    mean, sd = mean_sd([float(r[metric]) for r in rows])
    num, den = _pooled(rows, metric)
    interval = _percentiles(_ratios(num, den, _picks(len(num))))
    return {"mean": mean, "seed_sd": sd, "interval_90": interval, "seeds": len(rows)}


def difference_pct(a: Mapping[int, Mapping], b: Mapping[int, Mapping], metric: str) -> dict:
    """Recipe a's figure against b's, in percent of b's, over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    per_seed = [100.0 * (float(a[s][metric]) / float(b[s][metric]) - 1.0) for s in seeds]
    mean, sd = mean_sd(per_seed)
    (a_num, a_den), (b_num, b_den) = (_pooled([x[s] for s in seeds], metric) for x in (a, b))
    picks = _picks(len(a_num))
    pct = 100.0 * (_ratios(a_num, a_den, picks) / _ratios(b_num, b_den, picks) - 1.0)
    exceeds = len(seeds) > 1 and abs(mean) > 2 * sd
    return {"pct": mean, "seed_sd": sd, "interval_90": _percentiles(pct), "seeds": len(seeds),
            "exceeds_seed_spread": bool(exceeds)}  # fmt: skip


def _train(records: Iterable[Mapping[str, Any]]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        if r.get("kind") == "train":
            out.setdefault(r["recipe"], []).append(dict(r))
    return out


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The OUT object: recipes, train_seconds, ranking, adaspec_vs_distillspec_pct,
    lk_vs_fkl_pct (and lk_vs_tvd_pct), proxy_kendall, default (see docs/study.md)."""
    grid, train = _grid(records), _train(records)
    recipes: dict[str, dict] = {}
    for name, runs in sorted(train.items()):
        keys = sorted(k for (r, k) in grid if r == name)
        seconds = [r["seconds"] + r.get("reference_seconds", 0.0) for r in runs]
        proxies = [r["acceptance_proxy"] for r in runs if r.get("acceptance_proxy") is not None]
        recipes[name] = {
            "family": runs[0]["family"], "divergence": runs[0]["divergence"],
            "data": runs[0]["data"], "train_steps": runs[0]["steps"],
            "train_seconds": sum(seconds) / len(seconds),
            "acceptance_proxy": sum(proxies) / len(proxies) if proxies else None,
            **{m: {k: figure(grid[name, k], m) for k in keys} for m in COUNTS},
        }  # fmt: skip
    ranked = sorted(
        (n for n in recipes if PRIMARY in recipes[n]["alpha"]),
        key=lambda n: -recipes[n]["alpha"][PRIMARY]["mean"],
    )
    compare = lambda a, b, key=PRIMARY, m="alpha": difference_pct(grid[a, key], grid[b, key], m)
    summary: dict[str, Any] = {
        "primary": f"alpha at {PRIMARY} (set/T/gamma)",
        "recipes": recipes,
        "train_seconds": {n: r["train_seconds"] for n, r in recipes.items()},
        "ranking": ranked,
        "ranking_steps": [
            {"better": a, "worse": b, **compare(a, b)} for a, b in zip(ranked, ranked[1:])
        ],
        "adaspec_vs_distillspec_pct": _best_against(recipes, ranked, compare),
        "lk_vs_fkl_pct": _lk_against(recipes, compare, "fkl"),
        "lk_vs_tvd_pct": _lk_against(recipes, compare, "tvd"),
        "proxy_kendall": _kendall(recipes, ranked),
        "default": _default_check(recipes, ranked, compare),
    }
    return _finite(summary)


def _finite(value: Any) -> Any:
    """value with NaN (a spread over one seed) as None, so that OUT is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _best_against(recipes, ranked, compare) -> dict | None:
    best = {f: next((n for n in ranked if recipes[n]["family"] == f), None)
            for f in ("adaspec", "distillspec")}  # fmt: skip
    if None in best.values():
        return None
    return {"adaspec": best["adaspec"], "distillspec": best["distillspec"],
            **compare(best["adaspec"], best["distillspec"])}  # fmt: skip


def _temperature_keys(recipes, a: str, b: str) -> list[str]:
    """The stdlib_code gamma-5 keys (T 0 and 1) both recipes have."""
    keys = set(recipes[a]["alpha"]) & set(recipes[b]["alpha"])
    return sorted(k for k in keys if k.startswith("stdlib_code/") and k.endswith("/5"))


def _lk_against(recipes, compare, other: str) -> dict[str, dict]:
    """Each on-policy LK recipe against the on-policy `other` divergence, at T 0 and 1."""
    base = f"{other}-student"
    out = {}
    for name, r in recipes.items():
        if r["family"] == "distillspec" and r["data"] == "student" and name.startswith("lk_"):
            if base in recipes:
                keys = _temperature_keys(recipes, name, base)
                out[name] = {k: compare(name, base, k) for k in keys}
    return out


def _kendall(recipes, ranked) -> dict[str, Any]:
    """Kendall's tau between the recipes' training acceptance proxy (its mean over the last
    tenth of training) and their measured alpha (PRIMARY); also within each data source."""
    out = {}
    groups = {"all": ranked}
    for data in sorted({recipes[n]["data"] for n in ranked}):
        groups[f"data={data}"] = [n for n in ranked if recipes[n]["data"] == data]
    for group, names in groups.items():
        names = [n for n in names if recipes[n]["acceptance_proxy"] is not None]
        if len(names) < 3:
            continue
        proxy = [recipes[n]["acceptance_proxy"] for n in names]
        alpha = [recipes[n]["alpha"][PRIMARY]["mean"] for n in names]
        result = stats.kendalltau(proxy, alpha)
        tau, p = float(result.statistic), float(result.pvalue)
        out[group] = {"tau": tau if math.isfinite(tau) else None, "p_value": p,
                      "recipes": len(names)}  # fmt: skip
    return out


def _default_check(recipes, ranked, compare) -> dict[str, Any]:
    """Whether the best recipe beats DEFAULT beyond the seed spread at both temperatures."""
    if DEFAULT not in recipes or not ranked:
        return {"default": DEFAULT, "change": False, "reason": "the default was not run"}
    best = ranked[0]
    if best == DEFAULT:
        return {"default": DEFAULT, "best": best, "change": False,
                "reason": "the default ranks first"}  # fmt: skip
    by_t = {k: compare(best, DEFAULT, k) for k in _temperature_keys(recipes, best, DEFAULT)}
    change = len(by_t) == 2 and all(
        c["exceeds_seed_spread"] and c["pct"] > 0 for c in by_t.values()
    )
    reason = ("beats the default beyond the seed spread at T 0 and T 1" if change else
              "does not beat the default beyond the seed spread at both temperatures")  # fmt: skip
    return {"default": DEFAULT, "best": best, "change": change, "reason": reason, **by_t}


def _pm(f: Mapping[str, Any], digits: int = 3) -> str:
    lo, hi = f["interval_90"]
    sd = "" if f["seed_sd"] is None else f" ± {f['seed_sd']:.{digits}f}"
    return f"{f['mean']:.{digits}f}{sd} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _pct(c: Mapping[str, Any] | None) -> str:
    if not c:
        return "n/a"
    lo, hi = c["interval_90"]
    flag = "exceeds" if c["exceeds_seed_spread"] else "within"
    return f"{c['pct']:+.1f}% [{lo:+.1f}, {hi:+.1f}] ({flag} the seed spread)"


def _table(summary: Mapping[str, Any]) -> list[str]:
    recipes, ranked = summary["recipes"], summary["ranking"]
    keys = sorted({k for n in ranked for k in recipes[n]["alpha"]})
    lines = [
        "| rank | recipe | data | train steps | train s | proxy | "
        + " | ".join(f"α {k}" for k in keys) + " | " + " | ".join(f"τ {k}" for k in keys) + " |",
        "|" + "---|" * (6 + 2 * len(keys)),
    ]  # fmt: skip
    for i, name in enumerate(ranked, 1):
        r = recipes[name]
        proxy = "n/a" if r["acceptance_proxy"] is None else f"{r['acceptance_proxy']:.3f}"
        cells = [_pm(r[m][k]) if k in r[m] else "" for m in ("alpha", "tau") for k in keys]
        lines.append(
            f"| {i} | {name} | {r['data']} | {r['train_steps']} | {r['train_seconds']:.0f} | "
            f"{proxy} | " + " | ".join(cells) + " |"
        )
    return lines


def markdown(summary: Mapping[str, Any]) -> str:
    """docs/results/recipes.md's body."""
    lines = [
        f"Ranked by {summary['primary']}. Each figure: mean ± sd over training seeds [90% "
        "interval over (seed, prompt) rows]; train s: wall-clock training seconds per seed "
        "(AdaSPEC's include its reference model's training); proxy: the trainer's acceptance "
        "proxy (mean 1 - TVD on its training batches over the last tenth of training).",
        "", *_table(summary), "", "## Which differences exceed the seed spread", "",
        "Each recipe against the next in the ranking (α at the headline figure):", "",
    ]  # fmt: skip
    for step in summary["ranking_steps"]:
        lines.append(f"- {step['better']} vs {step['worse']}: {_pct(step)}")
    ada = summary["adaspec_vs_distillspec_pct"]
    lines += ["", "## Does AdaSPEC's +15% over DistillSpec hold at this scale?", ""]
    if ada is None:
        lines.append("Not measured: the run has no AdaSPEC or no DistillSpec recipe.")
    else:
        holds = ada["pct"] >= 15 and ada["exceeds_seed_spread"]
        verdict = "Yes" if holds else "No"
        lines.append(
            f"{verdict}: the best AdaSPEC recipe ({ada['adaspec']}) against the best DistillSpec "
            f"recipe ({ada['distillspec']}): {_pct(ada)}."
        )
    lines += ["", "## Does LK beat FKL / TVD on-policy?", ""]
    lk = [
        (name, other, key, c)
        for other in ("fkl", "tvd")
        for name, by_key in summary[f"lk_vs_{other}_pct"].items()
        for key, c in by_key.items()
    ]
    for name, other, key, c in lk:
        lines.append(f"- {name} vs {other}-student, α {key}: {_pct(c)}")
    if not lk:
        lines.append(
            "Not measured: the run has no on-policy LK recipe beside on-policy FKL or TVD."
        )
    lines += ["", "## Does the training proxy predict the measured acceptance?", ""]
    for group, k in summary["proxy_kendall"].items():
        tau = "undefined" if k["tau"] is None else f"{k['tau']:+.2f}"
        lines.append(
            f"- {group}: Kendall τ = {tau} (p = {k['p_value']:.2g}, {k['recipes']} recipes)"
        )
    d = summary["default"]
    lines += ["", "## The default", ""]
    verdict = "changes" if d["change"] else "stays"
    lines.append(f"The default ({d['default']}) {verdict}: {d.get('best', 'n/a')} {d['reason']}.")
    for key in sorted(k for k in d if "/" in k):
        lines.append(f"- {d['best']} vs {d['default']}, α {key}: {_pct(d[key])}")
    return "\n".join(lines)
