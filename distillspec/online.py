"""A draft that follows the traffic it serves (see `distillspec.runs.online`).

    python -m distillspec.online --gin_file=experiments/online_quickstart.gin [--json FILE]
    python -m distillspec.online --gin_file=runs/online.gin --gin.TARGET_CHECKPOINT=\\"DIR\\" \\
        --gin.DRAFT_CHECKPOINT=\\"DIR\\" --gin.STREAM=\\"DATA\\" --gin.OUTPUT_DIR=\\"OUT\\"

Serves a prompt stream in chunks with the draft while the decoder records the target's top-k,
distils the draft on the recording after each chunk (no teacher pass) and compares the adapted
draft with the frozen one on held-out prompts of the stream and on the draft's original data.
--json FILE: a copy of OUTPUT_DIR/online.json.
"""

from __future__ import annotations

import argparse
import sys

from distillspec import command_line


def build_parser() -> argparse.ArgumentParser:
    """The online run's own flags (the gin flags are `command_line.parser`'s)."""
    parser = argparse.ArgumentParser(prog="python -m distillspec.online", add_help=False)
    parser.add_argument("--json", help="a copy of OUTPUT_DIR/online.json")
    return parser


if __name__ == "__main__":  # --help and the command line's mistakes, before the heavy imports.
    command_line.preflight("online", sys.argv[1:], parents=(build_parser(),))

from distillspec import console  # noqa: E402

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402


def main(argv: list[str] | None = None):
    args, rest = build_parser().parse_known_args(argv if argv is not None else sys.argv[1:])
    if args.json:
        rest.append(f"--gin.online.json_path={args.json!r}")
    return gin_setup.main("online", rest, parents=(build_parser(),))


if __name__ == "__main__":
    main()
