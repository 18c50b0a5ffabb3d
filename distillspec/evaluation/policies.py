"""The lookahead policy axis (DISCO Table 1): batch-1 greedy latency of each policy.

Every policy of `resolve_policies` ('static-<k>', 'static-opt', 'heuristic', 'confidence',
'disco', 'cumulative', 'oracle') and the target alone decode the same prompts at batch 1,
greedy, interleaved per prompt (`measure_policies`); `evaluate_policies` makes one record per
(eval set, draft, policy) with the keys of `POLICY_RECORD_KEYS`: latency_ms per generated
token, speedup against the target alone, mean_sl, the per-round sl_histogram, alpha, tau and
exact (output identical to the target's). The tuned policies take a draft's saved DISCO tuning
as plain data (the 'tuning' of its classifier.json, written by `python -m distillspec.disco`).
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distillspec.decoding import DecodeResult, generate, speculative_generate
from distillspec.decoding.lookahead import THRESHOLD_KINDS, Lookahead, verify_widths
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation.drafts import mean_tvd
from distillspec.evaluation.timing import (
    call_cost_timers,
    call_costs,
    interleaved_items,
    modeled_latency_ms,
)
from distillspec.feature_converters import single_prompts
from distillspec.records import POLICY_NAMES, TARGET_POLICY, TUNED_POLICIES, append_records

POLICY_RECORD_KEYS = (
    "draft",
    "policy",
    "sl_max",
    "threshold",
    "keep_last",
    "source",
    "temperature",
    "alpha",
    "tau",
    "mean_sl",
    "sl_histogram",
    "latency_ms",
    "modeled_latency_ms",
    "target_latency_ms",
    "speedup",
    "exact",
    "num_prompts",
    "task",
    "split",
    "max_new_tokens",
    "tokens",
    "target_calls",
    "draft_calls",
)
# A policy's counted calls: what `priced` needs to price its runs at other call costs.
COUNT_KEYS = ("sl_histogram", "draft_calls", "tokens", "runs", "width_switches")


def _prompt_shape(item: tuple) -> tuple[int, ...]:
    """The compiled shape of a (prompt, reference) item: its prompt tokens' [1, P]."""
    return np.shape(item[0][0])


def _counter_sum(results: Sequence[DecodeResult], field: str) -> int:
    return int(sum(int(getattr(r, field).sum()) for r in results))


def _policy_fields(
    runs: Sequence[DecodeResult], prompt_seconds: Sequence[float], lookahead: Lookahead | None,
    references: Sequence[DecodeResult], target_latency: float, costs,
) -> dict[str, Any]:  # fmt: skip
    """The measured fields of one policy's record (see POLICY_RECORD_KEYS), and what prices it
    again with other call costs (`COUNT_KEYS`) or bootstraps it over prompts
    ('prompt_seconds')."""
    total = functools.partial(_counter_sum, runs)
    seconds = sum(prompt_seconds)
    tokens = total("lengths")
    hist = np.sum([r.sl_histogram.sum(0) for r in runs], axis=0)
    latency = 1000.0 * seconds / max(tokens, 1)
    tuned_threshold = lookahead is not None and lookahead.kind in THRESHOLD_KINDS
    fields = {
        "sl_max": lookahead.sl_max if lookahead else 0,
        "threshold": float(lookahead.threshold) if tuned_threshold else None,
        "keep_last": lookahead.keep_last if lookahead else None,
        "source": lookahead.source if lookahead else None,
        "alpha": total("accepted") / max(total("drafted"), 1),
        "tau": tokens / max(total("target_calls"), 1),
        "mean_sl": total("drafted") / max(total("target_calls"), 1),
        "sl_histogram": [int(v) for v in hist],
        "latency_ms": latency,
        "target_latency_ms": target_latency,
        "speedup": target_latency / max(latency, 1e-12),
        "exact": all(
            np.array_equal(r.tokens, ref.tokens) and np.array_equal(r.lengths, ref.lengths)
            for r, ref in zip(runs, references)
        ),
        "num_prompts": len(references),
        "tokens": tokens,
        "target_calls": total("target_calls"),
        "draft_calls": total("draft_calls"),
        "width_switches": total("width_switches"),
        "runs": len(runs),
        "prompt_seconds": list(prompt_seconds),
    }
    fields["modeled_latency_ms"] = None if costs is None else priced(fields, lookahead, costs)
    return fields


def priced(fields: Mapping[str, Any], lookahead: Lookahead | None, costs) -> float:
    """Modeled ms per token of a policy's measured fields (its counted calls: sl_histogram,
    draft_calls, tokens, runs, width_switches) at these call costs (`timing.call_costs`, or a
    deployment's profile, `costs.profile_costs`)."""
    return modeled_latency_ms(
        lookahead, fields["sl_histogram"], fields["draft_calls"], fields["tokens"], costs,
        fields["runs"], fields["width_switches"],
    )  # fmt: skip


def static_round_ms(
    measured: Mapping[str, Mapping[str, Any]], policies: Mapping[str, Lookahead],
    costs: Mapping[str, Any],
) -> dict[int, float]:  # fmt: skip
    """{d: ms of one round of d drafts} measured in real runs, not modeled: each static SL-d
    policy's measured time (`measure_policies`' prompt_seconds) less each run's fixed part
    (costs['fixed'], `timing.call_costs`: prefill, dispatch, output), over its rounds
    (sum of its sl_histogram); d = 0 is a plain step, from the target alone's runs."""
    out = {}

    def per_round(fields, fixed_ms):
        rounds = max(int(np.sum(fields["sl_histogram"])), int(fields["target_calls"]), 1)
        return (1e3 * sum(fields["prompt_seconds"]) - fields["runs"] * fixed_ms) / rounds

    if TARGET_POLICY in measured:
        plain = measured[TARGET_POLICY]
        out[0] = per_round(
            {**plain, "sl_histogram": [plain["target_calls"]]}, costs["fixed"]["plain"]
        )
    for name, policy in policies.items():
        if policy.kind == "static" and name == f"static-{policy.sl_max}":  # Not static-opt.
            out[policy.sl_max] = per_round(measured[name], costs["fixed"]["static"])
    return out


def _static_round(drafts: int, width: int, round_ms: Mapping[int, float], costs) -> float:
    """ms of a static round of `drafts` drafts verified at `width`: the measured one
    (`static_round_ms`) where its width is drafts + 1, else the nearest measured smaller round
    plus the missing draft calls and the target call's difference in width (`timing.call_costs`'
    in-context draft and target calls)."""
    target, draft = costs["target"], costs["draft"]
    if width == drafts + 1 and drafts in round_ms:
        return round_ms[drafts]
    base = max(k for k in round_ms if k <= drafts and k + 1 in target)
    more = (drafts - base) * draft[1] + (draft[2] - draft[1] if base == 0 else 0.0)
    return round_ms[base] + more + target[width] - target[base + 1]


def static_priced_rounds_ms(fields: Mapping[str, Any], policy: Lookahead,
                            round_ms: Mapping[int, float], costs) -> float:  # fmt: skip
    """ms of a policy's rounds (its runs' sl_histogram) had each cost a static round of the same
    draft count and verify width (`_static_round`), plus the draft calls a static round of
    that count does not make (an oracle's mismatching draft, a rule's dropped last draft:
    draft_calls - sum_d d x rounds(d); a round of 0 drafts still made the round's first,
    2-position draft call)."""
    hist = [int(n) for n in fields["sl_histogram"]]
    widths = verify_widths(policy)
    total = 0.0
    for drafts, rounds in enumerate(hist):
        if rounds:
            width = min(w for w in widths if w >= drafts + 1)
            total += rounds * _static_round(drafts, width, round_ms, costs)
    extra = int(fields["draft_calls"]) - sum(d * n for d, n in enumerate(hist))
    first = min(hist[0], max(extra, 0))
    return total + first * costs["draft"][2] + (extra - first) * costs["draft"][1]


def round_overhead_pct(fields: Mapping[str, Any], policy: Lookahead,
                       round_ms: Mapping[int, float], costs) -> float:  # fmt: skip
    """How much more (%) a policy's rounds took than static rounds of the same draft counts and
    verify widths measured in the same runs: 100 x (measured - priced) / priced, where measured
    is its runs' time less each run's fixed part (the static loop's, costs['fixed']['static'],
    so that a dynamic program's dearer prefill or dispatch counts too) and priced is
    `static_priced_rounds_ms`. Model-free: every price but a missing draft call (and a width
    above the widest static run) is a measured static round. ~0 for a static policy priced from
    its own runs; static-opt, a second run of a static SL-k, shows the timing's noise."""
    priced = static_priced_rounds_ms(fields, policy, round_ms, costs)
    measured = 1e3 * sum(fields["prompt_seconds"]) - fields["runs"] * costs["fixed"]["static"]
    return 100.0 * (measured - priced) / max(priced, 1e-12)


def measure_policies(
    target,
    target_params,
    draft,
    draft_params,
    prompts: Sequence[tuple[np.ndarray, np.ndarray]],
    policies: Mapping[str, Lookahead],
    *,
    classifier=None,
    cost_timers: tuple | None = None,
    max_new_tokens: int,
    eos_id: int | None,
    vocab_size: int | None = None,
    timing_repeats: int = 1,
    desc: str = "policies",
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Greedy decoding latency per generated token of each lookahead policy, at batch 1.

    Every prompt is decoded by the target alone ('target') and by each policy, one after the
    other (`timing.interleaved`, so a slower or busier stretch of the machine hits all of them
    alike); each program is compiled on the first prompt before anything is timed; per prompt
    the median of timing_repeats calls counts. The oracle policy gets the target's own output
    as reference.

    Args:
      prompts: (prompt_tokens [1, P], prompt_lengths [1]) pairs, all of one shape.
      policies: {name: Lookahead}; names must not be 'target'.
      classifier: DISCO classifier variables (for kind 'disco', and 'cumulative' from
        'classifier').
      cost_timers: `timing.call_cost_timers` output for these policies; with it the cost
        model's timers run once per prompt beside the policies (interleaved: the machine's
        speed drifts by tens of percent over minutes, so costs timed apart from the runs they
        price would misprice them), and each policy also gets modeled_latency_ms.
      Others as in `evaluate_drafts`.

    Returns:
      ({'target' and each policy name: measured fields of a policy record (see
      POLICY_RECORD_KEYS): alpha, tau, mean_sl, sl_histogram, latency_ms, target_latency_ms,
      speedup, exact, num_prompts, tokens, target_calls, draft_calls, sl_max, threshold; and
      width_switches, runs, prompt_seconds (each prompt's median seconds)},
      the call costs (`timing.call_costs`, per-prompt samples) or None without cost_timers).
    """
    if not prompts:
        raise ValueError("prompts is empty: pass at least one (prompt_tokens, prompt_lengths)")
    if TARGET_POLICY in policies:
        raise ValueError("'target' is the plain target's name; name the policies otherwise")
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab_size)
    greedy = SamplingConfig()

    def plain(prompt, reference):
        return generate(target, target_params, *prompt, sampling=greedy, **common)

    def policy_fn(lookahead):
        def run(prompt, reference):
            return speculative_generate(
                target, draft, target_params, draft_params, *prompt, lookahead=lookahead,
                classifier=classifier if lookahead.uses_classifier else None,
                oracle_tokens=reference.tokens if lookahead.kind == "oracle" else None,
                sampling=greedy, **common,
            )  # fmt: skip

        return run

    fns = {TARGET_POLICY: plain, **{name: policy_fn(la) for name, la in policies.items()}}
    references = [plain(prompt, None) for prompt in prompts]  # Also compiles the target.
    first = {"prompt_tokens": prompts[0][0], "prompt_lengths": prompts[0][1]}
    mean_tvd(  # Stops on non-finite logits of either model before anything is timed.
        target, target_params, draft, draft_params, [first], references[:1], greedy, vocab_size
    )
    timers = {}
    if cost_timers is not None:
        timers = {
            ("cost", *name): (lambda *_, t=timer: t()) for name, timer in cost_timers[0].items()
        }
    results, seconds = interleaved_items(
        {**fns, **timers}, list(zip(prompts, references)), timing_repeats, _prompt_shape,
        desc=desc, per_item=True,
    )  # fmt: skip
    costs = None
    if cost_timers is not None:
        # Means: each policy's latency is a total over prompts timed once each (per prompt,
        # the median of timing_repeats), slow spikes included.
        costs = call_costs(
            {name[1:]: results[name] for name in timers}, *cost_timers[1:], statistics.mean
        )
    generated = max(_counter_sum(references, "lengths"), 1)
    target_latency = 1000.0 * sum(seconds[TARGET_POLICY]) / generated
    measured = {
        name: _policy_fields(
            results[name], seconds[name], policies.get(name), references, target_latency, costs
        )
        for name in fns
    }
    return measured, costs


def policy_records(
    measured: Mapping[str, Mapping[str, Any]], *, draft: str, task: str, split: str,
    max_new_tokens: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Flat records (POLICY_RECORD_KEYS order) from `measure_policies`' output."""
    records = []
    for name, fields in measured.items():
        record = dict(fields, draft=draft, policy=name, temperature=0.0, task=task, split=split)
        record["max_new_tokens"] = max_new_tokens
        records.append({key: record[key] for key in POLICY_RECORD_KEYS})
    return records


def resolve_policies(
    names: Sequence[str],
    tuning: Mapping[str, Any] | None = None,
    *,
    heuristic_sl_max: int = 8,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
) -> dict[str, Lookahead]:
    """{name: Lookahead} for policy names (the target alone is always measured besides).

    Args:
      names: 'static-<k>', 'static-opt', 'heuristic', 'confidence', 'disco', 'cumulative',
        'oracle'.
      tuning: a draft's validation tuning (classifier.json's 'tuning', from
        `python -m distillspec.disco`): static_opt, and the confidence, disco and cumulative
        settings. A tuning saved before a tuned policy existed lacks its settings: that policy
        is an error naming the command that tunes it again.
      heuristic_sl_max, heuristic_start: the heuristic's cap and first lookahead.
      oracle_sl_max: the oracle's cap (large: the oracle SL histogram is DISCO's Figure 4).
    """
    out = {}
    for name in names:
        if name == TARGET_POLICY:
            continue
        if name in TUNED_POLICIES and not tuning:
            raise ValueError(
                f"policy {name!r} is tuned on validation data: train and tune the draft's "
                "classifier first with python -m distillspec.disco"
            )
        key = "static_opt" if name == "static-opt" else name
        if name in TUNED_POLICIES and key not in tuning:
            raise ValueError(
                f"the draft's saved tuning has no {key!r} settings (it was tuned before policy "
                f"{name!r} existed; it has {sorted(tuning)}): tune it again with python -m "
                "distillspec.disco (a rerun retunes a tuning that lacks a policy)"
            )
        if name.startswith("static-") and name[7:].isdigit():
            out[name] = Lookahead("static", int(name[7:]))
        elif name == "static-opt":
            out[name] = Lookahead("static", int(tuning["static_opt"]))
        elif name == "heuristic":
            out[name] = Lookahead(
                "heuristic", heuristic_sl_max, start=min(heuristic_start, heuristic_sl_max)
            )
        elif name in THRESHOLD_KINDS:
            out[name] = Lookahead(name, **tuning[name])
        elif name == "oracle":
            out[name] = Lookahead("oracle", oracle_sl_max)
        else:
            raise ValueError(f"unknown lookahead policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    return out


def evaluate_policies(
    target,
    target_params,
    drafts: Mapping[str, tuple[Any, Any, Any, Mapping[str, Any] | None]],
    sets: Mapping[tuple[str, str], Sequence[Mapping[str, np.ndarray]]],
    policies: Sequence[str],
    *,
    num_prompts: int,
    max_new_tokens: int,
    eos_id: int | None,
    records_path: str | None = None,
    timing_repeats: int = 1,
    heuristic_sl_max: int = 8,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
    model_costs: bool = True,
    vocab_size: int | None = None,
    context: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """DISCO Table 1: every policy's batch-1 greedy latency, per eval set and draft.

    Args:
      drafts: {name: (model, params, DISCO classifier variables or None, tuning or None)}.
      sets: {(task, split): prompt batches}; the first num_prompts valid prompts are used.
      policies: names for `resolve_policies` (the target alone is always measured).
      records_path: records are appended here as they are made (one eval set at a time).
      model_costs: also give each record modeled_latency_ms (call costs measured per draft).
      context: fields added to every record (e.g. {'dtype': 'bfloat16'}).
      Others as in `measure_policies` / `resolve_policies`.

    Returns:
      One record per (eval set, draft, policy), keys POLICY_RECORD_KEYS (and context's).
    """
    records = []
    for name, (draft, draft_params, classifier, tuning) in drafts.items():
        lookaheads = resolve_policies(
            policies, tuning, heuristic_sl_max=heuristic_sl_max,
            heuristic_start=heuristic_start, oracle_sl_max=oracle_sl_max,
        )  # fmt: skip
        cost_timers = None
        if model_costs:  # Timed on the first prompt, beside every set's runs.
            first = single_prompts(next(iter(sets.values())))[0]
            cost_timers = call_cost_timers(
                target, target_params, draft, draft_params, first, lookaheads.values(),
                classifier=classifier, max_new_tokens=max_new_tokens, vocab_size=vocab_size,
            )  # fmt: skip
        for (task, split), batches in sets.items():
            measured, _ = measure_policies(
                target, target_params, draft, draft_params,
                single_prompts(batches)[:num_prompts], lookaheads, classifier=classifier,
                cost_timers=cost_timers,
                max_new_tokens=max_new_tokens, eos_id=eos_id, timing_repeats=timing_repeats,
                vocab_size=vocab_size, desc=f"{name} {task}/{split}",
            )  # fmt: skip
            new = policy_records(
                measured, draft=name, task=task, split=split, max_new_tokens=max_new_tokens
            )
            new = [{**r, **(context or {})} for r in new]
            if records_path:
                append_records(records_path, new)
            records += new
            by = {r["policy"]: r for r in new}
            line = " ".join(f"{p}={r['latency_ms']:.2f}ms" for p, r in by.items())
            print(f"[policies] {name} {task}/{split}: {line}", file=sys.stderr, flush=True)
    return records
