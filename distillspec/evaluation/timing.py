"""Timing: one interleaved timer for everything that times, model call costs and the cost model.

Every measurement of this project follows GUIDE.md §4: candidates run in turn (A, B, A, B, ...)
so that a slower stretch of a shared machine hits them alike, compilation is excluded, results
are on the host before the clock is read (the decoders return host arrays), and medians count.

  interleaved         runs {name: fn} in turn `repeats` times; per-name results and seconds.
  interleaved_items   the same over a list of inputs (prompt batches, batch-1 prompts): one
                      untimed warm-up per compiled shape, then per-input medians, summed.
  step_timer          seconds per model call inside a jitted loop (prefill and dispatch cancel).
  round_timer         seconds per speculative round's model calls (gamma draft steps, then the
                      target scoring gamma + 1 positions) inside a jitted loop alternating them,
                      so the draft runs with the target's weights passing through the caches.
  decoder_round_timer seconds per round of the speculative decoder itself (static gamma,
                      greedy): its model calls and its own work (selection, acceptance,
                      bookkeeping).
  measure_call_costs  ms per target call by width, per draft call (in the loop's context and
                      alone), and the loop's own work per plain step and per speculative round.
  modeled_latency_ms  ms per token of a decoding run from its counted calls and those costs.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from distillspec import lookahead as sl
from distillspec.decoding import fixed_round_decoder


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), seconds it took). fn must return host data (the decoders do: one device_get)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def interleaved(
    fns: Mapping[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, list[Any]], dict[str, list[float]]]:
    """Calls every fn once per repeat, in the mapping's order, `repeats` times.

    Returns:
      ({name: [result of each repeat]}, {name: [seconds of each repeat]}); callers take the
      median of the seconds (or of per-repeat ratios).
    """
    results: dict[str, list[Any]] = {name: [] for name in fns}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            result, t = timed(fn)
            results[name].append(result)
            seconds[name].append(t)
    return results, seconds


def interleaved_items(
    fns: Mapping[str, Callable[..., Any]],
    items: Sequence[tuple],
    repeats: int,
    shape_of: Callable[[tuple], Hashable],
    desc: str | None = None,
) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Times every fn on every input, interleaved input by input, compilation excluded.

    For each item, the first time its compiled shape (`shape_of(item)`) occurs every fn runs
    once untimed (the warm-up compiles it); then `interleaved` runs the fns on it `repeats`
    times in turn.

    Args:
      fns: {name: fn}; each is called as fn(*item) and must return host data.
      items: the inputs, e.g. (index, prompt batch) or (prompt, reference) tuples.
      shape_of: the key of an item's compiled program (e.g. its prompt shape).
      desc: with it, a progress bar of that name on stderr.

    Returns:
      ({name: [result of the last repeat per item]}, {name: sum over items of the median
      seconds}).
    """
    compiled: set[Hashable] = set()
    results: dict[str, list[Any]] = {name: [] for name in fns}
    seconds = dict.fromkeys(fns, 0.0)
    if desc is not None:
        items = tqdm(list(items), desc=desc, unit="prompt", file=sys.stderr, leave=False)
    for item in items:
        if shape_of(item) not in compiled:  # Compilation is excluded from the timings.
            for fn in fns.values():
                fn(*item)
            compiled.add(shape_of(item))
        calls = {name: functools.partial(fn, *item) for name, fn in fns.items()}
        runs, times = interleaved(calls, repeats)
        for name in fns:
            results[name].append(runs[name][-1])
            seconds[name] += statistics.median(times[name])
    return results, seconds


def megabytes(params: Any) -> float:
    """Size of a parameter pytree in MB (10^6 bytes)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1e6


def _cache_length(prompt_len: int, needed: int, max_new_tokens: int | None) -> int:
    """A timer's KV-cache length: room for its own calls, and at least a decoding run's of
    max_new_tokens (attention reads the whole fixed-length cache, so a call's cost grows with
    it: a timer with a shorter cache than the run it prices would price it too cheap)."""
    return prompt_len + max(needed, max_new_tokens or 0) + 1


def step_timer(model, params, prompts, lengths, tokens_per_call: int, calls: int,
               max_new_tokens: int | None = None):  # fmt: skip
    """A jitted loop of `calls` cache extensions of `tokens_per_call` tokens; returns a
    zero-argument timer giving seconds per call (compiled before it is returned). The cache is
    as long as a run of max_new_tokens would have (`_cache_length`)."""
    batch, prompt_len = prompts.shape
    cache_length = _cache_length(prompt_len, tokens_per_call * calls, max_new_tokens)

    @jax.jit
    def run(params, prompts, lengths, num_calls):
        cache, _, position = model.prefill(params, prompts, lengths, cache_length)
        tokens = jnp.ones((batch, tokens_per_call), jnp.int32)

        def body(i, carry):
            cache, total = carry
            logits, cache = model.extend(params, cache, tokens, position + i * tokens_per_call)
            return cache, total + logits[:, -1, 0]

        return jax.lax.fori_loop(0, num_calls, body, (cache, jnp.zeros((batch,))))[1]

    return _per_call_timer(lambda n: run(params, prompts, lengths, n), calls)


def _per_call_timer(run: Callable[[int], jax.Array], calls: int) -> Callable[[], float]:
    """A zero-argument timer of seconds per call of run(n), a jitted loop of n calls: the
    difference of a long and a short loop, so prefill and dispatch cancel out. Compiles first."""
    timer = _linear_timer(run, calls)
    return lambda: timer()[0]


def _linear_timer(run: Callable[[int], jax.Array], calls: int) -> Callable[[], tuple[float, float]]:
    """`_per_call_timer` that also gives what cancelled out: (seconds per call, seconds of a run
    outside its calls: prefill, dispatch, output), >= 0. Compiles first."""

    def timer() -> tuple[float, float]:
        times = []
        for n in (calls, 1):
            start = time.perf_counter()
            run(n).block_until_ready()
            times.append(time.perf_counter() - start)
        per_call = (times[0] - times[1]) / (calls - 1)
        return per_call, max(times[1] - per_call, 0.0)

    timer()  # Compiles.
    return timer


def round_timer(target, target_params, draft, draft_params, prompts, lengths, gamma: int,
                rounds: int, max_new_tokens: int | None = None):  # fmt: skip
    """A jitted loop of `rounds` speculative rounds' model calls, as `decoding._round` makes them
    at a static gamma: the draft scores 2 positions, then 1 for gamma - 1 steps, each fed the
    previous step's argmax; then the target scores the last token and the gamma drafts. Returns
    a zero-argument timer giving seconds per round (compiled before it is returned).

    Subtracting a `step_timer` of the target at width gamma + 1 leaves the draft's cost in the
    loop's context: its weights reloaded after every target call, not kept cache-hot by a loop
    of draft calls alone.
    """
    batch, prompt_len = prompts.shape
    cache_length = _cache_length(prompt_len, (gamma + 1) * rounds, max_new_tokens) + gamma
    argmax = lambda logits: jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]

    @jax.jit
    def run(target_params, draft_params, prompts, lengths, num_rounds):
        target_cache, _, position = target.prefill(target_params, prompts, lengths, cache_length)
        draft_cache, _, _ = draft.prefill(draft_params, prompts, lengths, cache_length)

        def body(i, carry):
            target_cache, draft_cache, last = carry
            start = position + i * (gamma + 1)
            fed = jnp.concatenate([last, last], axis=1)  # The round's first call scores 2.
            logits, draft_cache = draft.extend(
                draft_params, draft_cache, fed, jnp.maximum(start - 1, 0)
            )
            drafts = [argmax(logits)]
            for k in range(1, gamma):
                logits, draft_cache = draft.extend(draft_params, draft_cache, drafts[-1], start + k)
                drafts.append(argmax(logits))
            block = jnp.concatenate([last, *drafts], axis=1)
            logits, target_cache = target.extend(target_params, target_cache, block, start)
            return target_cache, draft_cache, argmax(logits)

        first = jnp.ones((batch, 1), jnp.int32)
        return jax.lax.fori_loop(0, num_rounds, body, (target_cache, draft_cache, first))[2]

    return _per_call_timer(lambda n: run(target_params, draft_params, prompts, lengths, n), rounds)


def decoder_round_timer(target, target_params, draft, draft_params, prompts, lengths,
                        gamma: int, rounds: int, max_new_tokens: int | None = None):  # fmt: skip
    """The decoder's own loop (`decoding.fixed_round_decoder`: greedy, static gamma, every round
    full; gamma 0 and draft None: plain) as a zero-argument timer of (seconds per round, seconds
    per run outside its rounds: prefill, dispatch, output), compiled before it is returned.

    Minus a `round_timer` of the same pair and gamma (plain: a target `step_timer`), the first
    leaves the loop's own work per round: what a round spends outside its model calls."""
    run = fixed_round_decoder(target, draft, gamma, rounds, max_new_tokens)
    return _linear_timer(lambda n: run(target_params, draft_params, prompts, lengths, n), rounds)


def measure_call_costs(
    target,
    target_params,
    draft,
    draft_params,
    prompt: tuple[np.ndarray, np.ndarray],
    widths: Iterable[int],
    *,
    max_new_tokens: int | None = None,
    repeats: int = 5,
) -> dict[str, Any]:
    """Measured milliseconds per model call at batch 1, for `modeled_latency_ms`.

    Returns:
      {'target': {w: one target call scoring w positions}, 'draft': {1: .., 2: ..} the draft
       step in the loop's context, 'draft_isolated': {1: .., 2: ..} timed in a loop of draft
       calls alone, 'round' / 'spec_round': the loop's own work per plain step / speculative
       round (a round of the decoder itself, `decoder_round_timer`, minus its model calls,
       >= 0), 'fixed': {'plain': .., 'spec': ..} a run's cost outside its rounds (prefill of
       the model(s), dispatch, output)}.
    Each figure is the median of `repeats` timings of a jitted loop of calls or rounds. The
    in-context draft step is (a round of gamma draft steps and the target's gamma + 1 wide
    call, `round_timer`, at gamma = the widest verify width - 1, at most 8) minus that target
    call, / gamma, medians of per-repeat differences: alone, the draft's weights stay cache-hot
    and a draft step looks several times cheaper than it is inside the decoding loop. The
    speculative loop's own work and fixed part are measured at that gamma and priced for every
    policy.
    """
    tokens, lengths = prompt

    def timed(timer):
        return [1e3 * timer() for _ in range(repeats)]

    widths = set(widths)
    # Rounds of the widest verify up to 9 (SL_max 8): an oracle's SL_max of 64 would time
    # rounds of 64 drafts, whose long caches and bookkeeping no typical round pays.
    gamma = min(max(widths | {2}), 9) - 1
    widths = sorted(widths | {1, 2, gamma + 1})
    n = max_new_tokens
    target_ms = {w: timed(step_timer(target, target_params, tokens, lengths, w, 16, n))
                 for w in widths}  # fmt: skip
    pair = (target, target_params, draft, draft_params, tokens, lengths, gamma, 16, n)
    rounds = timed(round_timer(*pair))
    in_context = statistics.median(
        max(r - v, 0.0) / gamma for r, v in zip(rounds, target_ms[gamma + 1])
    )
    isolated = {w: statistics.median(timed(step_timer(draft, draft_params, tokens, lengths, w,
                                                      16, n))) for w in (1, 2)}  # fmt: skip
    spec_timer = decoder_round_timer(*pair)
    plain_timer = decoder_round_timer(target, target_params, None, None, tokens, lengths, 0, 16, n)
    spec, plain = [spec_timer() for _ in range(repeats)], [plain_timer() for _ in range(repeats)]
    loop = lambda runs, calls: statistics.median(
        max(1e3 * run[0] - call, 0.0) for run, call in zip(runs, calls)
    )
    return {
        "target": {w: statistics.median(ms) for w, ms in target_ms.items()},
        "draft": {1: in_context, 2: in_context},
        "draft_isolated": isolated,
        "round": loop(plain, target_ms[1]),
        "spec_round": loop(spec, rounds),
        "fixed": {
            name: statistics.median(1e3 * run[1] for run in runs)
            for name, runs in (("plain", plain), ("spec", spec))
        },
    }


def modeled_latency_ms(
    policy: sl.Lookahead | None, sl_histogram: Sequence[int], draft_calls: int, tokens: int,
    costs: Mapping[str, Any], runs: int = 1,
) -> float:  # fmt: skip
    """ms per token of `runs` decoding runs from counted calls and measured costs
    (`measure_call_costs`).

    Each round costs the target call at the width the decoder used (`verify_widths`) plus the
    loop's own work per round ('spec_round' for speculative rounds where measured, else 'round',
    a plain step's); each draft call costs a draft step (the first of a round scores 2
    positions); each run costs its fixed part ('fixed', where measured: prefill, dispatch).
    Deterministic for greedy decoding, so it ranks policies without the timing noise of a
    shared machine; the measured latency is reported beside it.
    """
    widths = sl.verify_widths(policy) if policy else (1,)
    loop = costs.get("spec_round", costs["round"]) if policy else costs["round"]
    total = runs * costs.get("fixed", {}).get("spec" if policy else "plain", 0.0)
    for drafts, rounds in enumerate(sl_histogram):
        if rounds:
            width = min(w for w in widths if w >= drafts + 1)
            total += rounds * (costs["target"][width] + loop)
    if policy:
        rounds = int(np.sum(sl_histogram))
        total += rounds * costs["draft"][2] + (draft_calls - rounds) * costs["draft"][1]
    return total / max(tokens, 1)
