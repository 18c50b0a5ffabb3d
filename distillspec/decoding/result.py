"""What a decoding call returns: `DecodeResult` (host arrays, with alpha and tau), and the
packing of the loop's outputs into two device-to-host transfers and back."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """What one decoding call returns (host numpy arrays)."""

    tokens: np.ndarray  # [B, N] generated tokens, 0 after each row's end.
    lengths: np.ndarray  # [B] tokens generated per row (EOS included when emitted).
    drafted: np.ndarray  # [B] draft tokens proposed to the target.
    accepted: np.ndarray  # [B] draft tokens the target kept.
    target_calls: np.ndarray  # [B] target calls made while decoding (the prompt's not counted).
    draft_calls: np.ndarray  # [B] draft calls made while decoding.
    width_switches: np.ndarray  # [B] rounds verified at another width than the round before.
    sl_histogram: np.ndarray  # [B, sl_max + 1] rounds per number of drafts proposed (0..sl_max).
    # record_top_k = k: the target's raw top-k log-probabilities [B, N, k] and ids [B, N, k] at
    # each generated token (0 past a row's length); None without recording.
    record_log_probs: np.ndarray | None = None
    record_ids: np.ndarray | None = None

    @property
    def alpha(self) -> float:
        """Acceptance rate over the batch: accepted / drafted drafts."""
        return float(self.accepted.sum() / max(self.drafted.sum(), 1))

    @property
    def tau(self) -> float:
        """Block efficiency over the batch: generated tokens per target call."""
        return float(self.lengths.sum() / max(self.target_calls.sum(), 1))


_COUNTERS = ("lengths", "drafted", "accepted", "target_calls", "draft_calls", "width_switches")


def packed_outputs(out: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """(tokens, [B, 6 + histogram] counters[, recorded log-probs, ids]): two transfers to the
    host instead of eight, which at batch 1 on small models is a measurable part of a call."""
    counters = [out[name][:, None] for name in _COUNTERS] + [out["sl_histogram"]]
    recorded = tuple(out[k] for k in ("record_log_probs", "record_ids") if k in out)
    return (out["tokens"], jnp.concatenate(counters, axis=1), *recorded)


def unpacked_result(
    tokens: np.ndarray, counters: np.ndarray, *recorded: np.ndarray
) -> DecodeResult:
    fields = {name: counters[:, i] for i, name in enumerate(_COUNTERS)}
    if recorded:
        fields["record_log_probs"], fields["record_ids"] = recorded
    return DecodeResult(tokens=tokens, sl_histogram=counters[:, len(_COUNTERS) :], **fields)
