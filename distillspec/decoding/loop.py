"""Plain and speculative decoding in one jitted `lax.while_loop`.

Both decoders share one loop: a *round* feeds the target the last emitted token plus gamma drafts
(gamma = 0 for plain decoding) and emits 1 to gamma + 1 tokens per row. Everything has a fixed
shape; ragged progress is a per-row position, and dropping rejected drafts is moving that
position back (the models' caches never look past it, see `distillspec.models.base`).

The number of drafts per round is decided by a lookahead policy (`distillspec.decoding.lookahead`):
static (gamma drafts every round) or dynamic (DISCO's classifier, a confidence threshold,
SpecDec++'s cumulative rule, the heuristic schedule, the oracle). A dynamic round drafts in a
`lax.while_loop` that ends when every row has stopped or sl_max drafts are drawn; a row's drafts
past its own stop are masked out of verification, so the output is the target's exactly,
whatever the policy decides.

Greedy rounds carry tokens only (`acceptance.accept_greedy`): no [B, G, V] distributions and
no random draws, which were most of a small pair's round outside its calls (README section 3).

Per call the caller gets, per row, the tokens and the counters from which the acceptance rate
alpha = accepted / drafted and the block efficiency tau = tokens / target_calls derive, and the
histogram of drafts per round.

Recording (`record_top_k=k`, speculative only): the verify call computes the target's raw
distribution (before temperature, top-k/top-p) at every position a round emits a token from;
the decoder keeps its top k log-probabilities and ids per emitted token ([B, N, k]), training
data for the draft with no teacher pass (`distillspec.served`). Positions after a rejected draft
are not kept. If the raw logits of all emitted tokens fit in RECORD_LOGITS_BYTES, rounds copy
them and one top-k runs after the loop (cheaper than a top-k per round on small pairs); else
each round writes its top-k. Acceptance is untouched: outputs do not change.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import distillspec.decoding.lookahead as sl
from distillspec import checks
from distillspec.decoding.acceptance import Lenience, accept_greedy, accept_or_resample
from distillspec.decoding.lookahead import Lookahead
from distillspec.decoding.result import DecodeResult, packed_outputs, unpacked_result
from distillspec.decoding.sampling import SamplingConfig, logits_to_probs, sample_categorical
from distillspec.models.base import DecodingModel, entry_writer

RECORD_LOGITS_BYTES = 64 * 2**20  # Largest raw-logits buffer recording keeps for one top-k.


@flax.struct.dataclass
class _LoopState:
    tokens: jax.Array  # [B, T] int32 decoder-side sequence: prefix, then generated tokens.
    position: jax.Array  # [B] int32 position of the last token; not yet fed to the models.
    num_new: jax.Array  # [B] int32 tokens generated so far.
    done: jax.Array  # [B] bool, EOS emitted or max_new_tokens reached.
    target_cache: Any
    draft_cache: Any  # None for plain decoding.
    rng: jax.Array
    drafted: jax.Array  # [B] int32 counters, see DecodeResult.
    accepted: jax.Array
    target_calls: jax.Array
    draft_calls: jax.Array
    sl_histogram: jax.Array  # [B, gamma + 1] int32.
    width: jax.Array  # [B] int32 the last round's verify width (0 before the first round).
    width_switches: jax.Array
    lookahead: jax.Array  # [B] int32, the heuristic policy's current lookahead.
    record_log_probs: Any = None  # [B, N + G + 1, k or V (record_late)] float32, or None.
    record_ids: Any = None  # [B, N + G + 1, k] int32 when recording per round, else None.


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of a decoding call: one compiled program per distinct value.

    Thresholds and other per-call values of the policy are inputs, not part of the spec, so
    tuning them never recompiles.
    """

    gamma: int  # sl_max (0 = plain decoding).
    policy: Lookahead | None  # Kind and sl_max only (threshold/start are canonicalised away).
    max_new_tokens: int
    sampling: SamplingConfig
    lenience: Lenience | None
    eos_id: int | None
    vocab_size: int
    record_top_k: int = 0  # k > 0: keep the target's top-k log-probabilities per emitted token.
    record_late: bool = False  # Keep raw logits in the loop, one top-k after it.


def _read_rows(buf: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """buf [B, T] -> [B, size], row b read from start[b]."""
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (size,)))(buf, start)


def _write_rows(buf: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
    """Writes values [B, K, ...] into buf [B, T, ...] at per-row start [B] along axis 1."""
    rest = (0,) * (buf.ndim - 2)
    return jax.vmap(lambda row, v, s: jax.lax.dynamic_update_slice(row, v, (s, *rest)))(
        buf, values, start
    )


def _top_k_log_probs(logits: jax.Array, spec: _Spec) -> tuple[jax.Array, jax.Array]:
    """Top record_top_k log-probabilities [..., k] and ids of logits [..., V] (raw, vocab_size)."""
    logits = logits[..., : spec.vocab_size].astype(jnp.float32)
    values, ids = jax.lax.top_k(logits, spec.record_top_k)  # The order of the log-probabilities.
    return values - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids.astype(jnp.int32)


def _choose(logits: jax.Array, rng, spec: _Spec) -> tuple[jax.Array, jax.Array | None]:
    """The next token [B] from float32 logits [B, V], and the processed distribution [B, V] it
    was drawn from; greedy: the argmax and None (greedy acceptance needs tokens only)."""
    if spec.sampling.greedy:
        return jnp.argmax(logits[:, : spec.vocab_size], axis=-1).astype(jnp.int32), None
    probs = logits_to_probs(logits, spec.sampling, spec.vocab_size)
    return sample_categorical(rng, probs), probs


def _draft_block(draft, params, cache, state: _LoopState, rng, spec: _Spec, inputs):
    """Draws up to sl_max tokens per row, stopping each row where its policy says.

    Returns ([B, G] tokens, [B, G, V] probs (None when greedy), num_drafts [B], draft calls [B],
    cache); positions at or past a row's num_drafts are not proposed (they are masked in
    verification).

    The first call re-feeds the token before the last one too (K = 2): after a fully accepted
    round the draft has not seen the last draft token yet, and rewriting a cache entry with the
    same token is harmless, so every round does the same fixed-shape work. Token i - 1 is fed
    at iteration i, so a row that stops after i + 1 drafts has paid i + 1 draft calls.
    """
    batch, gamma = state.position.shape[0], spec.gamma
    start = jnp.maximum(state.position - 1, 0)
    logits, cache = draft.extend(params, cache, _read_rows(state.tokens, start, 2), start)
    logits = jnp.take_along_axis(logits, (state.position - start)[:, None, None], axis=1)[:, 0]
    logits = logits.astype(jnp.float32)  # Policies and sampling read float32 in any dtype.

    def draw(i, logits, tokens, probs, stopped, num_drafts, calls, survival):
        token, p = _choose(logits, None if rng is None else jax.random.fold_in(rng, i), spec)
        stop, n, survival = sl.stop_after(
            spec.policy, inputs, i, logits, token, state.num_new, state.lookahead,
            spec.vocab_size, survival,
        )  # fmt: skip
        if "drafts" in inputs:  # Timing: rounds of scheduled sizes (`fixed_rounds`).
            schedule = inputs["drafts"]  # A run-time verdict: the rule's own work still runs.
            want = schedule[state.target_calls % schedule.shape[0]]
            stop = jnp.where(want > 0, i + 1 >= want, stop)
            n = jnp.where(want > 0, i + 1, n).astype(jnp.int32)
        return (
            tokens.at[:, i].set(token),
            probs if p is None else probs.at[:, i].set(p),
            stopped | stop,
            jnp.where(stopped, num_drafts, n),  # A row that stopped earlier keeps its count.
            calls + (~stopped).astype(jnp.int32),  # The call that produced this token.
            survival,
        )

    zeros = jnp.zeros((batch,), jnp.int32)
    carry = draw(
        0,
        logits,
        jnp.zeros((batch, gamma), jnp.int32),
        None if spec.sampling.greedy else jnp.zeros((batch, gamma, spec.vocab_size), jnp.float32),
        state.done,  # Finished rows never keep the loop going.
        zeros,
        zeros,
        jnp.ones((batch,), jnp.float32),  # The cumulative rule's product of estimates.
    )

    def body(loop):
        i, cache, (tokens, probs, stopped, num_drafts, calls, survival) = loop
        fed = state.position + i  # Token i - 1 sits at position + 1 + (i - 1).
        logits, cache = draft.extend(params, cache, tokens[:, i - 1][:, None], fed)
        logits = logits[:, 0].astype(jnp.float32)
        return i + 1, cache, draw(i, logits, tokens, probs, stopped, num_drafts, calls, survival)

    def more(loop):  # Another draft: below sl_max, and some row is still drafting.
        i, _, (_, _, stopped, _, _, _) = loop
        return (i < gamma) & ~jnp.all(stopped)

    _, cache, (tokens, probs, _, num_drafts, calls, _) = jax.lax.while_loop(
        more, body, (1, cache, carry)
    )
    return tokens, probs, num_drafts, calls, cache


def _verify(target, params, cache, tokens, position, num_drafts, done, spec: _Spec, select):
    """(select(target logits [B, w, V]) for last token + drafts, padded to [B, G + 1, ...], new
    cache, w) in the narrowest compiled width w holding every active row's drafts.

    The width is a `lax.switch` whose branches only read the cache and return their entries,
    padded to G + 1 tokens, for one write after it: XLA copies a conditional's operand that a
    branch updates in place, which was the whole target cache every dynamic round
    (tests/test_round_copies.py reads the compiled program). A target without
    `extend_entries` (`models.base.entry_writer`) writes inside the branches instead."""
    widths = sl.verify_widths(spec.policy)
    full = spec.gamma + 1

    def padded(selected, width):  # Each array of the selection, [B, w, ...] -> [B, G + 1, ...]
        pad = lambda x: jnp.pad(x, [(0, 0), (0, full - width)] + [(0, 0)] * (x.ndim - 2))
        return jax.tree.map(pad, selected)

    if len(widths) == 1:
        logits, cache = target.extend(params, cache, tokens[:, : widths[0]], position)
        return padded(select(logits), widths[0]), cache, jnp.int32(widths[0])
    needed = jnp.max(jnp.where(done, 0, num_drafts)) + 1
    branch = jnp.searchsorted(jnp.asarray(widths), needed)
    width = jnp.asarray(widths, jnp.int32)[branch]
    split = entry_writer(target)

    def call(w, cache):  # (selected, the new entries | the updated cache)
        if split:
            logits, out = target.extend_entries(params, cache, tokens[:, :w], position, full)
        else:
            logits, out = target.extend(params, cache, tokens[:, :w], position)
        return padded(select(logits), w), out

    selected, out = jax.lax.switch(branch, [functools.partial(call, w) for w in widths], cache)
    return selected, target.write_entries(cache, out, position) if split else out, width


def _kept_count(new: jax.Array, num_emitted: jax.Array, remaining: jax.Array, eos_id):
    """How many of the round's tokens new [B, K] a row keeps, and whether it ended on EOS."""
    index = jnp.arange(new.shape[1])
    count = jnp.minimum(num_emitted, remaining)
    if eos_id is None:
        return count, jnp.zeros_like(count, dtype=bool)
    is_eos = (new == eos_id) & (index < count[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), new.shape[1])
    return jnp.minimum(count, first_eos + 1), jnp.any(is_eos, axis=1)


def _round(state: _LoopState, target, draft, target_params, draft_params, spec: _Spec, inputs):
    """One draft-then-verify round (gamma = 0: one plain decoding step)."""
    batch = state.position.shape[0]
    if spec.sampling.greedy:  # No random draws: the key stays as it is.
        rng, rng_draft, rng_verify = state.rng, None, None
    else:
        rng, rng_draft, rng_verify = jax.random.split(state.rng, 3)
    last = jnp.take_along_axis(state.tokens, state.position[:, None], axis=1)
    if spec.sampling.greedy:  # What acceptance reads of the target's logits.
        read = lambda logits: jnp.argmax(logits[..., : spec.vocab_size], axis=-1)
    else:
        read = lambda logits: logits_to_probs(logits, spec.sampling, spec.vocab_size)
    select = read
    if spec.record_top_k:  # The recording, selected in the same verify call.
        raw = lambda logits: logits[..., : spec.vocab_size].astype(jnp.float32)
        keep = raw if spec.record_late else functools.partial(_top_k_log_probs, spec=spec)
        select = lambda logits: (read(logits), keep(logits))
    if spec.gamma:
        drafts, draft_probs, num_drafts, draft_calls, draft_cache = _draft_block(
            draft, draft_params, state.draft_cache, state, rng_draft, spec, inputs
        )
        tokens = jnp.concatenate([last, drafts], axis=1)
        target_out, target_cache, width = _verify(
            target, target_params, state.target_cache, tokens, state.position, num_drafts,
            state.done, spec, select,
        )  # fmt: skip
        if spec.record_top_k:
            target_out, recorded = target_out
    else:
        drafts = jnp.zeros((batch, 0), jnp.int32)
        draft_probs = jnp.zeros((batch, 0, spec.vocab_size), jnp.float32)
        num_drafts = draft_calls = jnp.zeros((batch,), jnp.int32)
        draft_cache = state.draft_cache
        logits, target_cache = target.extend(
            target_params, state.target_cache, last, state.position
        )
        target_out = select(logits)
        width = jnp.int32(1)
    proposed = num_drafts if spec.gamma else None
    if spec.sampling.greedy:
        num_accepted, next_token = accept_greedy(drafts, target_out, proposed)
    else:
        num_accepted, next_token = accept_or_resample(
            rng_verify, drafts, draft_probs, target_out, spec.lenience, num_drafts=proposed
        )
    index = jnp.arange(spec.gamma + 1)
    drafts_padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    new = jnp.where(index < num_accepted[:, None], drafts_padded, next_token[:, None])
    count, hit_eos = _kept_count(
        new, num_accepted + 1, spec.max_new_tokens - state.num_new, spec.eos_id
    )
    active = ~state.done
    count = jnp.where(active, count, 0)
    num_new = state.num_new + count
    step = active.astype(jnp.int32)
    lookahead = state.lookahead
    if spec.gamma:
        lookahead = sl.next_lookahead(spec.policy, lookahead, num_drafts, num_accepted)
        lookahead = jnp.where(active, lookahead, state.lookahead)
    record_log_probs, record_ids = state.record_log_probs, state.record_ids
    if spec.record_top_k:  # Position i of the round emitted the row's token num_new + i.
        values, ids = (recorded, None) if spec.record_late else recorded
        record_log_probs = _write_rows(record_log_probs, values, state.num_new)
        record_ids = None if ids is None else _write_rows(record_ids, ids, state.num_new)
    return _LoopState(
        tokens=_write_rows(state.tokens, new, state.position + 1),
        position=state.position + count,
        num_new=num_new,
        done=state.done | hit_eos | (num_new >= spec.max_new_tokens),
        target_cache=target_cache,
        draft_cache=draft_cache,
        rng=rng,
        drafted=state.drafted + step * num_drafts,
        accepted=state.accepted + step * num_accepted,
        target_calls=state.target_calls + step,
        draft_calls=state.draft_calls + step * draft_calls,
        sl_histogram=state.sl_histogram
        + step[:, None] * jax.nn.one_hot(num_drafts, spec.gamma + 1, dtype=jnp.int32),
        width=jnp.where(active, width, state.width),
        width_switches=state.width_switches + step * ((state.width > 0) & (width != state.width)),
        lookahead=lookahead,
        record_log_probs=record_log_probs,
        record_ids=record_ids,
    )


def _decode(
    target,
    draft,
    spec: _Spec,
    target_params,
    draft_params,
    prompt_tokens,
    prompt_lengths,
    rng,
    inputs,
    num_rounds=None,
):
    """The whole generation: prefill, rounds until every row is done, output extraction.

    With num_rounds, exactly that many rounds instead, for timing (`fixed_rounds`).
    rng None is key 0, made here: made on the host it would be a dispatch of its own."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    batch, prompt_len = prompt_tokens.shape
    length = prompt_len + spec.max_new_tokens + spec.gamma + 1  # Room for the last round's writes.
    target_cache, prefix, position = target.prefill(
        target_params, prompt_tokens, prompt_lengths, length
    )
    draft_cache = None
    if draft is not None:
        draft_cache, _, _ = draft.prefill(draft_params, prompt_tokens, prompt_lengths, length)
    zeros = jnp.zeros((batch,), jnp.int32)
    state = _LoopState(
        tokens=jnp.pad(prefix.astype(jnp.int32), ((0, 0), (0, length - prefix.shape[1]))),
        position=position.astype(jnp.int32),
        num_new=zeros,
        done=jnp.zeros((batch,), bool),
        target_cache=target_cache,
        draft_cache=draft_cache,
        rng=rng,
        drafted=zeros,
        accepted=zeros,
        target_calls=zeros,
        draft_calls=zeros,
        sl_histogram=jnp.zeros((batch, spec.gamma + 1), jnp.int32),
        width=zeros,
        width_switches=zeros,
        lookahead=jnp.full((batch,), jnp.clip(inputs["start"], 1, max(spec.gamma, 1)), jnp.int32),
    )
    if spec.record_top_k:  # Room for the last round's writes past max_new_tokens.
        shape, k = (batch, spec.max_new_tokens + spec.gamma + 1), spec.record_top_k
        state = state.replace(
            record_log_probs=jnp.zeros((*shape, spec.vocab_size if spec.record_late else k)),
            record_ids=None if spec.record_late else jnp.zeros((*shape, k), jnp.int32),
        )
    if inputs.get("oracle_tokens") is not None:  # -1 past the reference never matches a draft.
        oracle = jnp.asarray(inputs["oracle_tokens"], jnp.int32)
        oracle = jnp.pad(oracle, ((0, 0), (0, spec.gamma)), constant_values=-1)
        inputs = {**inputs, "oracle_tokens": oracle}
    body = lambda s: _round(s, target, draft, target_params, draft_params, spec, inputs)
    if num_rounds is None:
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    else:
        state = jax.lax.fori_loop(0, num_rounds, lambda _, s: body(s), state)
    tokens = _read_rows(state.tokens, position + 1, spec.max_new_tokens)
    emitted = jnp.arange(spec.max_new_tokens) < state.num_new[:, None]
    tokens = jnp.where(emitted, tokens, 0)
    records = {}
    if spec.record_top_k:
        keep = lambda buf: jnp.where(emitted[..., None], buf[:, : spec.max_new_tokens], 0)
        values, ids = state.record_log_probs, state.record_ids
        if spec.record_late:
            values, ids = _top_k_log_probs(values[:, : spec.max_new_tokens], spec)
        records = dict(record_log_probs=keep(values), record_ids=keep(ids))
    return dict(
        **records,
        tokens=tokens,
        lengths=state.num_new,
        drafted=state.drafted,
        accepted=state.accepted,
        target_calls=state.target_calls,
        draft_calls=state.draft_calls,
        width_switches=state.width_switches,
        sl_histogram=state.sl_histogram,
    )


@functools.lru_cache(maxsize=64)
def _compiled(target, draft, spec: _Spec, packed: bool = False):
    """One jitted program per (models, spec, packed); jax.jit adds one per input shape."""
    decode = functools.partial(_decode, target, draft, spec)
    return jax.jit((lambda *args: packed_outputs(decode(*args))) if packed else decode)


def _checked(target, draft, target_params, draft_params, prompt_tokens, prompt_lengths, rng,
             spec, inputs, packed=False):  # fmt: skip
    """(the compiled program of spec, its checked arguments)."""
    checks.check_int("max_new_tokens", spec.max_new_tokens)
    sizes = [target.vocab_size] + ([draft.vocab_size] if draft is not None else [])
    prompt_tokens, prompt_lengths = checks.check_prompt(prompt_tokens, prompt_lengths, min(sizes))
    fn = _compiled(target, draft, spec, packed)  # rng None: key 0, made inside the program.
    return fn, (target_params, draft_params, prompt_tokens, prompt_lengths, rng, inputs)


def generate(
    model: DecodingModel,
    params,
    prompt_tokens,
    prompt_lengths,
    rng: jax.Array | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> DecodeResult:
    """Plain autoregressive decoding: the baseline every speed-up is measured against.

    Args:
      model, params: any `DecodingModel` and its parameters.
      prompt_tokens: [B, P] right-padded prompts; prompt_lengths: [B] real lengths (>= 1).
      rng: PRNG key for sampling (unused when greedy).
      max_new_tokens: N, tokens to generate per row at most.
      sampling: temperature / top-k / top-p.
      eos_id: a row stops after emitting this id (it is included in the output).
      vocab_size: ignore logits at ids >= vocab_size (embedding padded past the tokenizer).

    Returns:
      DecodeResult; target_calls counts one per generated token.
    """
    out = _plain(model, params, prompt_tokens, prompt_lengths, rng, max_new_tokens, sampling,
                 eos_id, vocab_size, packed=True)  # fmt: skip
    return unpacked_result(*jax.device_get(out))


def generate_on_device(
    model: DecodingModel,
    params,
    prompt_tokens,
    prompt_lengths,
    rng: jax.Array | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> dict[str, jax.Array]:
    """`generate` without the transfer to the host: DecodeResult's fields as device arrays.

    Traceable, so training calls it inside jit for on-policy samples; and fit for the global
    arrays of a multi-process run, which no single host can read whole.
    """
    return _plain(model, params, prompt_tokens, prompt_lengths, rng, max_new_tokens, sampling,
                  eos_id, vocab_size, packed=False)  # fmt: skip


def _plain(model, params, prompt_tokens, prompt_lengths, rng, max_new_tokens, sampling, eos_id,
           vocab_size, packed):  # fmt: skip
    vocab = checks.shared_vocab_size(model, None, vocab_size)
    spec = _Spec(0, None, max_new_tokens, sampling, None, eos_id, vocab)
    inputs = {"start": np.int32(1)}
    fn, args = _checked(model, None, params, None, prompt_tokens, prompt_lengths, rng, spec,
                        inputs, packed)  # fmt: skip
    return fn(*args)


def speculative_generate(
    target: DecodingModel,
    draft: DecodingModel,
    target_params,
    draft_params,
    prompt_tokens,
    prompt_lengths,
    rng: jax.Array | None = None,
    *,
    gamma: int | None = None,
    lookahead: Lookahead | None = None,
    classifier=None,
    oracle_tokens=None,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    lenience: Lenience | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    record_top_k: int = 0,
) -> DecodeResult:
    """Speculative decoding (DistillSpec Algorithm A.1) in one jitted loop.

    Lossless (lenience None or eps = 1): greedy output equals `generate`'s token for token, and
    sampled output is distributed exactly as the target's, under every lookahead policy.
    Arguments as in `generate`, plus:

      draft, draft_params: the draft model.
      gamma: drafts per round (>= 1), the static policy; or else
      lookahead: a `distillspec.decoding.Lookahead` policy (static, heuristic, confidence,
        disco, cumulative, oracle) with its sl_max cap. Its threshold and start are call
        inputs: changing them does not recompile.
      classifier: DISCO's classifier variables, for lookahead kind 'disco' and 'cumulative'
        with source 'classifier'.
      oracle_tokens: [B, max_new_tokens] the target's greedy output, for kind 'oracle'.
      lenience: the lenience function for lossy decoding.
      record_top_k: k > 0 also returns the target's top-k log-probabilities and ids at every
        generated token (DecodeResult.record_log_probs / record_ids; the module's docstring).
    """
    fn, args = _speculative_call(
        target, draft, target_params, draft_params, prompt_tokens, prompt_lengths, rng,
        gamma=gamma, lookahead=lookahead, classifier=classifier, oracle_tokens=oracle_tokens,
        max_new_tokens=max_new_tokens, sampling=sampling, lenience=lenience, eos_id=eos_id,
        vocab_size=vocab_size, record_top_k=record_top_k,
    )  # fmt: skip
    return unpacked_result(*jax.device_get(fn(*args)))


def speculative_program(*args, **kwargs) -> jax.stages.Compiled:
    """The compiled program that `speculative_generate` runs for the same arguments, for reading:
    `.as_text()` is XLA's optimized program (`distillspec.benchmarks.rounds` counts the buffers
    a round copies in it)."""
    bound = inspect.signature(speculative_generate).bind(*args, **kwargs)
    bound.apply_defaults()
    fn, call_args = _speculative_call(**bound.arguments)
    return fn.lower(*call_args).compile()


def _speculative_call(target, draft, target_params, draft_params, prompt_tokens, prompt_lengths,
                      rng, gamma, lookahead, classifier, oracle_tokens, max_new_tokens, sampling,
                      lenience, eos_id, vocab_size, record_top_k=0):  # fmt: skip
    """(the jitted program, its arguments) of a `speculative_generate` call, checked."""
    if (gamma is None) == (lookahead is None):
        raise ValueError("pass exactly one of gamma= (static lookahead) and lookahead=")
    if lookahead is None:
        lookahead = Lookahead("static", checks.check_int("gamma", gamma))
    if not isinstance(lookahead, Lookahead):
        raise ValueError(f"lookahead must be a distillspec.decoding.Lookahead, got {lookahead!r}")
    vocab = checks.shared_vocab_size(target, draft, vocab_size)
    if not (isinstance(record_top_k, int) and 0 <= record_top_k <= vocab):
        raise ValueError(
            f"record_top_k must be an integer in [0, {vocab}] (0 = no recording, at most the "
            f"vocabulary's {vocab} ids), got {record_top_k!r}"
        )
    logits_bytes = 4 * np.shape(prompt_tokens)[0] * (max_new_tokens + lookahead.sl_max + 1) * vocab
    spec = _Spec(
        lookahead.sl_max,
        lookahead.static_part,  # Threshold and start are inputs.
        max_new_tokens,
        sampling,
        lenience,
        eos_id,
        vocab,
        record_top_k,
        bool(record_top_k) and logits_bytes <= RECORD_LOGITS_BYTES,
    )
    inputs = sl.policy_inputs(
        lookahead, classifier, oracle_tokens, spec.vocab_size, spec.sampling, spec.max_new_tokens,
        np.shape(prompt_tokens)[0],
    )  # fmt: skip
    return _checked(target, draft, target_params, draft_params, prompt_tokens, prompt_lengths,
                    rng, spec, inputs, packed=True)  # fmt: skip
