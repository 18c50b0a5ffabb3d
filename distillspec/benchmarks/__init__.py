"""Benchmarks: scripts that print JSON ratios measured in one process (GUIDE.md §4)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from distillspec import console

# `python -m distillspec.benchmarks.<name>` imports this package first, with sys.argv[0] still
# "-m" (the module is being located): an entry point, quiet before the benchmark's own imports
# load TensorFlow. An import from a test or a script leaves the process as it is.
if sys.argv[:1] == ["-m"]:
    console.quiet_startup()


def emit(result: Any, path: str | None, echo: bool = True) -> Any:
    """Prints the result as one JSON line (unless echo=False) and writes it to path if given
    (making its folder: a benchmark's minutes are not lost to a missing runs/benchmarks)."""
    if echo:
        print(json.dumps(result), flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result
