"""Argument checks shared by the library: each raises ValueError naming the value and the range."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """`value` as an int; ValueError unless it is an integer in [minimum, maximum]."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def check_int_list(name: str, values: Sequence[Any], minimum: int = 1) -> list[int]:
    """`values` as a list of ints; ValueError unless non-empty and every one is >= minimum."""
    if not values or any(not is_int(v) or v < minimum for v in values):
        raise ValueError(
            f"{name} must be a non-empty list of integers >= {minimum}, got {values!r}"
        )
    return [int(v) for v in values]
