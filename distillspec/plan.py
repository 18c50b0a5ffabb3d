"""Which draft to train, before training it (see `distillspec.runs.plan`).

    python -m distillspec.plan --gin_file=runs/plan.gin --gin.TEACHER_CHECKPOINT=\\"DIR\\" \\
        --gin.MIXTURE_OR_TASK_NAME=\\"DATA\\" --gin.OUTPUT_DIR=\\"OUT\\" [--gin.PILOT_STEPS=0] \\
        [--temperatures T[,T...]] [--profile FILE | --measure_profile FILE] \\
        [--validate [--json FILE]]
    python -m distillspec.plan --gin_file=experiments/plan_quickstart.gin   # embedded default

--temperatures 0,1 plans each serving temperature in one run (costs and pilots shared); by
default the plan serves as the target does (its generation_config.json: greedy unless it
samples).
--measure_profile FILE only times the candidates (random weights, no training) and writes their
costs: run it on the machine the pair will serve on, then plan anywhere with --profile FILE.
--validate also trains every candidate that can win with the recipe's full steps and measures
each with the speculative decoder (OUT/validation.{json,md}; --json FILE: a copy).
"""

from __future__ import annotations

import argparse
import sys

from distillspec import command_line


def build_parser() -> argparse.ArgumentParser:
    """The plan's own flags (the gin flags are `gin_setup.parse_command_line`'s)."""
    parser = argparse.ArgumentParser(prog="python -m distillspec.plan", add_help=False)
    parser.add_argument("--profile", help="price with this cost profile (--measure_profile)")
    parser.add_argument(
        "--measure_profile",
        metavar="FILE",
        help="only time the candidates here and write their costs to FILE",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="train the candidates fully and compare predicted with measured",
    )
    parser.add_argument("--json", help="--validate: write the check's JSON here too")
    parser.add_argument(
        "--temperatures",
        type=_temperatures,
        metavar="T[,T...]",
        help="serving temperatures to plan, e.g. 0,1 (costs and pilots shared; the first one's "
        "plan in OUTPUT_DIR, the others' in OUTPUT_DIR/temperature-T); default: the target's "
        "own (its generation_config.json: greedy, T = 0, unless it samples)",
    )
    return parser


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not t >= 0 for t in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give temperatures >= 0 separated by commas, e.g. 0,1"
        )
    return values


if __name__ == "__main__":  # --help and the command line's mistakes, before the heavy imports.
    command_line.preflight("plan", sys.argv[1:], parents=(build_parser(),))

from distillspec import console  # noqa: E402

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402


def main(argv: list[str] | None = None):
    args, rest = build_parser().parse_known_args(argv if argv is not None else sys.argv[1:])
    bindings = {"profile": args.profile, "measure_profile": args.measure_profile,
                "json_path": args.json}  # fmt: skip
    rest += [f"--gin.plan.{name}={value!r}" for name, value in bindings.items() if value]
    if args.validate:
        rest.append("--gin.plan.validate=True")
    if args.temperatures:
        rest.append(f"--gin.plan.temperatures={args.temperatures!r}")
    gin_setup.main("plan", rest, parents=(build_parser(),))


if __name__ == "__main__":
    main()
