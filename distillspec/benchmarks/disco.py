"""DISCO against its baselines where speculative decoding pays: the memory-bound reference pair.

    python -m distillspec.benchmarks.disco --json OUT.json

On a 2-core CPU the embedded default's tiny models are compute-bound (verifying k tokens costs
about k target steps), so no lookahead policy beats the target alone there. This benchmark runs
the same DISCO pipeline on `distillspec.benchmarks.speculative`'s reference pair (a >= 200 MB
Llama-style target and its early-exit draft, memory-bound on a CPU) with random-token prompts:

  1. features (DISCO App. D) on --train_prompts prompts, the stop classifier, its F1 against the
     best static-SL rule on the validation prompts;
  2. latency tuning on --validation_prompts prompts (batch 1, greedy): static SL-opt, and
     threshold / SL_max / keep_last of the confidence and DISCO rules;
  3. every policy timed on --test_prompts other prompts, interleaved per prompt, median of
     --timing_repeats calls, compilation excluded (`distillspec.evaluate.measure_policies`).

Prints one JSON object: per policy measured and modeled latency (ms per token; modeled = counted
calls priced with measured call costs, `evaluate.modeled_latency_ms`), speed-up against the
target alone, mean SL, tau and exactness (output identical to the target's greedy output), and
the headline ratios `disco_vs_static_opt_pct` and `oracle_vs_static_opt_pct` (latency
reduction, %; `modeled_` ones from the modeled latency).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np

from distillspec import disco, evaluate, lookahead
from distillspec.benchmarks.speculative import TARGET, megabytes, reference_pair


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--train_prompts", type=int, default=128)
    parser.add_argument("--validation_prompts", type=int, default=6)
    parser.add_argument("--test_prompts", type=int, default=12)
    parser.add_argument("--prompt_length", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--draft_layers", type=int, default=1)
    parser.add_argument("--deep_residual_scale", type=float, default=0.1)
    parser.add_argument("--static_sl", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--sl_max_grid", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--threshold_grid", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--oracle_sl_max", type=int, default=32)
    parser.add_argument("--timing_repeats", type=int, default=3, help="per test prompt (median)")
    args = parser.parse_args(argv)

    target, target_params, draft, draft_params, description = reference_pair(
        args.draft_layers, args.deep_residual_scale
    )
    common = dict(max_new_tokens=args.max_new_tokens, eos_id=None)
    train = _prompts(args.train_prompts, args.prompt_length, seed=1)
    valid = _prompts(args.validation_prompts, args.prompt_length, seed=2)
    test = _prompts(args.test_prompts, args.prompt_length, seed=3)
    examples = disco.extract_features(
        target, target_params, draft, draft_params, list(_batches(train, 32)), **common
    )
    valid_examples = disco.extract_features(
        target, target_params, draft, draft_params, list(_batches(valid, 32)), **common
    )
    classifier = disco.train_classifier(examples)
    static_k, static_f1 = disco.best_static_sl(valid_examples)
    print("[disco benchmark] tuning on validation prompts ...", file=sys.stderr, flush=True)
    tuning = disco.tune_policies(
        target, target_params, draft, draft_params, valid, classifier,
        static_sl=args.static_sl, sl_max_grid=args.sl_max_grid,
        threshold_grid=args.threshold_grid, **common,
    )  # fmt: skip
    names = [f"static-{k}" for k in args.static_sl]
    names += ["static-opt", "heuristic", "confidence", "disco", "oracle"]
    policies = evaluate.resolve_policies(
        names, tuning, heuristic_sl_max=max(args.sl_max_grid), oracle_sl_max=args.oracle_sl_max
    )
    widths = {w for la in policies.values() for w in lookahead.verify_widths(la)}
    costs = evaluate.measure_call_costs(
        target,
        target_params,
        draft,
        draft_params,
        test[0],
        widths,
        max_new_tokens=args.max_new_tokens,
    )
    measured = evaluate.measure_policies(
        target, target_params, draft, draft_params, test, policies, classifier=classifier,
        costs=costs, timing_repeats=args.timing_repeats, desc="test", **common,
    )  # fmt: skip

    def reduction(name, key="latency_ms"):
        opt = measured["static-opt"][key]
        return round(100.0 * (opt - measured[name][key]) / opt, 2)

    result = {
        "disco_vs_static_opt_pct": reduction("disco"),
        "oracle_vs_static_opt_pct": reduction("oracle"),
        "modeled_disco_vs_static_opt_pct": reduction("disco", "modeled_latency_ms"),
        "modeled_oracle_vs_static_opt_pct": reduction("oracle", "modeled_latency_ms"),
        "all_exact": all(m["exact"] for m in measured.values()),
        "static_opt": tuning["static_opt"],
        "disco": tuning["disco"],
        "confidence": tuning["confidence"],
        "f1_disco": round(disco.classifier_f1(classifier, valid_examples), 4),
        "f1_static_sl": round(static_f1, 4),
        "f1_static_sl_k": static_k,
        "train_tokens": len(examples),
        "call_costs_ms": {
            "target": {str(w): round(t, 3) for w, t in costs["target"].items()},
            "draft": {str(w): round(t, 3) for w, t in costs["draft"].items()},
            "round": round(costs["round"], 3),
        },
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
        "target_mb": round(megabytes(target_params), 1),
        "draft_mb": round(megabytes(draft_params), 1),
        "pair": description,
        "backend": jax.default_backend(),
    }
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
