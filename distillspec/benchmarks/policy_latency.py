"""Batch-1 greedy latency of lookahead policies on any pair, relative to static SL-k.

    python -m distillspec.benchmarks.policy_latency --target runs/quickstart/target/export \
        --draft runs/quickstart/distilled/export [--prompts 16] [--static 3]

Decodes the first --prompts stdlib test prompts one at a time with the target alone, static
SL-k, the heuristic (SL_max 8), the confidence rule (SL_max 4, threshold 0.5) and the oracle
(SL_max 64, given the target's own output), interleaved per prompt (compilation excluded,
median of --repeats calls per prompt). Prints one JSON object: ms per generated token of each,
`<policy>_vs_static` (its latency / static SL-k's: below 1 is faster) and `exact` (every
output equals the target's). Uses only the public decoding API, so it runs on earlier commits
too: a before/after comparison of a change to the decoder's dynamic rounds, in alternating
processes (the machine's speed differs between processes; ratios within one hold better).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from distillspec.benchmarks.speculative import checkpoint_pair, task_prompts
from distillspec.decoding import generate, speculative_generate
from distillspec.decoding.lookahead import Lookahead
from distillspec.evaluation.timing import interleaved_items


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--static", type=int, default=3, help="k of the static SL-k reference")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocabulary", help="tokenizer (default: the --target checkpoint's)")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    target, tp, draft, dp, _ = checkpoint_pair(args.target, args.draft)
    tokens, lengths = task_prompts(
        args.target, "stdlib_code", "test", args.prompts, args.prompt_length, args.vocabulary
    )
    prompts = [(tokens[i : i + 1], lengths[i : i + 1]) for i in range(len(tokens))]
    new = args.max_new_tokens
    references = [generate(target, tp, *p, max_new_tokens=new) for p in prompts]
    policies = {
        "static": Lookahead("static", args.static),
        "heuristic": Lookahead("heuristic", 8, start=5),
        "confidence": Lookahead("confidence", 4, threshold=0.5),
        "oracle": Lookahead("oracle", 64),
    }

    def run(lookahead):
        def decode(prompt, reference):
            oracle = reference.tokens if lookahead.kind == "oracle" else None
            return speculative_generate(target, draft, tp, dp, *prompt, lookahead=lookahead,
                                        oracle_tokens=oracle, max_new_tokens=new)  # fmt: skip

        return decode

    fns = {"target": lambda prompt, _: generate(target, tp, *prompt, max_new_tokens=new)}
    fns.update({name: run(lookahead) for name, lookahead in policies.items()})
    results, seconds = interleaved_items(
        fns, list(zip(prompts, references)), args.repeats, lambda item: np.shape(item[0][0])
    )
    generated = sum(int(r.lengths.sum()) for r in references)
    out = {name: round(1e3 * s / generated, 4) for name, s in seconds.items()}
    out.update({f"{name}_vs_static": round(seconds[name] / seconds["static"], 4)
                for name in ("target", "heuristic", "confidence", "oracle")})  # fmt: skip
    out["exact"] = all(
        np.array_equal(run.tokens, ref.tokens)
        for name in policies
        for run, ref in zip(results[name], references)
    )
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
