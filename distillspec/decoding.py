"""Plain and speculative decoding in one jitted `lax.while_loop`.

Both decoders share one loop: a *round* feeds the target the last emitted token plus gamma drafts
(gamma = 0 for plain decoding) and emits 1 to gamma + 1 tokens per row. Everything has a fixed
shape; ragged progress is a per-row position, and dropping rejected drafts is moving that
position back (the models' caches never look past it, see `distillspec.models.base`).

Per call the caller gets, per row, the tokens and the counters from which the acceptance rate
alpha = accepted / drafted and the block efficiency tau = tokens / target_calls derive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from distillspec.models.base import DecodingModel
from distillspec.sampling import SamplingConfig, logits_to_probs, sample_categorical
from distillspec.speculative import Lenience, accept_or_resample


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """What one decoding call returns (host numpy arrays)."""

    tokens: np.ndarray  # [B, N] generated tokens, 0 after each row's end.
    lengths: np.ndarray  # [B] tokens generated per row (EOS included when emitted).
    drafted: np.ndarray  # [B] draft tokens proposed to the target.
    accepted: np.ndarray  # [B] draft tokens the target kept.
    target_calls: np.ndarray  # [B] target calls made while decoding (the prompt's not counted).
    draft_calls: np.ndarray  # [B] draft calls made while decoding.

    @property
    def alpha(self) -> float:
        """Acceptance rate over the batch: accepted / drafted drafts."""
        return float(self.accepted.sum() / max(self.drafted.sum(), 1))

    @property
    def tau(self) -> float:
        """Block efficiency over the batch: generated tokens per target call."""
        return float(self.lengths.sum() / max(self.target_calls.sum(), 1))


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


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of a decoding call: one compiled program per distinct value."""

    gamma: int
    max_new_tokens: int
    sampling: SamplingConfig
    lenience: Lenience | None
    eos_id: int | None
    vocab_size: int


def _read_rows(buf: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """buf [B, T] -> [B, size], row b read from start[b]."""
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (size,)))(buf, start)


def _write_rows(buf: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
    """Writes values [B, K] into buf [B, T] at per-row start [B]."""
    return jax.vmap(lambda row, v, s: jax.lax.dynamic_update_slice(row, v, (s,)))(
        buf, values, start
    )


def _draft_block(draft, params, cache, state: _LoopState, rng, spec: _Spec):
    """Draws gamma tokens from the draft: ([B, G] tokens, [B, G, V] probs, cache).

    The first call re-feeds the token before the last one too (K = 2): after a fully accepted
    round the draft has not seen the last draft token yet, and rewriting a cache entry with the
    same token is harmless, so every round does the same fixed-shape work.
    """
    start = jnp.maximum(state.position - 1, 0)
    logits, cache = draft.extend(params, cache, _read_rows(state.tokens, start, 2), start)
    logits = jnp.take_along_axis(logits, (state.position - start)[:, None, None], axis=1)[:, 0]

    def step(carry, i, feed=True):
        cache, logits = carry
        probs = logits_to_probs(logits, spec.sampling, spec.vocab_size)
        token = sample_categorical(jax.random.fold_in(rng, i), probs)
        if feed:  # All but the last draft are fed back to get the next distribution.
            next_logits, cache = draft.extend(params, cache, token[:, None], state.position + 1 + i)
            logits = next_logits[:, 0]
        return (cache, logits), (token, probs)

    (cache, logits), (tokens, probs) = jax.lax.scan(
        step, (cache, logits), jnp.arange(spec.gamma - 1)
    )
    _, (last_token, last_probs) = step((cache, logits), spec.gamma - 1, feed=False)
    tokens = jnp.concatenate([tokens.T, last_token[:, None]], axis=1)
    probs = jnp.concatenate([jnp.swapaxes(probs, 0, 1), last_probs[:, None]], axis=1)
    return tokens, probs, cache


def _kept_count(new: jax.Array, num_emitted: jax.Array, remaining: jax.Array, eos_id):
    """How many of the round's tokens new [B, K] a row keeps, and whether it ended on EOS."""
    index = jnp.arange(new.shape[1])
    count = jnp.minimum(num_emitted, remaining)
    if eos_id is None:
        return count, jnp.zeros_like(count, dtype=bool)
    is_eos = (new == eos_id) & (index < count[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), new.shape[1])
    return jnp.minimum(count, first_eos + 1), jnp.any(is_eos, axis=1)


def _round(state: _LoopState, target, draft, target_params, draft_params, spec: _Spec):
    """One draft-then-verify round (gamma = 0: one plain decoding step)."""
    rng, rng_draft, rng_verify = jax.random.split(state.rng, 3)
    batch = state.position.shape[0]
    last = jnp.take_along_axis(state.tokens, state.position[:, None], axis=1)
    if spec.gamma:
        drafts, draft_probs, draft_cache = _draft_block(
            draft, draft_params, state.draft_cache, state, rng_draft, spec
        )
    else:
        drafts = jnp.zeros((batch, 0), jnp.int32)
        draft_probs = jnp.zeros((batch, 0, spec.vocab_size), jnp.float32)
        draft_cache = state.draft_cache
    logits, target_cache = target.extend(
        target_params, state.target_cache, jnp.concatenate([last, drafts], axis=1), state.position
    )
    target_probs = logits_to_probs(logits, spec.sampling, spec.vocab_size)
    num_accepted, next_token = accept_or_resample(
        rng_verify, drafts, draft_probs, target_probs, spec.lenience
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
    return _LoopState(
        tokens=_write_rows(state.tokens, new, state.position + 1),
        position=state.position + count,
        num_new=num_new,
        done=state.done | hit_eos | (num_new >= spec.max_new_tokens),
        target_cache=target_cache,
        draft_cache=draft_cache,
        rng=rng,
        drafted=state.drafted + step * spec.gamma,
        accepted=state.accepted + step * num_accepted,
        target_calls=state.target_calls + step,
        draft_calls=state.draft_calls + step * spec.gamma,
    )


def _decode(
    target, draft, spec: _Spec, target_params, draft_params, prompt_tokens, prompt_lengths, rng
):
    """The whole generation: prefill, rounds until every row is done, output extraction."""
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
    )
    state = jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: _round(s, target, draft, target_params, draft_params, spec),
        state,
    )
    tokens = _read_rows(state.tokens, position + 1, spec.max_new_tokens)
    tokens = jnp.where(jnp.arange(spec.max_new_tokens) < state.num_new[:, None], tokens, 0)
    return dict(
        tokens=tokens,
        lengths=state.num_new,
        drafted=state.drafted,
        accepted=state.accepted,
        target_calls=state.target_calls,
        draft_calls=state.draft_calls,
    )


@functools.lru_cache(maxsize=64)
def _compiled(target, draft, spec: _Spec):
    """One jitted program per (models, spec); jax.jit adds one per distinct input shape."""
    return jax.jit(functools.partial(_decode, target, draft, spec))


def shared_vocab_size(target, draft, vocab_size: int | None) -> int:
    """The vocabulary both models decode over; raises ValueError when they cannot share one."""
    sizes = [target.vocab_size] + ([draft.vocab_size] if draft is not None else [])
    if vocab_size is None:
        if len(set(sizes)) > 1:
            raise ValueError(
                f"draft vocabulary ({draft.vocab_size}) and target vocabulary "
                f"({target.vocab_size}) differ. If they share a tokenizer and only pad the "
                "embedding to different sizes, pass vocab_size=<the tokenizer's size>, at most "
                f"{min(sizes)}; ids from vocab_size up are then never drafted or emitted."
            )
        return sizes[0]
    if not 1 <= vocab_size <= min(sizes):
        raise ValueError(f"vocab_size must be in [1, {min(sizes)}], got {vocab_size!r}")
    return vocab_size


def _check_prompt(prompt_tokens, prompt_lengths) -> tuple[jax.Array, jax.Array]:
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
        raise ValueError(
            "prompt_tokens must be [B, P] and prompt_lengths [B]; got shapes "
            f"{prompt_tokens.shape} and {prompt_lengths.shape}"
        )
    if not isinstance(prompt_lengths, jax.core.Tracer):
        lengths = np.asarray(prompt_lengths)
        if lengths.min() < 1 or lengths.max() > prompt_tokens.shape[1]:
            raise ValueError(
                f"prompt_lengths must be in [1, {prompt_tokens.shape[1]}], got {lengths.tolist()}"
            )
    return prompt_tokens, prompt_lengths


def _run(target, draft, target_params, draft_params, prompt_tokens, prompt_lengths, rng, spec):
    if not (isinstance(spec.max_new_tokens, int) and spec.max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {spec.max_new_tokens!r}")
    prompt_tokens, prompt_lengths = _check_prompt(prompt_tokens, prompt_lengths)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    fn = _compiled(target, draft, spec)
    out = jax.device_get(fn(target_params, draft_params, prompt_tokens, prompt_lengths, rng))
    return DecodeResult(**out)


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
    spec = _Spec(
        0, max_new_tokens, sampling, None, eos_id, shared_vocab_size(model, None, vocab_size)
    )
    return _run(model, None, params, None, prompt_tokens, prompt_lengths, rng, spec)


def speculative_generate(
    target: DecodingModel,
    draft: DecodingModel,
    target_params,
    draft_params,
    prompt_tokens,
    prompt_lengths,
    rng: jax.Array | None = None,
    *,
    gamma: int,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    lenience: Lenience | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> DecodeResult:
    """Speculative decoding (DistillSpec Algorithm A.1) in one jitted loop.

    Lossless (lenience None or eps = 1): greedy output equals `generate`'s token for token, and
    sampled output is distributed exactly as the target's. Arguments as in `generate`, plus the
    draft model, gamma (drafts per round, >= 1) and the lenience function for lossy decoding.
    """
    if not (isinstance(gamma, int) and gamma >= 1):
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    spec = _Spec(
        gamma,
        max_new_tokens,
        sampling,
        lenience,
        eos_id,
        shared_vocab_size(target, draft, vocab_size),
    )
    return _run(
        target, draft, target_params, draft_params, prompt_tokens, prompt_lengths, rng, spec
    )
