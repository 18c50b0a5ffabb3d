"""python -m distillspec.train --gin_file=... --gin.MODEL_DIR=... (see `distillspec.runs.train`)."""

from distillspec import console

console.quiet_startup()  # Before anything imports TensorFlow.

from distillspec import gin_setup  # noqa: E402

if __name__ == "__main__":
    gin_setup.main("train")
