"""python -m distillspec.evaluate --gin_file=... (see `distillspec.runs.evaluate`)."""

from distillspec import console

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402

if __name__ == "__main__":
    gin_setup.main("evaluate")
