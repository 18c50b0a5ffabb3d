"""python -m distillspec.disco --gin_file=... (see `distillspec.runs.disco`)."""

from distillspec import gin_setup

if __name__ == "__main__":
    gin_setup.main("disco")
