"""python -m distillspec.train --gin_file=... --gin.MODEL_DIR=... (see `distillspec.runs.train`)."""

import sys

from distillspec import command_line

if __name__ == "__main__":  # --help and the command line's mistakes, before the heavy imports.
    command_line.preflight("train", sys.argv[1:])

from distillspec import console  # noqa: E402

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402

if __name__ == "__main__":
    gin_setup.main("train")
