"""Benchmarks: scripts that print JSON ratios measured in one process (GUIDE.md §4)."""

from __future__ import annotations

import json
from typing import Any


def emit(result: Any, path: str | None, echo: bool = True) -> Any:
    """Prints the result as one JSON line (unless echo=False) and writes it to path if given."""
    if echo:
        print(json.dumps(result), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result
