"""Output heads and per-token losses over chunks of positions: no [tokens, V] array at all.

At a real vocabulary (Llama 3: 128,256 ids; Gemma: 256,000) one float32 [tokens, V] logits
array of a 4,096-token batch is 2 GB, and a divergence's backward pass keeps several alive.
So the distillation step takes the models' final hidden states [B, N, E] (`head_of`) and runs
both output heads, the divergence, the acceptance metric and their gradient one chunk of
positions at a time (`chunked_sums`): a `lax.scan` over chunks whose body computes the chunk's
logits [B, C, V], its sums and, in the same pass, their gradient with respect to the student's
hidden states and head parameters (a custom VJP, as fused linear-cross-entropy kernels do).
Nothing is recomputed in the backward pass, which only scales the stored gradients, so the
step does the unchunked step's arithmetic, and only one chunk's [B, C, V] arrays are alive at
a time. One code path serves every size: a chunk of all positions is the unchunked case.

Evaluation-side consumers (NLL, TVD, top-k records, DISCO features) use `map_chunks`, the same
split without gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Bytes of one float32 [chunk tokens, V] array in the default chunk. A chunk keeps 5 (FKL) to
# 8 (JSD) such arrays alive at once (both models' logits, their softmaxes, the gradient), so
# the default keeps a step's vocabulary-sized temporaries well under 1 GB however many tokens
# it has (`python -m distillspec.benchmarks.memory` reports the compiled step's).
CHUNK_BYTES = 64 << 20


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk whose float32 [tokens, V] array is CHUNK_BYTES (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * int(vocab_size)))


@dataclasses.dataclass(frozen=True)
class Head:
    """A model's teacher-forced logits split at the output head:
    logits(params, batch, positions) = apply(select(params), features(params, batch, positions)).
    """

    features: Callable[..., jax.Array]  # (params, batch, positions) -> [B, N, E].
    select: Callable[[Any], Any]  # params -> the subtree the head reads.
    apply: Callable[[Any, jax.Array], jax.Array]  # (head params, [..., E]) -> [..., V] float32.


def head_of(model: Any) -> Head:
    """The model's `Head` (`models.base.ScoringModel`'s optional features / head_params /
    head); a model with only `logits` (a stub) has the identity as its head, so its 'hidden
    states' are its logits."""
    if all(callable(getattr(model, name, None)) for name in ("features", "head_params", "head")):
        return Head(model.features, model.head_params, model.head)
    return Head(model.logits, lambda params: {}, lambda head_params, x: x)


def chunk_positions(rows: int, positions: int, chunk_tokens: int | None, vocab_size: int) -> int:
    """Positions per chunk (along axis 1 of [rows, positions, ...]) for about chunk_tokens tokens
    per chunk (None: `default_chunk_tokens(vocab_size)`); at most `positions`."""
    tokens = default_chunk_tokens(vocab_size) if chunk_tokens is None else int(chunk_tokens)
    if tokens < 1:
        raise ValueError(f"chunk_tokens must be None or an integer >= 1, got {chunk_tokens!r}")
    return max(1, min(positions, tokens // max(rows, 1)))


def _split(x: jax.Array, size: int) -> jax.Array:
    """[B, N, ...] -> [ceil(N / size), B, size, ...], zero-padded past N."""
    count = -(-x.shape[1] // size)
    pad = count * size - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], count, size, *x.shape[2:]), 1, 0)


def _merge(x: jax.Array, length: int) -> jax.Array:
    """`_split`'s inverse: [count, B, size, ...] -> [B, length, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _scan(body, carry, xs):
    """`lax.scan` over the chunks, or the body called once for one chunk (no loop: the
    program of an unchunked step is the same straight-line program as before chunking)."""
    if jax.tree.leaves(xs)[0].shape[0] > 1:
        return jax.lax.scan(body, carry, xs)
    carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)


def map_chunks(fn: Callable[[dict], Any], chunked: dict, size: int) -> Any:
    """fn applied to chunks of `size` positions of every [B, N, ...] array in `chunked` (zero
    past N in the last chunk); fn's outputs are [B, size, ...] arrays (merged back to
    [B, N, ...]) or scalars (summed over chunks). For values only: a loss to differentiate
    goes through `chunked_sums`."""
    length = next(iter(chunked.values())).shape[1]
    pieces = _scan(
        lambda _, x: (None, fn(x)), None, {k: _split(v, size) for k, v in chunked.items()}
    )[1]
    return jax.tree.map(lambda y: y.sum(0) if y.ndim == 1 else _merge(y, length), pieces)


def chunked_sums(
    fn: Callable[..., dict[str, jax.Array]],
    params: Any,
    hidden: jax.Array,
    chunked: dict[str, jax.Array],
    consts: Any,
    size: int,
) -> dict[str, jax.Array]:
    """sum over chunks of positions of fn(params, hidden chunk, chunked chunk, consts).

    fn returns float32 scalars, among them 'loss_sum', whose gradient with respect to params
    and hidden this function carries: it is computed chunk by chunk in the forward pass
    (fn's logits are never recomputed); the other sums carry none, nor do chunked and consts.

    Args:
      fn: (params, hidden [B, size, E], {name: [B, size, ...]}, consts) -> {name: scalar}.
        Padding past N arrives as zeros: weights there must be 0 (then fn's sums are exact).
      params: the differentiated parameters fn reads (e.g. the student's head).
      hidden: [B, N, E] the differentiated hidden states.
      chunked: {name: [B, N, ...]} arrays cut into the same chunks (weights, the teacher's
        hidden states, top-k records, targets).
      consts: anything else fn reads whole (e.g. the teacher's head), not differentiated.
      size: positions per chunk (`chunk_positions`).

    Returns:
      {name: float32 scalar}, fn's sums added over the chunks.
    """
    length = hidden.shape[1]

    def forward(params, hidden, chunked, consts):
        def body(grad_params, xs):
            h, c = xs
            loss = lambda p, h: (lambda sums: (sums["loss_sum"], sums))(fn(p, h, c, consts))
            _, vjp, sums = jax.vjp(loss, params, h, has_aux=True)
            g_params, g_hidden = vjp(jnp.ones((), jnp.float32))
            return jax.tree.map(jnp.add, grad_params, g_params), (sums, g_hidden)

        xs = (_split(hidden, size), {k: _split(v, size) for k, v in chunked.items()})
        grad_params, (sums, g_hidden) = _scan(body, jax.tree.map(jnp.zeros_like, params), xs)
        totals = jax.tree.map(lambda s: s.sum(0), sums)
        return totals, (grad_params, _merge(g_hidden, length))

    @jax.custom_vjp
    def run(params, hidden, chunked, consts):
        return forward(params, hidden, chunked, consts)[0]

    def backward(residuals, cotangents):
        grad_params, grad_hidden = residuals
        g = cotangents["loss_sum"]
        scale = lambda x: (x * g).astype(x.dtype)
        return jax.tree.map(scale, grad_params), scale(grad_hidden), None, None

    run.defvjp(forward, backward)
    return run(params, hidden, chunked, consts)
