"""DISCO App. E: tuning the lookahead policies on validation prompts, by modeled latency.

`TuningConfig` holds the grids (static SL, SL_max, thresholds, keep_last, the cumulative rule's
thresholds and sources) and the baselines' settings; `tune_policies` times every configuration
at batch 1 and picks, per rule, the one with the lowest modeled latency per token.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from distillspec import checks
from distillspec.decoding import lookahead
from distillspec.evaluation.costs import load_profile, profile_costs
from distillspec.evaluation.policies import COUNT_KEYS, measure_policies, priced
from distillspec.evaluation.timing import call_cost_timers

# The cumulative rule's default thresholds: the predicted P(some draft of the round is
# rejected) above which a round stops.
CUMULATIVE_THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)


def check_thresholds(name: str, grid: Sequence[float]) -> tuple[float, ...]:
    """A non-empty grid of thresholds in [0, 1], as floats; else ValueError naming it."""
    grid = tuple(grid)
    try:
        ok = bool(grid) and all(0.0 <= float(t) <= 1.0 for t in grid)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must hold thresholds in [0, 1], got {grid!r}")
    return tuple(float(t) for t in grid)


def check_sources(sources: Sequence[str]) -> tuple[str, ...]:
    """A non-empty list of the cumulative rule's sources; else ValueError naming the valid ones."""
    sources = tuple(sources) if not isinstance(sources, str) else (sources,)
    bad = [s for s in sources if s not in lookahead.SOURCES]
    if not sources or bad:
        raise ValueError(
            f"cumulative_sources must be a non-empty list of {lookahead.SOURCES}, got {sources!r}"
        )
    return sources


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """DISCO's tuning grids and baselines; validated when made, before any model is loaded."""

    static_sl: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # Static SL-k candidates (and rows).
    sl_max_grid: tuple[int, ...] = (4, 8)  # SL_max candidates of the confidence / DISCO rules.
    threshold_grid: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # Stop thresholds.
    keep_last_grid: tuple[bool, ...] = (True, False)  # Keep the doubtful last draft or drop it.
    # The cumulative rule (SpecDec++): stop once P(some draft of the round is rejected) is above
    # the threshold; its thresholds and acceptance estimates (lookahead.SOURCES).
    cumulative_threshold_grid: tuple[float, ...] = CUMULATIVE_THRESHOLDS
    cumulative_sources: tuple[str, ...] = lookahead.SOURCES
    heuristic_start: int = 5  # The heuristic's first lookahead (capped by max(sl_max_grid)).
    oracle_sl_max: int = 64  # The oracle's cap (its SL histogram is DISCO's Figure 4).
    timing_repeats: int = 1  # Calls timed per prompt; the median counts.
    # A cost profile of the machine the pair will serve on (`python -m
    # distillspec.benchmarks.disco --write_profile PATH` there): tune for its costs, not this
    # machine's. Loaded (and checked) when made, into `profile`.
    cost_profile: str | None = None
    profile: dict[str, Any] | None = dataclasses.field(default=None, init=False, compare=False)

    def __post_init__(self):
        if self.cost_profile is not None:
            object.__setattr__(self, "profile", load_profile(self.cost_profile))
        for name in ("static_sl", "sl_max_grid"):
            values = getattr(self, name)
            if not values or any(not checks.is_int(v) or v < 1 for v in values):
                raise ValueError(
                    f"{name} must be a non-empty list of SL values >= 1, got {values!r}"
                )
            object.__setattr__(self, name, tuple(int(v) for v in values))
        for name in ("threshold_grid", "cumulative_threshold_grid"):
            object.__setattr__(self, name, check_thresholds(name, getattr(self, name)))
        object.__setattr__(self, "cumulative_sources", check_sources(self.cumulative_sources))
        keep_last = tuple(self.keep_last_grid)
        if not keep_last or any(not isinstance(k, bool) for k in keep_last):
            raise ValueError(
                f"keep_last_grid must be a non-empty list of booleans, got {keep_last}"
            )
        object.__setattr__(self, "keep_last_grid", keep_last)
        checks.check_int("timing_repeats", self.timing_repeats)
        lookahead.Lookahead("heuristic", max(self.sl_max_grid), start=self.heuristic_start)
        lookahead.Lookahead("oracle", self.oracle_sl_max)


def tuning_grid(
    static_sl: Sequence[int], sl_max_grid: Sequence[int], threshold_grid: Sequence[float],
    keep_last_grid: Sequence[bool], cumulative_threshold_grid: Sequence[float],
    cumulative_sources: Sequence[str], oracle_sl_max_grid: Sequence[int] = (),
) -> dict[str, dict[str, lookahead.Lookahead]]:  # fmt: skip
    """{rule: {label: Lookahead}} of every configuration `tune_policies` times: 'static'
    ('static-<k>'), 'confidence' and 'disco' ('<kind>@<sl_max>/<threshold>/<keep|drop>'),
    'cumulative' ('cumulative-<source>@<sl_max>/<threshold>/<keep|drop>') and, with an
    oracle_sl_max_grid, 'oracle' ('oracle@<sl_max>': its cap is tuned as the rules' are; a cap
    past what the target verifies cheaply pays for wide verify calls)."""
    keep = lambda k: "keep" if k else "drop"
    grid = {"static": {f"static-{k}": lookahead.Lookahead("static", k) for k in static_sl}}
    for kind in ("confidence", "disco"):
        grid[kind] = {
            f"{kind}@{n}/{t:g}/{keep(k)}": lookahead.Lookahead(kind, n, threshold=t, keep_last=k)
            for n, k, t in itertools.product(sl_max_grid, keep_last_grid, threshold_grid)
        }
    grid["cumulative"] = {
        f"cumulative-{s}@{n}/{t:g}/{keep(k)}": lookahead.Lookahead(
            "cumulative", n, threshold=t, keep_last=k, source=s
        )
        for s, n, k, t in itertools.product(
            check_sources(cumulative_sources), sl_max_grid, keep_last_grid,
            check_thresholds("cumulative_threshold_grid", cumulative_threshold_grid),
        )
    }  # fmt: skip
    if oracle_sl_max_grid:
        grid["oracle"] = {
            f"oracle@{n}": lookahead.Lookahead("oracle", n) for n in oracle_sl_max_grid
        }
    return grid


def tune_policies(
    target, target_params, draft, draft_params, prompts, classifier, *, static_sl: Sequence[int],
    sl_max_grid: Sequence[int], threshold_grid: Sequence[float],
    keep_last_grid: Sequence[bool] = (True, False),
    cumulative_threshold_grid: Sequence[float] = CUMULATIVE_THRESHOLDS,
    cumulative_sources: Sequence[str] = lookahead.SOURCES, max_new_tokens: int,
    eos_id: int | None, vocab_size: int | None = None, timing_repeats: int = 1,
    profile: dict[str, Any] | None = None, keep_counts: bool = False,
    oracle_sl_max_grid: Sequence[int] = (),
) -> dict[str, Any]:  # fmt: skip
    """DISCO App. E: the static SL, and threshold, SL_max (and keep_last) of the confidence,
    DISCO and cumulative rules (and the cumulative rule's source), with the lowest latency per
    token on `prompts` (batch-1 (tokens, lengths) pairs). Latency is
    `timing.modeled_latency_ms`: the decoding runs' counted calls priced with call costs
    measured here, which ranks 50-odd configurations without the timing noise of a shared
    machine (measured wall-clock latencies are kept beside it); or, with `profile` (a cost
    profile of the machine the pair will serve on, `costs.load_profile`), priced at its costs.

    With oracle_sl_max_grid, the oracle's cap too (the oracle's runs get the target's greedy
    output as their reference).

    Returns:
      {'static_opt': k, 'confidence': {'threshold', 'sl_max', 'keep_last'}, 'disco': {...},
       'cumulative': {'threshold', 'sl_max', 'keep_last', 'source'}, with oracle_sl_max_grid
       'oracle': {'sl_max'},
       'latency_ms': {policy label: ms per token}} (labels as in `tuning_grid`); with
      keep_counts also 'counts': {label: its counted calls (`policies.COUNT_KEYS`)}, to price
      the same runs at other costs.
    """
    rules = tuning_grid(static_sl, sl_max_grid, threshold_grid, keep_last_grid,
                        cumulative_threshold_grid, cumulative_sources,
                        oracle_sl_max_grid)  # fmt: skip
    grid = {label: policy for configs in rules.values() for label, policy in configs.items()}
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
    if profile is not None:
        pricing = profile_costs(profile, [None, *grid.values()])
        modeled = {name: priced(m, grid.get(name), pricing) for name, m in measured.items()}
    out: dict[str, Any] = {
        **choose(rules, modeled),
        "cost_profile": profile,  # None: this machine's costs.
        "modeled_latency_ms": modeled,
        "latency_ms": {name: m["latency_ms"] for name, m in measured.items()},
        "call_costs_ms": costs,
    }
    if keep_counts:
        out["counts"] = {name: {k: m[k] for k in COUNT_KEYS} for name, m in measured.items()}
    return out


def best_labels(
    rules: dict[str, dict[str, lookahead.Lookahead]], modeled: dict[str, float]
) -> dict[str, str]:
    """{rule: the label of its configuration with the lowest modeled latency}."""
    return {rule: min(configs, key=modeled.__getitem__) for rule, configs in rules.items()}


def choose(
    rules: dict[str, dict[str, lookahead.Lookahead]], modeled: dict[str, float]
) -> dict[str, Any]:
    """Per rule of `tuning_grid`, the configuration with the lowest modeled latency:
    {'static_opt': k, 'confidence' / 'disco' / 'cumulative': its settings[, 'oracle':
    {'sl_max'}]}."""
    labels = best_labels(rules, modeled)
    out: dict[str, Any] = {"static_opt": rules["static"][labels["static"]].sl_max}
    for kind in ("confidence", "disco", "cumulative"):
        chosen = rules[kind][labels[kind]]
        out[kind] = {
            "threshold": chosen.threshold,
            "sl_max": chosen.sl_max,
            "keep_last": chosen.keep_last,
        }
        if chosen.source is not None:
            out[kind]["source"] = chosen.source
    if "oracle" in rules:
        out["oracle"] = {"sl_max": rules["oracle"][labels["oracle"]].sl_max}
    return out
