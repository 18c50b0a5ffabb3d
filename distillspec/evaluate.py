"""python -m distillspec.evaluate --gin_file=... (see `distillspec.runs.evaluate`)."""

import sys

from distillspec import command_line

if __name__ == "__main__":  # --help and the command line's mistakes, before the heavy imports.
    command_line.preflight("evaluate", sys.argv[1:])

from distillspec import console  # noqa: E402

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402

if __name__ == "__main__":
    gin_setup.main("evaluate")
