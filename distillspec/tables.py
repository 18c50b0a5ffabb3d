"""Turning evaluation records (records.jsonl) into tables and plots, without JAX.

The layout follows DistillSpec's Table C.1: one row per (task/split, temperature, gamma) with
tau and speed-up of the draft without distillation and with distillation, and the difference
(tau as a relative improvement in %, speed-up as an absolute difference, e.g. +0.14).

Usage: python -m distillspec.tables RECORDS_JSONL [--out_dir DIR]
writes table.md, table.csv and tau_vs_gamma.png and prints the Markdown table.

This module is a pure formatter: it imports only the standard library, numpy and matplotlib, so
reports can be made on a machine without an accelerator stack (a test checks that jax stays out).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Row = dict[str, Any]

# Markdown headers of the comparison columns (CSV keeps the machine-friendly keys).
HEADERS = {
    "task": "Task",
    "split": "Split",
    "temperature": "Temp",
    "gamma": "γ",
    "tau_baseline": "τ w/o distillation",
    "speedup_baseline": "Speed-up w/o distillation",
    "tau_distilled": "τ with distillation",
    "speedup_distilled": "Speed-up with distillation",
    "tau_improvement_pct": "Δτ (%)",
    "speedup_difference": "Δ speed-up",
}
_GROUP_KEYS = ("task", "split", "temperature", "gamma")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a records.jsonl file (same format as `distillspec.evaluate.append_records`)."""
    with open(os.fspath(path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _group_key(record: Mapping[str, Any]) -> tuple:
    return (
        str(record.get("task", "")),
        str(record.get("split", "")),
        float(record["temperature"]),
        int(record["gamma"]),
    )


def _latest(records: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Mapping[str, Any]]]:
    """{(task, split, temperature, gamma): {draft: record}}; a later record of the same
    draft and grid point replaces an earlier one (records.jsonl is append-only)."""
    groups: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for record in records:
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
    """Rows of the Table C.1 layout, one per (task, split, temperature, gamma), sorted.

    If drafts named `baseline` and `distilled` both occur, each row holds tau_baseline,
    speedup_baseline, tau_distilled, speedup_distilled, tau_improvement_pct
    (100 * (tau_distilled / tau_baseline - 1)) and speedup_difference (distilled - baseline);
    any other drafts follow as tau[name] / speedup[name] columns. Otherwise every draft gets its
    own tau[name] / speedup[name] columns. A value missing at a grid point is None.
    """
    groups = _latest(records)
    names = sorted({name for drafts in groups.values() for name in drafts})
    compare = baseline in names and distilled in names
    others = [n for n in names if not (compare and n in (baseline, distilled))]
    rows = []
    for key, drafts in groups.items():
        row: Row = dict(zip(_GROUP_KEYS, key))
        if compare:
            base, dist = drafts.get(baseline), drafts.get(distilled)
            tau_b, tau_d = _metric(base, "tau"), _metric(dist, "tau")
            speed_b, speed_d = _metric(base, "speedup"), _metric(dist, "speedup")
            row.update(
                tau_baseline=tau_b,
                speedup_baseline=speed_b,
                tau_distilled=tau_d,
                speedup_distilled=speed_d,
                tau_improvement_pct=_ratio_pct(tau_d, tau_b),
                speedup_difference=_difference(speed_d, speed_b),
            )
        for name in others:
            row[f"tau[{name}]"] = _metric(drafts.get(name), "tau")
            row[f"speedup[{name}]"] = _metric(drafts.get(name), "speedup")
        rows.append(row)
    return rows


def _columns(rows: Sequence[Row]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    return columns


def _format_cell(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key == "temperature":
        return f"T={value:g}"
    if key == "tau_improvement_pct":
        return f"{value:+.1f}%"
    if key == "speedup_difference":
        return f"{value:+.2f}"
    if key.startswith("speedup"):
        return f"{value:.2f}×"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def to_markdown(rows: Sequence[Row]) -> str:
    """A GitHub-flavoured Markdown table of the rows (empty string for no rows)."""
    if not rows:
        return ""
    columns = _columns(rows)
    lines = [
        "| " + " | ".join(HEADERS.get(c, c) for c in columns) + " |",
        "|" + "|".join("---" if c in ("task", "split") else "---:" for c in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_format_cell(c, row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


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


def format_report(
    records_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    baseline: str = "standard",
    distilled: str = "distilled",
) -> str:
    """Writes table.md, table.csv and tau_vs_gamma.png into out_dir; returns the Markdown."""
    records = read_records(records_path)
    if not records:
        raise ValueError(f"{os.fspath(records_path)!r} holds no records")
    rows = records_to_table(records, baseline, distilled)
    out_dir = os.fspath(out_dir)
    text = write_markdown(rows, os.path.join(out_dir, "table.md"))
    write_csv(rows, os.path.join(out_dir, "table.csv"))
    plot_tau_vs_gamma(records, os.path.join(out_dir, "tau_vs_gamma.png"))
    return text


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
