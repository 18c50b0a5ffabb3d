"""Compares two training runs' metrics.jsonl: per-step losses and the median step time.

    python -m distillspec.benchmarks.compare_runs /tmp/scale_1p /tmp/scale_2p

Prints JSON: for each run its final loss and median seconds per step (steps after the first,
which includes compilation; from the logged tokens/s), and the largest relative difference
between the two runs' losses at the same step.
"""

from __future__ import annotations

import argparse
import json
import statistics

from distillspec.metrics import read_metrics


def summary(model_dir: str) -> dict:
    records = read_metrics(model_dir)
    seconds = [r["target_tokens"] / r["tokens_per_s"] for r in records[1:]]
    return {
        "model_dir": model_dir,
        "steps": len(records),
        "final_loss": records[-1]["loss"],
        "median_step_s": statistics.median(seconds) if seconds else None,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="MODEL_DIR of the first run")
    parser.add_argument("b", help="MODEL_DIR of the second run")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    losses = [{r["step"]: r["loss"] for r in read_metrics(d)} for d in (args.a, args.b)]
    common = sorted(losses[0].keys() & losses[1].keys())
    worst = max(abs(losses[1][s] - losses[0][s]) / abs(losses[0][s]) for s in common)
    print(json.dumps({
        "runs": [summary(args.a), summary(args.b)],
        "common_steps": len(common),
        "max_relative_loss_difference": worst,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
