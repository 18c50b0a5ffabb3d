"""Feature conversion: a seqio task's tokenized examples -> fixed-shape numpy prompt batches.

`prompt_batches` yields [B, P] prompts and [B, N] reference completions, right-padded, with a
`valid` row mask for a final partial batch; every consumer (training's example store, the
evaluation's prompt sets, DISCO's features) reads data through it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import seqio
import tensorflow as tf


def _split_example(
    ex: Mapping[str, np.ndarray], lm_prompt_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, completion ids); a targets-only example lends its first tokens as prompt."""
    if "inputs" in ex:
        return ex["inputs"], ex["targets"]
    targets = ex["targets"]
    k = min(lm_prompt_tokens, max(len(targets) - 1, 1))
    return targets[:k], targets[k:]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A distinct, stable tf.data shuffle seed per (seed, epoch)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:4], "big") >> 1


class _BatchBuilder:
    """Accumulates examples into fixed-shape numpy arrays."""

    def __init__(
        self, batch_size: int, prompt_length: int, completion_length: int, bos_id: int | None
    ):
        self.shape = (batch_size, prompt_length, completion_length)
        self.bos_id = bos_id
        self.reset()

    def reset(self) -> None:
        b, p, n = self.shape
        self.prompt = np.zeros((b, p), np.int32)
        self.completion = np.zeros((b, n), np.int32)
        self.prompt_len = np.zeros((b,), np.int32)
        self.completion_len = np.zeros((b,), np.int32)
        self.rows = 0

    def add(self, prompt: np.ndarray, completion: np.ndarray) -> None:
        _, p, n = self.shape
        if len(prompt) > p:  # Keep the prompt's end (and its BOS, which the model expects first).
            keep_bos = self.bos_id is not None and prompt[0] == self.bos_id and p > 1
            tail = prompt[len(prompt) - p + keep_bos :]
            prompt = np.concatenate([prompt[:1], tail]) if keep_bos else tail
        completion = completion[:n]
        self.prompt[self.rows, : len(prompt)] = prompt
        self.completion[self.rows, : len(completion)] = completion
        self.prompt_len[self.rows], self.completion_len[self.rows] = len(prompt), len(completion)
        self.rows += 1

    def full(self) -> bool:
        return self.rows == self.shape[0]

    def pop(self) -> dict[str, np.ndarray]:
        batch = {
            "prompt_tokens": self.prompt,  # [B, P] int32, right-padded with 0.
            "prompt_lengths": self.prompt_len,  # [B] int32.
            "completion_tokens": self.completion,  # [B, N] int32, right-padded with 0.
            "completion_lengths": self.completion_len,  # [B] int32.
            "valid": np.arange(self.shape[0]) < self.rows,  # [B] bool; False = padding row.
        }
        self.reset()
        return batch


def _tokenized_dataset(
    task: seqio.Task, split: str, seed: int, shard: tuple[int, int] = (0, 1)
) -> tf.data.Dataset:
    """The task's tokenized split (or one shard of it) in source order (shuffling happens per
    epoch, seeded)."""
    index, count = shard
    return task.get_dataset(
        sequence_length=None, split=split, shuffle=False, seed=seed, use_cached=False,
        shard_info=seqio.ShardInfo(index, count) if count > 1 else None,
    )  # fmt: skip


def prompt_batches(
    task_name: str,
    split: str,
    batch_size: int,
    prompt_length: int,
    completion_length: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    drop_remainder: bool = False,
    shuffle_buffer: int = 10_000,
    lm_prompt_tokens: int = 8,
    bos_id: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> Iterator[dict[str, np.ndarray]]:
    """Yields fixed-shape numpy batches of prompts and reference completions.

    Prompts longer than `prompt_length` are truncated from the LEFT, keeping the tokens nearest
    the completion; completions are truncated from the right. For a targets-only (language
    modelling) task the first `lm_prompt_tokens` tokens of each text are the prompt.

    Args:
      task_name: a registered seqio task.
      split: one of the task's splits.
      batch_size: B.
      prompt_length: P.
      completion_length: N.
      seed: fixes the example order (same seed, same batches).
      shuffle: shuffle examples (buffer `shuffle_buffer`), reshuffled per epoch.
      num_epochs: passes over the split; None = forever.
      drop_remainder: drop a final partial batch instead of padding it with invalid rows.
      shuffle_buffer: tf.data shuffle buffer size.
      lm_prompt_tokens: prompt size for targets-only tasks.
      bos_id: a prompt starting with this id keeps it when truncated from the left.
      shard: (index, count): read only shard `index` of `count` (seqio ShardInfo: by source
        files where there are enough, else every count-th example), e.g. one process's share.

    Yields:
      {'prompt_tokens': [B, P] int32, 'prompt_lengths': [B] int32,
       'completion_tokens': [B, N] int32, 'completion_lengths': [B] int32, 'valid': [B] bool}.

    Raises:
      ValueError: unknown split, or a split with no examples (raised on the first `next`).
    """
    task = seqio.get_mixture_or_task(task_name)
    if split not in task.splits:
        raise ValueError(f"Task {task_name!r} has no split {split!r}; splits: {task.splits}")
    builder = _BatchBuilder(batch_size, prompt_length, completion_length, bos_id)
    epoch = 0
    while num_epochs is None or epoch < num_epochs:
        ds = _tokenized_dataset(task, split, seed, shard)
        if shuffle:
            ds = ds.shuffle(shuffle_buffer, seed=_epoch_seed(seed, epoch))
        seen = 0
        for ex in ds.as_numpy_iterator():
            builder.add(*_split_example(ex, lm_prompt_tokens))
            seen += 1
            if builder.full():
                yield builder.pop()
        if seen == 0:
            raise ValueError(f"Task {task_name!r} split {split!r} has no examples")
        epoch += 1
    if builder.rows and not drop_remainder:
        yield builder.pop()


def valid_rows(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """[B] float32 mask of real rows (`prompt_batches` pads a final partial batch)."""
    rows = np.asarray(batch["prompt_tokens"]).shape[0]
    return np.asarray(batch.get("valid", np.ones(rows, bool)), bool).astype(np.float32)


def decodable(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies the first valid row into padding rows so every row is a real prompt (lengths >= 1);
    their outputs are masked out of every count, and the batch keeps its compiled shape."""
    valid = valid_rows(batch).astype(bool)
    tokens = np.array(batch["prompt_tokens"], np.int32)
    lengths = np.array(batch["prompt_lengths"], np.int32)
    first = int(np.argmax(valid))
    tokens[~valid], lengths[~valid] = tokens[first], lengths[first]
    return {**batch, "prompt_tokens": tokens, "prompt_lengths": lengths}


def single_prompts(batches: Iterable[Mapping[str, np.ndarray]]) -> list[tuple[np.ndarray, ...]]:
    """The valid rows of prompt batches as batch-1 (prompt_tokens [1, P], prompt_lengths [1])."""
    out = []
    for batch in batches:
        tokens, lengths = np.asarray(batch["prompt_tokens"]), np.asarray(batch["prompt_lengths"])
        for row in np.flatnonzero(valid_rows(batch)):
            out.append((tokens[row : row + 1].astype(np.int32), lengths[row : row + 1]))
    return out
