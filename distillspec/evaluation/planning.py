"""Which draft to train: candidate drafts for a target, priced before any training.

A draft's call cost does not depend on its weights, so every candidate is priced with random
weights on the machine the pair will serve on (`measure_plan_profile`):

  c, r_gamma   model calls alone (`costs.measure_profiles`), for S* = tau / (gamma c + r_gamma);
  round_ms     a static round of gamma drafts in the decoder's own loop
               (`timing.decoder_round_timers`: the model calls *and* the decoder's own work,
               which on small models is a large part of a round), and a plain decoding step.

Acceptance is what training decides; a short pilot distillation estimates it. Given the
acceptance rate a = 1 - mean TVD(target, draft) (DistillSpec Fig. 3c), a static round of gamma
drafts yields tau(gamma) = (1 - a^(gamma+1)) / (1 - a) tokens, and a decoding run of N tokens
costs plain: outside + N step, speculative: outside(gamma) + (N / tau) round(gamma)
(`predicted_speedup`); the acceptance rate each candidate needs for a speed-up of 1, 1.5 and 2
is priced the same way (`alpha_needed`). A candidate that loses even when every draft is
accepted can never win (`never_wins`). The profile JSON extends `costs.load_profile`'s format
with a 'candidates' section, so a profile measured on another machine prices the plan there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distillspec.decoding import lookahead as sl
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation import costs, timing
from distillspec.evaluation.drafts import tau_from_alpha
from distillspec.models import load_checkpoint
from distillspec.models.drafts import DraftSpec, make_draft, num_params

SPEEDUPS = (1.0, 1.5, 2.0)  # The S* whose needed alpha a plan lists.
ESTIMATES = ("held_out", "proxy")  # A pilot's acceptance estimates (`pilot_alphas`).


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A draft a plan prices: made for the target (`spec`) or a checkpoint directory."""

    name: str
    spec: DraftSpec | None = None
    checkpoint: str | None = None

    def __post_init__(self):
        if (self.spec is None) == (self.checkpoint is None):
            raise ValueError(f"candidate {self.name!r}: give exactly one of spec and checkpoint")

    @property
    def kind(self) -> str:
        if self.checkpoint:
            return "checkpoint"
        return "target layers" if self.spec.from_target_layers else "fresh"

    def gin(self) -> str:
        """The draft as `python -m distillspec.train --gin_file=runs/distill.gin` takes it."""
        if self.checkpoint:
            return f"STUDENT_CHECKPOINT = {self.checkpoint!r}\nSTUDENT = None\n"
        lines = ["STUDENT_CHECKPOINT = None", "STUDENT = @DraftSpec()"]
        for field in dataclasses.fields(DraftSpec):
            value = getattr(self.spec, field.name)
            if value != field.default:
                lines.append(f"DraftSpec.{field.name} = {value!r}")
        return "\n".join(lines) + "\n"


def _layers(config) -> int:
    return getattr(config, "num_layers", None) or config.num_decoder_layers


def default_candidates(target, checkpoints: Sequence[str] = ()) -> list[Candidate]:
    """The grid a plan prices by default: fresh drafts of 1 and L/2 layers (L the target's) at
    the target's width / 2, / 4 and / 8 (at least 16), the target's own first layers (1 and
    L/2, below L) and each checkpoint given."""
    config = target.config
    depth = _layers(config)
    out = []
    for layers in sorted({1, max(1, depth // 2)}):
        for shift in (1, 2, 3):
            width = config.embed_dim >> shift
            if width >= 16:
                spec = DraftSpec(num_layers=layers, embed_dim=width)
                out.append(Candidate(f"fresh-{layers}x{width}", spec=spec))
    for k in sorted({1, depth // 2}):
        if 1 <= k < depth:
            out.append(Candidate(f"target-layers-{k}", spec=DraftSpec(from_target_layers=k)))
    for i, path in enumerate(checkpoints):
        name = os.path.basename(os.path.normpath(path)) or f"checkpoint-{i}"
        out.append(Candidate(f"checkpoint-{name}", checkpoint=path))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"two candidates share a name: {names}; give the checkpoints "
                         "distinct directory names")  # fmt: skip
    return out


def build(candidate: Candidate, target, target_params, seed: int = 0) -> tuple[Any, Any]:
    """(model, params) of a candidate: random weights from seed, copied layers, or loaded."""
    if candidate.checkpoint:
        return load_checkpoint(candidate.checkpoint)
    return make_draft(candidate.spec, target, target_params, seed)


# --------------------------------------------------------------------------------------------
# Costs: measured here, or read from another machine's profile.
# --------------------------------------------------------------------------------------------


def measure_plan_profile(
    target, target_params, drafts: Mapping[str, tuple[Any, Any]], prompt, gammas: Sequence[int],
    max_new_tokens: int, repeats: int = costs.REPEATS, temperature: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """The plan's cost profile at one temperature (`measure_plan_profiles`)."""
    return measure_plan_profiles(target, target_params, drafts, prompt, gammas, max_new_tokens,
                                 repeats, [temperature])[temperature]  # fmt: skip


def measure_plan_profiles(
    target, target_params, drafts: Mapping[str, tuple[Any, Any]], prompt, gammas: Sequence[int],
    max_new_tokens: int, repeats: int = costs.REPEATS, temperatures: Sequence[float] = (0.0,),
) -> dict[float, dict[str, Any]]:  # fmt: skip
    """{temperature: the plan's cost profile} at batch 1 on prompt (tokens [1, P], lengths [1])
    for serving at each temperature (rounds and steps sample above 0, which costs more per
    call): the `costs.measure_profiles` calls (target widths 1..max(gammas)+1, draft widths 1,
    2; model calls do not depend on the temperature, so every profile shares them) plus, timed
    interleaved `repeats` times (medians), the decoder's own loop at each temperature:
    'plain_ms' {'step', 'outside'} and per draft 'round_ms' / 'outside_ms' by gamma (a static
    round; a run's prefill, dispatch and output), at the `round_gammas` of gammas (compiling a
    program per gamma and candidate is most of a plan's time; `predicted_speedup`
    interpolates)."""
    tokens, lengths = prompt
    widths = range(1, max(gammas) + 2)
    calls = costs.measure_profiles(target, target_params, drafts, tokens, lengths, widths,
                                   max_new_tokens, repeats, draft_widths=(1, 2))  # fmt: skip
    timed = round_gammas(gammas)
    loops = {}
    for temperature in temperatures:
        loops[temperature, "plain", 0] = (target, target_params, None, None, None)
        for name, (draft, draft_params) in drafts.items():
            for gamma in timed:
                loops[temperature, name, gamma] = (target, target_params, draft, draft_params,
                                                   sl.Lookahead("static", gamma))  # fmt: skip
    loop_timer = lambda temperature, t, tp, d, dp, policy: timing.decoder_round_timers(
        t, tp, d, dp, tokens, lengths, policy, max_new_tokens,
        sampling=SamplingConfig(temperature=temperature),
    )[0][0]  # fmt: skip
    timers = {key: loop_timer(key[0], *loop) for key, loop in loops.items()}
    runs = timing.interleaved(timers, repeats)[0]  # (per round, outside) per repeat.
    ms = {key: [1e3 * statistics.median(r[i] for r in rs) for i in (0, 1)]
          for key, rs in runs.items()}  # fmt: skip
    positive = lambda x: x if x > 0 else None
    first = next(iter(drafts))
    return {
        temperature: {
            "target_ms": calls[first]["target_ms"],
            "draft_ms": calls[first]["draft_ms"],
            "plain_ms": {
                "step": positive(ms[temperature, "plain", 0][0]),
                "outside": ms[temperature, "plain", 0][1],
            },  # fmt: skip
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "candidates": {
                name: {
                    "params": num_params(draft),
                    "megabytes": timing.megabytes(draft_params),
                    "draft_ms": calls[name]["draft_ms"],
                    "round_ms": {g: positive(ms[temperature, name, g][0]) for g in timed},
                    "outside_ms": {g: ms[temperature, name, g][1] for g in timed},
                }
                for name, (draft, draft_params) in drafts.items()
            },
        }
        for temperature in temperatures
    }


def untimed(profile: Mapping[str, Any]) -> list[str]:
    """The entries of a measured plan profile whose timers came out <= 0 (None)."""
    found = costs.untimed(profile)
    if not (profile.get("plain_ms") or {}).get("step"):
        found.append("plain_ms.step")
    for name, entry in profile["candidates"].items():
        for kind in ("draft_ms", "round_ms"):
            found += [f"{name}.{kind}[{w}]" for w, ms in entry[kind].items() if ms is None]
    return found


def load_plan_profile(path: str) -> dict[str, Any]:
    """A plan profile from JSON (`measure_plan_profile`'s, as `records.write_json_atomic`
    wrote it): the target's calls as `costs.load_profile` reads them, and its 'candidates';
    ValueError naming the bad entry. A profile without candidates (`python -m
    distillspec.benchmarks.disco --write_profile`'s) cannot price a plan: an error too."""
    profile = costs.load_profile(path)
    with open(path) as f:
        raw = json.load(f)
    found = raw.get("candidates")
    if not isinstance(found, dict) or not found:
        raise ValueError(
            f"cost profile {path} has no 'candidates' section (a plan prices each candidate's "
            "calls): measure it with python -m distillspec.plan --measure_profile PATH on the "
            "serving machine"
        )
    profile["candidates"] = {}
    for name, entry in found.items():
        where = f"cost profile {path}: candidates[{name!r}]"
        if not isinstance(entry, dict) or "draft_ms" not in entry:
            raise ValueError(f"{where} must hold 'draft_ms' (and 'round_ms', 'outside_ms')")
        parsed = {}
        for key in ("draft_ms", "round_ms", "outside_ms"):
            found = entry.get(key, {})
            if not isinstance(found, dict):
                raise ValueError(f"{where}.{key} must map widths or gammas to milliseconds")
            parsed[key] = costs.milliseconds(found, f"{where}.{key}", zero_ok=key == "outside_ms",
                                             null_ok=True)  # fmt: skip
        if not parsed["draft_ms"].get(1):
            raise ValueError(f"{where}.draft_ms has no call of width 1 (> 0 ms)")
        parsed["params"] = entry.get("params")
        parsed["megabytes"] = entry.get("megabytes")
        profile["candidates"][name] = parsed
    plain = raw.get("plain_ms") or {}
    profile["plain_ms"] = {"step": plain.get("step"), "outside": plain.get("outside", 0.0)}
    profile["max_new_tokens"] = raw.get("max_new_tokens")
    profile["temperature"] = raw.get("temperature")
    return profile


def check_profile_covers(profile: Mapping[str, Any], names: Sequence[str], gammas,
                         temperature: float | None = None) -> None:  # fmt: skip
    """ValueError unless the profile prices every candidate name at widths up to max gamma + 1
    (and, given a temperature, its rounds were timed greedy or sampling as that serves)."""
    timed_at = profile.get("temperature")
    if temperature is not None and timed_at is not None and (timed_at > 0) != (temperature > 0):
        raise ValueError(
            f"the cost profile timed its rounds at temperature {timed_at}, the plan serves at "
            f"{temperature}: a sampled round costs more than a greedy one; measure it with the "
            "same plan.temperature"
        )
    missing = [n for n in names if n not in profile["candidates"]]
    if missing:
        raise ValueError(
            f"the cost profile has no costs for candidates {missing} (it has "
            f"{sorted(profile['candidates'])}): measure it with the same candidates "
            "(the same plan configuration) on the serving machine"
        )
    widest = max(w for w, ms in profile["target_ms"].items() if ms)
    if widest < max(gammas) + 1:
        raise ValueError(
            f"the cost profile's target calls reach width {widest}; gammas up to {max(gammas)} "
            f"need width {max(gammas) + 1}: measure it with the same plan.gammas"
        )


# --------------------------------------------------------------------------------------------
# Predictions.
# --------------------------------------------------------------------------------------------


def call_ratios(profile: Mapping[str, Any], name: str, gammas) -> tuple[float | None, dict]:
    """(c, {gamma: r_gamma}) of candidate `name` (None where a timer came out <= 0)."""
    target = profile["target_ms"]
    one = target.get(1)
    ratio = lambda x: x / one if x and one else None
    draft = profile["candidates"][name]["draft_ms"]
    return ratio(draft.get(1)), {g: ratio(target.get(g + 1)) for g in gammas}


def round_gammas(gammas: Sequence[int]) -> list[int]:
    """The gammas whose rounds a plan times: the ends of gammas, the lowest plus one and powers of
    two from 16 between (1, 2, 8 of 1..8; 1, 2, 16, 32 of 1..32). From the second round size on,
    a round's cost is close to linear in gamma (gamma draft calls and a verify call whose cost
    grows with its width), so the others are interpolated; the lowest is not on that line (the
    embedded default's check: timed at gamma 2, fresh-1x32's round cost 14% above the line from
    gamma 1 to 4; interpolating gamma 4 instead moved its best prediction by 2%)."""
    low, high = min(gammas), max(gammas)
    return sorted(
        {low, min(low + 1, high), high} | {2**k for k in range(4, 8) if low < 2**k < high}
    )


def _interpolated(timed: Mapping[int, float | None], gamma: int) -> float | None:
    """timed[gamma], else linear between the nearest timed gammas around it (None outside)."""
    known = sorted(g for g, v in timed.items() if v is not None)
    if gamma in known:
        return timed[gamma]
    below = [g for g in known if g < gamma]
    above = [g for g in known if g > gamma]
    if not below or not above:
        return None
    a, b = below[-1], above[0]
    return timed[a] + (timed[b] - timed[a]) * (gamma - a) / (b - a)


def _pricing(profile: Mapping[str, Any], name: str, gamma: int,
             max_new_tokens: int | None = None) -> tuple[float, float] | None:  # fmt: skip
    """(fixed, per_tau): candidate `name`'s batch-1 latency speed-up at gamma and block
    efficiency tau is 1 / (fixed + per_tau / tau). From the decoder's own timed rounds where the
    profile has them (a run of max_new_tokens, module docstring; gammas between timed ones
    interpolated), else S* = tau / (gamma c + r_gamma) (model calls alone; the decoder's work
    free). None where a cost is unknown."""
    entry = profile["candidates"][name]
    plain = profile.get("plain_ms") or {}
    rounds = _interpolated(entry.get("round_ms", {}), gamma)
    if rounds and plain.get("step"):
        tokens = max_new_tokens or profile.get("max_new_tokens") or 64
        base = plain.get("outside", 0.0) + tokens * plain["step"]
        outside = _interpolated(entry.get("outside_ms", {}), gamma) or 0.0
        return outside / base, tokens * rounds / base
    c, r = call_ratios(profile, name, [gamma])
    if c is None or r[gamma] is None:
        return None
    return 0.0, gamma * c + r[gamma]


def predicted_speedup(profile: Mapping[str, Any], name: str, taus: Mapping[int, float],
                      max_new_tokens: int | None = None) -> dict[int, float | None]:  # fmt: skip
    """{gamma: batch-1 latency speed-up} at block efficiency taus[gamma] (`_pricing`)."""
    out = {}
    for gamma, tau in taus.items():
        priced = _pricing(profile, name, gamma, max_new_tokens)
        out[gamma] = None if priced is None else 1 / (priced[0] + priced[1] / tau)
    return out


def alpha_needed(profile: Mapping[str, Any], name: str, gamma: int, speedup: float):
    """The acceptance rate (accepted / proposed drafts, so tau = 1 + gamma alpha) at which
    candidate `name`'s speed-up at gamma reaches `speedup`, priced as its predictions are
    (`_pricing`); None when not even alpha = 1 reaches it (or a cost is unknown)."""
    priced = _pricing(profile, name, gamma)
    if priced is None or 1 / speedup <= priced[0]:
        return None
    alpha = (priced[1] / (1 / speedup - priced[0]) - 1) / gamma
    return None if alpha > 1 else max(alpha, 0.0)


def ceiling(profile: Mapping[str, Any], name: str, gammas: Sequence[int]):
    """(gamma, speed-up) of candidate `name` at its best gamma were every draft accepted
    (tau = gamma + 1): no training can take it higher. (None, None) if untimed."""
    best = predicted_speedup(profile, name, {g: g + 1.0 for g in gammas})
    known = {g: s for g, s in best.items() if s is not None}
    if not known:
        return None, None
    gamma = max(known, key=known.get)
    return gamma, known[gamma]


def never_wins(profile: Mapping[str, Any], name: str, gammas: Sequence[int]) -> str | None:
    """Why candidate `name` loses at every gamma even when every draft is accepted, or None
    when it can win (or its costs could not be timed)."""
    gamma, best = ceiling(profile, name, gammas)
    if best is None or best >= 1:
        return None
    c, _ = call_ratios(profile, name, [gamma])
    cost = "an untimed share" if c is None else f"c = {c:.2f}"
    return (
        f"even accepting every draft it is at most {best:.2f}x (gamma {gamma}): a draft call "
        f"costs {cost} of a target call, so a round of drafts costs more than the target "
        "calls it saves"
    )


def taus_from_alpha(alpha: float, gammas: Sequence[int]) -> dict[int, float]:
    """{gamma: tau} of per-token acceptance rate alpha (`drafts.tau_from_alpha`)."""
    return {g: tau_from_alpha(min(max(alpha, 0.0), 1.0), g) for g in gammas}


def curve_ratio(curve: Sequence[tuple[int, float]], steps: int) -> float:
    """How much a draft's disagreement with the target (1 - acceptance) shrinks from the end of
    its pilot to `steps` steps of the same recipe: a power law a t^-b fitted (least squares in
    log-log) to the trainer's per-step 1 - acceptance proxy over the pilot's second half, b
    clipped to [0, 1]. curve: (step, proxy) pairs; 1.0 when steps is not past the pilot or the
    curve is too short to fit."""
    last = max((t for t, _ in curve), default=0)
    points = [(t, 1.0 - p) for t, p in curve if t > last / 2 and 0 < 1.0 - p <= 1]
    if steps <= last or len(points) < 4:
        return 1.0
    t, gap = np.log(np.array(points, dtype=float)).T
    b = float(np.clip(-np.polyfit(t, gap, 1)[0], 0.0, 1.0))
    return (steps / last) ** -b


def pilot_alphas(pilot: Mapping[str, Any]) -> dict[str, float]:
    """A pilot's acceptance estimates: 'held_out' (1 - mean TVD to the target on held-out
    prompts), 'proxy' (the trainer's own, at T = 1), and each '+curve': extended to the full
    run along the pilot's learning curve (1 - alpha times `curve_ratio`)."""
    out = {e: pilot[e] for e in ESTIMATES if pilot.get(e) is not None}
    ratio = pilot.get("curve_ratio", 1.0)
    out.update({f"{e}+curve": 1.0 - (1.0 - a) * ratio for e, a in list(out.items())})
    return out
