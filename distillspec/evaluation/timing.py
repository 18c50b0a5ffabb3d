"""Timing: one interleaved timer for everything that times, model call costs and the cost model.

Every measurement of this project follows GUIDE.md §4: candidates run in turn (A, B, A, B, ...)
so that a slower stretch of a shared machine hits them alike, compilation is excluded, results
are on the host before the clock is read (the decoders return host arrays), and medians count.

  interleaved         runs {name: fn} in turn `repeats` times; per-name results and seconds.
  until_timed         a measurement again, up to 3 times, while a busy machine timed a cost <= 0.
  repeats_interval    a bootstrap interval of figures computed from interleaved repeats.
  interleaved_items   the same over a list of inputs (prompt batches, batch-1 prompts): one
                      untimed warm-up per compiled shape, then per-input medians, summed.
  step_timer          seconds per model call inside a jitted loop (prefill and dispatch cancel).
  round_timer         seconds per speculative round's model calls (gamma draft steps, then the
                      target scoring gamma + 1 positions) inside a jitted loop alternating them,
                      so the draft runs with the target's weights passing through the caches.
  decoder_round_timers seconds per round of the decoder itself (greedy, any policy's program,
                      one compile for its rounds of every size): its model calls and its own
                      work (selection, acceptance, bookkeeping, a dynamic draft loop's stops,
                      the verify-width switch).
  call_cost_timers    all the timers the cost model needs for a set of policies; run them
  call_costs          interleaved (`interleaved`) and these are the costs in ms:
  measure_call_costs  ms per target call by width, per draft call (in the loop's context and
                      alone), and each program's own work per round and per draft call.
  modeled_latency_ms  ms per token of a decoding run from its counted calls and those costs.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from distillspec.decoding import lookahead as sl
from distillspec.decoding.fixed_rounds import fixed_round_decoder, fixed_round_tokens


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), seconds it took). fn must return host data (the decoders do: one device_get).
    The garbage collector is off meanwhile (as in `timeit`): a collection landing in one
    millisecond-long call would add its pause to that call alone."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()


def until_timed(measure: Callable[[], Any], untimed: Callable[[Any], list[str]],
                attempts: int = 3) -> tuple[Any, list[str]]:  # fmt: skip
    """measure() again, up to `attempts` times in all, while untimed(result) names costs that
    came out <= 0 (a per-call difference of two timers under a busy machine's noise): the last
    result and the names it left untimed (empty when timed), for the caller to refuse."""
    for _ in range(attempts):
        result = measure()
        missing = untimed(result)
        if not missing:
            break
    return result, missing


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


def repeats_interval(
    figures: Callable[[Sequence[int]], Sequence[float]], repeats: int, confidence: float = 0.9
) -> np.ndarray:
    """[2, K] low and high ends of a percentile-bootstrap interval of the K figures that
    figures(indices) computes from the `interleaved` repeats at those indices (whole repeats are
    resampled, so the timings taken side by side stay together; `scipy.stats.bootstrap`, 1,000
    resamples, a fixed seed so the same timings give the same interval).

    A median over a few repeats of a shared machine moves by tens of percent between runs (on
    the 2-core VM one timing of a 10 ms call spreads by +-15%); the interval says how far a
    figure can be trusted, and what differences between figures are real."""
    import scipy.stats  # Deferred: only benchmarks need it.

    result = scipy.stats.bootstrap(
        (np.arange(repeats),), lambda i: np.asarray(figures(i), float), vectorized=False,
        n_resamples=1000, confidence_level=confidence, method="percentile", random_state=0,
    )  # fmt: skip
    return np.array([result.confidence_interval.low, result.confidence_interval.high])


def interleaved_items(
    fns: Mapping[str, Callable[..., Any]],
    items: Sequence[tuple],
    repeats: int,
    shape_of: Callable[[tuple], Hashable],
    desc: str | None = None,
    per_item: bool = False,
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Times every fn on every input, interleaved input by input, compilation excluded.

    For each item, the first time its compiled shape (`shape_of(item)`) occurs every fn runs
    once untimed (the warm-up compiles it); then `interleaved` runs the fns on it `repeats`
    times in turn.

    Args:
      fns: {name: fn}; each is called as fn(*item) and must return host data.
      items: the inputs, e.g. (index, prompt batch) or (prompt, reference) tuples.
      shape_of: the key of an item's compiled program (e.g. its prompt shape).
      desc: with it, a progress bar of that name on stderr.
      per_item: give each fn's median seconds per item (a list) instead of their sum (for
        intervals over the items).

    Returns:
      ({name: [result of the last repeat per item]}, {name: sum over items of the median
      seconds, or with per_item their list}).
    """
    compiled: set[Hashable] = set()
    results: dict[str, list[Any]] = {name: [] for name in fns}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
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
            seconds[name].append(statistics.median(times[name]))
    return results, seconds if per_item else {name: sum(s) for name, s in seconds.items()}


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
    """A jitted loop of `calls` cache extensions of `tokens_per_call` tokens, each call's
    logits consumed at every position (`_every_argmax`); returns a zero-argument timer giving
    seconds per call (compiled before it is returned). The cache is as long as a run of
    max_new_tokens would have (`_cache_length`)."""
    batch, prompt_len = prompts.shape
    cache_length = _cache_length(prompt_len, tokens_per_call * calls, max_new_tokens)

    @jax.jit
    def run(params, prompts, lengths, num_calls):
        cache, _, position = model.prefill(params, prompts, lengths, cache_length)
        tokens = jnp.ones((batch, tokens_per_call), jnp.int32)

        def body(i, carry):
            cache, total = carry
            logits, cache = model.extend(params, cache, tokens, position + i * tokens_per_call)
            return cache, total + _every_argmax(logits)

        return jax.lax.fori_loop(0, num_calls, body, (cache, jnp.zeros((batch,), jnp.int32)))[1]

    return _per_call_timer(lambda n: run(params, prompts, lengths, n), calls)


def _every_argmax(logits: jax.Array) -> jax.Array:
    """[B] sum of the argmax of every position of logits [B, W, V]: a timed call's output
    consumed as greedy verification consumes it. Were one logit read, XLA would slice the LM
    head's matmul down to it (measured: a reference-pair target call timed 13% cheap, the rest
    then showing up as the decoder's own work)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32).sum(axis=-1)


def _per_call_timer(run: Callable[[int], jax.Array], calls: int) -> Callable[[], float]:
    """A zero-argument timer of seconds per call of run(n), a jitted loop of n calls: the
    difference of a long and a short loop, so prefill and dispatch cancel out. Compiles first."""
    timer = _linear_timer(run, calls)
    return lambda: timer()[0]


def _linear_timer(run: Callable[[int], jax.Array], calls: int) -> Callable[[], tuple[float, float]]:
    """`_per_call_timer` that also gives what cancelled out: (seconds per call, seconds of a run
    outside its calls: prefill, dispatch, output), >= 0. Compiles first.

    A run started after other programs pays a cold start (on a 2-core CPU ~0.3 ms for the
    quickstart pair: weights and caches out of the CPU's caches), as each run of an interleaved
    evaluation does. So a short run is timed first, cold, for the run's outside part; per call is
    the difference of a long and a short run timed after it, warm (a cold long run would put the
    cold start into every call: 6% too much per round of 8 drafts, timed over 7 rounds)."""

    def timer() -> tuple[float, float]:
        times = []
        for n in (1, calls, 1):
            start = time.perf_counter()
            run(n).block_until_ready()
            times.append(time.perf_counter() - start)
        per_call = (times[1] - times[2]) / (calls - 1)
        return per_call, max(times[0] - per_call, 0.0)

    timer()  # Compiles.
    return timer


def round_timer(target, target_params, draft, draft_params, prompts, lengths, gamma: int,
                rounds: int, max_new_tokens: int | None = None):  # fmt: skip
    """A jitted loop of `rounds` speculative rounds' model calls, as `loop._round` makes them
    at a static gamma: the draft scores 2 positions, then 1 for gamma - 1 steps, each fed the
    previous step's argmax; then the target scores the last token and the gamma drafts, every
    position's argmax taken (`_every_argmax`) as greedy verification takes them. Returns
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
            target_cache, draft_cache, last, total = carry
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
            return target_cache, draft_cache, argmax(logits), total + _every_argmax(logits)

        carry = (target_cache, draft_cache, jnp.ones((batch, 1), jnp.int32),
                 jnp.zeros((batch,), jnp.int32))  # fmt: skip
        return jax.lax.fori_loop(0, num_rounds, body, carry)[3]

    return _per_call_timer(lambda n: run(target_params, draft_params, prompts, lengths, n), rounds)


def rounds_within(max_new_tokens: int | None, tokens_per_round: int, most: int = 16) -> int:
    """How many calls or rounds a timer loops over: as many as a run of max_new_tokens holds
    (its caches then are the run's length), 2 to `most`."""
    if not max_new_tokens:
        return most
    return int(np.clip(max_new_tokens // tokens_per_round, 2, most))


def program_key(policy: sl.Lookahead | None) -> str:
    """The cost model's name of a policy's compiled loop: 'plain', 'static' (every SL-k), or
    '<kind>-<sl_max>' (a dynamic policy's draft loop and verify-width switch; the cumulative
    rule's '<kind>-<source>-<sl_max>': its sources are different programs)."""
    if policy is None:
        return "plain"
    if policy.kind == "static":
        return "static"
    source = f"-{policy.source}" if policy.source else ""
    return f"{policy.kind}{source}-{policy.sl_max}"


def _verify_width(policy: sl.Lookahead | None, drafts: int) -> int:
    """The target call width a round of this many drafts uses (`lookahead.verify_widths`)."""
    widths = sl.verify_widths(policy) if policy else (1,)
    return min(w for w in widths if w >= drafts + 1)


def decoder_round_timers(target, target_params, draft, draft_params, prompts, lengths,
                         policy: sl.Lookahead | None, max_new_tokens: int | None = None,
                         classifier=None, schedules: Sequence[tuple[int, ...]] = ((0,),),
                         vocab_size: int | None = None, sampling=None):  # fmt: skip
    """The decoder's own loop (`fixed_rounds.fixed_round_decoder`, greedy unless `sampling`; policy
    None and draft None: plain), one compiled program, timed per schedule of round sizes (a dynamic
    policy's, `fixed_round_decoder`'s drafts; (0,): its own rule, held). Per schedule: a
    zero-argument timer of (seconds per round, seconds per run outside its rounds: prefill,
    dispatch, output), compiled before it is returned; and what one round does: {'draft_calls':
    draft calls, 'verify': {width: target calls}, 'switches': verify-width switches} (the busiest
    row's). The caches are as long as a run of max_new_tokens has (every schedule's rounds within
    them).

    Minus its rounds' model calls (a `round_timer`, a target `step_timer` per width), the first
    leaves the loop's own work per round: what a round spends outside its model calls."""
    rounds = [rounds_within(max_new_tokens, fixed_round_tokens(policy, s)) for s in schedules]
    room = max([max_new_tokens or 0] + [n * fixed_round_tokens(policy, s)
                                        for n, s in zip(rounds, schedules)])  # fmt: skip
    run = fixed_round_decoder(target, draft, policy, room, vocab_size,
                              math.lcm(*(len(s) for s in schedules)), sampling)  # fmt: skip

    def timed(n, drafts):
        call = functools.partial(run, target_params, draft_params, prompts, lengths,
                                 classifier=classifier, drafts=drafts)  # fmt: skip
        counts = [jax.device_get(call(k)) for k in (n, 1)]
        row = int(np.argmax(counts[0]["draft_calls"]))
        per_round = lambda name: (counts[0][name][row] - counts[1][name][row]) / (n - 1)
        verify = {}
        if policy is not None:
            for proposed, share in enumerate(per_round("sl_histogram")):
                if share:
                    width = _verify_width(policy, proposed)
                    verify[width] = verify.get(width, 0.0) + float(share)
        calls = {"draft_calls": float(per_round("draft_calls")), "verify": verify or {1: 1.0},
                 "switches": float(per_round("width_switches"))}  # fmt: skip
        return _linear_timer(lambda k: call(k)["lengths"], n), calls

    return [timed(n, drafts) for n, drafts in zip(rounds, schedules)]


def call_cost_timers(
    target, target_params, draft, draft_params, prompt, policies: Iterable[sl.Lookahead], *,
    classifier=None, max_new_tokens: int | None = None, vocab_size: int | None = None,
) -> tuple[dict[tuple, Callable[[], Any]], dict[str, dict], int]:  # fmt: skip
    """The timers behind the cost model of these policies, to be run interleaved.

    Returns:
      ({name: zero-argument timer}, {program: its round's calls}, gamma): ('target', w) a
      target call scoring w positions for every verify width; ('draft', 1|2) a draft call alone;
      ('round', 1|gamma) a static round's model calls (`round_timer`); ('decoder', program) the
      decoder's own rounds (`decoder_round_timers`) of 'plain', 'static-<k>' for k = 1, gamma
      and every static policy's, each dynamic policy's program (`program_key`), and when
      m = min(gamma, sl_max) > 1 that program's rounds of m drafts ('<program>/<m>') and of 1
      and m drafts in turn ('<program>/1,<m>'): with its rounds forced to one draft ('<program>';
      not its rule's own rounds: the heuristic's would draft and switch as the 1,m rounds do,
      leaving the fit singular) they price its own work per round, per draft and per switch.
      gamma is the widest verify width - 1, at most 8: an oracle's SL_max of 64 would time
      rounds no typical round pays.
    vocab_size: the vocabulary both decode over, as in `decoding.speculative_generate`.
    """
    tokens, lengths = prompt
    policies = list(policies)
    widths = {w for p in policies for w in sl.verify_widths(p)}
    gamma = min(max(widths | {2}), 9) - 1
    n = max_new_tokens
    timers: dict[tuple, Callable[[], Any]] = {}
    for w in sorted(widths | {1, 2, gamma + 1}):
        timers["target", w] = step_timer(target, target_params, tokens, lengths, w,
                                         rounds_within(n, w), n)  # fmt: skip
    for w in (1, 2):
        timers["draft", w] = step_timer(draft, draft_params, tokens, lengths, w,
                                        rounds_within(n, w), n)  # fmt: skip
    for g in sorted({1, gamma}):
        timers["round", g] = round_timer(target, target_params, draft, draft_params, tokens,
                                         lengths, g, rounds_within(n, g + 1), n)  # fmt: skip
    programs = {"plain": (None, [(0,)])}
    for k in sorted({1, gamma} | {p.sl_max for p in policies if p.kind == "static"}):
        programs[f"static-{k}"] = (sl.Lookahead("static", k), [(0,)])
    for policy in policies:
        if policy.kind != "static":
            m = min(gamma, policy.sl_max)
            sized = [(m,), (1, m)] if m > 1 else []
            programs[program_key(policy)] = (policy.static_part, [(1,), *sized])
    calls = {}
    for key, (policy, schedules) in programs.items():
        models = (draft, draft_params) if policy is not None else (None, None)
        timed = decoder_round_timers(
            target, target_params, *models, tokens, lengths, policy, n,
            classifier if policy is not None and policy.uses_classifier else None, schedules,
            vocab_size,
        )  # fmt: skip
        for i, (drafts, (timer, round_calls)) in enumerate(zip(schedules, timed)):
            name = f"{key}/{','.join(map(str, drafts))}" if i else key  # The first: its base.
            timers["decoder", name], calls[name] = timer, round_calls
    return timers, calls, gamma


def in_context_draft(seconds: Mapping[tuple, Sequence[float]], gamma: int) -> list[float]:
    """Seconds per draft step in the loop's context, per repeat: (a static round of gamma draft
    steps and the target's gamma + 1 wide call) - that call, / gamma, >= 0 (on a tiny pair
    timing noise can make a round look cheaper than its verify). The round's first draft call
    scores 2 positions and the others 1; both widths are priced at this mean."""
    rounds, verify = seconds["round", gamma], seconds["target", gamma + 1]
    return [max(r - v, 0.0) / gamma for r, v in zip(rounds, verify)]


def call_costs(seconds: Mapping[tuple, Sequence[Any]], calls: Mapping[str, dict], gamma: int,
               average: Callable[[Sequence[float]], float] = statistics.median):  # fmt: skip
    """The cost model's milliseconds from interleaved runs of `call_cost_timers` (one entry per
    repeat under each name; the average (median, or mean) of per-repeat differences, so a slow
    stretch of the machine hits both sides of a difference alike). Average as the latencies
    they are set against are: medians of repeats, or `statistics.mean` for totals over prompts
    timed once each (a timing's slow spikes are in those totals, and a median leaves them out:
    on a 2-core VM the mean of a 0.3 ms call's timings is 3-7% above their median).

    Returns:
      {'target': {w: a target call scoring w positions}, 'draft': {2: a round's first draft
       call (it scores 2 positions), 1: each later one} in the loop's context (static rounds of
       1 and gamma drafts minus their verify calls), 'draft_isolated': {1: .., 2: ..} a draft call
       alone (its weights cache-hot: a lower bound), 'round': the plain loop's own work per
       step, 'per_draft': {program: its own work per draft call}, 'spec_round': {program: its
       own work per round besides per_draft}, 'switch': {program: its own work per switch of
       verify width (the lax.switch running another branch than the round before: measured
       ~10% of a small target call on a 2-core CPU)}, 'static_round': {k: a round of the
       static SL-k program as timed, model calls and own work together}, 'fixed': {program: a
       run's cost outside its rounds (prefill, dispatch, output)}}, programs as in
       `program_key` ('static': every SL-k).
    The static loop's per-draft and per-round work come from its rounds of 1 and of gamma
    drafts. A dynamic program's come from its own rounds (of one draft call, of m drafts, of
    1 and m in turn), each minus its model calls priced at these costs, fitted as per round +
    per draft x drafts + per switch x switches; so the draft loop's stopping rule and the
    width switch are in them (without the rounds of m: the static loop's per draft, no switch).
    These three terms may be negative: they calibrate as well as price, for calls priced apart
    can cost more than the same calls in the decoder's program (0.4-3.1 ms per round of 2 to 8
    drafts on the reference pair, rounds of 12.7-17.4 ms), and the fit then prices a dynamic
    program's rounds at their timed cost as a static program's are. They are floored only so
    that a draft call, a round and a round that switches width each cost >= 0. A static
    program whose timed round came out <= 0 (noise on a tiny pair) has no 'static_round'.
    """
    ms = lambda values: 1e3 * average(values)
    repeats = range(len(seconds["target", 1]))
    target = {w: s for (kind, w), s in seconds.items() if kind == "target"}
    # In the loop's context: a round's first draft call (it scores 2 positions), then the rest.
    first = [max(r - v, 0.0) for r, v in zip(seconds["round", 1], target[2])]
    later = first
    if gamma > 1:
        later = [max(r - v - f, 0.0) / (gamma - 1)
                 for r, v, f in zip(seconds["round", gamma], target[gamma + 1], first)]  # fmt: skip

    def own_work(key, model_calls):  # ms per round outside its calls, per repeat.
        return [1e3 * (seconds["decoder", key][i][0] - model_calls[i]) for i in repeats]

    def own_work_per_draft(wide, narrow, extra_drafts):  # Average difference per draft.
        return max(average([(w - n) / extra_drafts for w, n in zip(wide, narrow)]), 0.0)

    def round_calls(key):  # Seconds of a timed round's model calls, per repeat.
        c = calls[key]
        return [sum(k * target[w][i] for w, k in c["verify"].items())
                + first[i] + (c["draft_calls"] - 1) * later[i] for i in repeats]  # fmt: skip

    plain = own_work("plain", target[1])
    one = own_work("static-1", seconds["round", 1])
    full = own_work(f"static-{gamma}", seconds["round", gamma])
    per_draft = {"static": own_work_per_draft(full, one, gamma - 1) if gamma > 1 else 0.0}
    spec_round = {"static": max(average(one) - per_draft["static"], 0.0)}
    switch = {"static": 0.0}
    fixed = {"plain": ms([run[1] for run in seconds["decoder", "plain"]]),
             "static": ms([run[1] for run in seconds["decoder", f"static-{gamma}"]])}  # fmt: skip
    static_round = {int(k[7:]): ms([run[0] for run in seconds["decoder", k]])
                    for k in calls if k.startswith("static-")}  # fmt: skip
    # A timed round <= 0 is noise (a tiny pair's difference of a long and a short run under
    # load): such a program is priced from its calls instead.
    static_round = {k: v for k, v in static_round.items() if v > 0}
    target_ms = {w: ms(s) for w, s in sorted(target.items())}
    draft_ms = {1: ms(later), 2: ms(first)}
    cheapest_target, cheapest_draft = min(target_ms.values()), min(draft_ms.values())
    for key in [k for k in calls if k != "plain" and "/" not in k and not k.startswith("static-")]:
        timed_rounds = [key] + [k for k in calls if k.startswith(key + "/")]
        work = np.array([own_work(k, round_calls(k)) for k in timed_rounds])  # [rounds, repeats]
        done = np.array([[calls[k]["draft_calls"], calls[k]["switches"]] for k in timed_rounds])
        if len(timed_rounds) == 3:  # Per round + per draft x drafts + per switch x switches.
            terms = np.linalg.lstsq(np.c_[np.ones(3), done], work, rcond=None)[0][1:]
            draft_work, switch[key] = (float(average(t)) for t in terms)
            per_draft[key] = max(draft_work, -cheapest_draft)  # A draft call costs >= 0.
        else:  # Rounds of one draft call only: the static loop's work per draft.
            per_draft[key], switch[key] = per_draft["static"], 0.0
        held = work[0] - per_draft[key] * done[0, 0] - switch[key] * done[0, 1]
        spec_round[key] = max(float(average(held)), -cheapest_target)  # A round costs >= 0,
        switch[key] = max(switch[key], -cheapest_target - spec_round[key])  # switching or not.
        fixed[key] = ms([run[1] for run in seconds["decoder", key]])
    return {
        "target": target_ms,
        "draft": draft_ms,
        "draft_isolated": {w: ms(seconds["draft", w]) for w in (1, 2)},
        "round": max(average(plain), 0.0),
        "per_draft": per_draft,
        "spec_round": spec_round,
        "switch": switch,
        "static_round": static_round,
        "fixed": fixed,
    }


def measure_call_costs(
    target,
    target_params,
    draft,
    draft_params,
    prompt: tuple[np.ndarray, np.ndarray],
    policies: Iterable[sl.Lookahead],
    *,
    classifier=None,
    max_new_tokens: int | None = None,
    repeats: int = 25,
) -> dict[str, Any]:
    """Measured milliseconds per model call and per round of each policy's loop at the prompt's
    batch (1 for `modeled_latency_ms` of batch-1 runs): `call_cost_timers` run interleaved
    `repeats` times after one untimed pass (the first pass after compiling runs slow), then
    `call_costs`. classifier: DISCO's variables, for 'disco' policies. Sub-millisecond calls on
    a shared machine vary by tens of percent from one timing to the next, hence the repeats
    (a few seconds in all on small models)."""
    timers, calls, gamma = call_cost_timers(
        target, target_params, draft, draft_params, prompt, policies,
        classifier=classifier, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    interleaved(timers, 1)
    return call_costs(interleaved(timers, repeats)[0], calls, gamma)


def modeled_latency_ms(
    policy: sl.Lookahead | None, sl_histogram: Sequence[int], draft_calls: int, tokens: int,
    costs: Mapping[str, Any], runs: int = 1, switches: int = 0,
) -> float:  # fmt: skip
    """ms per token of `runs` decoding runs from counted calls and measured costs
    (`measure_call_costs`); switches: their rounds verified at another width than the round
    before (DecodeResult.width_switches).

    A static SL-k run whose program was timed (`call_cost_timers` times every static policy's)
    costs its rounds at that program's timed round ('static_round') plus the fixed part: priced
    from the target's calls timed apart, rounds of 3 to 8 drafts came out 10-20% dearer than
    the decoder's own on the quickstart pair (the same calls, compiled in another program).
    Otherwise each round costs the target call at the width the decoder used (`verify_widths`)
    plus its program's own work per round ('spec_round'; a plain step's: 'round'); each draft
    call costs a draft step (the first of a round scores 2 positions) plus the loop's own work
    per draft ('per_draft' of its program); each width switch its program's 'switch'; each run
    costs its program's fixed part ('fixed': prefill, dispatch).
    Deterministic for greedy decoding, so it ranks policies without the timing noise of a
    shared machine; the measured latency is reported beside it.
    """
    key = program_key(policy)
    if policy is not None and key not in costs["spec_round"]:
        raise ValueError(
            f"these call costs have no measurement of the {key!r} loop (they have "
            f"{sorted(costs['spec_round'])}): pass its policy to measure_call_costs"
        )
    loop = costs["spec_round"][key] if policy else costs["round"]
    total = runs * costs["fixed"][key]
    timed_round = costs.get("static_round", {}).get(policy.sl_max) if key == "static" else None
    if timed_round is not None:
        return (total + int(np.sum(sl_histogram)) * timed_round) / max(tokens, 1)
    for drafts, rounds in enumerate(sl_histogram):
        if rounds:
            total += rounds * (costs["target"][_verify_width(policy, drafts)] + loop)
    if policy:
        rounds = int(np.sum(sl_histogram))
        total += rounds * costs["draft"][2] + (draft_calls - rounds) * costs["draft"][1]
        total += draft_calls * costs["per_draft"][key]
    if switches:
        total += switches * costs["switch"][key]
    return total / max(tokens, 1)
