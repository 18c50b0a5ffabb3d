"""Per-token decode times of a target and a draft, plain and speculative, at several batch sizes.

    python scripts/decode_speed.py TARGET_HF_DIR DRAFT_HF_DIR [--batch 1 32] [--gamma 5]

Prints one JSON line per batch size: milliseconds per decoding step of the target and of the
draft alone (plain greedy decoding, so c = draft_ms / target_ms), and per generated token of
speculative decoding, with its tau; and the cost of one bare target call scoring k positions
(`target_call_ms`, k = 1, 2, 3, 5, 9: flat when memory-bound, growing with k when
compute-bound). Compilation is excluded; each figure is the median of --repeats runs,
interleaved. Random prompts: only the costs are meaningful, not tau.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from distillspec.decoding import generate, speculative_generate
from distillspec.evaluation.timing import step_timer
from distillspec.models import from_pretrained


def _ms_per_token(fn, tokens: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / tokens * 1e3


def measure(target, tp, draft, dp, batch: int, args) -> dict:
    """One batch size: interleaved timed runs of the three decoders -> a record."""
    n = args.max_new_tokens
    rng = np.random.default_rng(batch)
    prompts = rng.integers(3, target.vocab_size, (batch, args.prompt_length)).astype(np.int32)
    lengths = np.full((batch,), args.prompt_length, np.int32)
    calls = {
        "target_ms": lambda: generate(target, tp, prompts, lengths, max_new_tokens=n),
        "draft_ms": lambda: generate(draft, dp, prompts, lengths, max_new_tokens=n),
        "speculative_ms": lambda: speculative_generate(
            target, draft, tp, dp, prompts, lengths, gamma=args.gamma, max_new_tokens=n
        ),
    }
    tau = calls["speculative_ms"]().tau  # Also compiles; so do the next two calls.
    calls["target_ms"](), calls["draft_ms"]()
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            times[name].append(_ms_per_token(fn, n))
    record = {name: round(statistics.median(t), 3) for name, t in times.items()}
    record["target_call_ms"] = {
        k: round(1e3 * statistics.median(timer() for _ in range(args.repeats)), 3)
        for k, timer in (
            (k, step_timer(target, tp, prompts, lengths, k, calls=16)) for k in (1, 2, 3, 5, 9)
        )
    }
    record.update(batch=batch, gamma=args.gamma, tau=round(tau, 3))
    record["c"] = round(record["draft_ms"] / record["target_ms"], 3)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    target, tp = from_pretrained(args.target)
    draft, dp = from_pretrained(args.draft)
    for batch in args.batch:
        print(json.dumps(measure(target, tp, draft, dp, batch, args)), flush=True)


if __name__ == "__main__":
    main()
