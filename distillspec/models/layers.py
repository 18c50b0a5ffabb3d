"""Flax building blocks shared by the decoder-only and the T5 families.

Every parameter carries logical axis names (T5X style); `distillspec.partitioning` maps them to
mesh axes:

  'vocab'           rows of the token embedding / columns of the lm head
  'embed'           model width
  'heads'           query heads          'kv_heads'  key/value heads (fewer under GQA)
  'kv'              width of one head    'mlp'       feed-forward hidden width
  'layers'          stacked (scanned) layers, added by `nn.scan`
  'abspos'          rows of a learned absolute-position table (GPT-2)
  'relpos_buckets'  T5 relative-position buckets

Parameters are stored in float32; each block casts them to its compute `dtype`. Matmuls
accumulate in float32, and attention softmax runs in float32 whatever the compute dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Initializer = Callable[..., jax.Array]
Dtype = Any

# Masked attention logits: a finite minimum keeps a fully masked row (an all-padding encoder
# input) a uniform softmax instead of NaN.
NEG_INF = float(np.finfo(np.float32).min)

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_new": functools.partial(
        jax.nn.gelu, approximate=True
    ),  # tanh approximation (HF gelu_new)
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact erf form
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def fan_in_init(scale: float, num_in_axes: int) -> Initializer:
    """Normal init with variance `scale / fan_in`, fan_in = product of the first `num_in_axes` axes.

    Flax's variance_scaling treats middle axes as a receptive field; for a [embed, heads, kv]
    kernel that would be wrong, hence this explicit version.
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> jax.Array:
        fan_in = math.prod(shape[:num_in_axes])
        return jax.random.normal(key, shape, dtype) * math.sqrt(scale / fan_in)

    return init


def _as_matrices(x: jax.Array, kernel: jax.Array, num_in_axes: int, g: jax.Array):
    """(x [N, K], kernel [K, F], g [N, F]): the contraction's operands as plain matrices (row-major
    reshapes, free)."""
    k = math.prod(kernel.shape[:num_in_axes])
    x2 = x.reshape(-1, k)
    return x2, kernel.reshape(k, -1), g.reshape(x2.shape[0], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def contract(x: jax.Array, kernel: jax.Array, num_in_axes: int) -> jax.Array:
    """x[..., *in] . kernel[*in, *out] -> float32 [..., *out] (`jnp.tensordot`, float32
    accumulation), with a backward pass that writes each gradient in its operand's layout.

    Autodiff's own backward computes the kernel's gradient as (g^T x) and transposes it; XLA:CPU
    then materialises a transposed copy of g, the largest array of the product ([N, V] for an lm
    head: ~30% of a small model's training step). Here dkernel = x^T g is one product of x [N, K]
    and g [N, F] over N, giving [K, F] directly; the values are autodiff's (one float32 product
    either way), and each gradient comes back in its operand's dtype, as autodiff's does.
    """
    return jnp.tensordot(x, kernel, axes=num_in_axes, preferred_element_type=jnp.float32)


def _contract_fwd(x, kernel, num_in_axes):
    return contract(x, kernel, num_in_axes), (x, kernel)


def _contract_bwd(num_in_axes, residuals, g):
    x, kernel = residuals
    x2, k2, g2 = _as_matrices(x, kernel, num_in_axes, g)
    f32 = jnp.float32
    dx = jax.lax.dot_general(g2, k2, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    dk = jax.lax.dot_general(x2, g2, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dx.reshape(x.shape).astype(x.dtype), dk.reshape(kernel.shape).astype(kernel.dtype)


contract.defvjp(_contract_fwd, _contract_bwd)


@jax.custom_vjp
def contract_rows(x: jax.Array, table: jax.Array) -> jax.Array:
    """x[..., E] . table[V, E]^T -> float32 [..., V] (a tied lm head), with `contract`'s backward:
    dtable = g^T x is one product over N giving [V, E] directly."""
    return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=jnp.float32)


def _contract_rows_fwd(x, table):
    return contract_rows(x, table), (x, table)


def _contract_rows_bwd(residuals, g):
    x, table = residuals
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    f32 = jnp.float32
    dx = jax.lax.dot_general(g2, table, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    dt = jax.lax.dot_general(g2, x2, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dx.reshape(x.shape).astype(x.dtype), dt.astype(table.dtype)


contract_rows.defvjp(_contract_rows_fwd, _contract_rows_bwd)


class DenseGeneral(nn.Module):
    """y = x[..., *in] . kernel[*in, *features] (+ bias[*features]).

    Contracts the trailing `num_in_axes` axes of x. The kernel is float32 and cast to `dtype`;
    the product accumulates in float32 and is returned in `out_dtype` (default: `dtype`).
    """

    features: tuple[int, ...]
    axes: tuple[str, ...]  # Logical names of the kernel's axes: input axes, then feature axes.
    num_in_axes: int = 1
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    out_dtype: Dtype | None = None
    kernel_init: Initializer = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[x.ndim - self.num_in_axes :]
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, self.axes),
            tuple(in_shape) + tuple(self.features),
            jnp.float32,
        )
        y = contract(x.astype(self.dtype), kernel.astype(self.dtype), self.num_in_axes)
        if self.use_bias:
            bias_axes = self.axes[self.num_in_axes :]
            init = nn.with_logical_partitioning(nn.initializers.zeros_init(), bias_axes)
            y = y + self.param("bias", init, tuple(self.features), jnp.float32)
        return y.astype(self.out_dtype or self.dtype)


class Embed(nn.Module):
    """A lookup table [num_embeddings, features]; `attend` uses it as a tied output layer."""

    num_embeddings: int
    features: int
    axes: tuple[str, str] = ("vocab", "embed")
    dtype: Dtype = jnp.float32
    embedding_init: Initializer = nn.initializers.normal(0.02)

    def setup(self):
        init = nn.with_logical_partitioning(self.embedding_init, self.axes)
        shape = (self.num_embeddings, self.features)
        self.embedding = self.param("embedding", init, shape, jnp.float32)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [...] int -> [..., features] in `dtype`."""
        return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """x [..., features] -> float32 logits [..., num_embeddings] (tied lm head)."""
        return contract_rows(x.astype(self.dtype), self.embedding.astype(self.dtype))


class Norm(nn.Module):
    """LayerNorm (`center=True`: GPT-2, with bias) or RMSNorm (`center=False`: Llama, T5).

    Statistics are computed in float32, as Hugging Face does, then cast to `dtype`.
    """

    eps: float
    center: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if self.center:
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        features = (x.shape[-1],)
        scale_init = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
        x = x * self.param("scale", scale_init, features, jnp.float32)
        if self.center:
            bias_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",))
            x = x + self.param("bias", bias_init, features, jnp.float32)
        return x.astype(self.dtype)


class Mlp(nn.Module):
    """Feed-forward: wo(act(wi x)), or wo(act(wi_0 x) * wi_1 x) when `gated` (SwiGLU, T5 v1.1)."""

    hidden_dim: int
    features: int
    activation: str
    gated: bool
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer | None = None  # Defaults to kernel_init.

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, features] -> [B, T, features]."""
        act = ACTIVATIONS[self.activation]
        dense = functools.partial(DenseGeneral, use_bias=self.use_bias, dtype=self.dtype)
        wi = functools.partial(
            dense, (self.hidden_dim,), ("embed", "mlp"), kernel_init=self.kernel_init
        )
        if self.gated:
            h = act(wi(name="wi_0")(x)) * wi(name="wi_1")(x)
        else:
            h = act(wi(name="wi")(x))
        out_init = self.out_init or self.kernel_init
        return dense((self.features,), ("mlp", "embed"), kernel_init=out_init, name="wo")(h)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half convention (HF Llama / Qwen2), computed in float32.

    Args:
      x: [B, T, H, D] queries or keys.
      positions: [B, T] int positions of the T tokens.
      theta: base frequency (`rope_theta`).

    Returns:
      [B, T, H, D] in x's dtype.
    """
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def write_rows(buffer: jax.Array, values: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes values[b] into buffer[b, starts[b] : starts[b] + K] for every row b.

    Args:
      buffer: [B, S, ...] the cache.
      values: [B, K, ...] new entries.
      starts: [B] int first position per row. The caller keeps starts[b] + K <= S (XLA would
        otherwise clamp the start and write at the wrong place).

    Returns:
      [B, S, ...] updated buffer (fixed shape; no Python loop over tokens).
    """

    def write_row(row: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(row, new.astype(row.dtype), start, axis=0)

    return jax.vmap(write_row)(buffer, values, starts)


def causal_mask(query_positions: jax.Array, key_length: int) -> jax.Array:
    """[B, 1, T, S] bool: key position s is visible to the query at position p iff s <= p."""
    keys = jnp.arange(key_length)
    return (keys[None, None, :] <= query_positions[:, :, None])[:, None]


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    bias: jax.Array | None = None,
    scale_logits: bool = True,
) -> jax.Array:
    """Multi-head (grouped-query) dot-product attention; logits and softmax in float32.

    Args:
      q: [B, T, H, D] queries.
      k, v: [B, S, Hkv, D] keys and values, H % Hkv == 0; query head h reads kv head h // (H/Hkv)
        (the order of HF's repeat_kv). They may be wider than q (a float32 cache beside
        bfloat16 activations): the probabilities are rounded to q's dtype either way.
      mask: [B, 1, T, S] bool, True where the query may attend.
      bias: optional [B or 1, H, T, S] float additive bias (T5 relative positions).
      scale_logits: divide logits by sqrt(D) (False for T5, whose init absorbs the scale).

    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    # Head-major operands ([B, Hkv, G, T, D], [B, Hkv, S, D]): the two products are then plain
    # batched matrix products over contiguous [T, D] / [S, D] blocks, a quarter faster forward
    # and backward on XLA:CPU than contracting the [B, T, H, D] layout in place.
    q = q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    if scale_logits:
        logits = logits * (d**-0.5)
    if bias is not None:
        logits = logits + bias.reshape(bias.shape[0], hkv, h // hkv, t, s).astype(jnp.float32)
    logits = jnp.where(mask[:, :, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def attend_cached(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    starts: jax.Array,
    scale_logits: bool = True,
) -> jax.Array:
    """`attend` over a cache's slots < starts[b] plus, causally, T new keys/values, without
    writing the new ones into the cache: one softmax over both parts (float32).

    Args:
      q: [B, T, H, D] queries at positions starts[b] .. starts[b] + T - 1.
      k_cache, v_cache: [B, S, Hkv, D]; slots >= starts[b] are ignored; may be wider than q,
        as in `attend`.
      k_new, v_new: [B, T, Hkv, D] this call's keys and values.
      starts: [B] int.

    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, d)
    f32 = jnp.float32
    old = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=f32)
    new = jnp.einsum("btkgd,bskd->bkgts", q, k_new, preferred_element_type=f32)
    if scale_logits:
        old, new = old * (d**-0.5), new * (d**-0.5)
    old = jnp.where((jnp.arange(s) < starts[:, None])[:, None, None, None, :], old, NEG_INF)
    new = jnp.where(jnp.tril(jnp.ones((t, t), bool)), new, NEG_INF)
    top = jnp.maximum(old.max(-1, keepdims=True), new.max(-1, keepdims=True))
    p_old, p_new = jnp.exp(old - top), jnp.exp(new - top)
    total = p_old.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
    p_old, p_new = (p_old / total).astype(q.dtype), (p_new / total).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p_old, v_cache, preferred_element_type=f32)
    out = out + jnp.einsum("bkgts,bskd->btkgd", p_new, v_new, preferred_element_type=f32)
    return out.reshape(b, t, h, d).astype(q.dtype)


class Attention(nn.Module):
    """Projections plus attention: self-attention (optionally through a cache) or cross-attention.

    Self-attention with a cache writes this call's keys/values at per-row positions and attends
    over the whole fixed-length cache under `mask`; without a cache it attends over this call's
    own keys/values.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    features: int  # Model width (output of the `o` projection).
    dtype: Dtype = jnp.float32
    qkv_bias: bool = False
    out_bias: bool = False
    scale_logits: bool = True
    rope_theta: float | None = None  # None = no rotary embedding.
    kernel_init: Initializer = nn.initializers.normal(0.02)
    query_init: Initializer | None = None  # Defaults to kernel_init.
    out_init: Initializer | None = None  # Defaults to kernel_init.

    def setup(self):
        dense = functools.partial(DenseGeneral, dtype=self.dtype)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = functools.partial(dense, use_bias=self.qkv_bias, kernel_init=self.kernel_init)
        self.q = qkv(
            (heads, dim), ("embed", "heads", "kv"), kernel_init=self.query_init or self.kernel_init
        )
        self.k = qkv((kv_heads, dim), ("embed", "kv_heads", "kv"))
        self.v = qkv((kv_heads, dim), ("embed", "kv_heads", "kv"))
        out_init = self.out_init or self.kernel_init
        self.o = dense(
            (self.features,), ("heads", "kv", "embed"), 2, self.out_bias, kernel_init=out_init
        )

    def project_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, S, E] -> keys, values [B, S, Hkv, D] (no rotary; for cross-attention memory)."""
        return self.k(x), self.v(x)

    def self_attention(
        self,
        x: jax.Array,
        mask: jax.Array,
        positions: jax.Array,
        cache: dict[str, jax.Array] | None,
        bias: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """Self-attention of x, optionally through a fixed-length cache.

        Args:
          x: [B, T, E] inputs at positions `positions`.
          mask: [B, 1, T, S] bool; S = cache length with a cache, else T.
          positions: [B, T] int positions (consecutive per row); rotary angles, cache slots.
          cache: {'k', 'v'} [B, S, Hkv, D] or empty/None for teacher forcing without a cache.
          bias: optional [B or 1, H, T, S] additive bias.

        Returns:
          ([B, T, E] output, updated cache or the empty value passed in).
        """
        q = self.q(x)
        k, v = self.project_kv(x)
        if self.rope_theta is not None:
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        if cache:
            k = write_rows(cache["k"], k, positions[:, 0])
            v = write_rows(cache["v"], v, positions[:, 0])
            cache = {"k": k, "v": v}
        out = attend(q, k, v, mask, bias, self.scale_logits)
        return self.o(out), cache

    def cached_self_attention(
        self, x: jax.Array, positions: jax.Array, cache: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Self-attention of x through a cache that it reads but does not write.

        The queries attend to the cache's slots before each row's first position and, causally,
        to this call's own keys/values; the caller writes the returned entries into the cache
        (`write_rows`), once for all layers. Same result as `self_attention` with a cache, but
        a scanned layer stack then neither rebuilds nor copies the whole cache per call.

        Args:
          x: [B, T, E] inputs at positions `positions` (consecutive per row).
          positions: [B, T] int positions.
          cache: {'k', 'v'} [B, S, Hkv, D], valid below positions[:, 0].

        Returns:
          ([B, T, E] output, {'k', 'v'} [B, T, Hkv, D] this call's entries).
        """
        q = self.q(x)
        k, v = self.project_kv(x)
        if self.rope_theta is not None:
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        out = attend_cached(q, cache["k"], cache["v"], k, v, positions[:, 0], self.scale_logits)
        return self.o(out), {"k": k.astype(cache["k"].dtype), "v": v.astype(cache["v"].dtype)}

    def cross_attention(
        self, x: jax.Array, mask: jax.Array, kv: tuple[jax.Array, jax.Array]
    ) -> jax.Array:
        """x [B, T, E] attends to memory kv ([B, S, Hkv, D] each) under mask [B, 1, 1, S]."""
        out = attend(self.q(x), kv[0], kv[1], mask, None, self.scale_logits)
        return self.o(out)


def relative_position_bucket_table(
    length: int, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """T5 bucket of every relative position (key - query) in [-(length-1), length-1].

    Computed on the host in float32 numpy, operation for operation as HF's
    `T5Attention._relative_position_bucket`, so the log-spaced boundaries round the same way
    (XLA's log could round the exact boundary distances, e.g. 16 or 32, differently).

    Returns:
      [2 * length - 1] int32; entry i is the bucket of relative position i - (length - 1).
    """
    relative = np.arange(-(length - 1), length, dtype=np.int64)
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).astype(np.int64) * num_buckets
        distance = np.abs(relative)
    else:
        distance = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        scaled = np.log(distance.astype(np.float32) / np.float32(max_exact))
    scaled = (
        scaled
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    )
    large = max_exact + np.where(distance < max_exact, 0, scaled).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return (buckets + np.where(distance < max_exact, distance, large)).astype(np.int32)


class RelativePositionBias(nn.Module):
    """T5 relative-position bias: a learned scalar per (bucket, head)."""

    num_buckets: int
    max_distance: int
    num_heads: int
    bidirectional: bool  # True in the encoder; False (causal buckets) in the decoder.
    embedding_init: Initializer = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, query_positions: jax.Array, key_length: int) -> jax.Array:
        """query_positions [B, T] int (each < key_length) -> float32 bias [B, H, T, key_length]."""
        table = relative_position_bucket_table(
            key_length, self.bidirectional, self.num_buckets, self.max_distance
        )
        relative = jnp.arange(key_length)[None, None, :] - query_positions[:, :, None]
        index = jnp.clip(relative + key_length - 1, 0, 2 * key_length - 2)
        buckets = jnp.asarray(table)[index]  # [B, T, S]
        init = nn.with_logical_partitioning(self.embedding_init, ("relpos_buckets", "heads"))
        weights = self.param("embedding", init, (self.num_buckets, self.num_heads), jnp.float32)
        return jnp.transpose(weights[buckets], (0, 3, 1, 2))


# Rematerialisation of a block in a differentiated call (MaxText's `remat_policy`): 'none'
# keeps every activation for the backward pass, 'full' keeps only the block's input and
# recomputes the rest, and any name of `jax.checkpoint_policies` keeps what it names (e.g.
# 'dots_with_no_batch_dims_saveable': the matmul outputs).
REMAT_POLICIES = ("none", "full") + tuple(
    name for name in dir(jax.checkpoint_policies) if name.endswith(("saveable", "_saveable"))
)


def check_remat(remat: str) -> str:
    """remat if it names a policy of REMAT_POLICIES, else ValueError listing them."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} is not valid; choose one of {REMAT_POLICIES}.")
    return remat


def scan_layers(
    block: type[nn.Module],
    num_layers: int,
    in_axes: tuple[Any, ...],
    unroll: int = 1,
    remat: str = "none",
) -> type[nn.Module]:
    """Stacks `block` over a leading 'layers' axis with nn.scan (one compiled body for all layers).

    The block's __call__ is (carry, *xs) -> (carry, ys); `in_axes` says per argument after the
    carry whether it is broadcast (nn.broadcast) or sliced per layer (0, e.g. the KV cache).
    `unroll` layers per loop iteration (`jax.lax.scan`'s) and `remat` (REMAT_POLICIES) leave
    the parameters as they are.
    """
    if check_remat(remat) != "none":
        policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
        block = nn.remat(block, policy=policy, prevent_cse=False)
    return nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=in_axes,
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
        unroll=unroll,
    )


# The mesh whose 'data' axis activations' rows are split over while a step is traced
# (`activation_mesh`); None: activations are left to XLA.
_ACTIVATION_MESH: contextvars.ContextVar = contextvars.ContextVar("activation_mesh", default=None)


@contextlib.contextmanager
def activation_mesh(mesh):
    """While tracing under it, `constrain_rows` keeps activations' rows on mesh's 'data' axis."""
    token = _ACTIVATION_MESH.set(mesh)
    try:
        yield
    finally:
        _ACTIVATION_MESH.reset(token)


def constrain_rows(x: jax.Array) -> jax.Array:
    """x [B, ...] with its rows split over the 'data' axis of the `activation_mesh` and nothing
    else split; x as it is outside one. Without it, XLA's sharding propagation may split
    activations like the FSDP-split weights (their 'embed' axis over 'data') and give every
    device every row (seen in the compiled step of an 8-device FSDP mesh)."""
    mesh = _ACTIVATION_MESH.get()
    if mesh is None:
        return x
    spec = jax.sharding.PartitionSpec("data", *(None,) * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
