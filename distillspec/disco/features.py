"""DISCO's classifier examples (App. D.1): features of the draft's distribution, and labels.

The target decodes greedily; the draft predicts every token of that continuation from the
target's prefix (one teacher-forced pass); the label is 1 where the draft's argmax equals the
target's token. Features are `lookahead.features`, the ones the decoder computes in its loop.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from distillspec import checks, datagen, heads
from distillspec.checks import shared_vocab_size
from distillspec.decoding import generate, lookahead
from distillspec.evaluation.drafts import check_same_family
from distillspec.feature_converters import decodable, valid_rows
from distillspec.models.base import ScoringModel


@dataclasses.dataclass(frozen=True)
class Examples:
    """Labelled draft tokens: one row per token of the target's greedy continuations.

    Rows of one sequence are stored in increasing `position`. F = top_k + 2 features.
    """

    x: np.ndarray  # [M, F] float32 `lookahead.features` of the draft's distribution.
    y: np.ndarray  # [M] int32, 1 = the draft's argmax equals the target's token (accepted).
    sequence: np.ndarray  # [M] int32, the prompt the token belongs to (see extract_features).
    position: np.ndarray  # [M] int32, tokens generated before this one in its sequence (n).

    def __post_init__(self):
        m = np.shape(self.y)
        if np.ndim(self.x) != 2 or np.shape(self.x)[:1] != m or len(m) != 1:
            raise ValueError(f"Examples needs x [M, F] and y [M]; got {np.shape(self.x)}, {m}")
        if np.shape(self.sequence) != m or np.shape(self.position) != m:
            raise ValueError(
                f"Examples needs sequence and position of shape {m}; got "
                f"{np.shape(self.sequence)} and {np.shape(self.position)}"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def top_k(self) -> int:
        """The top_k the features were extracted with (F - 2)."""
        return int(self.x.shape[1]) - 2

    def select(self, mask: np.ndarray) -> Examples:
        """The rows where the [M] bool mask is True (e.g. a split by `sequence`)."""
        mask = np.asarray(mask, bool)
        return Examples(self.x[mask], self.y[mask], self.sequence[mask], self.position[mask])


@functools.lru_cache(maxsize=32)
def _features_fn(draft, top_k: int, vocab_size: int):
    """Jitted (params, packed batch, weights [B, L], completion [B, N]) -> (x [B, N, F], y)."""

    head = heads.head_of(draft)

    def fn(params, batch, weights, completion):
        # The weighted positions of a row are the ones predicting completion tokens 0 .. n-1
        # (pack_teacher_forcing, either family): the first of them predicts token 0.
        offset = jnp.argmax(weights > 0, axis=1).astype(jnp.int32)
        n = jnp.arange(completion.shape[1], dtype=jnp.int32)
        index = jnp.minimum(offset[:, None] + n, weights.shape[1] - 1)  # [B, N]
        # Position t predicts token t + 1; the head runs on [B, N] chunks (no [B, L, V], `heads`).
        chunked = {"hidden": head.features(params, batch, index), "completion": completion}
        chunked["n"], head_params = jnp.broadcast_to(n, index.shape), head.select(params)

        def chunk(c):
            logits = head.apply(head_params, c["hidden"])  # [B, C, V]
            x = lookahead.features(logits, c["n"], top_k, vocab_size)
            guess = jnp.argmax(logits[..., :vocab_size], axis=-1)
            return x, (guess == c["completion"]).astype(jnp.int32)

        size = heads.chunk_positions(*index.shape, None, draft.vocab_size)
        return heads.map_chunks(chunk, chunked, size)

    return jax.jit(fn)


def extract_features(
    target,
    target_params,
    draft,
    draft_params,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    top_k: int = 8,
    vocab_size: int | None = None,
) -> Examples:
    """Labelled classifier examples along the target's greedy continuations (DISCO App. D.1).

    For every valid prompt row the target decodes greedily (`decoding.generate`). One
    teacher-forced pass of the draft over prompt + that continuation then gives, at each
    generated position n (0 .. length - 1), the draft's logits predicting token n from the
    target's prefix: the example's features are `lookahead.features(logits, n, top_k,
    vocab_size)`, and its label is 1 (accepted) if the draft's argmax over the first vocab_size
    ids equals the target's token n, else 0 (rejected). Progress goes to stderr.

    Args:
      target, target_params: the target model and its parameters.
      draft, draft_params: the draft model (same family as the target, with a `logits`
        teacher-forcing method) and its parameters.
      batches: prompt batches {'prompt_tokens' [B, P], 'prompt_lengths' [B], optional
        'valid' [B] bool} (`feature_converters.prompt_batches`); rows with valid=False are skipped.
      max_new_tokens: N, tokens the target generates per prompt at most.
      eos_id: the target stops after emitting it (the EOS token is an example too); None: never.
      top_k: top draft probabilities in the features, in [1, vocab_size].
      vocab_size: the shared vocabulary (`checks.shared_vocab_size`); None: the models'.

    Returns:
      Examples; `sequence` numbers the valid prompt rows 0, 1, ... in the order they are met
      across batches, and `position` is n.
    """
    vocab = shared_vocab_size(target, draft, vocab_size)
    if not checks.is_int(top_k) or not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be an integer in [1, vocab_size={vocab}], got {top_k!r}")
    checks.check_int("max_new_tokens", max_new_tokens)
    check_same_family(target, draft)
    if not isinstance(draft, ScoringModel):
        raise ValueError(
            f"the draft ({type(draft).__name__}) has no teacher-forcing `logits` method; "
            "extract_features needs a DecoderOnlyLM or T5LM draft"
        )
    fn = _features_fn(draft, top_k, vocab)
    xs, ys, sequences, positions = [], [], [], []
    num_sequences = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = tqdm.tqdm(batches, total=total, desc="disco features", unit="batch", file=sys.stderr)
    for i, batch in enumerate(bar):
        if "prompt_tokens" not in batch or "prompt_lengths" not in batch:
            raise ValueError(f"batches[{i}] lacks 'prompt_tokens' / 'prompt_lengths'")
        valid = valid_rows(batch).astype(bool)
        if not valid.any():
            continue
        padded = decodable(batch)
        prompt_tokens, prompt_lengths = padded["prompt_tokens"], padded["prompt_lengths"]
        result = generate(
            target, target_params, prompt_tokens, prompt_lengths,
            max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab,
        )  # fmt: skip
        packed, weights = datagen.pack_teacher_forcing(
            draft, prompt_tokens, prompt_lengths, result.tokens, result.lengths
        )
        completion = jnp.asarray(result.tokens, jnp.int32)
        x, y = jax.device_get(fn(draft_params, packed, weights, completion))
        n = np.arange(result.tokens.shape[1])
        keep = valid[:, None] & (n < np.asarray(result.lengths)[:, None])  # [B, N]
        rows = np.cumsum(valid) - 1 + num_sequences  # Sequence ids of the valid rows.
        xs.append(np.asarray(x, np.float32)[keep])
        ys.append(np.asarray(y, np.int32)[keep])
        sequences.append(np.broadcast_to(rows[:, None], keep.shape)[keep].astype(np.int32))
        positions.append(np.broadcast_to(n, keep.shape)[keep].astype(np.int32))
        num_sequences += int(valid.sum())
        bar.set_postfix(prompts=num_sequences, tokens=sum(len(v) for v in ys))
    bar.close()
    if not xs:
        raise ValueError("batches holds no valid prompt rows (none, or every row valid=False)")
    return Examples(
        np.concatenate(xs), np.concatenate(ys), np.concatenate(sequences), np.concatenate(positions)
    )
