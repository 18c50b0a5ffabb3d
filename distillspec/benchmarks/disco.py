"""DISCO against its baselines where speculative decoding pays: the memory-bound reference pairs.

    python -m distillspec.benchmarks.disco --json OUT.json
    python -m distillspec.benchmarks.disco --pair trained --draft distilled --json OUT.json

On a 2-core CPU the embedded default's tiny models are compute-bound (verifying k tokens costs
about k target steps), so no lookahead policy beats the target alone there. This benchmark runs
the same DISCO pipeline on `distillspec.benchmarks.speculative`'s reference pair (a >= 200 MB
Llama-style target and its early-exit draft, memory-bound on a CPU) with random-token prompts:

  1. features (DISCO App. D) on --train_prompts prompts, the stop classifier, its F1 against the
     best static-SL rule on the validation prompts;
  2. latency tuning on --validation_prompts prompts (batch 1, greedy): static SL-opt, and
     threshold / SL_max / keep_last of the confidence and DISCO rules and of SpecDec++'s
     cumulative rule (and its source of acceptance estimates: the classifier or the draft);
  3. every policy timed on --test_prompts other prompts, interleaved per prompt, median of
     --timing_repeats calls, compilation excluded (`evaluation.policies.measure_policies`).

Prints one JSON object: per policy measured and modeled latency (ms per token; modeled = counted
calls priced with measured call costs, `evaluation.timing.modeled_latency_ms`), speed-up against the
target alone, mean SL, tau and exactness (output identical to the target's greedy output), and
the headline ratios `disco_vs_static_opt_pct`, `cumulative_vs_static_opt_pct` and
`oracle_vs_static_opt_pct` (latency reduction, %; `modeled_` ones from the modeled latency),
and the pair's measured `c` (a draft step in the loop's context / a target call) and `r_gamma`
(a target call scoring static SL-opt + 1 positions / scoring 1; `pair_costs`).

`round_overhead_pct` (policy -> %, and `<policy>_round_overhead_pct` each) is the model-free
check of the decoder: each dynamic policy's measured time against the sum over its rounds of
the measured cost of a static round of the same draft count and verify width, from its
sl_histogram and the static SL-k runs of the same test prompts
(`evaluation.policies.round_overhead_pct`); static-opt's, a second static run priced from the
first, shows the timing's noise. The oracle's cap is tuned on the validation prompts over
--oracle_sl_max_grid (`oracle_best_sl_max`; 'oracle' runs at it) and every cap of the grid and
--oracle_sl_max is measured beside it ('oracle-<cap>', `oracle_sl_max_latency_ms`).

--pair trained (after python -m distillspec.quickstart) runs the same pipeline on a trained pair:
the main job's trained target padded with blocks whose residual output projections are zero
(logits bit-identical to the trained target's; `padded_target`) to >= --target_mb MB of
weights (or by --pad_layers blocks), its trained --draft ('standard' or 'distilled') from
--run_dir, and prompts of --task's train, validation and test splits (greedy decoding stops at
EOS). --pair random (the default) is the early-exit pair above.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

from distillspec.benchmarks import emit
from distillspec.benchmarks.padded_target import (
    DRAFT_EXPORTS,
    TARGET_EXPORT,
    task_prompts,
    trained_pair,
)
from distillspec.benchmarks.speculative import TARGET, reference_pair
from distillspec.decoding.lookahead import SOURCES, Lookahead, verify_widths
from distillspec.disco.classifier import best_static_sl, classifier_f1, train_classifier
from distillspec.disco.features import extract_features
from distillspec.disco.tuning import (
    CUMULATIVE_THRESHOLDS,
    best_labels,
    tune_policies,
    tuning_grid,
)
from distillspec.evaluation import costs as cost_profiles
from distillspec.evaluation.policies import (
    measure_policies,
    priced,
    resolve_policies,
    round_overhead_pct,
    static_round_ms,
)
from distillspec.evaluation.timing import (
    call_cost_timers,
    megabytes,
    repeats_interval,
    until_timed,
)
from distillspec.records import policy_list


def _prompts(count: int, length: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, TARGET.vocab_size, (count, 1, length)).astype(np.int32)
    return [(t, np.array([length], np.int32)) for t in tokens]


def _batches(prompts, batch_size: int):
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        yield {
            "prompt_tokens": np.concatenate([t for t, _ in chunk]),
            "prompt_lengths": np.concatenate([n for _, n in chunk]),
        }


HEADLINE = ("disco", "cumulative", "oracle")
# The modeled sweep's profiles (GPU-like to CPU-like): c, a draft call / a target call, and
# r_gamma, a target call scoring SWEEP_GAMMA + 1 positions / one scoring 1.
SWEEP_C = (0.02, 0.05, 0.1, 0.2, 0.4)
SWEEP_R = (1.0, 1.3, 1.6, 2.0)
SWEEP_GAMMA = 5
SWEEP_POLICIES = ("heuristic", "confidence", "disco", "cumulative", "oracle")


def reduction_pct(opt: float, value: float) -> float:
    """Latency reduction (%) of `value` against static SL-opt's `opt` (> 0: faster)."""
    return 100.0 * (opt - value) / opt


def prompt_intervals(measured, names=HEADLINE, confidence: float = 0.9) -> dict:
    """'<name>_vs_static_opt_pct_interval': a percentile-bootstrap interval over the test
    prompts (resampled whole: every policy's time on a prompt stays together) of each policy's
    latency reduction against static SL-opt; None with fewer than 2 prompts."""
    seconds = {n: np.asarray(measured[n]["prompt_seconds"]) for n in ("static-opt", *names)}
    count = len(seconds["static-opt"])
    keys = [f"{name}_vs_static_opt_pct_interval" for name in names]
    if count < 2:
        return dict.fromkeys(keys)

    def figures(index):
        opt = seconds["static-opt"][index].sum()
        return [reduction_pct(opt, seconds[n][index].sum()) for n in names]

    low, high = repeats_interval(figures, count, confidence)
    return {k: [round(float(a), 2), round(float(b), 2)] for k, a, b in zip(keys, low, high)}


def modeled_sweep(rules, fixed, valid_counts, test_counts, cs=SWEEP_C, rs=SWEEP_R,
                  gamma: int = SWEEP_GAMMA) -> list[dict]:  # fmt: skip
    """Modeled, not measured: per synthetic profile (`costs.synthetic_profile`: c, r_gamma at
    gamma), each rule of `tuning_grid` tuned on the validation prompts' counted calls and priced
    on the test prompts' (every configuration ran on both), and each policy's latency reduction
    against static SL-opt so tuned (%); fixed: the untuned policies ({'heuristic': ..,
    'oracle': ..}, priced on the test counts)."""
    grid = {label: p for configs in rules.values() for label, p in configs.items()}
    policies = {**grid, **fixed}
    rows = []
    for c in cs:
        for r in rs:
            profile = cost_profiles.synthetic_profile(c, r, gamma)
            costs = cost_profiles.profile_costs(profile, policies.values())
            price = lambda counts, n, costs=costs: priced(counts[n], policies[n], costs)
            labels = best_labels(rules, {n: price(valid_counts, n) for n in grid})
            chosen = {"static-opt": labels["static"], **{n: n for n in fixed}}
            tuned = ("confidence", "disco", "cumulative", "oracle")
            chosen.update({k: labels[k] for k in tuned if k in labels})
            opt = price(test_counts, chosen["static-opt"])
            row = {"c": c, "r_gamma": r, "static_opt": policies[chosen["static-opt"]].sl_max}
            for name in SWEEP_POLICIES:
                reduction = reduction_pct(opt, price(test_counts, chosen[name]))
                row[f"{name}_vs_static_opt_pct"] = round(reduction, 2)
            rows.append(row)
    return rows


def round_overheads(measured, policies, costs) -> dict[str, float]:
    """{policy: `policies.round_overhead_pct`} of every dynamic policy and of static-opt (a
    second run of a static SL-k, priced from the first: the timing's noise), their rounds priced
    at the static rounds measured in the same runs (`policies.static_round_ms`)."""
    round_ms = static_round_ms(measured, policies, costs)
    names = [n for n, p in policies.items() if p.kind != "static" or n == "static-opt"]
    return {
        name: round(round_overhead_pct(measured[name], policies[name], round_ms, costs), 2)
        for name in names
    }


def _result(measured, tuning, costs, classifier, valid_examples, examples, args,
            policies) -> dict:  # fmt: skip
    """The JSON result: headline ratios, tuning, F1, call costs and per-policy figures."""
    static_k, static_f1 = best_static_sl(valid_examples)
    overheads = round_overheads(measured, policies, costs)

    def reduction(name, key="latency_ms"):
        return round(reduction_pct(measured["static-opt"][key], measured[name][key]), 2)

    return {
        **{f"{name}_vs_static_opt_pct": reduction(name) for name in HEADLINE},
        **prompt_intervals(measured),
        **{
            f"modeled_{name}_vs_static_opt_pct": reduction(name, "modeled_latency_ms")
            for name in HEADLINE
        },
        "all_exact": all(m["exact"] for m in measured.values()),
        "static_opt": tuning["static_opt"],
        "oracle_best_sl_max": tuning["oracle"]["sl_max"],
        "oracle_sl_max_latency_ms": {
            int(n[7:]): round(m["latency_ms"], 4)
            for n, m in measured.items()
            if n.startswith("oracle-")
        },  # fmt: skip
        **{
            f"{n.replace('-', '_')}_vs_static_opt_pct": reduction(n)
            for n in measured
            if n.startswith("oracle-")
        },  # fmt: skip
        "disco": tuning["disco"],
        "cumulative": tuning["cumulative"],
        "confidence": tuning["confidence"],
        "f1_disco": round(classifier_f1(classifier, valid_examples), 4),
        "f1_static_sl": round(static_f1, 4),
        "f1_static_sl_k": static_k,
        "train_tokens": len(examples),
        # A dynamic round against a static one of the same draft count, in the same runs; and
        # each as a field of its own, for the page's table of fields.
        "round_overhead_pct": overheads,
        **{f"{name}_round_overhead_pct": pct for name, pct in overheads.items()},
        "call_costs_ms": jax.tree.map(lambda ms: round(ms, 3), costs),
        "policies": {
            name: {
                key: round(m[key], 4) if isinstance(m[key], float) else m[key]
                for key in (
                    "latency_ms",
                    "modeled_latency_ms",
                    "speedup",
                    "mean_sl",
                    "tau",
                    "alpha",
                    "exact",
                )  # fmt: skip
            }
            for name, m in measured.items()
        },
        "test_prompts": args.test_prompts,
        "timing_repeats": args.timing_repeats,
        "max_new_tokens": args.max_new_tokens,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument(
        "--pair", choices=("random", "trained"), default="random",
        help="random: the early-exit reference pair, random-token prompts; trained: the main "
        "job's trained target, padded (logits unchanged), and its trained --draft, task prompts",
    )  # fmt: skip
    parser.add_argument("--draft", choices=tuple(DRAFT_EXPORTS), default="distilled",
                        help="--pair trained: the main job's draft")  # fmt: skip
    parser.add_argument("--run_dir", default=os.path.join("runs", "quickstart"),
                        help="--pair trained: the main job's output directory")  # fmt: skip
    parser.add_argument("--target_mb", type=float, default=256.0,
                        help="--pair trained: pad the target to at least this many MB")  # fmt: skip
    parser.add_argument("--pad_layers", type=int, help="--pair trained: blocks to add instead")
    parser.add_argument("--task", default="stdlib_code",
                        help="--pair trained: prompts of its train, validation, test")  # fmt: skip
    parser.add_argument("--vocabulary", help="--pair trained: tokenizer (default: the target's)")
    parser.add_argument("--train_prompts", type=int, default=128)
    parser.add_argument("--validation_prompts", type=int, default=12)
    parser.add_argument("--test_prompts", type=int, default=24)
    parser.add_argument("--prompt_length", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--draft_layers", type=int, default=1)
    parser.add_argument("--deep_residual_scale", type=float, default=0.1)
    parser.add_argument("--static_sl", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--sl_max_grid", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--threshold_grid", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    parser.add_argument(
        "--cumulative_threshold_grid", type=float, nargs="+", default=list(CUMULATIVE_THRESHOLDS),
        help="the cumulative rule's thresholds on P(some draft of the round is rejected)",
    )  # fmt: skip
    parser.add_argument(
        "--cumulative_sources", nargs="+", default=list(SOURCES), choices=SOURCES,
        help="the cumulative rule's acceptance estimates: DISCO's classifier, the draft's own",
    )  # fmt: skip
    parser.add_argument("--oracle_sl_max", type=int, default=32,
                        help="the untuned oracle's cap, measured beside the tuned one")  # fmt: skip
    parser.add_argument(
        "--oracle_sl_max_grid", type=int, nargs="+", default=[4, 8, 16, 32],
        help="the oracle's caps, tuned on the validation prompts as the rules' SL_max are",
    )  # fmt: skip
    parser.add_argument("--timing_repeats", type=int, default=3, help="per test prompt (median)")
    parser.add_argument(
        "--write_profile", metavar="PATH",
        help="only measure the pair's cost profile here (target calls per verify width, draft "
        "calls; run it on the machine the pair will serve on) and write it to PATH as JSON",
    )  # fmt: skip
    parser.add_argument(
        "--profile", metavar="PATH",
        help="tune the policies for this cost profile (from --write_profile on another machine) "
        "instead of this machine's costs; its modeled latencies are reported beside",
    )  # fmt: skip
    parser.add_argument("--sweep_c", type=float, nargs="*", default=list(SWEEP_C),
                        help="the modeled sweep's draft costs c (none: no sweep)")  # fmt: skip
    parser.add_argument("--sweep_r", type=float, nargs="*", default=list(SWEEP_R),
                        help="the modeled sweep's r_gamma (at gamma 5)")  # fmt: skip
    return parser


def _pair_and_prompts(args):
    """(pair, {'train', 'validation', 'test': batch-1 prompts}, eos_id) of --pair."""
    counts = {"train": args.train_prompts, "validation": args.validation_prompts,
              "test": args.test_prompts}  # fmt: skip
    if args.pair == "random":
        pair = reference_pair(args.draft_layers, args.deep_residual_scale)
        seeds = {"train": 1, "validation": 2, "test": 3}
        return pair, {s: _prompts(n, args.prompt_length, seeds[s]) for s, n in counts.items()}, None
    pair = trained_pair(args.run_dir, args.draft, args.target_mb, args.pad_layers)
    checkpoint = os.path.join(args.run_dir, TARGET_EXPORT)
    prompts, eos_id = task_prompts(checkpoint, args.vocabulary, args.task, counts,
                                   args.prompt_length)  # fmt: skip
    return pair, prompts, eos_id


def pair_costs(costs, static_opt: int) -> dict:
    """c (a draft step in the loop's context / a target call scoring 1 position) and r_gamma
    (a target call scoring static_opt + 1 positions / scoring 1) from `timing.call_costs`,
    and whether they are in the memory-bound regime (c <= 0.1 and r_gamma <= 1.3)."""
    target = costs["target"]
    c = costs["draft"][1] / target[1]
    r_gamma = target[static_opt + 1] / target[1]
    return {"c": round(c, 4), "r_gamma": round(r_gamma, 4), "r_gamma_width": static_opt + 1,
            "memory_bound": bool(c <= 0.1 and r_gamma <= 1.3)}  # fmt: skip


def _profile_pricing(profile, path: str, measured: dict, policies: dict) -> dict:
    """The tuned policies' test runs priced at a cost profile's costs (result fields)."""
    pricing = cost_profiles.profile_costs(profile, [None, *policies.values()])
    modeled = {n: priced(m, policies.get(n), pricing) for n, m in measured.items()}
    fields = {"profile": path, "profile_modeled_latency_ms": {
        n: round(v, 5) for n, v in modeled.items()}}  # fmt: skip
    for name in HEADLINE:
        reduction = reduction_pct(modeled["static-opt"], modeled[name])
        fields[f"profile_{name}_vs_static_opt_pct"] = round(reduction, 2)
    return fields


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pair == "random" and (args.pad_layers is not None or args.draft != "distilled"):
        parser.error("--pad_layers and --draft choose the trained pair's models (--pair trained)")

    try:  # A bad profile stops here, before any model is loaded.
        profile = cost_profiles.load_profile(args.profile) if args.profile else None
    except (OSError, ValueError) as error:
        parser.error(str(error))
    rules = tuning_grid(args.static_sl, args.sl_max_grid, args.threshold_grid, (True, False),
                        args.cumulative_threshold_grid, args.cumulative_sources,
                        args.oracle_sl_max_grid)  # fmt: skip
    grid = {label: p for configs in rules.values() for label, p in configs.items()}
    fixed = resolve_policies(["heuristic", "oracle"], heuristic_sl_max=max(args.sl_max_grid),
                             oracle_sl_max=args.oracle_sl_max)  # fmt: skip

    pair, prompts, eos_id = _pair_and_prompts(args)
    target, target_params, draft, draft_params, description = pair
    common = dict(max_new_tokens=args.max_new_tokens, eos_id=eos_id)
    train, valid, test = prompts["train"], prompts["validation"], prompts["test"]
    about = dict(pair_kind=args.pair, pair=description, backend=jax.default_backend())
    if args.write_profile:
        every = [*grid.values(), *fixed.values()]
        widths = sorted({w for p in every for w in verify_widths(p)} | {1})
        written, untimed = until_timed(
            lambda: cost_profiles.measure_profile(
                target, target_params, draft, draft_params, *test[0], widths,
                args.max_new_tokens, draft_widths=(1, 2),
            ),
            cost_profiles.untimed,
        )  # fmt: skip
        if not untimed:
            return emit({**written, **about}, args.write_profile)
        parser.error(f"these calls timed <= 0 three times (a busy machine): {untimed}; "
                     "measure on a quiet machine")  # fmt: skip
    examples = extract_features(
        target, target_params, draft, draft_params, list(_batches(train, 32)), **common
    )
    valid_examples = extract_features(
        target, target_params, draft, draft_params, list(_batches(valid, 32)), **common
    )
    classifier = train_classifier(examples)
    sweep = bool(args.sweep_c and args.sweep_r)
    print("[disco benchmark] tuning on validation prompts ...", file=sys.stderr, flush=True)
    tuning = tune_policies(
        target, target_params, draft, draft_params, valid, classifier,
        static_sl=args.static_sl, sl_max_grid=args.sl_max_grid,
        threshold_grid=args.threshold_grid,
        cumulative_threshold_grid=args.cumulative_threshold_grid,
        cumulative_sources=args.cumulative_sources, profile=profile, keep_counts=sweep,
        oracle_sl_max_grid=args.oracle_sl_max_grid, **common,
    )  # fmt: skip
    policies = resolve_policies(
        policy_list(args.static_sl),
        tuning,
        heuristic_sl_max=max(args.sl_max_grid),
        oracle_sl_max=tuning["oracle"]["sl_max"],
    )
    # Every cap of the oracle's grid and the untuned one, measured beside its tuned cap.
    caps = sorted({*args.oracle_sl_max_grid, args.oracle_sl_max})
    policies.update({f"oracle-{n}": Lookahead("oracle", n) for n in caps})
    cost_timers = call_cost_timers(
        target, target_params, draft, draft_params, test[0], policies.values(),
        classifier=classifier, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    measured, costs = measure_policies(
        target, target_params, draft, draft_params, test, policies, classifier=classifier,
        cost_timers=cost_timers, timing_repeats=args.timing_repeats, desc="test", **common,
    )  # fmt: skip

    result = _result(measured, tuning, costs, classifier, valid_examples, examples, args, policies)
    result.update(pair_costs(costs, tuning["static_opt"]))
    if not result["memory_bound"]:
        print(
            f"[disco benchmark] not memory-bound here: c={result['c']}, r_gamma="
            f"{result['r_gamma']} (want c <= 0.1, r_gamma <= 1.3)"
            + ("; raise --target_mb" if args.pair == "trained" else ""),
            file=sys.stderr,
            flush=True,
        )
    if profile is not None:
        result.update(_profile_pricing(profile, args.profile, measured, policies))
    if sweep:  # Every configuration's counted calls on the test prompts (timing unused).
        counted, _ = measure_policies(
            target, target_params, draft, draft_params, test, {**grid, **fixed},
            classifier=classifier, desc="sweep counts", **common,
        )  # fmt: skip
        result["sweep"] = modeled_sweep(
            rules, fixed, tuning["counts"], counted, args.sweep_c, args.sweep_r
        )
        result["all_exact"] = result["all_exact"] and all(m["exact"] for m in counted.values())
    result.update(
        target_mb=round(megabytes(target_params), 1),
        draft_mb=round(megabytes(draft_params), 1),
        **about,
    )
    return emit(result, args.json)


if __name__ == "__main__":
    main()
