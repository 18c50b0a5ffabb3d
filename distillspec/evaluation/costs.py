"""The cost side of speculative decoding at batch 1: c, r_gamma and the ideal speed-up S*.

  c        = a draft call / a target call, one position each (a decode step at batch 1)
  r_gamma  = a target call scoring gamma + 1 positions / one scoring 1 position
  S*       = tau / (gamma * c + r_gamma): the speed-up a round of gamma drafts can give at block
             efficiency tau, were the decoder's own work free (GUIDE.md section 4; Leviathan et
             al.'s formula with r_gamma = 1, true only where decoding is memory-bound)

Measured with `timing.step_timer` (jitted loops of calls, prefill and dispatch cancelled) on one
prompt, the timers interleaved and their medians taken. A draft whose S* stays below 1 at
every gamma cannot win whatever it accepts; `verdict` says so in one line with the cause.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from distillspec import checks
from distillspec.decoding import lookahead as sl
from distillspec.evaluation import timing
from distillspec.evaluation.timing import step_timer

CALLS = 9  # The fewest calls in a timer's long loop: fewer came out <= 0 under a second worker.
REPEATS = 5
SMALLER_DRAFT = (
    "a smaller draft helps: --gin.DraftSpec.max_param_fraction=0.05 (or smaller "
    "DraftSpec.embed_dim / num_layers)"
)


def measure_profile(
    target, target_params, draft, draft_params, prompts, lengths, widths: Sequence[int],
    max_new_tokens: int, repeats: int = REPEATS, draft_widths: Sequence[int] = (1,),
) -> dict[str, Any]:  # fmt: skip
    """A cost profile at batch 1 on the first prompt of prompts [B, P]: {'target_ms': {w: ms per
    target call scoring w positions}, 'draft_ms': {w: ms per draft call}}, the medians of
    `repeats` interleaved timings. A call whose timer came out <= 0 (a loaded machine) is None,
    never a made-up number. `profile_costs` prices decoding runs with it."""
    return measure_profiles(
        target, target_params, {None: (draft, draft_params)}, prompts, lengths, widths,
        max_new_tokens, repeats, draft_widths,
    )[None]  # fmt: skip


def measure_profiles(
    target, target_params, drafts: Mapping[Any, tuple[Any, Any]], prompts, lengths,
    widths: Sequence[int], max_new_tokens: int, repeats: int = REPEATS,
    draft_widths: Sequence[int] = (1,),
) -> dict[Any, dict[str, Any]]:  # fmt: skip
    """`measure_profile` of every draft of {name: (model, params)} against one target, whose
    calls are timed once for them all (each draft's profile holds the same 'target_ms'): the
    target's timers are the costly part, compiled and run once per width."""
    first = np.asarray(prompts)[:1], np.asarray(lengths)[:1]
    # Each timer's long loop fills a run's cache (max_new_tokens positions), at least CALLS calls:
    # 9 calls of a 0.14 M-parameter draft differ from 1 call by ~0.3 ms, within a quiet 2-core
    # machine's noise (c came out untimeable in one main job of three).
    timer = lambda model, params, width: step_timer(
        model, params, *first, width, max(CALLS, max_new_tokens // width), max_new_tokens
    )
    timers = {
        (name, w): timer(draft, draft_params, w)
        for name, (draft, draft_params) in drafts.items()
        for w in draft_widths
    }
    timers.update({("target", w): timer(target, target_params, w) for w in sorted(widths)})
    seconds: dict[tuple, list[float]] = {key: [] for key in timers}
    for _ in range(repeats):
        for key, fn in timers.items():
            seconds[key].append(fn())
    ms = {key: 1e3 * statistics.median(s) for key, s in seconds.items()}
    ms = {key: value if value > 0 else None for key, value in ms.items()}
    target_ms = {w: ms["target", w] for w in sorted(widths)}
    return {
        name: {"target_ms": dict(target_ms), "draft_ms": {w: ms[name, w] for w in draft_widths}}
        for name in drafts
    }


def measure(
    target, target_params, draft, draft_params, prompts, lengths, gammas: Sequence[int],
    max_new_tokens: int, repeats: int = REPEATS,
) -> dict[str, Any]:  # fmt: skip
    """{'c': float, 'r_gamma': {gamma: float}} at batch 1 on the first prompt of prompts [B, P]
    (`measure_profile`'s ratios). A ratio whose timers came out <= 0 is None."""
    return measure_drafts(
        target, target_params, {None: (draft, draft_params)}, prompts, lengths, gammas,
        max_new_tokens, repeats,
    )[None]  # fmt: skip


def measure_drafts(
    target, target_params, drafts: Mapping[Any, tuple[Any, Any]], prompts, lengths,
    gammas: Sequence[int], max_new_tokens: int, repeats: int = REPEATS,
) -> dict[Any, dict[str, Any]]:  # fmt: skip
    """`measure` of every draft of {name: (model, params)}, the target timed once for all."""
    widths = [1] + [gamma + 1 for gamma in gammas]
    profiles = measure_profiles(target, target_params, drafts, prompts, lengths, widths,
                                max_new_tokens, repeats)  # fmt: skip
    out = {}
    for name, profile in profiles.items():
        one = profile["target_ms"][1]
        ratio = lambda x, one=one: x / one if x and one else None
        out[name] = {
            "c": ratio(profile["draft_ms"][1]),
            "r_gamma": {gamma: ratio(profile["target_ms"][gamma + 1]) for gamma in gammas},
        }
    return out


def untimed(profile: dict[str, Any]) -> list[str]:
    """The calls of a measured profile whose timers came out <= 0 (None): `load_profile`
    refuses such a profile, so a writer measures again or stops instead of writing it."""
    return [f"{kind}[{w}]" for kind in ("target_ms", "draft_ms")
            for w, ms in profile[kind].items() if ms is None]  # fmt: skip


def synthetic_profile(c: float, r_gamma: float, gamma: int = 5, max_width: int = 65) -> dict:
    """A modeled deployment's profile, in units of a target call scoring one position: a
    target call's cost linear in its width, r_gamma at width gamma + 1; a draft call c (the
    first of a round scores 2 positions: c times the target's width-2 ratio)."""
    if not (c > 0 and r_gamma >= 1 and checks.is_int(gamma) and gamma >= 1):
        raise ValueError(f"want c > 0, r_gamma >= 1, gamma >= 1; got {c}, {r_gamma}, {gamma}")
    target = {w: 1.0 + (r_gamma - 1.0) * (w - 1) / gamma for w in range(1, max_width + 1)}
    return {"target_ms": target, "draft_ms": {1: c, 2: c * target[2]}}


def load_profile(path: str) -> dict[str, Any]:
    """A cost profile from a JSON file (`python -m distillspec.benchmarks.disco
    --write_profile`): widths as ints; ValueError naming the file and the bad entry."""
    if not os.path.isfile(path):
        raise ValueError(
            f"cost profile {path!r} not found: write one with python -m "
            "distillspec.benchmarks.disco --write_profile PATH on the machine the pair serves on"
        )
    with open(path) as f:
        raw = json.load(f)
    profile = {}
    for kind in ("target_ms", "draft_ms"):
        entries = raw.get(kind) if isinstance(raw, dict) else None
        if not isinstance(entries, dict) or "1" not in entries:
            raise ValueError(
                f"cost profile {path}: {kind!r} must map widths to milliseconds, width 1 "
                f"included (got {entries!r})"
            )
        profile[kind] = milliseconds(entries, f"cost profile {path}: {kind}")
    return profile


def milliseconds(entries: dict, where: str, zero_ok: bool = False, null_ok: bool = False):
    """{width or gamma: ms} of a profile's entries {"1": ms, ...} as ints and floats; ValueError
    naming `where` and the bad entry. ms must be > 0 (>= 0 with zero_ok; null with null_ok)."""
    out = {}
    for key, ms in entries.items():
        if not (str(key).isdigit() and int(key) >= 1):
            raise ValueError(f"{where} width {key!r} is not >= 1")
        if ms is None and null_ok:
            out[int(key)] = None
            continue
        if not (
            isinstance(ms, (int, float)) and math.isfinite(ms) and (ms > 0 or zero_ok and ms == 0)
        ):
            raise ValueError(
                f"{where}[{key}] = {ms!r}; want milliseconds > 0 (a timer that came out <= 0: "
                "measure it again on a quiet machine)"
            )
        out[int(key)] = float(ms)
    return out


def profile_costs(profile: dict[str, Any], policies: Iterable[sl.Lookahead | None]) -> dict:
    """The cost model (`timing.modeled_latency_ms`) of a profile, for these policies: model
    calls at the profile's costs (a target width it lacks interpolated linearly between its
    neighbours; a draft call scoring 2 positions, the 1-position cost if it lacks one), the
    decoder's own work free (a deployment's loop overhead is not in a profile)."""
    policies = list(policies)
    programs = {timing.program_key(p) for p in policies} | {"plain"}
    needed = {1} | {w for p in policies if p is not None for w in sl.verify_widths(p)}
    known = sorted(w for w, ms in profile["target_ms"].items() if ms)
    if 1 not in known or max(needed) > known[-1]:
        raise ValueError(
            f"the cost profile has target calls of widths {known}; these policies verify at "
            f"widths up to {max(needed)} (width 1 needed too): measure it with wider --widths"
        )
    known_ms = [profile["target_ms"][w] for w in known]
    draft = profile["draft_ms"]
    if not draft.get(1):
        raise ValueError(f"the cost profile has no draft call of width 1 ({draft!r})")
    zero = dict.fromkeys(programs, 0.0)
    return {
        "target": {w: float(np.interp(w, known, known_ms)) for w in sorted(needed)},
        "draft": {1: draft[1], 2: draft.get(2) or draft[1]},
        "round": 0.0,
        "per_draft": zero,
        "spec_round": zero,
        "switch": zero,
        "fixed": zero,
    }


def ideal_speedup(tau: float, gamma: int, c: float | None, r_gamma: float | None) -> float | None:
    """S* = tau / (gamma * c + r_gamma); None when a cost could not be timed."""
    return None if c is None or r_gamma is None else tau / (gamma * c + r_gamma)


def break_even_alpha(gamma: int, c: float, r_gamma: float) -> float | None:
    """The acceptance rate alpha at which S* = 1, None when not even alpha = 1 reaches it.

    alpha as `evaluate` reports it, accepted drafts / proposed drafts, so tau = 1 + gamma * alpha
    and S* = 1 exactly at alpha = (gamma * c + r_gamma - 1) / gamma. (Not the per-token
    acceptance probability of Leviathan et al.'s i.i.d. model, which the printed alpha is not.)
    """
    alpha = (gamma * c + r_gamma - 1) / gamma
    return None if alpha > 1 else max(alpha, 0.0)


def verdict(name: str, costs: dict[str, Any], taus: dict[int, float]) -> str:
    """One line for draft `name`: c and its best S* over the measured tau per gamma; when S* < 1
    at every gamma, the cause (c) and what helps."""
    c = costs["c"]
    ideal = {g: ideal_speedup(t, g, c, costs["r_gamma"][g]) for g, t in taus.items()}
    ideal = {g: s for g, s in ideal.items() if s is not None}
    if c is None or not ideal:
        return f"draft {name!r}: its call costs could not be timed on this machine (no S*)"
    gamma = max(ideal, key=ideal.get)
    line = (
        f"draft {name!r}: c = {c:.3f} (a draft call / a target call, batch 1); best ideal "
        f"speed-up S* = {ideal[gamma]:.2f} at gamma = {gamma} (tau {taus[gamma]:.2f}, "
        f"r_gamma {costs['r_gamma'][gamma]:.2f})"
    )
    if ideal[gamma] < 1:
        r = costs["r_gamma"][gamma]
        if gamma * c >= 0.3 * (gamma * c + r):  # The drafts are a large part of a round's cost.
            line += (
                f". S* < 1 at every gamma: at c = {c:.2f} a round of drafts costs more than the "
                f"tokens it saves; {SMALLER_DRAFT}"
            )
        else:  # The drafts are cheap: too few of them are accepted for the verify cost r_gamma.
            line += (
                f". S* < 1 at every gamma: the drafts are cheap (c = {c:.2f}) but too few are "
                f"accepted (tau {taus[gamma]:.2f} < r_gamma {r:.2f}): distil longer or on "
                "prompts closer to the evaluation's"
            )
    return line


def break_even_line(costs: dict[str, Any]) -> str:
    """One line after training: c, and the acceptance rate (as `evaluate` reports it) the draft
    needs to win per gamma."""
    c = costs["c"]
    if c is None:
        return "the draft's call cost could not be timed on this machine"
    needs = {g: break_even_alpha(g, c, r) for g, r in costs["r_gamma"].items() if r is not None}
    possible = {g: a for g, a in needs.items() if a is not None}
    head = f"c = {c:.3f} (a draft call / a target call, batch 1, this machine)"
    if not possible:
        return (
            f"{head}: speculative decoding cannot win with this draft at any acceptance rate "
            f"(gamma {sorted(needs)}); {SMALLER_DRAFT}"
        )
    wins = ", ".join(f"alpha > {a:.2f} at gamma = {g}" for g, a in sorted(possible.items()))
    return (
        f"{head}: it speeds decoding up only if {wins} (measure it: python -m distillspec.evaluate)"
    )
