"""The served-data buffer: what speculative decoding recorded, kept on disk as training data.

A recording decoder (`decoding.speculative_generate(..., record_top_k=k)`) returns, for every
generated token, the target's top-k log-probabilities and ids at that position. Appended here,
the prompts, the generated tokens and those top-k are the draft's training data with the
teacher's distribution already computed: the trainer reads them as the `served` source of
`datagen.DataMixture` (served_data_fraction) with the loss of `losses.topk_teacher_logits`, and
never runs the teacher on them.

Format (anything that writes these files is a writer, a serving process in another language
included): a directory of chunk files `served-<12-digit sequence number>.npz` (numpy .npz, no
pickles), oldest = lowest number, each holding n examples:

  prompt_tokens     int32   [n, P]     right-padded prompts
  prompt_lengths    int32   [n]        >= 1
  tokens            int32   [n, N]     generated tokens, 0 past each row's length
  lengths           int32   [n]        tokens generated per row, in [0, N]
  top_k_log_probs   float32 [n, N, k]  the target's k largest log-probabilities (temperature 1,
                                       descending) at generated token j, given the prompt and
                                       tokens < j; 0 past the row's length
  top_k_ids         int32   [n, N, k]  their ids, distinct per position
  vocab_size        int32   []         the ids' range (the target's vocabulary)

P and N may differ between chunks (rows are padded when read); k and vocab_size may not.

Bounded and crash-safe: a chunk is written to a temporary name and renamed into place (readers
never see half a chunk; a killed writer leaves at most a `.tmp` file, which readers ignore and
the next append removes); after an append the oldest chunks are deleted while the buffer holds
more than `max_examples` rows (a chunk larger than the cap keeps its newest rows). One writer
per buffer.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import numpy as np

from distillspec import datagen
from distillspec.teacher_cache import TeacherTopK

PREFIX, SUFFIX = "served-", ".npz"
_NAME = re.compile(r"^served-(\d{12})\.npz$")
FIELDS = ("prompt_tokens", "prompt_lengths", "tokens", "lengths", "top_k_log_probs", "top_k_ids")


@dataclasses.dataclass(frozen=True)
class ServedData:
    """A buffer read for training: the examples (prompt, generated tokens) and the target's
    top-k at every generated position, row for row."""

    store: datagen.ExampleStore
    top_k: TeacherTopK
    vocab_size: int

    def __len__(self) -> int:
        return len(self.store)


def chunks(directory: str) -> list[str]:
    """The buffer's chunk files, oldest first."""
    names = [os.path.basename(p) for p in glob.glob(os.path.join(directory, PREFIX + "*"))]
    return [os.path.join(directory, n) for n in sorted(n for n in names if _NAME.match(n))]


def _check(arrays: dict, where: str) -> None:
    """Refuses a chunk whose arrays disagree in shape or hold impossible values, naming them."""
    missing = [f for f in (*FIELDS, "vocab_size") if f not in arrays]
    if missing:
        raise ValueError(f"{where}: missing arrays {missing} (a served chunk holds {FIELDS})")
    if np.ndim(arrays["top_k_log_probs"]) != 3:
        raise ValueError(
            f"{where}: top_k_log_probs has shape {np.shape(arrays['top_k_log_probs'])}, expected "
            "[n, N, k]"
        )
    n, steps, k = np.shape(arrays["top_k_log_probs"])
    shapes = {
        "prompt_tokens": (n, np.shape(arrays["prompt_tokens"])[1]),
        "prompt_lengths": (n,),
        "tokens": (n, steps),
        "lengths": (n,),
        "top_k_ids": (n, steps, k),
    }
    for name, shape in shapes.items():
        if np.shape(arrays[name]) != shape:
            raise ValueError(
                f"{where}: {name} has shape {np.shape(arrays[name])}, expected {shape} "
                f"(n = {n} rows, N = {steps} tokens, k = {k})"
            )
    vocab = int(arrays["vocab_size"])
    lengths, prompt_lengths = arrays["lengths"], arrays["prompt_lengths"]
    problems = {
        "prompt_lengths outside [1, P]": np.any(prompt_lengths < 1)
        or np.any(prompt_lengths > shapes["prompt_tokens"][1]),
        f"lengths outside [0, {steps}]": np.any(lengths < 0) or np.any(lengths > steps),
        f"token ids outside [0, {vocab})": any(
            np.any(arrays[f] < 0) or np.any(arrays[f] >= vocab)
            for f in ("prompt_tokens", "tokens", "top_k_ids")
        ),
        "log-probabilities that are not finite or above 0": not np.all(
            np.isfinite(arrays["top_k_log_probs"])
        )
        or np.any(arrays["top_k_log_probs"] > 1e-6),
    }
    bad = [name for name, wrong in problems.items() if wrong]
    if bad:
        raise ValueError(f"{where}: {', '.join(bad)}")


def append(directory: str, examples: dict, max_examples: int) -> str:
    """Writes `examples` (the FIELDS, plus vocab_size) as the buffer's newest chunk, then drops
    the oldest chunks while the buffer holds more than max_examples rows. Returns the chunk."""
    if not (isinstance(max_examples, int) and max_examples >= 1):
        raise ValueError(
            f"the served buffer's max_examples must be an integer >= 1, got {max_examples!r}"
        )
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, "*.tmp")):  # A writer killed mid-chunk.
        os.remove(stale)
    arrays = {f: np.asarray(examples[f])[-max_examples:] for f in FIELDS}
    arrays["vocab_size"] = np.int32(examples["vocab_size"])
    _check(arrays, f"a chunk for {directory}")
    existing = chunks(directory)
    number = int(_NAME.match(os.path.basename(existing[-1])).group(1)) + 1 if existing else 0
    path = os.path.join(directory, f"{PREFIX}{number:012d}{SUFFIX}")
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    sizes = [(p, _rows(p)) for p in chunks(directory)]
    total = sum(n for _, n in sizes)
    for old, n in sizes[:-1]:  # Oldest first; the new chunk always stays.
        if total <= max_examples:
            break
        os.remove(old)
        total -= n
    return path


def _rows(path: str) -> int:
    with np.load(path) as data:
        return int(np.shape(data["prompt_lengths"])[0])


def count(directory: str) -> int:
    """Examples the buffer holds (one small array read per chunk, not the chunks)."""
    return sum(_rows(p) for p in chunks(directory))


def records(prompt_tokens, prompt_lengths, result, vocab_size: int) -> dict:
    """The chunk of a recording decoder's call (`DecodeResult` with record_log_probs) on these
    prompts, for `append`."""
    if result.record_log_probs is None:
        raise ValueError("this decoding result holds no recording: decode with record_top_k=k > 0")
    return {
        "prompt_tokens": np.asarray(prompt_tokens, np.int32),
        "prompt_lengths": np.asarray(prompt_lengths, np.int32),
        "tokens": np.asarray(result.tokens, np.int32),
        "lengths": np.asarray(result.lengths, np.int32),
        "top_k_log_probs": np.asarray(result.record_log_probs, np.float32),
        "top_k_ids": np.asarray(result.record_ids, np.int32),
        "vocab_size": vocab_size,
    }


def _padded(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def read(
    directory: str, encoder_decoder: bool = False, vocab_size: int | None = None
) -> ServedData:
    """The whole buffer as training data (rows padded to the longest chunk's P and N).

    vocab_size: the models' vocabulary, checked against the buffer's (a buffer recorded with
    another target is refused rather than trained on)."""
    paths = chunks(directory)
    if not paths:
        raise FileNotFoundError(
            f"no served data in {directory!r}: it holds no {PREFIX}*{SUFFIX} chunk (record with "
            "speculative_generate(..., record_top_k=k) and distillspec.served.append)"
        )
    parts = []
    for path in paths:
        with np.load(path) as data:
            arrays = {f: data[f] for f in (*FIELDS, "vocab_size") if f in data}
        _check(arrays, path)
        parts.append(arrays)
    ks = {p["top_k_ids"].shape[2] for p in parts}
    vocabs = {int(p["vocab_size"]) for p in parts}
    if len(ks) > 1 or len(vocabs) > 1:
        raise ValueError(
            f"{directory}: chunks disagree on k {sorted(ks)} or vocab_size {sorted(vocabs)}; "
            "one buffer holds one recording's top-k of one target"
        )
    (vocab,) = vocabs
    if vocab_size is not None and vocab != vocab_size:
        raise ValueError(
            f"{directory} was recorded over a vocabulary of {vocab} ids, but the models have "
            f"{vocab_size}: it was served by another target"
        )
    width = {f: max(p[f].shape[1] for p in parts) for f in ("prompt_tokens", "tokens")}
    joined = lambda f, w=None: np.concatenate(
        [p[f] if w is None else _padded(p[f], w) for p in parts]
    )
    store = datagen.ExampleStore(
        joined("prompt_tokens", width["prompt_tokens"]),
        joined("prompt_lengths"),
        joined("tokens", width["tokens"]),
        joined("lengths"),
    )
    log_probs, ids = (
        joined("top_k_log_probs", width["tokens"]),
        joined("top_k_ids", width["tokens"]),
    )
    k = log_probs.shape[2]
    past = np.arange(log_probs.shape[1]) >= store.completion_lengths[:, None]
    # Past a row's end (no weight in the loss): a uniform top-k over distinct ids, as
    # `TeacherTopK.rows` fills masked positions, rather than k copies of id 0.
    log_probs[past] = -np.log(k)
    ids[past] = np.arange(k, dtype=np.int32)
    return ServedData(store, TeacherTopK(log_probs, ids, encoder_decoder), vocab)
