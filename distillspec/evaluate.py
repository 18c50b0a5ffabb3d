"""python -m distillspec.evaluate --gin_file=... (see `distillspec.runs.evaluate`)."""

from distillspec import gin_setup

if __name__ == "__main__":
    gin_setup.main("evaluate")
