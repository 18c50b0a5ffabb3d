"""Where a batch-1 decoding round's time goes, on any pair: its model calls against the loop.

    python -m distillspec.benchmarks.profile_round --target runs/quickstart/target/export \
        --draft runs/quickstart/distilled/export [--gamma 3] [--temperature 0 1]

For each temperature, interleaved in one process (compilation excluded, medians of --repeats):
plain decoding and speculative decoding (static gamma) of the first stdlib test prompt, and
jitted loops of the bare model calls (`evaluation.timing.step_timer`, `round_timer`). Prints one
JSON object per temperature, milliseconds:
  target_call_ms            one target call scoring 1 position;
  round_calls_ms            one round's model calls: gamma draft steps and the target scoring
                            gamma + 1 positions (greedy token choice between them);
  plain_step_ms             a plain run / its steps (prefill and the call's host work included);
  spec_round_ms             a speculative run / its rounds (the same);
  plain_outside_ms          plain_step_ms - target_call_ms: what a step spends outside its call;
  spec_outside_ms           spec_round_ms - round_calls_ms: what a round spends outside its calls;
  speedup                   plain run time / speculative run time (median of per-repeat ratios).
Uses only the public decoding API and timers, so it runs on earlier commits too (a before/after
profile of a change); its call timers size their caches for their own calls, shorter than a
run's, so the "outside" figures include what the longer cache adds to the run's calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

from distillspec.benchmarks.speculative import checkpoint_pair, task_prompts
from distillspec.decoding import generate, speculative_generate
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation.timing import interleaved, round_timer, step_timer


def profile(pair, prompts, gamma: int, temperature: float, max_new_tokens: int, repeats: int):
    target, tp, draft, dp, _ = pair
    tokens, lengths = prompts
    sampling, rng = SamplingConfig(temperature), jax.random.PRNGKey(0)
    common = dict(max_new_tokens=max_new_tokens, sampling=sampling)
    plain = lambda: generate(target, tp, tokens, lengths, rng, **common)
    spec = lambda: speculative_generate(
        target, draft, tp, dp, tokens, lengths, rng, gamma=gamma, **common
    )
    calls = max(8, max_new_tokens // (gamma + 1))
    timers = {
        "target": step_timer(target, tp, tokens, lengths, 1, calls),
        "round": round_timer(target, tp, draft, dp, tokens, lengths, gamma, calls),
    }
    plain(), spec()  # Compiles.
    runs, seconds = interleaved({"plain": plain, "spec": spec, **timers}, repeats)
    ms = lambda values: 1e3 * statistics.median(values)
    steps = int(runs["plain"][-1].target_calls.max())
    rounds = int(runs["spec"][-1].target_calls.max())
    out = {
        "temperature": temperature,
        "gamma": gamma,
        "target_call_ms": ms(runs["target"]),
        "round_calls_ms": ms(runs["round"]),
        "plain_step_ms": ms(seconds["plain"]) / steps,
        "spec_round_ms": ms(seconds["spec"]) / rounds,
        "rounds": rounds,
        "tau": runs["spec"][-1].tau,
    }
    out["plain_outside_ms"] = out["plain_step_ms"] - out["target_call_ms"]
    out["spec_outside_ms"] = out["spec_round_ms"] - out["round_calls_ms"]
    out["speedup"] = statistics.median(p / s for p, s in zip(seconds["plain"], seconds["spec"]))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--vocabulary", help="tokenizer (default: the --target checkpoint's)")
    return parser


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    pair = checkpoint_pair(args.target, args.draft)
    prompts = task_prompts(
        args.target, "stdlib_code", "test", 1, args.prompt_length, args.vocabulary
    )
    records = []
    for temperature in args.temperature:
        records.append(
            profile(pair, prompts, args.gamma, temperature, args.max_new_tokens, args.repeats)
        )
        print(json.dumps(records[-1]), flush=True)
    return records


if __name__ == "__main__":
    main()
