"""The study's report, from its records alone (no JAX): tables, figures and the findings.

    python -m distillspec.study.report runs/study     # rewrites the report of a finished study

Writes into the study's directory:
  recipes.md / .csv          Fig. 2 / Table 1: tau of each recipe and its gain over the standard
                             draft, per temperature, mean +- sd over seeds
  grid.md / .csv             Fig. 4: tau gain (%) over the standard draft, divergence x data
                             source, per temperature (first seed)
  fig2_recipes.png, fig4_grid.png, fig3a_training.png (alpha and tau over training steps per
  recipe), fig3b_per_prompt.png (each prompt's tau, standard vs distilled), fig3c_tau_theory.png
  (tau from the TVD vs measured tau, every draft a point), fig5a_quality.png (draft quality vs
  tau gain), fig5b_lenience.png (quality vs batch-1 latency under lenience)
  findings.md                the paper's findings (a)-(f), the figures measured here, and
                             whether each reproduced (the rule for each is stated in the table)
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats

from distillspec.records import write_text_atomic

RECIPE_NAMES = {
    "supervised_kd": "Supervised KD",
    "seqkd": "SeqKD",
    "imitkd": "ImitKD",
    "fdistill": "f-Distill",
    "gkd": "GKD",
}


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _fmt(mean: float, sd: float | None = None, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    text = f"{mean:.{digits}f}"
    return text + (f" ± {sd:.{digits}f}" if sd else "")


class Results:
    """The study's records, indexed."""

    def __init__(self, records: Sequence[Mapping[str, Any]]):
        self.records = list(records)
        self.grid = [r for r in records if r["kind"] == "grid"]
        self.quality = [r for r in records if r["kind"] == "quality"]
        self.curves = [r for r in records if r["kind"] == "curve"]
        self.lenience = [r for r in records if r["kind"] == "lenience"]
        self.temperatures = sorted({r["temperature"] for r in self.grid})
        cells = [r for r in self.grid if r["cell"] != "standard"]
        self.cells = list(dict.fromkeys(r["cell"] for r in cells))
        self.seeds = sorted({r["seed"] for r in cells})
        grid = [r for r in cells if r.get("in_grid", True)]  # Not the recipes outside it.
        self.divergences = list(dict.fromkeys(r["divergence"] for r in grid))
        self.data_sources = list(dict.fromkeys(r["data"] for r in grid))
        self.recipes = {r["recipe"]: r["cell"] for r in cells if r.get("recipe")}

    def standard_tau(self, temperature: float) -> float:
        return next(
            r["tau"]
            for r in self.grid
            if r["cell"] == "standard" and r["temperature"] == temperature
        )

    def taus(self, cell: str, temperature: float) -> list[float]:
        """The cell's tau at every seed."""
        return [
            r["tau"] for r in self.grid if r["cell"] == cell and r["temperature"] == temperature
        ]

    def gains(self, cell: str, temperature: float) -> list[float]:
        """The cell's tau gain over the standard draft, %, at every seed."""
        base = self.standard_tau(temperature)
        return [100.0 * (tau / base - 1.0) for tau in self.taus(cell, temperature)]

    def first_seed_gain(self, cell: str, temperature: float) -> float:
        gains = self.gains(cell, temperature)
        return gains[0] if gains else float("nan")


# --------------------------------------------------------------------------------------------
# Tables.


def _write_table(rows: list[dict], path_stem: str, title: str) -> str:
    header = list(rows[0])
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(str(r[h]) for h in header) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    write_text_atomic(path_stem + ".md", text)
    with open(path_stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, header)
        writer.writeheader()
        writer.writerows(rows)
    return text


def recipes_table(res: Results) -> list[dict]:
    rows = [
        {
            "recipe": "standard draft",
            "cell": "-",
            **{f"tau T={t:g}": _fmt(res.standard_tau(t)) for t in res.temperatures},
            **{f"gain T={t:g} (%)": "0" for t in res.temperatures},
        }
    ]
    for recipe, cell in res.recipes.items():
        row = {"recipe": RECIPE_NAMES.get(recipe, recipe), "cell": cell}
        for t in res.temperatures:
            row[f"tau T={t:g}"] = _fmt(*_mean_sd(res.taus(cell, t)))
        for t in res.temperatures:
            row[f"gain T={t:g} (%)"] = _fmt(*_mean_sd(res.gains(cell, t)), digits=1)
        row["seeds"] = len(res.taus(cell, res.temperatures[0]))
        rows.append(row)
    rows[0]["seeds"] = "-"
    return rows


def grid_table(res: Results, temperature: float) -> list[dict]:
    rows = []
    for d in res.divergences:
        row = {"divergence": d.upper()}
        for s in res.data_sources:
            cell = f"{d}-{s}"
            row[s] = (
                _fmt(*_mean_sd(res.gains(cell, temperature)), digits=1)
                if cell in res.cells
                else "-"
            )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Findings.


def _defined(x: Sequence[float], y: Sequence[float]) -> bool:
    """A correlation needs 3 points and spread in both variables."""
    return len(x) > 2 and np.ptp(x) > 0 and np.ptp(y) > 0


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return float(stats.spearmanr(x, y).statistic) if _defined(x, y) else float("nan")


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    return float(stats.pearsonr(x, y).statistic) if _defined(x, y) else float("nan")


def theory_points(res: Results) -> list[tuple[float, float, float]]:
    """(temperature, tau_theory, tau) of every distilled draft and the standard one."""
    return [(r["temperature"], r["tau_theory"], r["tau"]) for r in res.grid]


def quality_points(res: Results, temperature: float) -> list[tuple[str, float, float]]:
    """(draft, chrF of its greedy output, tau gain % at `temperature`) of every distilled draft."""
    quality = {r["model"]: r["chrf"] for r in res.quality if r.get("chrf") is not None}
    base = res.standard_tau(temperature)
    return [
        (r["draft"], quality[r["draft"]], 100.0 * (r["tau"] / base - 1.0))
        for r in res.grid
        if r["cell"] != "standard" and r["temperature"] == temperature and r["draft"] in quality
    ]


QUALITY_AXES = {"chrf": "chrF", "target_nll": "the target's NLL"}  # chrF higher, NLL lower.


def _dominated_share(res: Results, metric: str) -> tuple[float, int]:
    """Share of the standard draft's lenience points (latency, quality by `metric`) that some
    point of the distilled draft with the same lenience kind, or its lossless point, weakly
    dominates (no slower and no worse)."""
    sign = 1.0 if metric == "chrf" else -1.0  # Higher is better.
    points = defaultdict(lambda: defaultdict(list))
    for r in res.lenience:
        if r["draft"] != "target":
            who = "standard" if r["draft"] == "standard" else "distilled"
            points[r["lenience"]][who].append((r["latency_ms"], sign * r[metric]))
    dominated = total = 0
    lossless = points.get("none", {}).get("distilled", [])
    for by in points.values():
        for lat, q in by.get("standard", []):
            total += 1
            rivals = by.get("distilled", []) + lossless
            dominated += any(l2 <= lat and q2 >= q for l2, q2 in rivals)
    return (dominated / total if total else float("nan")), total


def pooled_sd(res: Results, temperature: float) -> float:
    """The seed spread of a cell's gain (%) at `temperature`: the root mean square of the
    standard deviations of the cells run at several seeds (0 if none was)."""
    sds = [_mean_sd(res.gains(c, temperature))[1] for c in res.cells
           if len(res.gains(c, temperature)) > 1]  # fmt: skip
    return float(np.sqrt(np.mean(np.square(sds)))) if sds else 0.0


def _finding_a(res: Results) -> dict:
    worst = {}
    for recipe, cell in res.recipes.items():
        for t in res.temperatures:
            mean, sd = _mean_sd(res.gains(cell, t))
            worst[(recipe, t)] = (mean, sd)
    beats = all(m > 0 and m > 2 * sd for m, sd in worst.values())
    (lo_recipe, lo_t), (lo_m, lo_sd) = min(worst.items(), key=lambda kv: kv[1][0])
    return {
        "finding": "(a) every recipe beats the standard draft (Fig. 2)",
        "measured here": f"smallest gain: {RECIPE_NAMES.get(lo_recipe, lo_recipe)} at "
        f"T={lo_t:g}, {lo_m:+.1f}% (sd {lo_sd:.1f} over seeds)",
        "rule": "every recipe's mean gain > 0 and > 2 sd over seeds, at every temperature",
        "reproduced": "yes" if beats else "no",
    }


def _complete_divergences(res: Results) -> list[str]:
    """The divergences whose every data source was run."""
    return [d for d in res.divergences if all(f"{d}-{s}" in res.cells for s in res.data_sources)]


def _finding_b(res: Results) -> dict:
    generated = [s for s in res.data_sources if s != "fixed"]
    complete = _complete_divergences(res)
    wins, pairs, detail = 0, 0, []
    if "fixed" in res.data_sources and generated:
        for d in complete:
            for t in res.temperatures:
                fixed = res.first_seed_gain(f"{d}-fixed", t)
                gen = np.mean([res.first_seed_gain(f"{d}-{s}", t) for s in generated])
                pairs += 1
                wins += gen - fixed > 2 * pooled_sd(res, t)
                detail.append(f"{d.upper()} T={t:g}: {gen:+.1f}% vs {fixed:+.1f}%")
    spread = ", ".join(f"T={t:g} {pooled_sd(res, t):.1f}%" for t in res.temperatures)
    return {
        "finding": "(b) model-generated data beats fixed data (Fig. 4)",
        "measured here": f"mean gain over {', '.join(generated)} vs fixed, per divergence and "
        f"temperature: {'; '.join(detail)} (seed spread of a cell: {spread})",
        "rule": "generated > fixed by more than 2 x the seed spread, in every (divergence, "
        "temperature)",
        "reproduced": "n/a"
        if not pairs
        else ("yes" if wins == pairs else f"partly ({wins} of {pairs})"),
    }


def _finding_c(res: Results) -> dict:
    complete = _complete_divergences(res)
    means = {
        t: {d: np.mean([res.first_seed_gain(f"{d}-{s}", t) for s in res.data_sources])
            for d in complete}
        for t in res.temperatures
    }  # fmt: skip
    best = {t: max(m, key=m.get) if m else "n/a" for t, m in means.items()}
    # Taking the other temperature's best divergence costs (gain points) at this one:
    cost = {
        t: max((means[t][best[t]] - means[t][best[o]] for o in res.temperatures
                if best[o] in means[t]), default=0.0)
        for t in res.temperatures
    }  # fmt: skip
    matters = any(cost[t] > 2 * pooled_sd(res, t) for t in res.temperatures)
    return {
        "finding": "(c) the best divergence depends on the task and the temperature (Fig. 4)",
        "measured here": "best divergence (mean gain over data sources): "
        + ", ".join(f"T={t:g} {best[t].upper()} ({means[t].get(best[t], float('nan')):+.1f}%)"
                    for t in res.temperatures)
        + "; the other temperature's choice loses "
        + ", ".join(f"{cost[t]:.1f} points at T={t:g} (seed spread {pooled_sd(res, t):.1f})"
                    for t in res.temperatures)
        + " (one task here)",
        "rule": "the best divergences differ, and using one temperature's at the other loses "
        "more than 2 x the seed spread",
        "reproduced": "yes" if len(set(best.values())) > 1 and matters else "no",
    }  # fmt: skip


def _finding_d(res: Results) -> dict:
    per_t = {}
    for t in res.temperatures:
        pts = [(a, b) for tt, a, b in theory_points(res) if tt == t]
        per_t[t] = _spearman([a for a, _ in pts], [b for _, b in pts])
    return {
        "finding": "(d) tau from the TVD ranks drafts like measured tau (Fig. 3c)",
        "measured here": "Spearman rank correlation over every draft: "
        + ", ".join(f"T={t:g} {rho:.2f}" for t, rho in per_t.items()),
        "rule": "rank correlation >= 0.7 at every temperature",
        "reproduced": "yes" if all(rho >= 0.7 for rho in per_t.values()) else "no",
    }


def _finding_e(res: Results) -> dict:
    corr = {}
    for t in res.temperatures:
        pts = quality_points(res, t)
        corr[t] = _pearson([q for _, q, _ in pts], [g for _, _, g in pts])
    return {
        "finding": "(e) draft quality and tau gain are only weakly correlated (Fig. 5a)",
        "measured here": "Pearson correlation of chrF (greedy output) and tau gain over the "
        "distilled drafts: " + ", ".join(f"T={t:g} {r:.2f}" for t, r in corr.items()),
        "rule": "|r| < 0.5 at every temperature",
        "reproduced": "yes" if all(abs(r) < 0.5 for r in corr.values()) else "no",
    }


def _finding_f(res: Results) -> dict:
    shares = {m: _dominated_share(res, m) for m in QUALITY_AXES}
    total = shares["chrf"][1]
    verdict = lambda share: "yes" if share >= 0.75 else "no"
    return {
        "finding": "(f) with lenience the distilled draft's quality-latency curve dominates "
        "the standard draft's (Fig. 5b)",
        "measured here": (
            f"of the standard draft's {total} points, the share weakly dominated by a distilled "
            "point of the same lenience kind (or its lossless point): "
            + ", ".join(f"{shares[m][0]:.0%} in (latency, {name})"
                        for m, name in QUALITY_AXES.items())
        ) if total else "no lenience sweep",
        "rule": ">= 75% of the standard draft's points dominated, per quality measure",
        "reproduced": "n/a" if not total else "; ".join(
            f"{verdict(shares[m][0])} by {name}" for m, name in QUALITY_AXES.items()
        ),
    }  # fmt: skip


def findings(res: Results) -> list[dict]:
    """The findings (a)-(f): each as the paper states it, the figure measured, the rule."""
    rows = [
        _finding_a(res),
        _finding_b(res),
        _finding_c(res),
        _finding_d(res),
        _finding_e(res),
        _finding_f(res),
    ]
    if len(res.seeds) < 2:
        rows[0]["reproduced"] += " (one seed: no spread)"
    return rows


# --------------------------------------------------------------------------------------------
# Figures.


def _fig2(res: Results, plt, save) -> None:
    """Fig. 2: recipes."""
    temps = res.temperatures
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(res.recipes)
    width = 0.8 / max(len(temps), 1)
    for k, t in enumerate(temps):
        stats_ = [_mean_sd(res.gains(res.recipes[r], t)) for r in names]
        ax.bar(
            np.arange(len(names)) + k * width,
            [m for m, _ in stats_],
            width,
            yerr=[sd for _, sd in stats_],
            capsize=3,
            label=f"T = {t:g}",
        )
    ax.set_xticks(np.arange(len(names)) + width * (len(temps) - 1) / 2)
    ax.set_xticklabels([RECIPE_NAMES.get(n, n) for n in names])
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("tau gain over the standard draft (%)")
    ax.legend()
    save(fig, "fig2_recipes.png")


def _fig4(res: Results, plt, save) -> None:
    """Fig. 4: grid."""
    temps = res.temperatures
    fig, axes = plt.subplots(1, len(temps), figsize=(4.2 * len(temps), 3.4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        values = np.array(
            [
                [res.first_seed_gain(f"{d}-{s}", t) for s in res.data_sources]
                for d in res.divergences
            ]
        )
        im = ax.imshow(values, cmap="viridis")
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="w")
        ax.set_xticks(range(len(res.data_sources)), res.data_sources, rotation=30)
        ax.set_yticks(range(len(res.divergences)), [d.upper() for d in res.divergences])
        ax.set_title(f"tau gain (%), T = {t:g}")
        fig.colorbar(im, ax=ax, shrink=0.8)
    save(fig, "fig4_grid.png")


def _fig3a(res: Results, plt, save) -> None:
    """Fig. 3a: training curves of the recipes (first seed)."""
    if res.curves:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        first = res.seeds[0] if res.seeds else 0
        for recipe, cell in res.recipes.items():
            pts = sorted(
                (r["step"], r["eval_alpha"], r["eval_tau"])
                for r in res.curves
                if r["cell"] == cell and r["seed"] == first
            )
            if pts:
                steps, alpha, tau = zip(*pts)
                axes[0].plot(steps, alpha, marker=".", label=RECIPE_NAMES.get(recipe, recipe))
                axes[1].plot(steps, tau, marker=".")
        axes[0].set(xlabel="training step", ylabel="alpha (held-out prompts)")
        axes[1].set(xlabel="training step", ylabel="tau")
        axes[0].legend(fontsize=7)
        save(fig, "fig3a_training.png")


def _fig3b(res: Results, plt, save) -> None:
    """Fig. 3b: per-prompt tau, standard vs the best cell at each temperature."""
    temps = res.temperatures
    fig, axes = plt.subplots(1, len(temps), figsize=(4 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        std = next(r for r in res.grid if r["cell"] == "standard" and r["temperature"] == t)
        best = max(res.cells, key=lambda c: res.first_seed_gain(c, t))
        dist = next(r for r in res.grid if r["cell"] == best and r["temperature"] == t)
        x, y = std["tau_per_prompt"], dist["tau_per_prompt"]
        ax.scatter(x, y, s=10)
        hi = max(max(x), max(y)) + 0.2
        ax.plot([1, hi], [1, hi], "k--", lw=0.8)
        above = np.mean(np.array(y) > np.array(x))
        ax.set(
            xlabel="tau, standard draft",
            ylabel=f"tau, {dist['draft']}",
            title=f"T = {t:g}: {above:.0%} of prompts above the diagonal",
        )
    save(fig, "fig3b_per_prompt.png")


def _fig3c(res: Results, plt, save) -> None:
    """Fig. 3c: theory vs measured."""
    temps = res.temperatures
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for t in temps:
        pts = [(a, b) for tt, a, b in theory_points(res) if tt == t]
        ax.scatter([a for a, _ in pts], [b for _, b in pts], s=14, label=f"T = {t:g}")
    lo = min(min(a, b) for _, a, b in theory_points(res)) - 0.1
    hi = max(max(a, b) for _, a, b in theory_points(res)) + 0.1
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set(xlabel="tau from TVD (theory)", ylabel="tau measured")
    ax.legend()
    save(fig, "fig3c_tau_theory.png")


def _fig5a(res: Results, plt, save) -> None:
    """Fig. 5a: quality vs gain."""
    temps = res.temperatures
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for t in temps:
        pts = quality_points(res, t)
        ax.scatter([g for *_, g in pts], [q for _, q, _ in pts], s=14, label=f"T = {t:g}")
    std_q = next((r["chrf"] for r in res.quality if r["model"] == "standard"), None)
    if std_q is not None:
        ax.axhline(std_q, color="gray", ls=":", label="standard draft")
    ax.set(xlabel="tau gain over the standard draft (%)", ylabel="chrF of the draft's output")
    ax.legend()
    save(fig, "fig5a_quality.png")


def _fig5b(res: Results, plt, save) -> None:
    """Fig. 5b: lenience, quality (chrF; the target's NLL) vs batch-1 latency per kind."""
    if not res.lenience:
        return
    kinds = [
        k for k in dict.fromkeys(r["lenience"] for r in res.lenience) if k not in (None, "none")
    ]
    fig, axes = plt.subplots(2, len(kinds), figsize=(4 * len(kinds), 6.4), squeeze=False)
    target = next(r for r in res.lenience if r["draft"] == "target")
    drafts = dict.fromkeys(r["draft"] for r in res.lenience if r["draft"] != "target")
    for row, (metric, name) in enumerate(QUALITY_AXES.items()):
        for ax, kind in zip(axes[row], kinds):
            for draft in drafts:
                pts = sorted(
                    (r["latency_ms"], r[metric], r["epsilon"])
                    for r in res.lenience
                    if r["draft"] == draft and r["lenience"] in (kind, "none")
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=draft)
                for lat, q, eps in pts:
                    ax.annotate(f"{eps:g}", (lat, q), fontsize=6)
            ax.scatter(
                [target["latency_ms"]],
                [target[metric]],
                marker="*",
                s=80,
                c="k",
                label="target (plain)",
            )
            ax.set(xlabel="ms per token (batch 1)", ylabel=name, title=f"lenience {kind}")
    axes[0][0].legend(fontsize=7)
    save(fig, "fig5b_lenience.png")


FIGURES = (_fig2, _fig4, _fig3a, _fig3b, _fig3c, _fig5a, _fig5b)


def _plots(res: Results, out: str) -> list[str]:
    """Writes every figure into `out`; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(name)

    for figure in FIGURES:
        figure(res, plt, save)
    return written


def write_report(records: Sequence[Mapping[str, Any]], output_dir: str) -> str:
    """Writes the tables, figures and findings.md into output_dir; returns the Markdown."""
    res = Results(records)
    parts = [
        _write_table(
            recipes_table(res),
            os.path.join(output_dir, "recipes"),
            "Recipes (Fig. 2 / Table 1): tau at the study's gamma",
        )
    ]
    for t in res.temperatures:
        stem = os.path.join(output_dir, f"grid_T{t:g}")
        parts.append(
            _write_table(
                grid_table(res, t),
                stem,
                f"tau gain (%) over the standard draft, T = {t:g} (Fig. 4)",
            )
        )
    parts.append(
        _write_table(
            findings(res), os.path.join(output_dir, "findings"), "The paper's findings, here"
        )
    )
    figures = _plots(res, output_dir)
    parts.append("Figures: " + ", ".join(figures))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    if len(argv) != 1:
        raise SystemExit("usage: python -m distillspec.study.report STUDY_DIR")
    with open(os.path.join(argv[0], "records.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    print(write_report(records, argv[0]))


if __name__ == "__main__":
    main()
