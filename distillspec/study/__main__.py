"""python -m distillspec.study [--gin_file=experiments/study_quickstart.gin] [--output_dir DIR]
[--json OUT] [--gin.NAME=VALUE ...]: the paper study (`distillspec.study.pipeline.study`) under
gin (the embedded default's study_quickstart.gin when no --gin_file is given), or, for a
configuration that binds recipes.output_dir (experiments/recipes_quickstart.gin), the recipes
comparison (`distillspec.study.recipes.recipes`, its summary to --json OUT); a rerun after an
interruption continues where it stopped and skips finished cells."""

from __future__ import annotations

import argparse
import sys

from distillspec import console

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402

GIN_FILE = str(gin_setup.CONFIGS_DIR / "experiments" / "study_quickstart.gin")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--json", default=None, help="the recipes comparison's summary")
    args, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    if not any(arg.startswith("--gin_file") for arg in rest):
        rest = [f"--gin_file={GIN_FILE}", *rest]
    flags = gin_setup.parse_command_line(rest, "study")
    if flags.multiprocess:
        gin_setup.check_multiprocess_run("study")
    kwargs = {} if args.output_dir is None else {"output_dir": args.output_dir}
    if gin_setup.binds("recipes.output_dir"):
        return gin_setup.run_function("recipes")(json_path=args.json, **kwargs)
    if args.json is not None:
        parser.error("--json is the recipes comparison's (experiments/recipes_quickstart.gin)")
    return gin_setup.run_function("study")(**kwargs)


if __name__ == "__main__":
    main()
