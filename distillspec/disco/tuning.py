"""DISCO App. E: tuning the lookahead policies on validation prompts, by modeled latency.

`TuningConfig` holds the grids (static SL, SL_max, thresholds, keep_last) and the baselines'
settings; `tune_policies` times every configuration at batch 1 and picks, per rule, the one
with the lowest modeled latency per token.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from distillspec import checks, lookahead
from distillspec.evaluation.policies import measure_policies
from distillspec.evaluation.timing import call_cost_timers


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """DISCO's tuning grids and baselines; validated when made, before any model is loaded."""

    static_sl: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # Static SL-k candidates (and rows).
    sl_max_grid: tuple[int, ...] = (4, 8)  # SL_max candidates of the confidence / DISCO rules.
    threshold_grid: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # Stop thresholds.
    keep_last_grid: tuple[bool, ...] = (True, False)  # Keep the doubtful last draft or drop it.
    heuristic_start: int = 5  # The heuristic's first lookahead (capped by max(sl_max_grid)).
    oracle_sl_max: int = 64  # The oracle's cap (its SL histogram is DISCO's Figure 4).
    timing_repeats: int = 1  # Calls timed per prompt; the median counts.

    def __post_init__(self):
        for name in ("static_sl", "sl_max_grid"):
            values = getattr(self, name)
            if not values or any(not checks.is_int(v) or v < 1 for v in values):
                raise ValueError(
                    f"{name} must be a non-empty list of SL values >= 1, got {values!r}"
                )
            object.__setattr__(self, name, tuple(int(v) for v in values))
        grid = tuple(self.threshold_grid)
        if not grid or any(not 0.0 <= float(t) <= 1.0 for t in grid):
            raise ValueError(f"threshold_grid must hold thresholds in [0, 1], got {grid!r}")
        object.__setattr__(self, "threshold_grid", tuple(float(t) for t in grid))
        keep_last = tuple(self.keep_last_grid)
        if not keep_last or any(not isinstance(k, bool) for k in keep_last):
            raise ValueError(
                f"keep_last_grid must be a non-empty list of booleans, got {keep_last}"
            )
        object.__setattr__(self, "keep_last_grid", keep_last)
        checks.check_int("timing_repeats", self.timing_repeats)
        lookahead.Lookahead("heuristic", max(self.sl_max_grid), start=self.heuristic_start)
        lookahead.Lookahead("oracle", self.oracle_sl_max)


def tune_policies(
    target, target_params, draft, draft_params, prompts, classifier, *, static_sl: Sequence[int],
    sl_max_grid: Sequence[int], threshold_grid: Sequence[float],
    keep_last_grid: Sequence[bool] = (True, False), max_new_tokens: int,
    eos_id: int | None, vocab_size: int | None = None, timing_repeats: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """DISCO App. E: the static SL, and threshold, SL_max (and keep_last) of the confidence and
    DISCO rules, with the lowest latency per token on `prompts` (batch-1 (tokens, lengths)
    pairs). Latency is `timing.modeled_latency_ms`: the decoding runs' counted calls priced
    with call costs measured here, which ranks 50-odd configurations without the timing noise
    of a shared machine (measured wall-clock latencies are kept beside it).

    Returns:
      {'static_opt': k, 'confidence': {'threshold', 'sl_max', 'keep_last'}, 'disco': {...},
       'latency_ms': {policy label: ms per token}} (labels like 'disco@8/0.5/keep').
    """
    grid = {f"static-{k}": lookahead.Lookahead("static", k) for k in static_sl}
    for kind, sl_max, keep_last, threshold in itertools.product(
        ("confidence", "disco"), sl_max_grid, keep_last_grid, threshold_grid
    ):
        label = f"{kind}@{sl_max}/{threshold:g}/{'keep' if keep_last else 'drop'}"
        grid[label] = lookahead.Lookahead(kind, sl_max, threshold=threshold, keep_last=keep_last)
    cost_timers = call_cost_timers(
        target, target_params, draft, draft_params, prompts[0], grid.values(),
        classifier=classifier, max_new_tokens=max_new_tokens, vocab_size=vocab_size,
    )  # fmt: skip
    measured, costs = measure_policies(
        target, target_params, draft, draft_params, prompts, grid, classifier=classifier,
        cost_timers=cost_timers, max_new_tokens=max_new_tokens, eos_id=eos_id,
        vocab_size=vocab_size,
        timing_repeats=timing_repeats, desc="tuning",
    )  # fmt: skip
    modeled = {name: m["modeled_latency_ms"] for name, m in measured.items()}
    best = lambda prefix: min((n for n in grid if n.startswith(prefix)), key=modeled.get)
    out: dict[str, Any] = {
        "static_opt": grid[best("static-")].sl_max,
        "modeled_latency_ms": modeled,
        "latency_ms": {name: m["latency_ms"] for name, m in measured.items()},
        "call_costs_ms": costs,
    }
    for kind in ("confidence", "disco"):
        chosen = grid[best(kind + "@")]
        out[kind] = {
            "threshold": chosen.threshold,
            "sl_max": chosen.sl_max,
            "keep_last": chosen.keep_last,
        }
    return out
