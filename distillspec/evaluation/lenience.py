"""Lossy speculative decoding: the quality-latency trade-off of the lenience functions.

DistillSpec Section 4 / Fig. 5b: with a lenience function f(p, eps) the verifier accepts a
draft token with probability min(1, f(p, eps) / q), so a smaller eps accepts more drafts: faster
decoding whose output drifts from the target's distribution. For each draft and each
(kind, eps) of a sweep, `lenience_records` decodes the first prompts of a set one at a time
(batch 1, interleaved with plain target decoding, compilation excluded, `drafts.batch1_latency`)
and records, beside alpha and tau, the latency and the quality of the lossy output
(`quality.output_quality`: chrF against the reference completions, the target's NLL of it).
eps = 1 (lossless) is in every sweep, once per draft, as kind 'none'; one record
('draft': 'target') gives the plain target's own quality and latency.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from distillspec import checks
from distillspec.decoding.acceptance import LENIENCE_KINDS, Lenience
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation.drafts import (
    batch1_latency,
    check_drafts,
    latency_batches,
    plain_call,
    spec_call,
)  # fmt: skip
from distillspec.evaluation.quality import output_quality

LOSSLESS = "none"  # The kind of the eps = 1 record.


def _outputs(results) -> tuple[np.ndarray, np.ndarray]:
    """Batch-1 DecodeResults as (tokens [R, N], lengths [R])."""
    return (
        np.concatenate([np.asarray(r.tokens) for r in results]),
        np.concatenate([np.asarray(r.lengths) for r in results]),
    )


def _sweep(kinds: Sequence[str], epsilons: Sequence[float]) -> list[tuple[str, float]]:
    for kind in kinds:
        if kind not in LENIENCE_KINDS:
            raise ValueError(f"lenience kind {kind!r} is not one of {LENIENCE_KINDS}")
    for eps in epsilons:
        Lenience(epsilon=float(eps))  # Fails on eps outside (0, 1].
    lossy = [(k, float(e)) for k in kinds for e in epsilons if float(e) < 1.0]
    return [(LOSSLESS, 1.0)] + lossy


def lenience_records(
    target,
    target_params,
    drafts: Mapping[str, tuple[Any, Any]],
    batches: Sequence[Mapping[str, np.ndarray]],
    *,
    vocabulary,
    eos_id: int | None,
    kinds: Sequence[str] = LENIENCE_KINDS,
    epsilons: Sequence[float] = (0.5, 0.2, 0.1, 0.05),
    gamma: int = 5,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    num_prompts: int = 32,
    timing_repeats: int = 1,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[dict[str, Any]]:
    """One record per (draft, lenience kind, eps) and one for the plain target.

    Args:
      target, target_params, drafts: as in `drafts.evaluate_drafts`.
      batches: prompt batches with reference completions (`feature_converters.prompt_batches`).
      vocabulary, eos_id: the tokenizer's vocabulary (to detokenise for chrF) and EOS.
      kinds, epsilons: the sweep (see module docstring); eps = 1 is always added.
      gamma, temperature: the speculative decoder's static lookahead and sampling.
      num_prompts: the first valid prompts decoded (one at a time).

    Returns:
      Records with 'draft', 'lenience', 'epsilon', 'gamma', 'temperature', 'alpha', 'tau',
      'latency_ms', 'target_latency_ms', 'latency_speedup', 'latency_prompts', 'chrf',
      'target_nll' ('draft' = 'target', 'lenience' = None: plain decoding).
    """
    check_drafts(target, drafts, vocab_size)
    checks.check_int("gamma", gamma)
    checks.check_int("num_prompts", num_prompts)
    sweep = _sweep(kinds, epsilons)
    singles = latency_batches(batches, num_prompts)
    if not singles or "completion_tokens" not in singles[0]:
        raise ValueError("lenience_records needs prompt batches with reference completions")
    sampling = SamplingConfig(temperature=float(temperature))
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab_size)
    base_rng = jax.random.PRNGKey(seed)
    plain_fn = functools.partial(plain_call, target, target_params, base_rng, sampling, common)
    quality = functools.partial(
        output_quality, singles, vocabulary=vocabulary, eos_id=eos_id,
        scorer=(target, target_params),
    )  # fmt: skip
    context = {"gamma": gamma, "temperature": float(temperature)}
    records, plain_record = [], None
    for name, (draft, draft_params) in drafts.items():
        for kind, eps in sweep:
            lenience = None if kind == LOSSLESS else Lenience(kind, eps)
            spec_fn = functools.partial(
                spec_call, target, draft, target_params, draft_params, base_rng, sampling,
                dict(common, gamma=gamma, lenience=lenience),
            )  # fmt: skip
            fields, plain, spec = batch1_latency(plain_fn, spec_fn, singles, timing_repeats)
            sums = {f: float(sum(np.sum(getattr(r, f)) for r in spec)) for f in
                    ("accepted", "drafted", "lengths", "target_calls")}  # fmt: skip
            record = {
                "draft": name, "lenience": kind, "epsilon": eps, **context,
                "alpha": sums["accepted"] / max(sums["drafted"], 1.0),
                "tau": sums["lengths"] / max(sums["target_calls"], 1.0),
                **fields, **quality(*_outputs(spec)),
            }  # fmt: skip
            records.append(record)
            if plain_record is None:  # The same prompts and keys every time: once.
                plain_record = {
                    "draft": "target", "lenience": None, "epsilon": None, **context,
                    "alpha": None, "tau": 1.0, "latency_ms": fields["target_latency_ms"],
                    "target_latency_ms": fields["target_latency_ms"], "latency_speedup": 1.0,
                    "latency_prompts": fields["latency_prompts"], **quality(*_outputs(plain)),
                }  # fmt: skip
            print(
                f"[lenience {len(records)}/{len(drafts) * len(sweep)}] {name} {kind} eps={eps:g}: "
                f"tau={record['tau']:.2f} latency x{record['latency_speedup']:.2f} "
                f"chrF={record['chrf']:.1f} target NLL={record['target_nll']:.3f}",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    return records + [plain_record]
