"""What every checkpoint load checks of its weights: finite values, whole files.

A NaN in a draft's embedding rows loads silently and an evaluation whose prompts never touch
those rows ends with exit 0; a half-written `model.safetensors` fails deep in safetensors with
"incomplete metadata, file not fully covered", naming neither the file nor the checkpoint. Both
loaders (`safetensors_files.LazyTensors` for Hugging Face directories, `t5x_store.Source` for
T5X) call `check_finite` on each array as it is read and raise `CheckpointError`, which names
the tensor and the file (and says "truncated" for a file shorter than its header declares), so
a run refuses the checkpoint before any work starts. The entry points print it as one line.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

_FLOAT_KINDS = ("f",)  # numpy's float16/32/64; ml_dtypes' bfloat16 is kind 'V', named below.
_EXTRA_FLOATS = ("bfloat16",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as stored: truncated, corrupt, or non-finite values."""


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind in _FLOAT_KINDS or dtype.name in _EXTRA_FLOATS


def _all_finite(value: np.ndarray) -> bool:
    """Whether every value is finite. For float32/64 a dot product does it without a temporary:
    NaN and inf propagate into it; an overflow (values near the dtype's limit) is only a false
    alarm, settled by the exact test."""
    if value.dtype in (np.float32, np.float64) and value.size:
        flat = value.reshape(-1)
        if np.isfinite(np.dot(flat, flat)):
            return True
    return bool(np.isfinite(value).all())


def check_finite(value: np.ndarray, tensor: str, where: str) -> np.ndarray:
    """`value`, after checking that a floating-point array holds no NaN or inf.

    Raises:
      CheckpointError: naming `tensor`, `where` (its file) and how many values are not finite.
    """
    value = np.asarray(value)
    if not _is_float(value.dtype) or _all_finite(value):
        return value
    bad = ~np.isfinite(value)
    nan = int(np.isnan(value).sum())
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise CheckpointError(
        f"tensor {tensor!r} in {where} holds {int(bad.sum())} non-finite values ({nan} NaN, "
        f"{int(bad.sum()) - nan} inf; the first at index {first}) of {value.size}: the "
        "checkpoint is corrupt; re-export it (or restore the file) before using it"
    )


def safetensors_failure(file: str, error: Exception) -> CheckpointError:
    """The CheckpointError for a safetensors file that safetensors could not open: 'truncated'
    when the file is shorter than its header says, else 'corrupt', with the library's words."""
    size = os.path.getsize(file)
    declared = None
    try:
        with open(file, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            if size >= 8 + header_bytes:
                header = json.loads(f.read(header_bytes))
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                declared = 8 + header_bytes + max(ends, default=0)
            else:
                declared = 8 + header_bytes
    except (struct.error, ValueError, KeyError, TypeError, IndexError):
        declared = None
    if declared is not None and size < declared and declared < 1 << 50:
        return CheckpointError(
            f"{file} is truncated: it holds {size} bytes of the {declared} its header declares "
            f"(an interrupted copy or save?); copy or export the checkpoint "
            f"{os.path.dirname(file) or '.'} again"
        )
    return CheckpointError(
        f"{file} is not a readable safetensors file (corrupt or not safetensors): {error}; copy "
        f"or export the checkpoint {os.path.dirname(file) or '.'} again"
    )
