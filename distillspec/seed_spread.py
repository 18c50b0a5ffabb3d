"""The main job's Table C.1 over training seeds: mean and spread of each figure, and whether the
distilled draft's tau gain exceeds its spread (`python -m distillspec.report --seeds`).
Like `tables`, no JAX."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distillspec.tables import GROUP_KEYS, Row, records_to_table

_SEED_METRICS = (
    "alpha_baseline", "tau_baseline", "latency_speedup_baseline",
    "alpha_distilled", "tau_distilled", "latency_speedup_distilled",
)  # fmt: skip


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def seed_spread_table(
    runs: Sequence[Iterable[Mapping[str, Any]]],
    baseline: str = "standard",
    distilled: str = "distilled",
) -> list[Row]:
    """Table C.1 over training seeds: one row per (task, split, temperature, gamma) that every
    run (the records of one seed) has, holding `seeds`, the mean and the sample standard
    deviation (`_sd`) over runs of alpha, tau and the batch-1 latency speed-up of both drafts
    and of `tau_ratio` (tau_distilled / tau_baseline), and `gain_exceeds_spread`: whether the
    mean tau gain (distilled - baseline) exceeds twice its standard deviation over the seeds."""
    per_run = [
        {tuple(r[k] for k in GROUP_KEYS): r for r in records_to_table(run, baseline, distilled)}
        for run in runs
    ]
    if not per_run:
        raise ValueError("seed_spread_table needs the records of at least one run")
    rows = []
    for key in sorted(set.intersection(*(set(t) for t in per_run))):
        seeds = [t[key] for t in per_run]
        if any(r.get("tau_baseline") is None or r.get("tau_distilled") is None for r in seeds):
            continue
        row: Row = {**dict(zip(GROUP_KEYS, key)), "seeds": len(seeds)}
        for metric in (*_SEED_METRICS, "tau_ratio"):
            values = [
                r["tau_distilled"] / r["tau_baseline"] if metric == "tau_ratio" else r.get(metric)
                for r in seeds
            ]
            if None not in values:  # Older records have no batch-1 latency.
                row[metric], row[f"{metric}_sd"] = mean_sd(values)
        gain, spread = mean_sd([r["tau_distilled"] - r["tau_baseline"] for r in seeds])
        row["gain_exceeds_spread"] = len(seeds) > 1 and gain > 2 * spread
        rows.append(row)
    return rows
