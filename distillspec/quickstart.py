"""The main job: the embedded default, end to end, in one command.

    python -m distillspec.quickstart [--output_dir runs/quickstart] [--gin.NAME=VALUE ...]

A gin pipeline (configs/experiments/quickstart.gin) run by `distillspec.runs.quickstart`: each
stage is `distillspec.train.train` or `distillspec.evaluate.evaluate` under a gin scope (target/,
draft/, distill/, evaluate/), so any setting can be overridden, e.g.
--gin.distill/LoopConfig.train_steps=400. Rerunning the command resumes every training stage.
"""

from __future__ import annotations

import argparse
import sys

from distillspec import console

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402

GIN_FILE = str(gin_setup.CONFIGS_DIR / "experiments" / "quickstart.gin")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output_dir", default="runs/quickstart")
    args, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    flags = gin_setup.parse_command_line([f"--gin_file={GIN_FILE}"] + rest, "quickstart")
    if flags.multiprocess:
        gin_setup.check_multiprocess_run("quickstart")
    return gin_setup.run_function("quickstart")(output_dir=args.output_dir)


if __name__ == "__main__":
    main()
