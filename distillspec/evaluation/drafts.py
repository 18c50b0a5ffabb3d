"""Evaluating draft models for speculative decoding: alpha, tau, tau_theory and speed-up.

For every (draft, gamma, temperature) of a grid, `evaluate_drafts` decodes the same prompts with
the plain target decoder and with the speculative decoder and returns one flat record:

  alpha      = accepted drafts / drafted tokens                 (over all valid prompt rows)
  tau        = generated tokens / target calls                  (block efficiency)
  alpha_ci95, tau_ci95: half-widths of 95% intervals over prompts: 1.96 x the standard error of
               the ratio over a bootstrap of the prompt rows (1,000 resamples, fixed seed)
  mean_tvd   = mean over the target's own continuations of TVD(p_target, q_draft), both processed
               with the record's temperature (T = 0: one-hot argmax, so TVD = [argmaxes differ])
  tau_theory = (1 - a^(gamma+1)) / (1 - a) with a = 1 - mean_tvd  (DistillSpec Fig. 3c)
  speedup    = (spec tokens / spec time) / (plain tokens / plain time), timed in this process,
               compilation excluded, plain and speculative calls interleaved batch by batch
               (per batch: one plain run, then every (draft, gamma) of the temperature):
               the batch *throughput* speed-up at the prompt batches' size.
  latency_ms, target_latency_ms: ms per generated token of speculative and plain decoding at
               batch 1 over the first `latency_prompts` valid prompts, one prompt at a time,
               interleaved prompt by prompt the same way, compilation excluded (None with
               latency_prompts 0); the target's figure is the same in a temperature's records
  latency_speedup = target_latency_ms / latency_ms: the batch-1 *latency* speed-up, the figure
               DistillSpec and DISCO report

Records go to `records.jsonl` (`distillspec.records.append_records`); `distillspec.tables`
formats them without JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import checks, datagen, heads, losses
from distillspec.checks import shared_vocab_size
from distillspec.decoding import DecodeResult, generate, speculative_generate
from distillspec.decoding.sampling import SamplingConfig, logits_to_probs
from distillspec.evaluation import costs as call_costs
from distillspec.evaluation.timing import interleaved_items
from distillspec.feature_converters import decodable, valid_rows
from distillspec.records import timing_warnings

RECORD_KEYS = (
    "draft",
    "gamma",
    "temperature",
    "alpha",
    "alpha_ci95",
    "tau",
    "tau_ci95",
    "tau_theory",
    "speedup",
    "latency_speedup",
    "latency_ms",
    "target_latency_ms",
    "latency_prompts",
    "num_prompts",
    "task",
    "split",
    "max_new_tokens",
    "tokens_per_s",
    "target_tokens_per_s",
    "mean_tvd",
    "c",
    "r_gamma",
    "speedup_ideal",
)


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """The (draft x gamma x temperature) grid of `evaluate_drafts` and how it is timed."""

    gammas: tuple[int, ...] = (3, 5, 7)  # Draft block sizes, each >= 1.
    temperatures: tuple[float, ...] = (0.0, 1.0)  # 0 = greedy, else softmax(logits / T).
    max_new_tokens: int = 64  # Tokens generated per prompt at most.
    timing_repeats: int = 1  # Interleaved (plain, spec) pairs timed per batch; medians summed.
    seed: int = 0  # Batch i samples with fold_in(PRNGKey(seed), i), plain and spec alike.
    latency_prompts: int | None = None  # Prompts timed at batch 1; None = all, 0 = none.
    # Also record each prompt's tau ('tau_per_prompt', a list) and its counts ('accepted',
    # 'drafted', 'lengths', 'target_calls' + '_per_prompt'), e.g. for intervals of differences.
    per_prompt: bool = False

    def __post_init__(self):
        object.__setattr__(self, "gammas", tuple(checks.check_int_list("gammas", self.gammas)))
        temperatures = tuple(self.temperatures)
        if not temperatures or any(not (float(t) >= 0) for t in temperatures):
            raise ValueError(
                f"temperatures must be a non-empty list of values >= 0, got {list(temperatures)}"
            )
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temperatures))
        checks.check_int("max_new_tokens", self.max_new_tokens)
        checks.check_int("timing_repeats", self.timing_repeats)
        checks.check_int("seed", self.seed, minimum=0)
        if self.latency_prompts is not None:
            checks.check_int("latency_prompts", self.latency_prompts, minimum=0)


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


@functools.lru_cache(maxsize=32)
def _tvd_fn(target, draft, sampling: SamplingConfig, vocab_size: int | None):
    """Jitted (target_params, draft_params, batch, weights [B, L]) -> (tvd sum, weight sum)."""

    target_head, draft_head = heads.head_of(target), heads.head_of(draft)

    def tvd_sum(target_params, draft_params, batch, weights):  # Chunked: no [B, L, V] (`heads`).
        chunked = {"target": target_head.features(target_params, batch), "weights": weights}
        chunked["draft"] = draft_head.features(draft_params, batch)
        target_head_params, draft_head_params = (
            target_head.select(target_params), draft_head.select(draft_params)
        )  # fmt: skip

        def chunk(c):
            p = logits_to_probs(target_head.apply(target_head_params, c["target"]), sampling,
                                vocab_size)  # fmt: skip
            q = logits_to_probs(draft_head.apply(draft_head_params, c["draft"]), sampling,
                                vocab_size)  # fmt: skip
            return jnp.sum(losses.tvd_of_probs(p, q) * c["weights"]), jnp.sum(c["weights"])

        size = heads.chunk_positions(*weights.shape, None, target.vocab_size)
        return heads.map_chunks(chunk, chunked, size)

    return jax.jit(tvd_sum)


def check_same_family(target, draft, what: str = "the draft") -> None:
    """ValueError unless target and draft are both decoder-only or both encoder-decoder."""
    if target.encoder_decoder != draft.encoder_decoder:
        raise ValueError(
            f"{what} and the target must both be decoder-only or both encoder-decoder (T5-style)"
        )


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
    check_same_family(target, draft)
    fn = _tvd_fn(target, draft, sampling, vocab_size)
    total, count = 0.0, 0.0
    for batch, result in zip(batches, continuations):
        packed, weights = datagen.pack_teacher_forcing(
            target, batch["prompt_tokens"], batch["prompt_lengths"], result.tokens, result.lengths
        )
        weights = weights * valid_rows(batch)[:, None]
        s, c = jax.device_get(fn(target_params, draft_params, packed, weights))
        if not np.isfinite(s):  # NaN * 0 is NaN: padding rows cannot hide it.
            raise FloatingPointError(
                f"non-finite logits from the target or the draft (temperature "
                f"{sampling.temperature:g}, vocab_size {vocab_size}); a metric computed from "
                "them would be meaningless. Check the checkpoints' dtype and that every token "
                "id is inside both embeddings"
            )
        total, count = total + float(s), count + float(c)
    return total / count if count else float("nan")


# --------------------------------------------------------------------------------------------
# Input checks.
# --------------------------------------------------------------------------------------------


def check_drafts(target, drafts: Mapping[str, Any], vocab_size: int | None) -> None:
    """ValueError unless drafts is {name: (model, params)} of models the target can verify."""
    if not drafts:
        raise ValueError("drafts is empty: pass {name: (model, params)} with at least one draft")
    for name, entry in drafts.items():
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            raise ValueError(f"drafts[{name!r}] must be a (model, params) pair, got {type(entry)}")
        try:  # The decoders' own check, run for every draft before anything is decoded.
            shared_vocab_size(target, entry[0], vocab_size)
        except ValueError as e:
            raise ValueError(f"drafts[{name!r}]: {e}") from None
        check_same_family(target, entry[0], f"drafts[{name!r}]")


def check_prompts(prompts: Sequence[Mapping[str, np.ndarray]]) -> None:
    """ValueError unless prompts is a non-empty list of prompt batches with a valid row."""
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt batch")
    for i, batch in enumerate(prompts):
        if "prompt_tokens" not in batch or "prompt_lengths" not in batch:
            raise ValueError(f"prompts[{i}] lacks 'prompt_tokens' / 'prompt_lengths'")
    if not any(valid_rows(b).any() for b in prompts):
        raise ValueError("prompts holds no valid rows (every row has valid=False)")


# --------------------------------------------------------------------------------------------
# The evaluation loop.
# --------------------------------------------------------------------------------------------


def _batch_shape(item: tuple) -> tuple[int, ...]:
    """The compiled shape of an (index, prompt batch) item: its prompt tokens' [B, P]."""
    return np.shape(item[1]["prompt_tokens"])


_PLAIN = object()  # The plain decoder's key among the speculative ones' in `_measure_many`.


def _measure(plain_fn, spec_fn, batches, timing_repeats: int):
    """Runs both decoders on every batch: warm-up per distinct shape (not timed), then
    timing_repeats interleaved (plain, spec) pairs per batch; per-batch median times.

    Returns (plain results, spec results, plain seconds, spec seconds).
    """
    plain, spec, t_plain, t_spec = _measure_many(plain_fn, {0: spec_fn}, batches, timing_repeats)
    return plain, spec[0], t_plain, t_spec[0]


def _measure_many(plain_fn, spec_fns: Mapping, batches, timing_repeats: int):
    """`_measure` of one plain decoder against several speculative ones {key: fn}: on every
    batch the plain decoder runs once, then each speculative one, so every ratio to the plain
    time is still measured side by side while the plain decoding (the same for all of them)
    runs once per batch instead of once per speculative decoder.

    Returns (plain results, {key: spec results}, plain seconds, {key: spec seconds}).
    """
    results, seconds = interleaved_items(
        {_PLAIN: plain_fn, **spec_fns}, list(enumerate(batches)), timing_repeats, _batch_shape
    )
    return (
        results[_PLAIN], {k: results[k] for k in spec_fns}, seconds[_PLAIN],
        {k: seconds[k] for k in spec_fns},
    )  # fmt: skip


def latency_batches(batches, latency_prompts: int | None) -> list[dict[str, np.ndarray]]:
    """The first `latency_prompts` valid rows of prompt batches (None = all) as batch-1
    prompt batches ('prompt_tokens' [1, P], 'prompt_lengths' [1], and the row of every other
    per-row array, e.g. the reference completion) for `_measure`."""
    singles = []
    for batch in batches:
        rows = np.shape(batch["prompt_tokens"])[0]
        for row in np.flatnonzero(valid_rows(batch)):
            singles.append({
                key: np.asarray(value)[row : row + 1]
                for key, value in batch.items()
                if key != "valid" and np.ndim(value) and np.shape(value)[0] == rows
            })  # fmt: skip
    return singles[:latency_prompts]


def batch1_latency(plain_fn, spec_fn, singles, timing_repeats: int):
    """Batch-1 runs of both decoders, interleaved prompt by prompt, compilation excluded.

    Returns:
      (fields, plain results, spec results): fields are latency_ms, target_latency_ms (ms per
      generated token), latency_speedup and latency_prompts (all None without prompts).
    """
    fields, plain, spec = batch1_latencies(plain_fn, {0: spec_fn}, singles, timing_repeats)
    return fields[0], plain, spec[0]


def batch1_latencies(plain_fn, spec_fns: Mapping, singles, timing_repeats: int):
    """`batch1_latency` of one plain decoder against several speculative ones {key: fn}, the
    plain one run once per prompt (`_measure_many`). Returns ({key: fields}, plain results,
    {key: spec results})."""
    if not singles:
        fields = dict(
            latency_speedup=None, latency_ms=None, target_latency_ms=None, latency_prompts=0
        )
        return {k: dict(fields) for k in spec_fns}, [], {k: [] for k in spec_fns}
    plain, spec, t_plain, t_spec = _measure_many(plain_fn, spec_fns, singles, timing_repeats)
    count = lambda results: max(sum(int(np.sum(r.lengths)) for r in results), 1)
    target_latency = 1e3 * t_plain / count(plain)
    fields = {}
    for key in spec_fns:
        latency = 1e3 * t_spec[key] / count(spec[key])
        fields[key] = {
            "latency_speedup": target_latency / max(latency, 1e-12),
            "latency_ms": latency,
            "target_latency_ms": target_latency,
            "latency_prompts": len(singles),
        }
    return fields, plain, spec


def plain_call(target, params, base_rng, sampling, kwargs, index: int, batch) -> DecodeResult:
    """Plain decoding of prompt batch `index` (its sampling key is fold_in(base_rng, index))."""
    rng = jax.random.fold_in(base_rng, index)
    return generate(
        target, params, batch["prompt_tokens"], batch["prompt_lengths"], rng,
        sampling=sampling, **kwargs,
    )  # fmt: skip


def spec_call(
    target, draft, target_params, draft_params, base_rng, sampling, kwargs, index: int, batch
) -> DecodeResult:
    """Speculative decoding of prompt batch `index`, with the same key as `plain_call`."""
    rng = jax.random.fold_in(base_rng, index)
    return speculative_generate(
        target, draft, target_params, draft_params, batch["prompt_tokens"],
        batch["prompt_lengths"], rng, sampling=sampling, **kwargs,
    )  # fmt: skip


def _valid_rows(results: Sequence[DecodeResult], field: str, batches) -> np.ndarray:
    """A DecodeResult counter of every valid row of all batches, [R] float64."""
    return np.concatenate(
        [
            np.asarray(getattr(r, field), np.float64)[valid_rows(b) > 0]
            for r, b in zip(results, batches)
        ]
    )


def _valid_sum(results: Sequence[DecodeResult], field: str, batches) -> float:
    """Sum of a DecodeResult counter over the valid rows of all batches."""
    return float(np.sum(_valid_rows(results, field, batches)))


def bootstrap_ci95(
    numerators: np.ndarray, denominators: np.ndarray, resamples: int = 1000, seed: int = 0
) -> float:
    """Half-width of a 95% interval of sum(numerators) / sum(denominators) over rows [R]:
    1.96 x the standard deviation of the ratio over `resamples` resamplings of the rows with
    replacement (0 for a single row: one prompt gives no spread)."""
    numerators, denominators = np.asarray(numerators), np.asarray(denominators)
    if len(numerators) < 2:
        return 0.0
    picks = np.random.default_rng(seed).integers(0, len(numerators), (resamples, len(numerators)))
    ratios = numerators[picks].sum(1) / np.maximum(denominators[picks].sum(1), 1.0)
    return float(1.96 * np.std(ratios))


def bootstrap_difference(a, b, confidence: float = 0.9, resamples: int = 2000, seed: int = 0):
    """An interval of sum(a_num) / sum(a_den) - sum(b_num) / sum(b_den) for paired rows (the same
    prompts decoded two ways; a and b are (numerators [R], denominators [R])): the percentiles
    of the difference over `resamples` resamplings of the rows with replacement. Returns
    (low, high)."""
    (a_num, a_den), (b_num, b_den) = [(np.asarray(n), np.asarray(d)) for n, d in (a, b)]
    picks = np.random.default_rng(seed).integers(0, len(a_num), (resamples, len(a_num)))
    ratio = lambda n, d: n[picks].sum(1) / np.maximum(d[picks].sum(1), 1.0)
    diffs = ratio(a_num, a_den) - ratio(b_num, b_den)
    tail = 100 * (1 - confidence) / 2
    return float(np.percentile(diffs, tail)), float(np.percentile(diffs, 100 - tail))


def _record(plain, spec, t_plain, t_spec, batches, tvd: float, gamma: int) -> dict[str, Any]:
    """The measured part of one record (see the module docstring for the definitions)."""
    spec_tokens = _valid_sum(spec, "lengths", batches)
    drafted, accepted = _valid_sum(spec, "drafted", batches), _valid_sum(spec, "accepted", batches)
    tokens_per_s = spec_tokens / max(t_spec, 1e-12)
    target_tokens_per_s = _valid_sum(plain, "lengths", batches) / max(t_plain, 1e-12)
    rows = lambda field: _valid_rows(spec, field, batches)
    return {
        "alpha": accepted / max(drafted, 1.0),
        "alpha_ci95": bootstrap_ci95(rows("accepted"), rows("drafted")),
        "tau": spec_tokens / max(_valid_sum(spec, "target_calls", batches), 1.0),
        "tau_ci95": bootstrap_ci95(rows("lengths"), rows("target_calls")),
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
    grid: GridConfig,
    *,
    eos_id: int | None,
    task: str = "",
    split: str = "",
    vocab_size: int | None = None,
) -> list[dict[str, Any]]:
    """Speculative-decoding quality and speed of each draft against the target, over a grid.

    Args:
      target, target_params: the target model (a `ScoringModel`: it also has teacher-forced
        `logits`, for the TVD).
      drafts: {name: (model, params)}, e.g. {'standard': ..., 'distilled': ...}.
      prompts: prompt batches as yielded by `feature_converters.prompt_batches` ('prompt_tokens'
        [B, P], 'prompt_lengths' [B], optional 'valid' [B]; rows with valid=False are decoded
        for shape's sake but not counted).
      grid: gammas, temperatures, max_new_tokens, timing, the sampling seed and how many
        prompts are also timed one at a time (batch-1 latency).
      eos_id: a row stops after this id; None = always max_new_tokens.
      task, split: context copied into the records.
      vocab_size: shared tokenizer size when the embeddings are padded differently.

    Returns:
      One record per (draft, gamma, temperature), with the keys of `RECORD_KEYS`.
    """
    prompts = list(prompts)
    check_drafts(target, drafts, vocab_size)
    check_prompts(prompts)
    batches = [decodable(b) for b in prompts if valid_rows(b).any()]
    base_rng = jax.random.PRNGKey(grid.seed)
    common = dict(max_new_tokens=grid.max_new_tokens, eos_id=eos_id, vocab_size=vocab_size)
    singles = latency_batches(batches, grid.latency_prompts)
    records = []
    costs = call_costs.measure_drafts(
        target, target_params, drafts, batches[0]["prompt_tokens"],
        batches[0]["prompt_lengths"], grid.gammas, grid.max_new_tokens,
    )  # fmt: skip
    total = len(drafts) * len(grid.gammas) * len(grid.temperatures)
    for temperature in grid.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        plain_fn = functools.partial(plain_call, target, target_params, base_rng, sampling, common)
        spec_fns = {
            (name, gamma): functools.partial(
                spec_call, target, draft, target_params, draft_params, base_rng, sampling,
                dict(common, gamma=gamma),
            )
            for name, (draft, draft_params) in drafts.items()
            for gamma in grid.gammas
        }  # fmt: skip
        # Every configuration of this temperature side by side with one plain decoding per batch
        # (and per batch-1 prompt): the plain decoder's output and time are the same for all.
        print(
            f"[evaluate] T={temperature:g}: decoding {len(spec_fns)} configurations "
            f"({len(drafts)} drafts x {len(grid.gammas)} gammas) beside the plain target on "
            f"{len(batches)} batches, then {len(singles)} prompts at batch 1",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        plain, specs, t_plain, t_specs = _measure_many(
            plain_fn, spec_fns, batches, grid.timing_repeats
        )
        latencies = batch1_latencies(plain_fn, spec_fns, singles, grid.timing_repeats)[0]
        tvds = {  # Along the target's own outputs: depends on neither gamma nor timing.
            name: mean_tvd(target, target_params, draft, draft_params, batches, plain, sampling,
                           vocab_size)
            for name, (draft, draft_params) in drafts.items()
        }  # fmt: skip
        for (name, gamma), spec in specs.items():
            record = _record(plain, spec, t_plain, t_specs[name, gamma], batches, tvds[name], gamma)
            record.update(latencies[name, gamma])
            record = {"draft": name, "gamma": gamma, "temperature": temperature, **record}
            c, r_gamma = costs[name]["c"], costs[name]["r_gamma"][gamma]
            ideal = call_costs.ideal_speedup(record["tau"], gamma, c, r_gamma)
            record.update(c=c, r_gamma=r_gamma, speedup_ideal=ideal)
            record.update(task=task, split=split, max_new_tokens=grid.max_new_tokens)
            record = {key: record[key] for key in RECORD_KEYS}  # Fixed key order.
            if grid.per_prompt:
                tokens = _valid_rows(spec, "lengths", batches)
                calls = _valid_rows(spec, "target_calls", batches)
                record["tau_per_prompt"] = (tokens / np.maximum(calls, 1.0)).tolist()
                for field in ("accepted", "drafted", "lengths", "target_calls"):  # For intervals.
                    record[f"{field}_per_prompt"] = _valid_rows(spec, field, batches).tolist()
            records.append(record)
            _report_progress(record, len(records), total, np.shape(batches[0]["prompt_tokens"])[0])
    for warning in timing_warnings(records):
        print(f"[evaluate] warning: {warning}", file=sys.stderr, flush=True)
    for name in drafts:
        taus = {}
        for r in records:
            if r["draft"] == name:
                taus[r["gamma"]] = max(taus.get(r["gamma"], 0.0), r["tau"])
        print(f"[evaluate] {call_costs.verdict(name, costs[name], taus)}", file=sys.stderr)
    return records


def _report_progress(record: Mapping[str, Any], done: int, total: int, batch: int) -> None:
    """One line per configuration: batch-1 latency speed-up first (what one user waits), then
    the throughput speed-up on batches of `batch` prompts."""
    latency = record["latency_speedup"]
    print(
        f"[evaluate {done}/{total}] draft={record['draft']} gamma={record['gamma']} "
        f"T={record['temperature']:g}: alpha={record['alpha']:.3f} tau={record['tau']:.3f} "
        f"tau_theory={record['tau_theory']:.3f} | speed-up: batch-1 latency "
        + ("not measured" if latency is None else f"{latency:.2f}x")
        + f", throughput at batch {batch} {record['speedup']:.2f}x",
        file=sys.stderr,
        flush=True,
    )
