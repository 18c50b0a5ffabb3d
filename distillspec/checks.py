"""Checks shared by the library: arguments (each raises ValueError naming the value and the range)
and a training run's numbers (FloatingPointError naming the step and the checkpoint kept)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
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


def check_prompt(prompt_tokens, prompt_lengths, num_ids: int) -> tuple[jax.Array, jax.Array]:
    """Shapes, lengths in [1, P], and ids of the real prompt tokens in [0, num_ids) (an id past
    an embedding reads garbage, NaN on some backends, and every metric after it is wrong)."""
    # Host input stays numpy (checked here, sent with the call); device arrays stay on device.
    asarray = lambda x: (
        jnp.asarray(x, jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32)
    )
    prompt_tokens, prompt_lengths = asarray(prompt_tokens), asarray(prompt_lengths)
    if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
        raise ValueError(
            "prompt_tokens must be [B, P] and prompt_lengths [B]; got shapes "
            f"{prompt_tokens.shape} and {prompt_lengths.shape}"
        )
    if not isinstance(prompt_lengths, jax.core.Tracer):
        lengths = np.asarray(prompt_lengths)
        if lengths.min() < 1 or lengths.max() > prompt_tokens.shape[1]:
            raise ValueError(
                f"prompt_lengths must be in [1, {prompt_tokens.shape[1]}], got {lengths.tolist()}"
            )
    if not isinstance(prompt_tokens, jax.core.Tracer):
        tokens = np.asarray(prompt_tokens)
        real = np.arange(tokens.shape[1]) < np.asarray(prompt_lengths)[:, None]
        bad = real & ((tokens < 0) | (tokens >= num_ids))
        if bad.any():
            row, col = (int(i[0]) for i in np.nonzero(bad))
            raise ValueError(
                f"prompt token id {int(tokens[row, col])} (row {row}, position {col}) is outside "
                f"the models' embeddings [0, {num_ids}): the tokenizer does not match the models"
            )
    return prompt_tokens, prompt_lengths


def shared_vocab_size(target, draft, vocab_size: int | None) -> int:
    """The vocabulary both models decode over; raises ValueError when they cannot share one."""
    sizes = [target.vocab_size] + ([draft.vocab_size] if draft is not None else [])
    if vocab_size is None:
        if len(set(sizes)) > 1:
            raise ValueError(
                f"draft vocabulary ({draft.vocab_size}) and target vocabulary "
                f"({target.vocab_size}) differ. If they share a tokenizer and only pad the "
                "embedding to different sizes, pass vocab_size=<the tokenizer's size>, at most "
                f"{min(sizes)}; ids from vocab_size up are then never drafted or emitted."
            )
        return sizes[0]
    if not 1 <= vocab_size <= min(sizes):
        raise ValueError(f"vocab_size must be in [1, {min(sizes)}], got {vocab_size!r}")
    return vocab_size


def _stopped(problem: str, last_checkpoint: int | None, model_dir: str) -> FloatingPointError:
    kept = f"step {last_checkpoint}" if last_checkpoint is not None else "none yet"
    return FloatingPointError(
        f"{problem}; training stopped without saving it. The last good checkpoint ({kept}) is "
        f"kept in {model_dir}/checkpoints; lower the learning rate or check the data."
    )


def check_finite(record: dict, step: int, last_checkpoint: int | None, model_dir: str) -> None:
    """Stops training on a NaN/inf loss, naming the step and the checkpoint that is kept."""
    if not np.isfinite(record["loss"]):
        raise _stopped(f"loss is {record['loss']} at step {step}", last_checkpoint, model_dir)


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def check_finite_params(params, step: int, last_checkpoint: int | None, model_dir: str) -> None:
    """Refuses to checkpoint NaN/inf parameters, naming the step and the checkpoint kept."""
    if not bool(_all_finite(params)):
        problem = f"the student's parameters after step {step} are not finite"
        raise _stopped(problem, last_checkpoint, model_dir)
