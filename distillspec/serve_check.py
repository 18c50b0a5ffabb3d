"""python -m distillspec.serve_check DRAFT_DIR --target TARGET_DIR [--engine ENGINE] [--json OUT]

Whether a draft's Hugging Face export serves beside its target in vLLM (`draft_model`), SGLang
(`STANDALONE`) and transformers (assisted generation): per engine "ready" or "not ready" with
each unmet condition named (`distillspec.serving.check`), and the ready engines' commands.
Exit status 0 when every engine asked is ready, 1 when one is not, 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from distillspec import serving


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(
        prog="python -m distillspec.serve_check",
        description="Check a draft's export against what vLLM, SGLang and transformers need.",
    )
    parser.add_argument("draft", metavar="DRAFT_DIR", help="the draft's Hugging Face directory")
    parser.add_argument("--target", required=True, help="the target's Hugging Face directory")
    parser.add_argument(
        "--engine", choices=(*serving.ENGINES, "all"), default="all",
        help="the engine to check for (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--gamma", type=int, help="drafts per round in the printed commands (default: the "
        "γ the export's SERVING.md states, else 5)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="OUT", help="write the report here as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gamma is not None and args.gamma < 1:
        parser.error(f"--gamma must be an integer >= 1, got {args.gamma}")
    if not os.path.isdir(args.target):
        parser.error(f"--target {args.target!r} is not a directory")
    engines = serving.ENGINES if args.engine == "all" else (args.engine,)
    report = serving.check(args.draft, args.target, engines)
    gamma, source = (
        (args.gamma, "--gamma")
        if args.gamma is not None
        else serving.serving_gamma(None, None, None, args.draft)
    )
    report["gamma"], report["gamma_source"] = gamma, source
    print(serving.summary(report, gamma, source))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
