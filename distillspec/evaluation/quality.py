"""Model quality, apart from speculative decoding: is the target a real model of its data?

  completion_nll     mean negative log-likelihood (nats/token) of the reference completions,
                     teacher-forced after their prompts, as in training (`datagen.pack_for`)
  distinct_ngrams    distinct n-grams / all n-grams over a set of outputs (pooled distinct-n,
                     Li et al. 2016): near 0 for an output that repeats one loop
  repeating_share    share of outputs that never stop and end in a loop (at most half of the
                     4-grams of their last 32 tokens distinct), the degenerate
                     `x.call(____...` output of an under-trained target
  chrf               corpus chrF (sacrebleu's CHRF: character n-grams up to 6, beta = 2;
                     0-100) of the detokenised outputs against the reference completions: the
                     task-quality metric of the paper study (Fig. 5). Character n-grams need no
                     code tokenizer and give partial credit for near-miss identifiers, which
                     word-level ROUGE-L does not
  target_nll         the target's NLL (nats/token) of an output, teacher-forced after its
                     prompt: how likely the target finds what a draft (or a lossy decoder)
                     wrote

A degenerate target makes every speculative-decoding figure machine-dependent (greedy
acceptance then depends on which loop bit-level rounding sends it into), so the quickstart
reports these beside alpha and tau.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from sacrebleu.metrics import CHRF

from distillspec import datagen, heads, losses
from distillspec.decoding import generate
from distillspec.decoding.sampling import SamplingConfig
from distillspec.feature_converters import valid_rows
from distillspec.models.base import TruncatedVocabulary


@functools.lru_cache(maxsize=16)
def _nll_fn(model):
    """Jitted (params, batch, targets [B, L], weights [B, L]) -> (nll sum, weight sum)."""

    head = heads.head_of(model)

    def nll(params, batch, targets, weights):  # Chunk by chunk: no [B, L, V] logits (`heads`).
        head_params, chunked = head.select(params), {"targets": targets, "weights": weights}
        chunked["hidden"] = head.features(params, batch)
        size = heads.chunk_positions(*targets.shape, None, model.vocab_size)
        return heads.map_chunks(
            lambda c: losses.cross_entropy(
                head.apply(head_params, c["hidden"]), c["targets"], c["weights"]
            ),
            chunked, size,
        )  # fmt: skip

    return jax.jit(nll)


def completion_nll(model, params, batches: Sequence[dict]) -> float:
    """Mean NLL (nats per completion token, EOS included) of the batches' reference completions.

    Batches are `feature_converters.prompt_batches` output; rows with valid=False are weighted
    out. Raises FloatingPointError on non-finite logits (a NaN must not become a loss figure).
    """
    fn = _nll_fn(model)
    total, count = 0.0, 0.0
    for b in batches:
        packed = datagen.pack_for(model)(
            b["prompt_tokens"], b["prompt_lengths"], b["completion_tokens"],
            b["completion_lengths"],
        )  # fmt: skip
        weights = packed.pop("weights") * valid_rows(b)[:, None]
        targets = packed.pop("targets")
        s, c = jax.device_get(fn(params, packed, targets, weights))
        if not np.isfinite(s):
            raise FloatingPointError("non-finite logits while scoring reference completions")
        total, count = total + float(s), count + float(c)
    if not count:
        raise ValueError("no completion tokens to score (every row is padding or empty)")
    return total / count


def _rows(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(t[: int(n)]) for t, n in zip(tokens, lengths)]


def distinct_ngrams(tokens: np.ndarray, lengths: np.ndarray, n: int = 4) -> float:
    """Pooled distinct-n of outputs [B, N] with lengths [B]: unique n-grams / all n-grams."""
    rows = _rows(tokens, lengths)
    grams = [tuple(row[i : i + n]) for row in rows for i in range(len(row) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def is_repeating(row: np.ndarray, window: int = 32, n: int = 4) -> bool:
    """True if at most half of the n-grams of the last `window` tokens of `row` are distinct:
    the row ends in a loop (exact, like `____...`, or of variants, like `if self.\n if = self.`)."""
    tail = np.asarray(row)[-window:]
    if len(tail) < window:
        return False
    grams = {tuple(tail[i : i + n]) for i in range(window - n + 1)}
    return len(grams) <= (window - n + 1) / 2


def repeating_share(tokens: np.ndarray, lengths: np.ndarray, eos_id: int | None) -> float:
    """Share of outputs [B, N] that run to the length limit without EOS and end in a loop
    (`is_repeating`): outputs stuck in a repeated run."""
    rows = _rows(tokens, lengths)
    stuck = [(eos_id is None or len(r) == 0 or r[-1] != eos_id) and is_repeating(r) for r in rows]
    return float(np.mean(stuck)) if stuck else float("nan")


def chrf(outputs: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF (0-100) of outputs against one reference each."""
    if len(outputs) != len(references) or not outputs:
        raise ValueError(
            f"chrF needs one reference per output, got {len(outputs)} outputs and "
            f"{len(references)} references"
        )
    return float(CHRF().corpus_score(list(outputs), [list(references)]).score)


def detokenize(vocabulary, tokens: np.ndarray, lengths: np.ndarray, eos_id: int | None) -> list:
    """Rows [R, N] (lengths [R]) as text, each cut at its first EOS (not included)."""
    texts = []
    for row in _rows(tokens, lengths):
        ids = [int(t) for t in row]
        if eos_id is not None and eos_id in ids:
            ids = ids[: ids.index(eos_id)]
        texts.append(vocabulary.decode(ids))
    return texts


def _with_completions(batches: Sequence[dict], tokens: np.ndarray, lengths: np.ndarray):
    """The batches with their valid rows' completions replaced by outputs [R, N] (lengths [R],
    one per valid row, in order); padding rows get empty completions."""
    out, start = [], 0
    for b in batches:
        rows = valid_rows(b) > 0
        stop = start + int(rows.sum())
        completions = np.zeros((len(rows), tokens.shape[1]), np.int32)
        completion_lengths = np.zeros(len(rows), np.int32)
        completions[rows], completion_lengths[rows] = tokens[start:stop], lengths[start:stop]
        out.append(
            {**b, "completion_tokens": completions, "completion_lengths": completion_lengths}
        )
        start = stop
    return out


def output_quality(
    batches: Sequence[dict], tokens: np.ndarray, lengths: np.ndarray, *, vocabulary,
    eos_id: int | None, scorer: tuple[Any, Any] | None = None,
) -> dict[str, float]:  # fmt: skip
    """{'chrf'} of outputs [R, N] (one per valid row of `batches`, in order) against the
    batches' reference completions, and {'target_nll'} under `scorer` = (model, params)."""
    references = [
        text
        for b in batches
        for text in detokenize(
            vocabulary, np.asarray(b["completion_tokens"])[valid_rows(b) > 0],
            np.asarray(b["completion_lengths"])[valid_rows(b) > 0], eos_id,
        )
    ]  # fmt: skip
    quality = {"chrf": chrf(detokenize(vocabulary, tokens, lengths, eos_id), references)}
    if scorer is not None:
        quality["target_nll"] = completion_nll(*scorer, _with_completions(batches, tokens, lengths))
    return quality


def quality_records(
    models: Mapping[str, tuple[Any, Any]],
    batches: Sequence[dict],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    task: str = "",
    split: str = "",
    vocab_size: int | None = None,
    vocabulary=None,
    scorer: tuple[Any, Any] | None = None,
) -> list[dict[str, Any]]:
    """One record per model: {'model', 'task', 'split', 'num_prompts', 'nll', 'distinct_4',
    'repeating_share'}; nll on the batches' reference completions, the other two on each
    model's greedy output (max_new_tokens) for the same prompts. With the tokenizer's
    `vocabulary`, also 'chrf' of the greedy outputs against the references, and with
    `scorer` = (target, params) 'target_nll', the target's NLL of them (`output_quality`)."""
    truncate = lambda m: m if vocab_size is None else TruncatedVocabulary(m, vocab_size)
    records = []
    for name, (model, params) in models.items():
        scored = truncate(model)
        tokens, lengths = [], []
        for b in batches:
            rows = valid_rows(b) > 0
            out = generate(
                model, params, b["prompt_tokens"], b["prompt_lengths"],
                max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=0.0),
                eos_id=eos_id, vocab_size=vocab_size,
            )  # fmt: skip
            tokens.append(np.asarray(out.tokens)[rows])
            lengths.append(np.asarray(out.lengths)[rows])
        tokens, lengths = np.concatenate(tokens), np.concatenate(lengths)
        records.append({
            "model": name, "task": task, "split": split, "num_prompts": len(lengths),
            "nll": completion_nll(scored, params, batches),
            "distinct_4": distinct_ngrams(tokens, lengths, 4),
            "repeating_share": repeating_share(tokens, lengths, eos_id),
        })  # fmt: skip
        if vocabulary is not None:
            records[-1].update(output_quality(
                batches, tokens, lengths, vocabulary=vocabulary, eos_id=eos_id,
                scorer=None if scorer is None else (truncate(scorer[0]), scorer[1]),
            ))  # fmt: skip
    return records
