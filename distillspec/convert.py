"""Converts T5 v1.1 checkpoints between the T5X and Hugging Face formats.

  python -m distillspec.convert --from t5x --to hf SRC DST [--config small]
  python -m distillspec.convert --from hf --to t5x SRC DST [--step 0] [--dtype bfloat16]

SRC may be a T5X model directory (its latest checkpoint_<step>/ is read) or a step directory.
--config is a T5 v1.1 size (small, base, large, xl, xxl: configs/models/t5_1_1_<size>.gin) or a
gin file binding one T5Config; without it the config is inferred from the T5X array shapes. The
conversion logic lives in distillspec.models (t5x*.py, hf_interop.py); this is its command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from distillspec.models.t5 import T5Config

SIZES = ("small", "base", "large", "xl", "xxl")
FORMATS = ("t5x", "hf")
# 'scope/T5Config.param = value' (or an unscoped binding) in gin's config string.
_T5_BINDING = re.compile(r"^(?:([\w.]+(?:/[\w.]+)*)/)?(?:[\w.]+\.)?T5Config\.\w+ = ", re.MULTILINE)


def config_from_gin(path: str) -> T5Config:
    """The T5Config a gin file binds (under one scope, e.g. t5_1_1_small/T5Config.*).

    Raises:
      ValueError: if the file binds no T5Config or binds several (under different scopes).
    """
    from distillspec import gin_setup

    gin_setup.clear()
    try:
        gin_setup.load_config([path], [])
        scopes = {match or "" for match in _T5_BINDING.findall(gin_setup.config_str())}
        if len(scopes) != 1:
            found = sorted(scopes) if scopes else "none"
            raise ValueError(
                f"{path} must bind exactly one T5Config (under one scope); scopes found: {found}."
            )
        return gin_setup.configured("distillspec.models.T5Config", scopes.pop() or None)
    finally:
        gin_setup.clear()


def resolve_config(value: str | None) -> T5Config | None:
    """--config: None, a size name ('small' or 't5_1_1_small') or the path of a gin file."""
    if value is None:
        return None
    if os.path.isfile(value):
        return config_from_gin(value)
    size = value.removeprefix("t5_1_1_")
    if size not in SIZES:
        raise ValueError(
            f"--config {value!r} is neither a gin file nor a T5 v1.1 size; sizes: {list(SIZES)}."
        )
    from distillspec.gin_setup import CONFIGS_DIR

    return config_from_gin(str(CONFIGS_DIR / "models" / f"t5_1_1_{size}.gin"))


def _describe(path: str) -> list[str]:
    """Lines saying what `path` holds: its files, and its array directories summed up."""
    lines, arrays, array_bytes = [], 0, 0
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isdir(full):
            arrays += 1
            array_bytes += sum(
                os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(full) for f in files
            )
        else:
            lines.append(f"  {name}  {os.path.getsize(full) / 2**20:.2f} MiB")
    if arrays:
        lines.append(f"  {arrays} TensorStore arrays  {array_bytes / 2**20:.2f} MiB")
    return lines


def convert(
    source_format: str,
    target_format: str,
    source: str,
    destination: str,
    config: T5Config | None = None,
    step: int | None = None,
    dtype: str | None = None,
) -> str:
    """Converts `source` to `destination`; returns the path written (a T5X step directory or
    the Hugging Face directory)."""
    from distillspec.models import hf_interop, t5x, t5x_store

    if source_format == "t5x":
        model, params = t5x.from_t5x(source, config, progress=True)
    else:
        if config is not None:
            raise ValueError("--config applies to T5X sources; a Hugging Face one has config.json.")
        model, params = hf_interop.from_pretrained(source)
    if target_format == "hf":
        hf_interop.save_pretrained(model, params, destination)
        return destination
    if step is None:  # Keep a T5X source's step number.
        step = 0
        if source_format == "t5x":
            name = os.path.basename(os.path.normpath(t5x_store.find_step_dir(source)))
            match = re.fullmatch(r"checkpoint_(\d+)", name)
            step = int(match[1]) if match else 0
    return t5x.save_t5x(model, params, destination, step, dtype=dtype, progress=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(
        prog="python -m distillspec.convert",
        description="Convert T5 v1.1 checkpoints between T5X and Hugging Face formats.",
    )
    parser.add_argument("--from", dest="source_format", choices=FORMATS, required=True)
    parser.add_argument("--to", dest="target_format", choices=FORMATS, required=True)
    parser.add_argument("source", metavar="SRC", help="T5X model/step directory or HF directory")
    parser.add_argument("destination", metavar="DST", help="T5X model directory or HF directory")
    parser.add_argument(
        "--config",
        help=f"T5X source architecture: a size {SIZES} or a gin file (default: from the shapes)",
    )
    parser.add_argument(
        "--step", type=int, help="step of the written T5X checkpoint (default: the source's, or 0)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="dtype of the written T5X arrays (default: float32, the params' dtype)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # Its backend probing is noise here.
    if args.target_format == "hf" and (args.step is not None or args.dtype is not None):
        parser.error("--step and --dtype apply to --to t5x")
    if args.source_format == "hf" and args.config is not None:
        parser.error("--config applies to --from t5x (a Hugging Face directory has config.json)")
    try:
        written = convert(
            args.source_format, args.target_format, args.source, args.destination,
            resolve_config(args.config), args.step, args.dtype,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {args.target_format} checkpoint {written}:")
    print("\n".join(_describe(written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
