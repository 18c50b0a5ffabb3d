"""What `distillspec.runs.plan` writes: plan.json, plan.md, plan.png, draft.gin, the terminal
summary, and the check of a plan against fully trained drafts (validation.json / .md)."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping
from typing import Any

from distillspec.evaluation import planning
from distillspec.records import write_json_atomic

DRAFTS_DIR = "drafts"  # OUTPUT_DIR/drafts/<candidate>.gin: each candidate's draft and recipe.
NO_PILOT = "no pilot: ranked by the acceptance rate each needs to break even (lowest first)"


def _break_even(row) -> float:
    """The lowest acceptance rate at which the candidate breaks even at some gamma (2: never)."""
    found = [a for a in row["alpha_needed"]["1"].values() if a is not None]
    return min(found, default=2.0)


def finish(output_dir: str, chosen, rows: dict[str, dict], costs, context) -> dict[str, Any]:
    """Ranks the rows, writes OUTPUT_DIR/plan.{json,md,png} and draft.gin, prints the summary;
    returns plan.json's content."""
    for name, row in rows.items():
        row["best_gamma"], row["best_speedup"] = _best_of(row["predicted_speedup"] or {})
        row["gin_file"] = f"{DRAFTS_DIR}/{name}.gin"
    piloted = any(row["predicted_speedup"] for row in rows.values())
    if piloted:
        key = lambda n: (rows[n]["best_speedup"] is None, -(rows[n]["best_speedup"] or 0),
                         rows[n]["params"])  # fmt: skip
    else:
        key = lambda n: (_break_even(rows[n]), rows[n]["params"])
    order = sorted(rows, key=lambda n: (rows[n]["never_wins"] is not None, *key(n)))
    for i, name in enumerate(order, 1):
        rows[name]["rank"] = i
    winners = [n for n in order if not rows[n]["never_wins"]]
    choice = winners[0] if winners else None
    result = {"context": context, "choice": choice, "order": order, "candidates": rows,
              "profile": costs}  # fmt: skip
    os.makedirs(output_dir, exist_ok=True)
    write_json_atomic(os.path.join(output_dir, "plan.json"), result)
    headline = _headline(choice, rows, piloted, len(rows))
    with open(os.path.join(output_dir, "plan.md"), "w") as f:
        f.write(markdown(result, headline))
    plot(rows, os.path.join(output_dir, "plan.png"))
    by_name = {c.name: c for c in chosen}
    if choice:
        with open(os.path.join(output_dir, "draft.gin"), "w") as f:
            f.write(draft_gin(by_name[choice], context, headline, rows[choice]["best_gamma"]))
    # Every candidate's, to train any of them (a tie's other side, the second choice).
    os.makedirs(os.path.join(output_dir, DRAFTS_DIR), exist_ok=True)
    for name in order:
        with open(os.path.join(output_dir, DRAFTS_DIR, f"{name}.gin"), "w") as f:
            f.write(draft_gin(by_name[name], context, _candidate_line(name, rows[name]),
                              rows[name]["best_gamma"], f"{DRAFTS_DIR}/{name}.gin"))  # fmt: skip
    print(summary(result, headline, output_dir))
    return result


def _headline(choice, rows, piloted: bool, count: int) -> str:
    if choice is None:
        return (f"No candidate of {count} can win on this machine's costs, even accepting every "
                "draft: price smaller drafts (plan.candidates)")  # fmt: skip
    row = rows[choice]
    size = f"{row['params'] / 1e6:.2f} M parameters, c = {_fmt(row['c'], 3)}"
    if piloted and row["best_speedup"] and row["best_speedup"] < 1:
        return (
            f"No candidate is predicted to speed decoding up after its pilot; the best, "
            f"{choice} ({size}), gives {row['best_speedup']:.2f}x at gamma "
            f"{row['best_gamma']}: a longer pilot (PILOT_STEPS) or cheaper drafts may"
        )
    if piloted and row["best_speedup"]:
        return (
            f"Train {choice} ({size}): predicted {row['best_speedup']:.2f}x batch-1 latency "
            f"at gamma {row['best_gamma']}, the best of {count} candidates after a pilot"
        )
    return (f"Train {choice} ({size}): it breaks even at the lowest acceptance rate "
            f"({_break_even(row):.2f}) of {count} candidates ({NO_PILOT})")  # fmt: skip


def _candidate_line(name: str, row: Mapping[str, Any]) -> str:
    """drafts/<name>.gin's first line: the candidate's rank and what the plan says of it."""
    size = f"{row['params'] / 1e6:.2f} M parameters, c = {_fmt(row['c'], 3)}"
    if row["never_wins"]:
        said = f"never wins: {row['never_wins']}"
    elif row["best_speedup"]:
        said = f"predicted {row['best_speedup']:.2f}x batch-1 latency at gamma {row['best_gamma']}"
    else:
        said = f"breaks even at acceptance {_break_even(row):.2f} (no pilot)"
    return f"{name} ({size}), rank {row['rank']} of the plan: {said}"


def _fmt(x, digits=2, none="—") -> str:
    return none if x is None else f"{x:.{digits}f}"


def _pilot_seconds(rows) -> float:
    return sum((row["pilot"] or {}).get("seconds", 0.0) for row in rows.values())


def _r_gammas(rows, gammas) -> str:
    r = next(iter(rows.values()))["r_gamma"]
    return ", ".join(f"{_fmt(r.get(g))} (γ = {g})" for g in gammas)


def markdown(result: Mapping[str, Any], headline: str) -> str:
    """plan.md: the headline, one row per candidate, the acceptance needed per gamma."""
    ctx, rows = result["context"], result["candidates"]
    gammas = ctx["gammas"]
    out = [f"# {title(ctx)}\n\n**{headline}.**\n",
           f"Target `{ctx['teacher_checkpoint']}`, data `{ctx['task']}`, temperature "
           f"{ctx['temperature']:g}, costs "
           + (f"from the profile `{ctx['profile']}`" if ctx["profile"] else "measured here")
           + f"; pilot {ctx['pilot_steps']} steps of the recipe ({ctx['train_steps']} in a full "
           f"run; {_pilot_seconds(rows):.0f} s for all pilots), acceptance estimate "
           f"`{ctx['estimate']}`. The target's r_γ: {_r_gammas(rows, gammas)}.\n",
           "| Rank | Candidate | Kind | Params (M) | MB | c | α used (pilot: held out / proxy) "
           "| Predicted speed-up (γ) | Pilot (s) | Never wins |",
           "|---:|---|---|---:|---:|---:|---|---|---:|---|"]  # fmt: skip
    for name in result["order"]:
        row = rows[name]
        pilot = row["pilot"] or {}
        speed = (f"{row['best_speedup']:.2f}x ({row['best_gamma']})" if row["best_speedup"]
                 else "—")  # fmt: skip
        out.append(
            f"| {row['rank']} | {name} | {row['kind']} | {row['params'] / 1e6:.3f} | "
            f"{_fmt(row['megabytes'])} | {_fmt(row['c'], 3)} | {_fmt(row['alpha'])} "
            f"({_fmt(pilot.get('held_out'))} / "
            f"{_fmt(pilot.get('proxy'))}) | {speed} | {_fmt(pilot.get('seconds'), 0)} | "
            f"{row['never_wins'] or ''} |"
        )
    out += ["", "Acceptance rate α (accepted / proposed drafts, as `evaluate` reports it) each "
            "candidate needs for a batch-1 speed-up of 1 / 1.5 / 2, priced as the predictions "
            "are (— : not even at α = 1):", "",
            "| Candidate | " + " | ".join(f"γ = {g}" for g in gammas) + " |",
            "|---|" + "---|" * len(gammas)]  # fmt: skip
    for name in result["order"]:
        needed = rows[name]["alpha_needed"]
        cells = [" / ".join(_fmt(needed[f"{s:g}"][g]) for s in planning.SPEEDUPS) for g in gammas]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "![predicted speed-up against draft parameters](plan.png)", ""]
    return "\n".join(out)


def title(ctx: Mapping[str, Any]) -> str:
    """plan.md's first line: the temperature planned, why, and how to plan for another."""
    temperature, temps = ctx["temperature"], ctx.get("temperatures") or [ctx["temperature"]]
    mode = "greedy" if temperature == 0 else "sampling"
    why = ctx.get("temperature_source") or "set by plan.temperature(s)"
    out = f"Draft plan at temperature {temperature:g} ({mode}; {why})"
    others = [t for t in temps if t != temperature]
    if others:
        where = lambda t: "plan.md" if t == temps[0] else f"temperature-{t:g}/plan.md"
        first = temperature == temps[0]
        return (
            out
            + ": the plan at "
            + ", ".join(f"T = {t:g} is in {'' if first else '../'}{where(t)}" for t in others)
        )
    other = 1 if temperature == 0 else 0
    return (f"{out}: to plan for T = {other} instead, add --temperatures {other}, or both in "
            f"one run: --temperatures {temperature:g},{other}")  # fmt: skip


def summary(result: Mapping[str, Any], headline: str, output_dir: str) -> str:
    """The terminal summary, at most 100 columns."""
    lines = textwrap.wrap(headline + ".", 100, break_long_words=False, break_on_hyphens=False)
    lines.append(f"{'rank':>4}  {'candidate':<24} {'params M':>8} {'c':>6} {'alpha':>6} "
                 f"{'speed-up':>9} {'gamma':>5}  note")  # fmt: skip
    for name in result["order"]:
        row = result["candidates"][name]
        note = "never wins" if row["never_wins"] else ""
        lines.append(
            f"{row['rank']:>4}  {name[:24]:<24} {row['params'] / 1e6:>8.3f} {_fmt(row['c'], 3):>6} "
            f"{_fmt(row['alpha']):>6} {_fmt(row['best_speedup']):>9} "
            f"{row['best_gamma'] or '—':>5}  {note}"
        )
    lines.append(f"plan.md, plan.png, plan.json, draft.gin, drafts/<candidate>.gin: {output_dir}")
    return "\n".join(line[:100] for line in lines)


def draft_gin(candidate, context, headline: str, gamma: int | None = None,
              path: str = "draft.gin") -> str:  # fmt: skip
    """A candidate's draft (draft.gin: the chosen one; drafts/<name>.gin: each) and the recipe
    the plan priced, for `python -m distillspec.train --gin_file=runs/distill.gin
    --gin_file=<path>`; with the γ of its best predicted speed-up (after a pilot) as the serve
    commands' γ (train.serve_gamma)."""
    serve = (
        "# The serve commands' γ (export/SERVING.md): the best predicted one.\n"
        f"train.serve_gamma = {int(gamma)}\n"
        if gamma is not None
        else ""
    )
    return (
        f"# {headline}.\n# Written by python -m distillspec.plan. Train it with the recipe the "
        "plan priced:\n"
        f"#   python -m distillspec.train --gin_file=runs/distill.gin --gin_file={path} \\\n"
        f'#     --gin.TEACHER_CHECKPOINT=\\"{context["teacher_checkpoint"]}\\" '
        '--gin.MODEL_DIR=\\"DIR\\"\n\n# The draft.\n'
        + candidate.gin()
        + serve
        + "\n# The recipe (its pilot ran the first steps of exactly this run).\n"
        + context["recipe"]
    )


def plot(rows: Mapping[str, Mapping[str, Any]], path: str) -> None:
    """plan.png: each candidate's predicted speed-up (pilot) and its ceiling (every draft
    accepted) against its parameters, with the break-even line. Labels of candidates close on
    the plot are stacked apart, the legend sits below the axes (it hides no point) and lists
    only the series drawn, and the log axis is ticked at 1, 2 and 5 per decade."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    points = []
    for name, row in rows.items():
        x, ceiling = row["params"] / 1e6, (row.get("ceiling") or (None, None))[1]
        if ceiling:
            ax.scatter([x], [ceiling], marker="_", color="grey", s=200)
        if row["best_speedup"]:
            ax.scatter([x], [row["best_speedup"]], color="C0")
        points.append((x, row["best_speedup"] or ceiling or 1.0, name))
    values = [y for _, y, _ in points] + [1.0]
    span = (max(values) - min(values)) or 1.0
    placed = []
    for x, y, name in sorted(points):
        near = sum(1 for px, py in placed if abs(math.log(x / px)) < 0.5 and abs(y - py) < span / 8)
        ax.annotate(name, (x, y), fontsize=7, xytext=(4, 4 + 9 * near), textcoords="offset points")
        placed.append((x, y))
    ax.axhline(1.0, color="C3", linestyle="--", label="break-even (1x)")
    if any(row["best_speedup"] for row in rows.values()):
        ax.scatter([], [], color="C0", label="predicted after the pilot (best γ)")
    if any((row.get("ceiling") or (None, None))[1] for row in rows.values()):
        ax.scatter([], [], marker="_", color="grey", label="ceiling: every draft accepted")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.15, y=0.12)
    ax.set_xlabel("draft parameters (M)")
    ax.set_ylabel("batch-1 latency speed-up")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# The check: predicted against measured.
# --------------------------------------------------------------------------------------------


def _best_of(speedups: Mapping[int, float | None]) -> tuple[int | None, float | None]:
    known = {g: s for g, s in speedups.items() if s is not None}
    gamma = max(known, key=known.get, default=None)
    return gamma, known.get(gamma)


def validation(result: Mapping[str, Any], measured: Mapping[str, Mapping[int, Mapping]]) -> dict:
    """Predicted against measured batch-1 speed-up of each fully trained candidate (measured:
    {name: {gamma: evaluate's record}}): each one's best over gamma both ways, the Spearman
    correlation of the two rankings, how far the plan's choice measures below the best
    measured, and the same for every acceptance estimate of the pilot."""
    import scipy.stats

    rows = result["candidates"]
    per = {}
    for name, records in measured.items():
        predicted = rows[name]["predicted_speedup"]
        gamma_p, best_p = _best_of(predicted)
        gamma_m, best_m = _best_of({g: r["latency_speedup"] for g, r in records.items()})
        at = records[gamma_m]
        per[name] = {
            "predicted_speedup": best_p, "predicted_gamma": gamma_p,
            "measured_speedup": best_m, "measured_gamma": gamma_m,
            "measured_at_predicted_gamma": records[gamma_p]["latency_speedup"],
            "error_pct": 100 * (best_p / best_m - 1),
            "tau": at["tau"], "tau_ci95": at["tau_ci95"], "alpha": at["alpha"],
            "predicted_tau": {e: planning.taus_from_alpha(a, [gamma_m])[gamma_m]
                              for e, a in planning.pilot_alphas(rows[name]["pilot"]).items()},
            "by_gamma": {g: {"predicted": predicted.get(g), "measured": r["latency_speedup"],
                             "tau": r["tau"], "tau_ci95": r["tau_ci95"]}
                         for g, r in sorted(records.items())},
        }  # fmt: skip
    names = list(per)
    actual = [per[n]["measured_speedup"] for n in names]
    correlation = lambda xs: float(scipy.stats.spearmanr(xs, actual)[0]) if len(xs) > 2 else None
    by_estimate = {}
    estimates = {e for n in names for e in rows[n].get("predicted_by_estimate") or {}}
    for estimate in sorted(estimates):
        xs = [_best_of(rows[n]["predicted_by_estimate"].get(estimate) or {})[1] for n in names]
        if all(x is not None for x in xs):
            by_estimate[estimate] = {
                "spearman": correlation(xs),
                "mean_abs_error_pct": sum(abs(100 * (x / a - 1)) for x, a in zip(xs, actual))
                / len(xs),
            }
    best = max(actual, default=None)
    top = result["choice"]
    return {
        "candidates": per,
        "spearman": correlation([per[n]["predicted_speedup"] for n in names]),
        "top_choice": top,
        "top_choice_vs_best_measured_pct": (
            100 * (per[top]["measured_speedup"] / best - 1) if top in per and best else None),
        "max_abs_error_pct": max((abs(p["error_pct"]) for p in per.values()), default=None),
        "by_estimate": by_estimate,
        "context": result["context"],
    }  # fmt: skip


def validation_markdown(check: Mapping[str, Any]) -> str:
    """The check as Markdown (validation.md, and the results page)."""
    ctx = check["context"]
    out = [
        f"Target `{ctx['teacher_checkpoint']}`, data `{ctx['task']}`, T = {ctx['temperature']:g}; "
        f"pilot {ctx['pilot_steps']} steps, full runs {ctx['train_steps']} steps, acceptance "
        f"estimate `{ctx['estimate']}`.\n",
        f"- Spearman (predicted against measured ranking): **{_fmt(check['spearman'])}**",
        f"- The plan's choice, {check['top_choice']}, measures "
        f"**{_fmt(check['top_choice_vs_best_measured_pct'], 1)}%** against the best measured",
        f"- Largest |predicted / measured − 1|: **{_fmt(check['max_abs_error_pct'], 1)}%**\n",
        "Each candidate's best batch-1 latency speed-up over γ, predicted from its pilot and "
        "measured after the full run (τ at the measured best γ with its 95% interval over "
        "prompts; a static round's cost is fixed, so the speed-up's spread over prompts is "
        "τ's):\n",
        "| Candidate | Predicted (γ) | Measured (γ) | Error | Measured at the predicted γ | "
        "τ measured | τ predicted by each estimate |",
        "|---|---:|---:|---:|---:|---|---|",
    ]  # fmt: skip
    for name, p in check["candidates"].items():
        taus = ", ".join(f"{e} {t:.2f}" for e, t in sorted(p["predicted_tau"].items()))
        out.append(
            f"| {name} | {p['predicted_speedup']:.2f}x ({p['predicted_gamma']}) | "
            f"{p['measured_speedup']:.2f}x ({p['measured_gamma']}) | {p['error_pct']:+.1f}% | "
            f"{p['measured_at_predicted_gamma']:.2f}x | {p['tau']:.2f} ± {p['tau_ci95']:.2f} | "
            f"{taus} |"
        )
    if check.get("by_estimate"):
        out += [
            "",
            "Every acceptance estimate of the pilot, judged the same way:",
            "",
            "| Estimate | Spearman | Mean |predicted / measured − 1| |",
            "|---|---:|---:|",
        ]
        for estimate, e in sorted(check["by_estimate"].items()):
            out.append(f"| `{estimate}` | {_fmt(e['spearman'])} | {e['mean_abs_error_pct']:.1f}% |")
    return "\n".join(out) + "\n"


def write_validation(output_dir: str, check: Mapping[str, Any], json_path: str | None) -> None:
    for path in {os.path.join(output_dir, "validation.json"), json_path} - {None}:
        write_json_atomic(path, check)
    with open(os.path.join(output_dir, "validation.md"), "w") as f:
        f.write("# Plan check\n\n" + validation_markdown(check))
    print(validation_markdown(check))
