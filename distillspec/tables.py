"""Turning evaluation records (records.jsonl) into tables and plots, without JAX.

records.jsonl holds two kinds of records. Grid records (with a 'gamma' key, no 'policy' key) go
into DistillSpec's Table C.1 layout: one row per (task/split, temperature, gamma) with tau,
the batch throughput speed-up and the batch-1 latency speed-up of the draft without
distillation and with distillation, and the differences (tau as a relative improvement in %,
speed-ups as absolute differences, e.g. +0.14), plus a tau-vs-gamma plot. Policy records (with
a 'policy' key: target, static-<k>, static-opt, heuristic, confidence, disco, cumulative,
oracle) go into DISCO's Table 1 layout: one row per (task/split, draft, policy) with latency
(ms/token), speed-up over the target, mean speculation lookahead (SL), tau, alpha, whether the
output equals the target's, and the latency reduction relative to static-opt; the oracle's SL
histogram gives DISCO's Figure 4. In both kinds, a later record of the same row replaces an
earlier one (records.jsonl is append-only).

Usage: python -m distillspec.tables RECORDS_JSONL [--out_dir DIR]
writes table.md, table.csv and tau_vs_gamma.png (if grid records exist), disco_table.md,
disco_table.csv (if policy records exist) and oracle_sl_hist.png (if oracle records exist),
and prints the Markdown tables (Table C.1 first).

This module is a pure formatter: it imports only the standard library, numpy and matplotlib, so
reports can be made on a machine without an accelerator stack (a test checks that jax stays out).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distillspec.records import POLICY_NAMES, TARGET_POLICY, eval_set, read_jsonl, task_label

Row = dict[str, Any]

# Markdown headers of the comparison columns (CSV keeps the machine-friendly keys).
HEADERS = {
    "task": "Task",
    "split": "Split",
    "temperature": "Temp",
    "gamma": "γ",
    "alpha_baseline": "α w/o distillation",
    "tau_baseline": "τ w/o distillation",
    "speedup_baseline": "Throughput speed-up w/o distillation",
    "latency_speedup_baseline": "Batch-1 latency speed-up w/o distillation",
    "alpha_distilled": "α with distillation",
    "tau_distilled": "τ with distillation",
    "speedup_distilled": "Throughput speed-up with distillation",
    "latency_speedup_distilled": "Batch-1 latency speed-up with distillation",
    "tau_improvement_pct": "Δτ (%)",
    "speedup_difference": "Δ throughput speed-up",
    "latency_speedup_difference": "Δ batch-1 latency speed-up",
    # DISCO Table 1 (policy records).
    "draft": "Draft",
    "policy": "Policy",
    "sl_max": "SL max",
    "threshold": "Threshold",
    "latency_ms": "Latency (ms/token)",
    "modeled_latency_ms": "Modeled (ms/token)",
    "speedup": "Speed-up",
    "mean_sl": "Mean SL",
    "tau": "τ",
    "alpha": "α",
    "exact": "Exact",
    "vs_static_opt_pct": "Latency vs static-opt (%)",
    "own_work_ms": "Own work (ms/round)",
    # Over seeds (seed_spread_table).
    "seeds": "Seeds",
    "tau_ratio": "τ distilled / τ standard",
    "gain_exceeds_spread": "Gain > 2 sd",
    # Model quality (evaluation.quality records).
    "model": "Model",
    "num_prompts": "Prompts",
    "nll": "NLL (nats/token)",
    "distinct_4": "distinct-4",
    "repeating_share": "Looping outputs",
    "chrf": "chrF of greedy output",
    "target_nll": "Target NLL of greedy output",
}
# Headers of the per-draft grid columns ('speedup[fkl]' reads 'Throughput speed-up fkl'):
# 'speedup' alone is the policy table's batch-1 speed-up over the target.
_DRAFT_HEADERS = {
    "speedup": "Throughput speed-up",
    "latency_speedup": "Batch-1 latency speed-up",
}
GROUP_KEYS = ("task", "split", "temperature", "gamma")  # One Table C.1 row.
_TEXT_COLUMNS = ("task", "split", "draft", "policy", "model")  # Left-aligned in Markdown.
_THREE_DECIMALS = ("nll", "distinct_4", "repeating_share")
# DISCO Table 1 order; static-<k> sort by k between target and static-opt, unknown names last.
_POLICY_ORDER = (TARGET_POLICY, *POLICY_NAMES)
_POLICY_COLUMNS = (
    "sl_max", "threshold", "latency_ms", "modeled_latency_ms", "speedup", "mean_sl", "tau",
    "alpha", "exact",
)  # fmt: skip


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a records.jsonl file (written by `distillspec.records.append_records`)."""
    return read_jsonl(path)


def is_policy_record(record: Mapping[str, Any]) -> bool:
    """Whether a record is a DISCO policy record (it has a 'policy' key) rather than a grid
    record of the Table C.1 layout."""
    return "policy" in record


def _group_key(record: Mapping[str, Any]) -> tuple:
    return (
        str(record.get("task", "")),
        str(record.get("split", "")),
        float(record["temperature"]),
        int(record["gamma"]),
    )


def _latest(records: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Mapping[str, Any]]]:
    """{(task, split, temperature, gamma): {draft: record}} of the grid records (policy records
    are skipped); a later record of the same draft and grid point replaces an earlier one
    (records.jsonl is append-only)."""
    groups: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for record in records:
        if is_policy_record(record):
            continue
        groups.setdefault(_group_key(record), {})[str(record["draft"])] = record
    return dict(sorted(groups.items()))


def _ratio_pct(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or not old:
        return None
    return 100.0 * (new / old - 1.0)


def _difference(new: float | None, old: float | None) -> float | None:
    return None if new is None or old is None else new - old


def _metric(record: Mapping[str, Any] | None, key: str) -> float | None:
    return None if record is None or record.get(key) is None else float(record[key])


def records_to_table(
    records: Iterable[Mapping[str, Any]], baseline: str = "standard", distilled: str = "distilled"
) -> list[Row]:
    """Rows of the Table C.1 layout, one per (task, split, temperature, gamma), sorted; policy
    records (see `policy_table`) are ignored.

    Two speed-ups: `speedup` is the batch throughput speed-up (on the evaluation's prompt
    batches) and `latency_speedup` the batch-1 latency speed-up; the latter's columns appear
    when some record has it (records of older runs lack it).

    If drafts named `baseline` and `distilled` both occur, each row holds alpha_baseline,
    tau_baseline, speedup_baseline, latency_speedup_baseline, alpha_distilled, tau_distilled,
    speedup_distilled, latency_speedup_distilled, tau_improvement_pct (100 * (tau_distilled /
    tau_baseline - 1)), speedup_difference and latency_speedup_difference (distilled -
    baseline); any other drafts follow as alpha[name] / tau[name] / speedup[name] /
    latency_speedup[name] columns. Otherwise every draft gets its own alpha[name] / tau[name] /
    speedup[name] (/ latency_speedup[name]) columns (Table C.1 has both alpha and tau). Each
    alpha and tau has a `_ci95` companion (alpha_ci95[name], tau_baseline_ci95, ...: the
    half-width of its 95% interval over prompts), shown in Markdown as "3.84 ± 0.21". A value
    missing at a grid point is None.
    """
    groups = _latest(records)
    names = sorted({name for drafts in groups.values() for name in drafts})
    compare = baseline in names and distilled in names
    # Records of runs before batch-1 latency was measured keep their old layout.
    latency = any(
        r.get("latency_speedup") is not None for drafts in groups.values() for r in drafts.values()
    )
    others = [n for n in names if not (compare and n in (baseline, distilled))]
    rows = []
    for key, drafts in groups.items():
        row: Row = dict(zip(GROUP_KEYS, key))
        if compare:
            base, dist = drafts.get(baseline), drafts.get(distilled)
            tau_b, tau_d = _metric(base, "tau"), _metric(dist, "tau")
            speed_b, speed_d = _metric(base, "speedup"), _metric(dist, "speedup")
            for side, record in (("baseline", base), ("distilled", dist)):
                for metric in ("alpha", "alpha_ci95", "tau", "tau_ci95", "speedup"):
                    row[_side_key(metric, side)] = _metric(record, metric)
                if latency:
                    row[f"latency_speedup_{side}"] = _metric(record, "latency_speedup")
            row["tau_improvement_pct"] = _ratio_pct(tau_d, tau_b)
            row["speedup_difference"] = _difference(speed_d, speed_b)
            if latency:
                row["latency_speedup_difference"] = _difference(
                    _metric(dist, "latency_speedup"), _metric(base, "latency_speedup")
                )
        for name in others:
            metrics = ("alpha", "alpha_ci95", "tau", "tau_ci95", "speedup")
            for metric in metrics + (("latency_speedup",) if latency else ()):
                row[f"{metric}[{name}]"] = _metric(drafts.get(name), metric)
        rows.append(row)
    return rows


SUMMARY_WIDTH = 100  # Columns of the terminal summary (GUIDE.md §7).


def _best_gamma_row(rows: Sequence[Row]) -> Row:
    """The row whose distilled draft has the best batch-1 latency speed-up (τ without one)."""
    for key in ("latency_speedup_distilled", "tau_distilled"):
        scored = [r for r in rows if r.get(key) is not None]
        if scored:
            return max(scored, key=lambda r: r[key])
    return rows[0]


def _arrow(row: Row, metric: str, spec: str, unit: str = "") -> str:
    """'0.227 → 0.406': the metric of the standard draft, then of the distilled one."""
    value = lambda side: row.get(f"{metric}_{side}")
    cell = lambda side: "–" if value(side) is None else format(value(side), spec) + unit
    return f"{cell('baseline')} → {cell('distilled')}"


def terminal_summary(
    records: Iterable[Mapping[str, Any]],
    table_path: str | os.PathLike,
    baseline: str = "standard",
    distilled: str = "distilled",
) -> str:
    """A summary of the grid records no wider than SUMMARY_WIDTH columns: per eval set and
    temperature, `baseline` → `distilled` α, τ and batch-1 latency speed-up over plain decoding,
    at the γ where the distilled draft's batch-1 latency speed-up is best (its τ when latency
    was not measured), and the path of the full table. Without both drafts' records, each
    draft of whatever name at its own best γ (`_drafts_summary`); empty without records."""
    records = list(records)
    rows = [r for r in records_to_table(records, baseline, distilled) if "tau_baseline" in r]
    if not rows:
        return _drafts_summary(records, table_path)
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((eval_set(row), row["temperature"]), []).append(row)
    lines = [
        f"Summary: {baseline} → {distilled} draft at the γ of the best batch-1 latency speed-up",
        f"{'eval set':<24} {'T':>3} {'γ':>2}  {'α':<15} {'τ':<13} batch-1 latency speed-up",
    ]
    for (name, temperature), group in groups.items():
        row = _best_gamma_row(group)
        alpha, tau = _arrow(row, "alpha", ".3f"), _arrow(row, "tau", ".2f")
        latency = _arrow(row, "latency_speedup", ".2f", "×")
        lines.append(
            f"{name[:24]:<24} {temperature:>3g} {row['gamma']:>2}  {alpha:<15} {tau:<13} {latency}"
        )
    lines += ["Full table (every γ, throughput too):", f"  {os.fspath(table_path)}"]
    return "\n".join(lines)


def _drafts_summary(records: Sequence[Mapping[str, Any]], table_path) -> str:
    """Per eval set, temperature and draft: α, τ and batch-1 latency speed-up at the γ of the
    draft's best batch-1 latency speed-up (its τ when latency was not measured)."""
    best: dict[tuple, Mapping[str, Any]] = {}
    score = lambda r: (r.get("latency_speedup") is not None, r.get("latency_speedup") or r["tau"])
    for r in (r for r in records if not is_policy_record(r) and r.get("tau") is not None):
        key = (eval_set(r), r["temperature"], str(r["draft"]))
        best[key] = max(best.get(key, r), r, key=score)
    lines = ["Summary: each draft at the γ of its best batch-1 latency speed-up",
             f"{'eval set':<24} {'T':>3} {'draft':<16} {'γ':>2}  {'α':<6} {'τ':<5} batch-1 "
             "latency speed-up"]  # fmt: skip
    for (name, temperature, draft), r in sorted(best.items(), key=lambda kv: kv[0]):
        latency = "–" if r.get("latency_speedup") is None else f"{r['latency_speedup']:.2f}×"
        lines.append(f"{name[:24]:<24} {temperature:>3g} {draft[:16]:<16} {r['gamma']:>2}  "
                     f"{r['alpha']:<6.3f} {r['tau']:<5.2f} {latency}")  # fmt: skip
    lines += ["Full table (every γ, throughput too):", f"  {os.fspath(table_path)}"]
    return "\n".join(lines) if best else ""


def _side_key(metric: str, side: str) -> str:
    """The row key of a compared draft's metric: ('tau_ci95', 'baseline') -> 'tau_baseline_ci95'."""
    base, ci, _ = metric.partition("_ci95")
    return f"{base}_{side}{ci}"


def _policy_rank(policy: str) -> tuple:
    """Sort key of a policy name in DISCO's Table 1 order (see _POLICY_ORDER)."""
    if policy in _POLICY_ORDER:
        return (_POLICY_ORDER.index(policy), 0, "")
    prefix, _, number = policy.partition("-")
    if prefix == "static" and number.isdigit():
        return (_POLICY_ORDER.index("static-<k>"), int(number), "")
    return (len(_POLICY_ORDER), 0, policy)


def _draft_rank(draft: str, baseline: str, distilled: str) -> tuple:
    """Sort key of a draft: baseline first, then distilled, then the others alphabetically."""
    order = (baseline, distilled)
    return (order.index(draft), "") if draft in order else (len(order), draft)


def _latest_policies(
    records: Iterable[Mapping[str, Any]], baseline: str = "standard", distilled: str = "distilled"
) -> dict[tuple[str, str, str, str], Mapping[str, Any]]:
    """{(task, split, draft, policy): record} of the policy records (grid records are skipped),
    in table order; a later record of the same key replaces an earlier one."""
    latest: dict[tuple[str, str, str, str], Mapping[str, Any]] = {}
    for record in records:
        if is_policy_record(record):
            key = (
                str(record.get("task", "")),
                str(record.get("split", "")),
                str(record["draft"]),
                str(record["policy"]),
            )
            latest[key] = record

    def order(key: tuple[str, str, str, str]) -> tuple:
        task, split, draft, policy = key
        return (task, split, _draft_rank(draft, baseline, distilled), _policy_rank(policy))

    return {key: latest[key] for key in sorted(latest, key=order)}


def policy_table(
    records: Iterable[Mapping[str, Any]], baseline: str = "standard", distilled: str = "distilled"
) -> list[Row]:
    """Rows of DISCO's Table 1 layout, one per (task, split, draft, policy); grid records are
    ignored and a later record of the same key replaces an earlier one.

    Rows are grouped by (task, split), then by draft (`baseline` first, then `distilled`, then
    the others alphabetically), then ordered by policy: target, static-1, static-2, ... (by k),
    static-opt, heuristic, confidence, disco, cumulative, oracle, unknown names alphabetically.
    Each row holds task, split, draft, policy, sl_max, threshold, latency_ms, speedup, mean_sl,
    tau, alpha, exact and vs_static_opt_pct, the latency reduction relative to the static-opt
    record of the same task, split and draft: 100 * (latency(static-opt) - latency) /
    latency(static-opt) (positive: faster; None without such a record). Missing values: None.
    """
    latest = _latest_policies(records, baseline, distilled)
    rows = []
    for (task, split, draft, policy), record in latest.items():
        row: Row = {"task": task, "split": split, "draft": draft, "policy": policy}
        row.update((key, record.get(key)) for key in _POLICY_COLUMNS)
        static_opt = _metric(latest.get((task, split, draft, "static-opt")), "latency_ms")
        latency = _metric(record, "latency_ms")
        row["vs_static_opt_pct"] = (
            None if latency is None or not static_opt else 100.0 * (1.0 - latency / static_opt)
        )
        rows.append(row)
    return rows


def _columns(rows: Sequence[Row]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    return columns


_SPREADS = ("_ci95", "_sd")  # A value's companions: 95% half-width over prompts, std over seeds.


def _spread_keys(key: str) -> list[str]:
    """The keys of a value's spreads: 'tau_baseline' -> 'tau_baseline_ci95', 'tau_baseline_sd';
    'tau[fkl]' -> 'tau_ci95[fkl]', 'tau_sd[fkl]'."""
    metric, bracket, name = key.partition("[")
    return [f"{metric}{suffix}{bracket}{name}" for suffix in _SPREADS]


def _is_spread_key(key: str) -> bool:
    return any(suffix in key for suffix in _SPREADS)


def _header(key: str) -> str:
    """Markdown header of a column: 'tau[fkl]' reads 'τ fkl'."""
    metric, _, name = key.rstrip("]").partition("[")
    if name:
        return f"{_DRAFT_HEADERS.get(metric, HEADERS.get(metric, metric))} {name}"
    return HEADERS.get(key, key)


def _format_cell(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key == "temperature":
        return f"T={value:g}"
    if key == "task":
        return task_label(value)
    if key == "threshold":
        return f"{value:g}"
    if key in ("tau_improvement_pct", "vs_static_opt_pct"):
        return f"{value:+.1f}%"
    if key in ("speedup_difference", "latency_speedup_difference"):
        return f"{value:+.2f}"
    if key.startswith(("speedup", "latency_speedup")):
        return f"{value:.2f}×"
    if key.startswith(("alpha_", "alpha[")) or key in _THREE_DECIMALS and isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def to_markdown(rows: Sequence[Row]) -> str:
    """A GitHub-flavoured Markdown table of the rows (empty string for no rows)."""
    if not rows:
        return ""
    columns = [c for c in _columns(rows) if not _is_spread_key(c)]  # Shown beside their value.
    lines = [
        "| " + " | ".join(_header(c) for c in columns) + " |",
        "|" + "|".join("---" if c in _TEXT_COLUMNS else "---:" for c in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell_with_ci(row, c) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell_with_ci(row: Row, key: str) -> str:
    """A cell, with its spread after it when the row has one ("3.84 ± 0.21")."""
    text = _format_cell(key, row.get(key))
    for spread in (row.get(k) for k in _spread_keys(key)):
        if spread is not None and row.get(key) is not None and not _is_nan(spread):
            return f"{text} ± {_format_cell(key, spread)}"
    return text


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _parent(path: str | os.PathLike) -> None:
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)


def write_markdown(rows: Sequence[Row], path: str | os.PathLike) -> str:
    """Writes the Markdown table to path and returns its text."""
    text = to_markdown(rows)
    _parent(path)
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def write_csv(rows: Sequence[Row], path: str | os.PathLike) -> None:
    """Writes the rows as CSV with the row keys as header; missing values are empty cells."""
    _parent(path)
    columns = _columns(rows)
    with open(os.fspath(path), "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row.get(c) is None else row[c] for c in columns})


def plot_tau_vs_gamma(records: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """PNG: measured tau against gamma, one solid line per (task/split, draft, temperature);
    dashed in the same colour, tau_theory from the mean TVD (DistillSpec Fig. 3c)."""
    import matplotlib

    matplotlib.use("Agg")  # No display; must precede pyplot's import.
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = _latest(records)
    lines: dict[tuple, list[tuple[int, float, float | None]]] = {}
    for (task, split, temperature, gamma), drafts in groups.items():
        for name, record in drafts.items():
            point = (gamma, float(record["tau"]), _metric(record, "tau_theory"))
            lines.setdefault((task, split, name, temperature), []).append(point)
    several_tasks = len({key[:2] for key in lines}) > 1
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (task, split, name, temperature), points in sorted(lines.items()):
        points.sort()
        gammas = [p[0] for p in points]
        prefix = f"{task}/{split} " if several_tasks else ""
        (line,) = ax.plot(
            gammas, [p[1] for p in points], marker="o", label=f"{prefix}{name}, T={temperature:g}"
        )
        theory = [(g, t) for g, _, t in points if t is not None and math.isfinite(t)]
        if theory:
            ax.plot(*zip(*theory), linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel("τ (tokens per target call)")
    ax.set_title("Block efficiency (solid: measured, dashed: from mean TVD)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # gamma is an integer.
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    _parent(path)
    fig.savefig(os.fspath(path), format="png", dpi=120)
    plt.close(fig)


def sl_stats(histogram: Sequence[float]) -> tuple[float, float]:
    """Mean and (population) standard deviation of the SL whose histogram[k] counts rounds
    with SL k; (nan, nan) for an empty histogram."""
    total = float(sum(histogram))
    if total <= 0:
        return math.nan, math.nan
    mean = sum(k * count for k, count in enumerate(histogram)) / total
    variance = sum(count * (k - mean) ** 2 for k, count in enumerate(histogram)) / total
    return mean, math.sqrt(variance)


def plot_sl_histogram(
    records: Iterable[Mapping[str, Any]], path: str | os.PathLike, policy: str = "oracle"
) -> None:
    """PNG: probability histogram of the SL chosen by `policy` (DISCO Fig. 4), from the
    sl_histogram of its latest policy records; one subplot per task/split, one bar series per
    draft, each subplot titled with mean ± std SL per draft. ValueError without such records."""
    import matplotlib

    matplotlib.use("Agg")  # No display; must precede pyplot's import.
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels: dict[tuple[str, str], list[tuple[str, list[float]]]] = {}
    for (task, split, draft, name), record in _latest_policies(records).items():
        if name == policy:
            histogram = [float(count) for count in record.get("sl_histogram") or []]
            panels.setdefault((task, split), []).append((draft, histogram))
    if not panels:
        raise ValueError(f"no policy records of policy {policy!r} to plot")
    drafts = {draft for series in panels.values() for draft, _ in series}
    ordered = sorted(drafts, key=lambda d: _draft_rank(d, "standard", "distilled"))
    colors = {draft: f"C{i % 10}" for i, draft in enumerate(ordered)}  # Same in every subplot.
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, ((task, split), series) in zip(axes.flat, panels.items()):
        width = 0.8 / len(series)
        stats = []
        for i, (draft, histogram) in enumerate(series):
            total = sum(histogram)
            mean, std = sl_stats(histogram)
            stats.append(f"{draft}: {mean:.2f} ± {std:.2f}")
            if total > 0:
                xs = [k - 0.4 + width * (i + 0.5) for k in range(len(histogram))]
                probabilities = [c / total for c in histogram]
                ax.bar(xs, probabilities, width=width, color=colors[draft], label=draft)
        ax.set_title(f"{task}/{split}, {policy} SL (mean ± std)\n" + "; ".join(stats), fontsize=9)
        ax.set_xlabel("SL (draft tokens per round)")
        ax.set_ylabel("Probability")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # SL is an integer.
        ax.grid(True, axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    _parent(path)
    fig.savefig(os.fspath(path), format="png", dpi=120)
    plt.close(fig)


def format_report(
    records_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    baseline: str = "standard",
    distilled: str = "distilled",
) -> str:
    """Writes the report into out_dir and returns its Markdown tables, Table C.1 first and the
    DISCO table second (separated by an empty line).

    Grid records give table.md, table.csv and tau_vs_gamma.png; policy records give
    disco_table.md and disco_table.csv, and oracle policy records also oracle_sl_hist.png.
    Files of a kind that the records lack are not written. ValueError for a file without records.
    """
    records = read_records(records_path)
    if not records:
        raise ValueError(f"{os.fspath(records_path)!r} holds no records")
    grid = [record for record in records if not is_policy_record(record)]
    policies = [record for record in records if is_policy_record(record)]
    out_dir = os.fspath(out_dir)
    texts = []
    if grid:
        rows = records_to_table(grid, baseline, distilled)
        texts.append(write_markdown(rows, os.path.join(out_dir, "table.md")))
        write_csv(rows, os.path.join(out_dir, "table.csv"))
        plot_tau_vs_gamma(grid, os.path.join(out_dir, "tau_vs_gamma.png"))
    if policies:
        rows = policy_table(policies, baseline, distilled)
        texts.append(write_markdown(rows, os.path.join(out_dir, "disco_table.md")))
        write_csv(rows, os.path.join(out_dir, "disco_table.csv"))
        if any(str(record["policy"]) == "oracle" for record in policies):
            plot_sl_histogram(policies, os.path.join(out_dir, "oracle_sl_hist.png"))
    return "\n".join(texts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", help="records.jsonl written by distillspec.evaluate")
    parser.add_argument("--out_dir", help="where to write the report (default: next to records)")
    parser.add_argument("--baseline", default="standard", help="draft name without distillation")
    parser.add_argument("--distilled", default="distilled", help="draft name with distillation")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.records))
    print(format_report(args.records, out_dir, args.baseline, args.distilled), end="")


if __name__ == "__main__":
    main()
