"""A cache of the teacher's top-k log-probabilities on the fixed data set.

On fixed data (DataMixture lambda1 > 0) the teacher's distribution at every completion
position is a function of the teacher and the data alone, yet a plain run recomputes it at
every step, and a study recomputes it in every cell. With `train.teacher_top_k = k`, the first
run computes the teacher's k largest log-probabilities (and their ids) at every completion
position of the training split once, stores them in
<cache>/teacher_topk/<key>.npz (key: the teacher's parameters, the data, k and the model
family, hashed), and every later fixed-data step reads its rows instead of running the teacher
forward; steps on generated data still run the teacher. The loss sees the distribution of
`losses.topk_teacher_logits` (exact top-k probabilities, the tail mass over the other ids in the
student's own proportions): exact for k = V; otherwise the top k and the tail's mass are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import datagen, heads
from distillspec.vocabularies import default_cache_dir

SUBDIR = "teacher_topk"
LOG_PROBS, IDS = "teacher_topk_log_probs", "teacher_topk_ids"  # The batch keys train_step reads.


@dataclasses.dataclass(frozen=True)
class TeacherTopK:
    """Top-k log-probabilities [n, N, k] and ids [n, N, k] of an ExampleStore's n examples at
    their N completion positions."""

    log_probs: np.ndarray
    ids: np.ndarray
    encoder_decoder: bool

    def rows(self, indices: np.ndarray, prompt_lengths: np.ndarray, length: int) -> dict:
        """The batch entries of examples `indices`, laid out like the packed batch ([B, L, k]:
        decoder-only completion position j of an example with prompt length p is p - 1 + j)."""
        n, k = self.log_probs.shape[1], self.log_probs.shape[2]
        rows = len(indices)
        log_probs = np.full((rows, length, k), -np.log(k), np.float32)  # Masked positions.
        ids = np.broadcast_to(np.arange(k, dtype=np.int32), (rows, length, k)).copy()
        for b, (i, p) in enumerate(zip(indices, prompt_lengths)):
            start = 0 if self.encoder_decoder else int(p) - 1
            log_probs[b, start : start + n], ids[b, start : start + n] = (
                self.log_probs[i],
                self.ids[i],
            )
        return {LOG_PROBS: log_probs, IDS: ids}


def _key(teacher, teacher_params, store: datagen.ExampleStore, top_k: int) -> str:
    digest = hashlib.sha256(f"{top_k} {teacher.encoder_decoder} {teacher.vocab_size}".encode())
    for leaf in jax.tree.leaves(jax.device_get(teacher_params)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    for array in (store.prompts, store.prompt_lengths, store.completions, store.completion_lengths):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:24]


def compute(teacher, teacher_params, store, top_k: int, batch_size: int = 32) -> TeacherTopK:
    pack, head = datagen.pack_for(teacher), heads.head_of(teacher)
    n = store.completions.shape[1]

    @jax.jit
    def top(params, prompts, prompt_lengths, completions, completion_lengths):
        batch = pack(prompts, prompt_lengths, completions, completion_lengths)
        inputs = {k: v for k, v in batch.items() if k.endswith("_input_tokens")}
        hidden = head.features(params, inputs)  # [B, L, E]: no [B, L, V] logits (`heads`).
        if not teacher.encoder_decoder:  # Completion position j sits at p - 1 + j.
            start = prompt_lengths - 1
            hidden = jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, n, axis=0))(
                hidden, start
            )
        head_params = head.select(params)

        def chunk(c):
            logits = head.apply(head_params, c["hidden"]).astype(jnp.float32)
            return jax.lax.top_k(jax.nn.log_softmax(logits), top_k)

        size = heads.chunk_positions(hidden.shape[0], n, None, teacher.vocab_size)
        values, ids = heads.map_chunks(chunk, {"hidden": hidden}, size)
        return values, ids, jnp.all(jnp.isfinite(values))

    parts = []
    for start in range(0, len(store), batch_size):
        rows = slice(start, start + batch_size)
        values, ids, finite = top(
            teacher_params, store.prompts[rows], store.prompt_lengths[rows],
            store.completions[rows], store.completion_lengths[rows],
        )  # fmt: skip
        if not bool(finite):
            raise FloatingPointError("non-finite teacher logits while caching its top-k")
        parts.append((np.asarray(values), np.asarray(ids)))
    log_probs = np.concatenate([p[0] for p in parts])
    ids = np.concatenate([p[1] for p in parts]).astype(np.int32)
    return TeacherTopK(log_probs, ids, teacher.encoder_decoder)


def load_or_compute(
    teacher, teacher_params, store: datagen.ExampleStore, top_k: int, cache_dir: str | None = None
) -> TeacherTopK:
    """The cached top-k of `teacher` on `store`, computed (and written atomically) if missing."""
    if not (isinstance(top_k, int) and 1 <= top_k <= teacher.vocab_size):
        raise ValueError(
            f"train.teacher_top_k must be an integer in [1, {teacher.vocab_size}] (the "
            f"teacher's vocabulary), or 0 for no cache; got {top_k!r}"
        )
    directory = cache_dir or os.path.join(default_cache_dir(), SUBDIR)
    path = os.path.join(directory, _key(teacher, teacher_params, store, top_k) + ".npz")
    if os.path.exists(path):
        with np.load(path) as f:
            return TeacherTopK(f["log_probs"], f["ids"], bool(f["encoder_decoder"]))
    print(f"[train] caching the teacher's top-{top_k} log-probabilities on {len(store)} "
          f"examples in {path}", file=sys.stderr, flush=True)  # fmt: skip
    cached = compute(teacher, teacher_params, store, top_k)
    os.makedirs(directory, exist_ok=True)
    tmp = path + f".tmp{os.getpid()}.npz"
    np.savez(tmp, log_probs=cached.log_probs, ids=cached.ids,
             encoder_decoder=cached.encoder_decoder)  # fmt: skip
    os.replace(tmp, path)
    return cached
