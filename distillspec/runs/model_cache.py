"""A cache of pretrained models across runs, keyed by their training configuration and data.

The quickstart (and any pipeline that pretrains the same target or standard draft again) trains
a stage once into `<cache>/models/<name>-<key>/` (`<cache>` = `$DISTILLSPEC_CACHE`, else
~/.cache/distillspec) and links to it. The key is a SHA-256 of:

* the stage's resolved run-function arguments (architecture, task, lengths, loop, optimizer,
  loss, data mixture, vocabulary, ...), so changing any of them trains a new model;
* the Python version, whose standard library is the embedded default's data, and `$XLA_FLAGS`
  (flags that change the CPU code path change the trained weights' bits);
* the source of the package's training code (everything but `evaluation/`, `disco/`,
  `benchmarks/` and `tables.py`), so a changed trainer never serves a stale model.

An entry is complete once its `CACHED` marker is written, after training and export; an
interrupted stage resumes from its checkpoints in the cache on the next run. Clearing the cache
is deleting the directory (`rm -rf ~/.cache/distillspec/models`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
from collections.abc import Callable, Mapping
from typing import Any

from distillspec.vocabularies import default_cache_dir

MARKER = "CACHED"
# Not training code: changing these cannot change a pretrained model.
_NOT_TRAINING = ("evaluation", "disco", "benchmarks", "study", "tables.py")
# Arguments that say where or how a run reports, not what it trains.
_NOT_CONFIG = ("model_dir", "console", "config_text")


def models_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """`cache_dir`, else `<cache>/models`."""
    return pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"


def _describe(value: Any) -> str:
    """A stable text for a bound value: models by their class and config dataclass."""
    if hasattr(value, "config") and not isinstance(value, type):
        return f"{type(value).__name__}({value.config!r})"
    text = repr(value)
    if " at 0x" in text:  # An object without a stable repr cannot key a cache.
        raise ValueError(f"cannot fingerprint a bound value without a stable repr: {text}")
    return text


def _code_digest() -> str:
    package = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] not in _NOT_TRAINING:
            digest.update(str(rel).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def fingerprint(bindings: Mapping[str, Any]) -> str:
    """The cache key (20 hex digits) of a training stage with these run-function arguments."""
    config = {k: _describe(v) for k, v in sorted(bindings.items()) if k not in _NOT_CONFIG}
    text = json.dumps(
        {
            "config": config,
            "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "code": _code_digest(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_stage(
    name: str, key: str, train: Callable[..., Any], cache_dir: str | os.PathLike | None = None
) -> str:
    """The model directory of stage `name` with cache key `key` in `models_dir(cache_dir)`,
    trained now (or resumed) by `train(model_dir=...)` unless a complete entry exists."""
    model_dir = models_dir(cache_dir) / f"{name}-{key}"
    marker = model_dir / MARKER
    if marker.exists():
        print(f"[cache] {name}: reusing {model_dir}", flush=True)
        return str(model_dir)
    print(f"[cache] {name}: training into {model_dir}", flush=True)
    train(model_dir=str(model_dir))
    marker.write_text(key + "\n")
    return str(model_dir)


def link(target: str, link_path: str) -> None:
    """Points `link_path` at `target` (a symlink replaced if it exists; a real directory there
    is an error, never deleted)."""
    if os.path.islink(link_path):
        os.remove(link_path)
    elif os.path.exists(link_path):
        raise FileExistsError(
            f"{link_path!r} exists and is not a link to the model cache; move it away (an "
            "earlier run's output?) or pass another --output_dir"
        )
    os.makedirs(os.path.dirname(os.path.abspath(link_path)), exist_ok=True)
    os.symlink(os.path.abspath(target), link_path)
