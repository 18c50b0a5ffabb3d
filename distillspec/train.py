"""python -m distillspec.train --gin_file=... --gin.MODEL_DIR=... (see `distillspec.runs.train`)."""

from distillspec import gin_setup

if __name__ == "__main__":
    gin_setup.main("train")
