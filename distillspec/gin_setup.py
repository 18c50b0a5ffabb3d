"""Gin glue for the run functions: what is configurable, and T5X's command-line flags.

Only run modules (`train`, `evaluate`, `quickstart`) import this; library modules never import
gin. The typed config objects are registered here as external configurables, so a gin file can
say `TransformerConfig.embed_dim = 128` or `LossConfig.divergence = 'jsd'`.
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import gin

from distillspec import datagen, trainer
from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig
from distillspec.sampling import SamplingConfig

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


@functools.cache
def register_configurables() -> None:
    """Makes the config classes and model wrappers bindable from gin (once per process)."""
    for cls in (TransformerConfig, DecoderOnlyLM, T5Config, T5LM):
        gin.external_configurable(cls, module="distillspec.models")
    for cls in (trainer.LoopConfig, trainer.LossConfig, trainer.OptimizerConfig):
        gin.external_configurable(cls, module="distillspec.trainer")
    gin.external_configurable(datagen.DataMixture, module="distillspec.datagen")
    gin.external_configurable(SamplingConfig, module="distillspec.sampling")


def _binding(flag: str) -> str:
    """'--gin.NAME=VALUE' -> 'NAME = VALUE'; a bare path or word VALUE is quoted for the user."""
    name, _, value = flag[len("--gin.") :].partition("=")
    if not value:
        raise ValueError(f"gin flag {flag!r} needs a value: --gin.NAME=VALUE")
    bare = value[0] not in "'\"@%[({-.0123456789" and value not in ("True", "False", "None")
    return f"{name} = {value!r}" if bare else f"{name} = {value}"


def parse_command_line(argv: list[str], run_name: str) -> argparse.Namespace:
    """Parses T5X-style flags and loads the gin configuration they name.

    Flags: --gin_file (repeatable; searched in the working directory, --gin_search_paths and
    the repository's configs/), --gin.NAME=VALUE (repeatable bindings, applied after the
    files), --gin_search_paths=DIR[,DIR...], --tfds_data_dir=DIR (bound to
    `<run_name>.tfds_data_dir`).
    """
    parser = argparse.ArgumentParser(prog=f"python -m distillspec.{run_name}")
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file(s)")
    parser.add_argument("--gin_search_paths", default="", help="comma-separated directories")
    parser.add_argument("--tfds_data_dir", default=None, help="prepared TFDS data sets")
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--gin.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    bindings = [_binding(flag) for flag in rest]
    if args.tfds_data_dir:
        bindings.append(f"{run_name}.tfds_data_dir = {args.tfds_data_dir!r}")
    load_config(args.gin_file, bindings, args.gin_search_paths.split(","))
    return args


def load_config(files: list[str], bindings: list[str], search_paths: list[str] = ()) -> None:
    """Registers configurables, adds search paths (configs/ last) and parses files + bindings."""
    register_configurables()
    for path in [p for p in search_paths if p] + [str(CONFIGS_DIR), str(CONFIGS_DIR.parent)]:
        gin.add_config_file_search_path(path)
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
