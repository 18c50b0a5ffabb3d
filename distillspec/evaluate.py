"""Evaluating draft models for speculative decoding: alpha, tau, tau_theory and speed-up.

For every (draft, gamma, temperature) of a grid, `evaluate_drafts` decodes the same prompts with
the plain target decoder and with the speculative decoder and returns one flat record:

  alpha      = accepted drafts / drafted tokens                 (over all valid prompt rows)
  tau        = generated tokens / target calls                  (block efficiency)
  mean_tvd   = mean over the target's own continuations of TVD(p_target, q_draft), both processed
               with the record's temperature (T = 0: one-hot argmax, so TVD = [argmaxes differ])
  tau_theory = (1 - a^(gamma+1)) / (1 - a) with a = 1 - mean_tvd  (DistillSpec Fig. 3c)
  speedup    = (spec tokens / spec time) / (plain tokens / plain time), timed in this process,
               compilation excluded, plain and speculative calls interleaved batch by batch.

Records go to `records.jsonl` (`append_records`); `distillspec.tables` formats them without JAX.

The lookahead policy axis (DISCO Table 1, `evaluate_policies`): every policy of
`resolve_policies` ('static-<k>', 'static-opt', 'heuristic', 'confidence', 'disco', 'oracle')
and the target alone decode the same prompts at batch 1, greedy, interleaved per prompt
(`measure_policies`), one record per (draft, policy) with the keys of `POLICY_RECORD_KEYS`:
latency_ms per generated token, speedup against the target alone, mean_sl, the per-round
sl_histogram, alpha, tau and exact (output identical to the target's).

`evaluate` is the gin run function around `evaluate_drafts` (T5X style):

    python -m distillspec.evaluate --gin_file=runs/evaluate.gin --gin.OUTPUT_DIR=\"DIR\" \
        --gin.TARGET_CHECKPOINT=\"HF_DIR\" --gin.DRAFTS="{'standard': 'HF_DIR', ...}"
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import datagen
from distillspec import lookahead as sl
from distillspec.datagen import is_encoder_decoder
from distillspec.decoding import DecodeResult, generate, shared_vocab_size, speculative_generate
from distillspec.lookahead import Lookahead
from distillspec.sampling import SamplingConfig, logits_to_probs
from distillspec.tables import read_records  # noqa: F401  (re-exported: records I/O lives here)

RECORD_KEYS = (
    "draft",
    "gamma",
    "temperature",
    "alpha",
    "tau",
    "tau_theory",
    "speedup",
    "num_prompts",
    "task",
    "split",
    "max_new_tokens",
    "tokens_per_s",
    "target_tokens_per_s",
    "mean_tvd",
)


# --------------------------------------------------------------------------------------------
# Theory: tau from the mean TVD.
# --------------------------------------------------------------------------------------------


def tau_from_alpha(alpha: float, gamma: int) -> float:
    """Expected tokens per target call for i.i.d. acceptance rate alpha (Leviathan et al.).

    tau = (1 - alpha^(gamma+1)) / (1 - alpha) = 1 + alpha + ... + alpha^gamma; gamma + 1 at alpha 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tau_from_tvd(mean_tvd: float, gamma: int) -> float:
    """DistillSpec Fig. 3c: tau_theory with alpha = 1 - mean TVD(target, draft)."""
    return tau_from_alpha(min(max(1.0 - mean_tvd, 0.0), 1.0), gamma)


# --------------------------------------------------------------------------------------------
# Teacher forcing along the target's continuations.
# --------------------------------------------------------------------------------------------


def pack_teacher_forcing(
    prompt_tokens: np.ndarray,
    prompt_lengths: np.ndarray,
    completion_tokens: np.ndarray,
    completion_lengths: np.ndarray,
    *,
    encoder_decoder: bool = False,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """Teacher-forcing inputs for prompt + completion rows, packed as for training.

    Returns:
      (batch, weights): the model inputs of `datagen.pack_decoder_only` (decoder_input_tokens
      [B, P+N], weights 1 at positions p-1 .. p+n-2) or of `datagen.pack_encoder_decoder`
      (encoder_input_tokens [B, P], decoder_input_tokens [B, N] = [0] + completion[:-1],
      weights 1 at positions < n).
    """
    pack = datagen.pack_encoder_decoder if encoder_decoder else datagen.pack_decoder_only
    batch = pack(prompt_tokens, prompt_lengths, completion_tokens, completion_lengths)
    weights = batch.pop("weights")
    del batch["targets"]
    return batch, weights


@functools.lru_cache(maxsize=32)
def _tvd_fn(target, draft, sampling: SamplingConfig, vocab_size: int | None):
    """Jitted (target_params, draft_params, batch, weights [B, L]) -> (tvd sum, weight sum)."""

    def tvd_sum(target_params, draft_params, batch, weights):
        p = logits_to_probs(target.logits(target_params, batch), sampling, vocab_size)
        q = logits_to_probs(draft.logits(draft_params, batch), sampling, vocab_size)
        tvd = 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)  # [B, L]
        return jnp.sum(tvd * weights), jnp.sum(weights)

    return jax.jit(tvd_sum)


def mean_tvd(
    target,
    target_params,
    draft,
    draft_params,
    batches: Sequence[Mapping[str, np.ndarray]],
    continuations: Sequence[DecodeResult],
    sampling: SamplingConfig,
    vocab_size: int | None = None,
) -> float:
    """Mean next-token TVD(target, draft) along the target's continuations (completion positions).

    Both distributions are processed like the decoders process them (`logits_to_probs`), so for
    greedy decoding the TVD is the indicator that the argmaxes differ. Rows with valid=False are
    weighted out.
    """
    if is_encoder_decoder(target) != is_encoder_decoder(draft):
        raise ValueError("target and draft must both be decoder-only or both encoder-decoder")
    fn = _tvd_fn(target, draft, sampling, vocab_size)
    total, count = 0.0, 0.0
    for batch, result in zip(batches, continuations):
        packed, weights = pack_teacher_forcing(
            batch["prompt_tokens"],
            batch["prompt_lengths"],
            result.tokens,
            result.lengths,
            encoder_decoder=is_encoder_decoder(target),
        )
        weights = weights * valid_rows(batch)[:, None]
        s, c = jax.device_get(fn(target_params, draft_params, packed, weights))
        total, count = total + float(s), count + float(c)
    return total / count if count else float("nan")


# --------------------------------------------------------------------------------------------
# Input checks and prompt batches.
# --------------------------------------------------------------------------------------------


def valid_rows(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """[B] float32 mask of real rows (prompt_batches pads a final partial batch)."""
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


def _check_drafts(target, drafts, vocab_size: int | None) -> None:
    if not drafts:
        raise ValueError("drafts is empty: pass {name: (model, params)} with at least one draft")
    for name, entry in drafts.items():
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            raise ValueError(f"drafts[{name!r}] must be a (model, params) pair, got {type(entry)}")
        try:  # The decoders' own check, run for every draft before anything is decoded.
            shared_vocab_size(target, entry[0], vocab_size)
        except ValueError as e:
            raise ValueError(f"drafts[{name!r}]: {e}") from None
        if is_encoder_decoder(entry[0]) != is_encoder_decoder(target):
            raise ValueError(
                f"drafts[{name!r}] and the target must both be decoder-only or both T5-style"
            )


def _check_grid(prompts, gammas, temperatures, max_new_tokens, timing_repeats):
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt batch")
    for i, batch in enumerate(prompts):
        if "prompt_tokens" not in batch or "prompt_lengths" not in batch:
            raise ValueError(f"prompts[{i}] lacks 'prompt_tokens' / 'prompt_lengths'")
    if not any(valid_rows(b).any() for b in prompts):
        raise ValueError("prompts holds no valid rows (every row has valid=False)")
    if not gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gammas):
        raise ValueError(f"gammas must be a non-empty list of integers >= 1, got {gammas!r}")
    if not temperatures or any(not (float(t) >= 0) for t in temperatures):
        raise ValueError(
            f"temperatures must be a non-empty list of values >= 0, got {temperatures}"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(timing_repeats, int) and timing_repeats >= 1):
        raise ValueError(f"timing_repeats must be an integer >= 1, got {timing_repeats!r}")


# --------------------------------------------------------------------------------------------
# The evaluation loop.
# --------------------------------------------------------------------------------------------


def _timed(fn) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()  # The decoders return host arrays (device_get), so the work is done here.
    return result, time.perf_counter() - start


def _measure(plain_fn, spec_fn, batches, timing_repeats: int):
    """Runs both decoders on every batch: warm-up per distinct shape (not timed), then
    timing_repeats interleaved (plain, spec) pairs per batch; per-batch median times.

    Returns (plain results, spec results, plain seconds, spec seconds).
    """
    compiled: set[tuple[int, ...]] = set()
    plain_results, spec_results, plain_time, spec_time = [], [], 0.0, 0.0
    for i, batch in enumerate(batches):
        shape = np.shape(batch["prompt_tokens"])
        if shape not in compiled:  # Compilation is excluded from the timings.
            plain_fn(i, batch), spec_fn(i, batch)
            compiled.add(shape)
        plain_times, spec_times = [], []
        for _ in range(timing_repeats):
            plain, t_plain = _timed(functools.partial(plain_fn, i, batch))
            spec, t_spec = _timed(functools.partial(spec_fn, i, batch))
            plain_times.append(t_plain)
            spec_times.append(t_spec)
        plain_results.append(plain)
        spec_results.append(spec)
        plain_time += statistics.median(plain_times)
        spec_time += statistics.median(spec_times)
    return plain_results, spec_results, plain_time, spec_time


def _plain_call(target, params, base_rng, sampling, kwargs, index: int, batch) -> DecodeResult:
    """Plain decoding of prompt batch `index` (its sampling key is fold_in(base_rng, index))."""
    rng = jax.random.fold_in(base_rng, index)
    return generate(
        target, params, batch["prompt_tokens"], batch["prompt_lengths"], rng,
        sampling=sampling, **kwargs,
    )  # fmt: skip


def _spec_call(
    target, draft, target_params, draft_params, base_rng, sampling, kwargs, index: int, batch
) -> DecodeResult:
    """Speculative decoding of prompt batch `index`, with the same key as `_plain_call`."""
    rng = jax.random.fold_in(base_rng, index)
    return speculative_generate(
        target, draft, target_params, draft_params, batch["prompt_tokens"],
        batch["prompt_lengths"], rng, sampling=sampling, **kwargs,
    )  # fmt: skip


def _valid_sum(results: Sequence[DecodeResult], field: str, batches) -> float:
    """Sum of a DecodeResult counter over the valid rows of all batches."""
    return float(
        sum(
            np.sum(np.asarray(getattr(r, field), np.float64) * valid_rows(b))
            for r, b in zip(results, batches)
        )
    )


def _record(plain, spec, t_plain, t_spec, batches, tvd: float, gamma: int) -> dict[str, Any]:
    """The measured part of one record (see the module docstring for the definitions)."""
    spec_tokens = _valid_sum(spec, "lengths", batches)
    drafted, accepted = _valid_sum(spec, "drafted", batches), _valid_sum(spec, "accepted", batches)
    tokens_per_s = spec_tokens / max(t_spec, 1e-12)
    target_tokens_per_s = _valid_sum(plain, "lengths", batches) / max(t_plain, 1e-12)
    return {
        "alpha": accepted / max(drafted, 1.0),
        "tau": spec_tokens / max(_valid_sum(spec, "target_calls", batches), 1.0),
        "tau_theory": tau_from_tvd(tvd, gamma) if math.isfinite(tvd) else float("nan"),
        "speedup": tokens_per_s / max(target_tokens_per_s, 1e-12),
        "num_prompts": int(sum(valid_rows(b).sum() for b in batches)),
        "tokens_per_s": tokens_per_s,
        "target_tokens_per_s": target_tokens_per_s,
        "mean_tvd": tvd,
    }


def evaluate_drafts(
    target,
    target_params,
    drafts: Mapping[str, tuple[Any, Any]],
    prompts: Iterable[Mapping[str, np.ndarray]],
    *,
    gammas: Sequence[int] = (3, 5, 7),
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int,
    eos_id: int | None,
    seed: int = 0,
    task: str = "",
    split: str = "",
    vocab_size: int | None = None,
    timing_repeats: int = 1,
) -> list[dict[str, Any]]:
    """Speculative-decoding quality and speed of each draft against the target, over a grid.

    Args:
      target, target_params: the target model (a `DecodingModel` with teacher-forced `logits`).
      drafts: {name: (model, params)}, e.g. {'standard': ..., 'distilled': ...}.
      prompts: prompt batches as yielded by `distillspec.tasks.prompt_batches` ('prompt_tokens'
        [B, P], 'prompt_lengths' [B], optional 'valid' [B]; rows with valid=False are decoded
        for shape's sake but not counted).
      gammas: draft block sizes (>= 1).
      temperatures: 0 = greedy, else softmax(logits / T) sampling.
      max_new_tokens: tokens generated per prompt at most.
      eos_id: a row stops after this id; None = always max_new_tokens.
      seed: sampling key of batch i is fold_in(PRNGKey(seed), i), shared by plain and spec.
      task, split: context copied into the records.
      vocab_size: shared tokenizer size when the embeddings are padded differently.
      timing_repeats: interleaved (plain, spec) pairs timed per batch; medians are summed.

    Returns:
      One record per (draft, gamma, temperature), with the keys of `RECORD_KEYS`.
    """
    prompts = list(prompts)
    gammas, temperatures = list(gammas), [float(t) for t in temperatures]
    _check_drafts(target, drafts, vocab_size)
    _check_grid(prompts, gammas, temperatures, max_new_tokens, timing_repeats)
    batches = [decodable(b) for b in prompts if valid_rows(b).any()]
    base_rng = jax.random.PRNGKey(seed)
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab_size)
    records, tvd_cache = [], {}
    for temperature in temperatures:
        sampling = SamplingConfig(temperature=temperature)
        plain_fn = functools.partial(_plain_call, target, target_params, base_rng, sampling, common)
        for name, (draft, draft_params) in drafts.items():
            for gamma in gammas:
                spec_fn = functools.partial(
                    _spec_call, target, draft, target_params, draft_params, base_rng, sampling,
                    dict(common, gamma=gamma),
                )  # fmt: skip
                plain, spec, t_plain, t_spec = _measure(plain_fn, spec_fn, batches, timing_repeats)
                if (name, temperature) not in tvd_cache:  # Depends on neither gamma nor timing.
                    tvd_cache[name, temperature] = mean_tvd(
                        target, target_params, draft, draft_params, batches, plain, sampling,
                        vocab_size,
                    )  # fmt: skip
                record = _record(
                    plain, spec, t_plain, t_spec, batches, tvd_cache[name, temperature], gamma
                )
                record = {"draft": name, "gamma": gamma, "temperature": temperature, **record}
                record.update(task=task, split=split, max_new_tokens=max_new_tokens)
                record = {key: record[key] for key in RECORD_KEYS}  # Fixed key order.
                records.append(record)
                _report_progress(
                    record, len(records), len(drafts) * len(gammas) * len(temperatures)
                )
    return records


# --------------------------------------------------------------------------------------------
# Lookahead policies: batch-1 latency (DISCO Table 1).
# --------------------------------------------------------------------------------------------

POLICY_RECORD_KEYS = (
    "draft",
    "policy",
    "sl_max",
    "threshold",
    "keep_last",
    "temperature",
    "alpha",
    "tau",
    "mean_sl",
    "sl_histogram",
    "latency_ms",
    "modeled_latency_ms",
    "target_latency_ms",
    "speedup",
    "exact",
    "num_prompts",
    "task",
    "split",
    "max_new_tokens",
    "tokens",
    "target_calls",
    "draft_calls",
)


def single_prompts(batches: Iterable[Mapping[str, np.ndarray]]) -> list[tuple[np.ndarray, ...]]:
    """The valid rows of prompt batches as batch-1 (prompt_tokens [1, P], prompt_lengths [1])."""
    out = []
    for batch in batches:
        tokens, lengths = np.asarray(batch["prompt_tokens"]), np.asarray(batch["prompt_lengths"])
        for row in np.flatnonzero(valid_rows(batch)):
            out.append((tokens[row : row + 1].astype(np.int32), lengths[row : row + 1]))
    return out


def measure_call_costs(
    target,
    target_params,
    draft,
    draft_params,
    prompt: tuple[np.ndarray, np.ndarray],
    widths: Iterable[int],
    *,
    max_new_tokens: int,
    repeats: int = 5,
) -> dict[str, Any]:
    """Measured milliseconds per model call at batch 1, for `modeled_latency_ms`.

    Returns:
      {'target': {w: one target call scoring w positions}, 'draft': {1: .., 2: ..},
       'round': the decoding loop's own work per step (plain ms/token - target[1], >= 0)}.
    Each figure is the median of `repeats` timings of a jitted loop of calls (prefill and
    dispatch cancelled out; `distillspec.benchmarks.speculative.step_timer`).
    """
    from distillspec.benchmarks.speculative import step_timer

    tokens, lengths = prompt

    def per_call(model, params, width):
        timer = step_timer(model, params, tokens, lengths, width, calls=16)
        return 1e3 * statistics.median(timer() for _ in range(repeats))

    costs = {
        "target": {w: per_call(target, target_params, w) for w in sorted(set(widths) | {1})},
        "draft": {w: per_call(draft, draft_params, w) for w in (1, 2)},
    }
    plain = lambda: generate(target, target_params, tokens, lengths, max_new_tokens=max_new_tokens)
    result = plain()
    seconds = statistics.median(_timed(plain)[1] for _ in range(repeats))
    per_token = 1e3 * seconds / max(int(result.lengths.sum()), 1)
    costs["round"] = max(per_token - costs["target"][1], 0.0)
    return costs


def modeled_latency_ms(
    policy: Lookahead | None, sl_histogram, draft_calls: int, tokens: int, costs
) -> float:
    """ms per token from counted calls and measured call costs (`measure_call_costs`).

    Each round costs the target call at the width the decoder used (`verify_widths`) plus the
    loop's per-round work; each draft call costs a draft step (the first of a round scores 2
    positions). Deterministic for greedy decoding, so it ranks policies without the timing noise
    of a shared machine; the measured latency is reported beside it.
    """
    widths = sl.verify_widths(policy) if policy else (1,)
    total = 0.0
    for drafts, rounds in enumerate(sl_histogram):
        if rounds:
            width = min(w for w in widths if w >= drafts + 1)
            total += rounds * (costs["target"][width] + costs["round"])
    if policy:
        rounds = int(np.sum(sl_histogram))
        total += rounds * costs["draft"][2] + (draft_calls - rounds) * costs["draft"][1]
    return total / max(tokens, 1)


def measure_policies(
    target,
    target_params,
    draft,
    draft_params,
    prompts: Sequence[tuple[np.ndarray, np.ndarray]],
    policies: Mapping[str, Lookahead],
    *,
    classifier=None,
    costs: Mapping[str, Any] | None = None,
    max_new_tokens: int,
    eos_id: int | None,
    vocab_size: int | None = None,
    timing_repeats: int = 1,
    desc: str = "policies",
) -> dict[str, dict[str, Any]]:
    """Greedy decoding latency per generated token of each lookahead policy, at batch 1.

    Every prompt is decoded by the target alone ('target') and by each policy, one after the
    other (so a slower or busier stretch of the machine hits all of them alike); each program
    is compiled on the first prompt before anything is timed; per prompt the median of
    timing_repeats calls counts. The oracle policy gets the target's own output as reference.

    Args:
      prompts: (prompt_tokens [1, P], prompt_lengths [1]) pairs, all of one shape.
      policies: {name: Lookahead}; names must not be 'target'.
      classifier: DISCO classifier variables (for kind 'disco').
      costs: `measure_call_costs` output; with it each policy also gets modeled_latency_ms.
      Others as in `evaluate_drafts`.

    Returns:
      {'target' and each policy name: measured fields of a policy record (see
      POLICY_RECORD_KEYS): alpha, tau, mean_sl, sl_histogram, latency_ms, target_latency_ms,
      speedup, exact, num_prompts, tokens, target_calls, draft_calls, sl_max, threshold}.
    """
    from tqdm import tqdm

    if not prompts:
        raise ValueError("prompts is empty: pass at least one (prompt_tokens, prompt_lengths)")
    if "target" in policies:
        raise ValueError("'target' is the plain target's name; name the policies otherwise")
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab_size)
    greedy = SamplingConfig()

    def plain(prompt, reference):
        return generate(target, target_params, *prompt, sampling=greedy, **common)

    def policy_fn(lookahead):
        def run(prompt, reference):
            return speculative_generate(
                target, draft, target_params, draft_params, *prompt, lookahead=lookahead,
                classifier=classifier if lookahead.kind == "disco" else None,
                oracle_tokens=reference.tokens if lookahead.kind == "oracle" else None,
                sampling=greedy, **common,
            )  # fmt: skip

        return run

    fns = {"target": plain, **{name: policy_fn(la) for name, la in policies.items()}}
    references = [plain(prompt, None) for prompt in prompts]  # Also compiles the target.
    for fn in fns.values():
        fn(prompts[0], references[0])
    seconds = dict.fromkeys(fns, 0.0)
    results: dict[str, list[DecodeResult]] = {name: [] for name in fns}
    for prompt, reference in tqdm(
        list(zip(prompts, references)), desc=desc, unit="prompt", file=sys.stderr, leave=False
    ):
        for name, fn in fns.items():
            times = []
            for _ in range(timing_repeats):
                result, t = _timed(functools.partial(fn, prompt, reference))
                times.append(t)
            seconds[name] += statistics.median(times)
            results[name].append(result)
    target_latency = 1000.0 * seconds["target"] / max(_counter_sum(references, "lengths"), 1)
    out = {}
    for name, runs in results.items():
        total = functools.partial(_counter_sum, runs)
        tokens = total("lengths")
        hist = np.sum([r.sl_histogram.sum(0) for r in runs], axis=0)
        latency = 1000.0 * seconds[name] / max(tokens, 1)
        lookahead = policies.get(name)
        out[name] = {
            "sl_max": lookahead.sl_max if lookahead else 0,
            "threshold": float(lookahead.threshold)
            if lookahead and lookahead.kind in ("confidence", "disco")
            else None,
            "keep_last": lookahead.keep_last if lookahead else None,
            "alpha": total("accepted") / max(total("drafted"), 1),
            "tau": tokens / max(total("target_calls"), 1),
            "mean_sl": total("drafted") / max(total("target_calls"), 1),
            "sl_histogram": [int(v) for v in hist],
            "latency_ms": latency,
            "modeled_latency_ms": None
            if costs is None
            else modeled_latency_ms(lookahead, hist, total("draft_calls"), tokens, costs),
            "target_latency_ms": target_latency,
            "speedup": target_latency / max(latency, 1e-12),
            "exact": all(
                np.array_equal(r.tokens, ref.tokens) and np.array_equal(r.lengths, ref.lengths)
                for r, ref in zip(runs, references)
            ),
            "num_prompts": len(prompts),
            "tokens": tokens,
            "target_calls": total("target_calls"),
            "draft_calls": total("draft_calls"),
        }
    return out


def _counter_sum(results: Sequence[DecodeResult], field: str) -> int:
    return int(sum(int(getattr(r, field).sum()) for r in results))


def policy_records(
    measured: Mapping[str, Mapping[str, Any]], *, draft: str, task: str, split: str,
    max_new_tokens: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Flat records (POLICY_RECORD_KEYS order) from `measure_policies`' output."""
    records = []
    for name, fields in measured.items():
        record = dict(fields, draft=draft, policy=name, temperature=0.0, task=task, split=split)
        record["max_new_tokens"] = max_new_tokens
        records.append({key: record[key] for key in POLICY_RECORD_KEYS})
    return records


POLICY_NAMES = ("static-<k>", "static-opt", "heuristic", "confidence", "disco", "oracle")
TUNED_POLICIES = ("static-opt", "confidence", "disco")  # Need `distillspec.disco`'s tuning.


def resolve_policies(
    names: Sequence[str],
    tuning: Mapping[str, Any] | None = None,
    *,
    heuristic_sl_max: int = 8,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
) -> dict[str, Lookahead]:
    """{name: Lookahead} for policy names (the target alone is always measured besides).

    Args:
      names: 'static-<k>', 'static-opt', 'heuristic', 'confidence', 'disco', 'oracle'.
      tuning: a draft's validation tuning (classifier.json's 'tuning', from
        `python -m distillspec.disco`): static_opt, and the confidence and disco settings.
      heuristic_sl_max, heuristic_start: the heuristic's cap and first lookahead.
      oracle_sl_max: the oracle's cap (large: the oracle SL histogram is DISCO's Figure 4).
    """
    out = {}
    for name in names:
        if name == "target":
            continue
        if name in TUNED_POLICIES and not tuning:
            raise ValueError(
                f"policy {name!r} is tuned on validation data: train and tune the draft's "
                "classifier first with python -m distillspec.disco"
            )
        if name.startswith("static-") and name[7:].isdigit():
            out[name] = Lookahead("static", int(name[7:]))
        elif name == "static-opt":
            out[name] = Lookahead("static", int(tuning["static_opt"]))
        elif name == "heuristic":
            out[name] = Lookahead(
                "heuristic", heuristic_sl_max, start=min(heuristic_start, heuristic_sl_max)
            )
        elif name in ("confidence", "disco"):
            out[name] = Lookahead(name, **tuning[name])
        elif name == "oracle":
            out[name] = Lookahead("oracle", oracle_sl_max)
        else:
            raise ValueError(f"unknown lookahead policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    return out


def evaluate_policies(
    target,
    target_params,
    drafts: Mapping[str, tuple[Any, Any, Any, Mapping[str, Any] | None]],
    sets: Mapping[tuple[str, str], Sequence[Mapping[str, np.ndarray]]],
    policies: Sequence[str],
    *,
    num_prompts: int,
    max_new_tokens: int,
    eos_id: int | None,
    records_path: str | None = None,
    timing_repeats: int = 1,
    heuristic_sl_max: int = 8,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
    model_costs: bool = True,
) -> list[dict[str, Any]]:
    """DISCO Table 1: every policy's batch-1 greedy latency, per eval set and draft.

    Args:
      drafts: {name: (model, params, DISCO classifier variables or None, tuning or None)}.
      sets: {(task, split): prompt batches}; the first num_prompts valid prompts are used.
      policies: names for `resolve_policies` (the target alone is always measured).
      records_path: records are appended here as they are made (one eval set at a time).
      model_costs: also give each record modeled_latency_ms (call costs measured per draft).
      Others as in `measure_policies` / `resolve_policies`.

    Returns:
      One record per (eval set, draft, policy), keys POLICY_RECORD_KEYS.
    """
    records = []
    for name, (draft, draft_params, classifier, tuning) in drafts.items():
        lookaheads = resolve_policies(
            policies, tuning, heuristic_sl_max=heuristic_sl_max,
            heuristic_start=heuristic_start, oracle_sl_max=oracle_sl_max,
        )  # fmt: skip
        costs = None
        if model_costs:
            first = single_prompts(next(iter(sets.values())))[0]
            widths = {w for la in lookaheads.values() for w in sl.verify_widths(la)}
            costs = measure_call_costs(
                target, target_params, draft, draft_params, first, widths,
                max_new_tokens=max_new_tokens,
            )  # fmt: skip
        for (task, split), batches in sets.items():
            measured = measure_policies(
                target, target_params, draft, draft_params,
                single_prompts(batches)[:num_prompts], lookaheads, classifier=classifier,
                costs=costs,
                max_new_tokens=max_new_tokens, eos_id=eos_id, timing_repeats=timing_repeats,
                desc=f"{name} {task}/{split}",
            )  # fmt: skip
            new = policy_records(
                measured, draft=name, task=task, split=split, max_new_tokens=max_new_tokens
            )
            if records_path:
                append_records(records_path, new)
            records += new
            by = {r["policy"]: r for r in new}
            line = " ".join(f"{p}={r['latency_ms']:.2f}ms" for p, r in by.items())
            print(f"[policies] {name} {task}/{split}: {line}", file=sys.stderr, flush=True)
    return records


def _report_progress(record: Mapping[str, Any], done: int, total: int) -> None:
    print(
        f"[evaluate {done}/{total}] draft={record['draft']} gamma={record['gamma']} "
        f"T={record['temperature']:g}: alpha={record['alpha']:.3f} tau={record['tau']:.3f} "
        f"tau_theory={record['tau_theory']:.3f} speedup={record['speedup']:.2f}x",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# records.jsonl
# --------------------------------------------------------------------------------------------


def append_records(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Appends one JSON object per line to path (parent directories are created)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(dict(record), sort_keys=False) + "\n")


def _prompt_sets(eval_sets, lengths, num_prompts: int, batch_size: int) -> dict:
    """{(task, split): [prompt batches]} holding the first num_prompts prompts of each set."""
    from distillspec import tasks

    sets = {}
    for task, split in eval_sets:
        batches, seen = [], 0
        for batch in tasks.prompt_batches(
            task, split, batch_size, lengths["inputs"], lengths["targets"], shuffle=False
        ):
            batches.append(batch)
            seen += int(batch["valid"].sum())
            if seen >= num_prompts:
                break
        sets[(task, split)] = batches
    return sets


def open_run(run: str, output_dir, target_checkpoint, drafts, vocabulary, tfds_data_dir):
    """A run function's common start: checks OUTPUT_DIR and drafts, registers the tasks,
    loads the target. Returns (vocabulary, target model, target params)."""
    from distillspec import checkpoints, tasks
    from distillspec.models import from_pretrained

    checkpoints.check_writable(output_dir)
    if not drafts:
        raise ValueError(f"{run} needs at least one draft: drafts = {{name: hf_directory}}")
    vocab = tasks.get_vocabulary(vocabulary)
    tasks.register_tasks(vocab, tfds_data_dir=tfds_data_dir)
    return (vocab, *from_pretrained(target_checkpoint))


def evaluate(
    output_dir: str,
    target_checkpoint: str,
    drafts: Mapping[str, str],
    eval_sets: Sequence[tuple[str, str]] = (("stdlib_code", "test"), ("humaneval", "test")),
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},  # noqa: B006
    num_prompts: int = 64,
    batch_size: int = 16,
    gammas: Sequence[int] = (3, 5, 7),
    temperatures: Sequence[float] = (0.0, 1.0),
    timing_repeats: int = 1,
    seed: int = 0,
    vocabulary: str = "sentencepiece",
    tfds_data_dir: str | None = None,
    policies: Sequence[str] = (),
    heuristic_sl_max: int = 8,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
) -> list[dict[str, Any]]:
    """Evaluates drafts (Hugging Face directories) against a target over eval sets and a grid.

    Appends one record per (eval set, draft, gamma, temperature) to OUTPUT_DIR/records.jsonl
    (none if gammas is empty), and with `policies` one record per (eval set, draft, policy):
    the lookahead policy axis, timed at batch 1 (see `evaluate_policies`; the tuned policies
    read `<draft>/disco/`, written by python -m distillspec.disco). Then writes table.md,
    table.csv, tau_vs_gamma.png (and disco_table.md, oracle_sl_hist.png) and prints the tables.
    """
    from distillspec import disco, tables
    from distillspec.models import from_pretrained

    if not gammas and not policies:
        raise ValueError("nothing to evaluate: gammas and policies are both empty")
    resolve_policies(
        [p for p in policies if p not in TUNED_POLICIES], heuristic_sl_max=heuristic_sl_max,
        heuristic_start=heuristic_start, oracle_sl_max=oracle_sl_max,
    )  # fmt: skip  # Bad names and values fail before anything is loaded.
    vocab, target, target_params = open_run(
        "evaluate", output_dir, target_checkpoint, drafts, vocabulary, tfds_data_dir
    )
    models = {name: from_pretrained(path) for name, path in drafts.items()}
    records_path = os.path.join(output_dir, "records.jsonl")
    sets = _prompt_sets(eval_sets, task_feature_lengths, num_prompts, batch_size)
    records = []
    for (task, split), batches in sets.items() if gammas else ():
        new = evaluate_drafts(
            target, target_params, models, batches, gammas=gammas, temperatures=temperatures,
            max_new_tokens=task_feature_lengths["targets"], eos_id=vocab.eos_id, seed=seed,
            task=task, split=split, timing_repeats=timing_repeats,
        )  # fmt: skip
        append_records(records_path, new)
        records += new
    if policies:
        with_classifiers = {}
        for name, (draft, draft_params) in models.items():
            classifier = tuning = None
            if any(p in TUNED_POLICIES for p in policies):
                classifier, metadata = disco.load_classifier(
                    disco.classifier_dir(drafts[name]), draft, draft_params
                )
                tuning = metadata.get("tuning")
            with_classifiers[name] = (draft, draft_params, classifier, tuning)
        records += evaluate_policies(
            target, target_params, with_classifiers, sets, policies, num_prompts=num_prompts,
            max_new_tokens=task_feature_lengths["targets"], eos_id=vocab.eos_id,
            records_path=records_path, timing_repeats=timing_repeats,
            heuristic_sl_max=heuristic_sl_max, heuristic_start=heuristic_start,
            oracle_sl_max=oracle_sl_max,
        )  # fmt: skip
    print(tables.format_report(records_path, output_dir))
    return records


def main(argv: Sequence[str] | None = None) -> None:
    from distillspec import gin_setup

    gin_setup.parse_command_line(list(argv if argv is not None else sys.argv[1:]), "evaluate")
    gin_setup.run_function("evaluate")()


if __name__ == "__main__":
    main()
