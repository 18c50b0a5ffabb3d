"""Decoder-only Transformer covering GPT-2, Llama and Qwen2 from one configurable implementation.

GPT-2: learned absolute positions, LayerNorm, gelu_new MLP, biases everywhere, tied embeddings.
Llama / Qwen2: RoPE, RMSNorm, SwiGLU, grouped-query attention, optional q/k/v bias (Qwen2),
tied or untied lm head. Layers are stacked with nn.scan, so every layer parameter and the KV
cache carry a leading [num_layers] axis.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from distillspec.models import layers
from distillspec.models.base import DECODE_DTYPES, FlaxModel

DTYPES = DECODE_DTYPES  # Compute dtypes: float32 and bfloat16.
# Teacher-forced calls (training, scoring) of a stack this shallow run its layers unrolled: a
# scanned stack's backward pass writes each layer's activations into stacked buffers and reads
# them back (the main job's 2-layer target pretrained 6-10% faster unrolled). Deeper stacks and
# every cached (decoding) call stay scanned: compile time, and decoding was slower unrolled.
UNROLL_MAX_LAYERS = 4


def check_choice(name: str, value: Any, choices: Any) -> None:
    """Raises ValueError naming the field, the bad value and the valid choices."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {sorted(choices)}.")


def check_dtypes(config: Any) -> None:
    """Raises ValueError unless config.dtype and config.cache_dtype (or None) name DTYPES."""
    check_choice("dtype", config.dtype, set(DTYPES))
    if config.cache_dtype is not None:
        check_choice("cache_dtype", config.cache_dtype, set(DTYPES))


def check_positive(config: Any, names: tuple[str, ...]) -> None:
    """Raises ValueError unless every named field of `config` is > 0."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0.")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a decoder-only Transformer (defaults: a tiny Llama-style model)."""

    vocab_size: int = 256  # Rows of the token embedding and columns of the lm head.
    embed_dim: int = 64  # Model width (HF hidden_size / n_embd).
    num_layers: int = 2  # Number of Transformer blocks.
    num_heads: int = 4  # Query heads.
    num_kv_heads: int = 4  # Key/value heads; fewer than num_heads is grouped-query attention.
    head_dim: int = 16  # Width of one attention head.
    mlp_dim: int = 256  # Hidden width of the feed-forward block.
    position_embedding: str = "rope"  # 'rope' (Llama, Qwen2) or 'learned' absolute table (GPT-2).
    max_positions: int = 2048  # Rows of the learned position table (unused by 'rope').
    rope_theta: float = 10000.0  # RoPE base frequency (unused by 'learned').
    norm: str = "rmsnorm"  # 'rmsnorm' (Llama, Qwen2) or 'layernorm' with bias (GPT-2).
    norm_eps: float = 1e-6  # Epsilon added to the variance inside the norms.
    activation: str = "silu"  # MLP nonlinearity: 'silu', 'gelu_new' (tanh approx.), 'gelu', 'relu'.
    gated_mlp: bool = True  # act(x W_gate) * (x W_up) (SwiGLU) instead of act(x W_in).
    qkv_bias: bool = False  # Biases on the query/key/value projections (GPT-2, Qwen2).
    out_bias: bool = False  # Bias on the attention output projection (GPT-2).
    mlp_bias: bool = False  # Biases in the feed-forward block (GPT-2).
    tie_embeddings: bool = False  # lm head = transposed token embedding (GPT-2, small Qwen2).
    dtype: str = "float32"  # Compute dtype, 'float32' or 'bfloat16'; params stay float32.
    cache_dtype: str | None = None  # KV cache dtype when decoding; None: the compute dtype.
    init_std: float = 0.02  # Std of the normal init of fresh parameters (HF's initializer_range).
    # What a teacher-forced (training) call keeps of each block for the backward pass
    # (`layers.REMAT_POLICIES`: 'none', 'full' or a jax.checkpoint_policies name).
    remat: str = "none"

    def __post_init__(self):
        check_positive(self, ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads"))
        check_positive(self, ("head_dim", "mlp_dim", "max_positions", "rope_theta", "norm_eps"))
        check_positive(self, ("init_std",))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}."
            )
        check_choice("position_embedding", self.position_embedding, {"rope", "learned"})
        check_choice("norm", self.norm, {"rmsnorm", "layernorm"})
        check_choice("activation", self.activation, set(layers.ACTIVATIONS))
        check_dtypes(self)
        layers.check_remat(self.remat)
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def kv_cache_dtype(self) -> Any:
        return DTYPES[self.cache_dtype or self.dtype]


class _Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask, positions, cache):
        """x [B, T, E]; mask [B, 1, T, S]; positions [B, T]; cache {'k','v'} [B, S, Hkv, D] | {}."""
        cfg, dtype = self.config, self.config.compute_dtype
        norm = functools.partial(
            layers.Norm, cfg.norm_eps, center=cfg.norm == "layernorm", dtype=dtype
        )
        init = nn.initializers.normal(cfg.init_std)
        attention = layers.Attention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim, dtype,
            qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
            rope_theta=cfg.rope_theta if cfg.position_embedding == "rope" else None,
            kernel_init=init, name="attn",
        )  # fmt: skip
        if cache:  # The stack writes this call's entries into the cache after the scan.
            h, cache = attention.cached_self_attention(norm(name="attn_norm")(x), positions, cache)
        else:
            h, cache = attention.self_attention(norm(name="attn_norm")(x), mask, positions, cache)
        x = x + h
        mlp = layers.Mlp(
            cfg.mlp_dim, cfg.embed_dim, cfg.activation, cfg.gated_mlp, cfg.mlp_bias, dtype,
            kernel_init=init, name="mlp",
        )  # fmt: skip
        return layers.constrain_rows(x + mlp(norm(name="mlp_norm")(x))), cache


_LAYER_IN_AXES = (nn.broadcast, nn.broadcast, 0)  # mask, positions broadcast; the cache per layer.


class DecoderOnlyTransformer(nn.Module):
    """The flax module; use it through `DecoderOnlyLM`."""

    config: TransformerConfig

    def setup(self):
        cfg, dtype = self.config, self.config.compute_dtype
        init = nn.initializers.normal(cfg.init_std)
        self.embed = layers.Embed(cfg.vocab_size, cfg.embed_dim, dtype=dtype, embedding_init=init)
        if cfg.position_embedding == "learned":
            self.pos_embed = layers.Embed(
                cfg.max_positions, cfg.embed_dim, ("abspos", "embed"), dtype, init
            )
        self.layers = layers.scan_layers(_Block, cfg.num_layers, _LAYER_IN_AXES)(cfg)
        self.final_norm = layers.Norm(cfg.norm_eps, cfg.norm == "layernorm", dtype)
        if not cfg.tie_embeddings:
            self.lm_head = layers.DenseGeneral(
                (cfg.vocab_size,), ("embed", "vocab"), dtype=dtype, out_dtype=jnp.float32,
                kernel_init=init,
            )  # fmt: skip

    def __call__(
        self,
        tokens: jax.Array,
        starts: jax.Array,
        cache: dict[str, jax.Array],
        select: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs tokens [B, T] placed at positions starts[b] .. starts[b] + T - 1.

        Args:
          tokens: [B, T] int token ids.
          starts: [B] int position of each row's first token.
          cache: {'k', 'v'} [num_layers, B, S, Hkv, D], or {} to attend within `tokens` only
            (teacher forcing; then starts must be 0).
          select: optional [B, N] indices into T: the head runs on those positions only.

        Returns:
          (logits [B, T, V] (or [B, N, V]) float32, this call's entries {'k', 'v'}
          [num_layers, B, T, Hkv, D] (the cache is only read; `DecoderOnlyLM` writes them) or
          {}).
        """
        x, entries = self.features(tokens, starts, cache, select)
        return self.head(x), entries

    def features(self, tokens, starts, cache, select=None):
        """`__call__` up to the head: (final hidden states [B, T, E] (or [B, N, E]), entries)."""
        positions = starts[:, None] + jnp.arange(tokens.shape[1])  # [B, T]
        key_length = cache["k"].shape[2] if cache else tokens.shape[1]
        mask = layers.causal_mask(positions, key_length)
        x = self.embed(tokens)
        if self.config.position_embedding == "learned":
            x = x + self.pos_embed(positions)
        x, entries = self._run_layers(layers.constrain_rows(x), mask, positions, cache)
        if select is not None:  # The head and what follows it only where they are needed.
            x = jnp.take_along_axis(x, select[..., None], axis=1)
        return self.final_norm(x), entries

    def head(self, x: jax.Array) -> jax.Array:
        """Final hidden states [..., E] -> logits [..., V] float32."""
        logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32)

    def _run_layers(self, x, mask, positions, cache):
        """The layer stack: the scanned module, or its parameters through a copy of it for a
        teacher-forced call, unrolled for a shallow stack (UNROLL_MAX_LAYERS) and
        rematerialised as `config.remat` says (decoding never is)."""
        count, remat = self.config.num_layers, self.config.remat
        shallow = count <= UNROLL_MAX_LAYERS
        if cache or (not shallow and remat == "none") or self.is_initializing():
            return self.layers(x, mask, positions, cache)
        unroll = count if shallow else 1
        stack = layers.scan_layers(_Block, count, _LAYER_IN_AXES, unroll=unroll, remat=remat)
        unrolled = stack(self.config, parent=None)  # Unbound: applied to the stack's parameters.
        return unrolled.apply(
            {"params": self.layers.variables["params"]}, x, mask, positions, cache
        )


class DecoderOnlyLM(FlaxModel):
    """A decoder-only language model implementing `distillspec.models.base.DecodingModel`.

    Params are a plain pytree of float32 arrays (no flax boxing); `logical_axes()` gives their
    logical PartitionSpecs. All methods are jit-traceable; `cache_length` is a static int.
    """

    def __init__(self, config: TransformerConfig):
        self.config = config
        self.vocab_size = config.vocab_size
        self.encoder_decoder = False
        self.module = DecoderOnlyTransformer(config)

    def _init_variables(self, rng: jax.Array) -> Any:
        tokens = jnp.zeros((1, 1), jnp.int32)
        return self.module.init(rng, tokens, jnp.zeros((1,), jnp.int32), {})

    def logits(
        self, params: Any, batch: dict[str, jax.Array], positions: jax.Array | None = None
    ) -> jax.Array:
        """Teacher-forced logits.

        Args:
          params: model parameters.
          batch: {'decoder_input_tokens': [B, L] int}. Rows are right-padded; attention is
            causal, so real positions never attend to the right padding, and logits at padding
            positions are meaningless (losses weight them out).
          positions: optional [B, N] int: only the logits at these positions (the packed
            batch's `loss_positions`), computed without the head's work elsewhere.

        Returns:
          [B, L, V] (or [B, N, V]) float32 logits; position t predicts token t + 1.
        """
        return self.head(self.head_params(params), self.features(params, batch, positions))

    def features(
        self, params: Any, batch: dict[str, jax.Array], positions: jax.Array | None = None
    ) -> jax.Array:
        """`logits` before the head: final hidden states [B, L, E] (or [B, N, E])."""
        tokens = batch["decoder_input_tokens"]
        starts = jnp.zeros((tokens.shape[0],), jnp.int32)
        x, _ = self.module.apply(
            {"params": params}, tokens, starts, {}, positions, method="features"
        )
        return x

    def head_params(self, params: Any) -> Any:
        """The part of params the head reads (the tied embedding or the lm head)."""
        name = "embed" if self.config.tie_embeddings else "lm_head"
        return {name: params[name]}

    def head(self, head_params: Any, x: jax.Array) -> jax.Array:
        """Hidden states [..., E] -> logits [..., V] float32, from `head_params` alone."""
        return self.module.apply({"params": head_params}, x, method="head")

    def init_cache(self, batch_size: int, cache_length: int) -> dict[str, jax.Array]:
        """Zero cache {'k', 'v'}: [num_layers, B, cache_length, num_kv_heads, head_dim] each."""
        cfg = self.config
        shape = (cfg.num_layers, batch_size, cache_length, cfg.num_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, cfg.kv_cache_dtype)
        return {"k": zeros, "v": zeros}

    def prefill(
        self, params: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_length: int
    ) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
        """Feeds the whole padded prompt at position 0 into a fresh cache (see base.py).

        Padding slots get written too; they lie at positions >= prompt_lengths and are never
        read before the decoders overwrite them.

        Returns:
          (cache, prompt_tokens [B, P], prompt_lengths - 1 [B]).
        """
        batch, prompt_length = prompt_tokens.shape
        if prompt_length > cache_length:
            raise ValueError(f"prompt length {prompt_length} exceeds cache_length={cache_length}.")
        cfg = self.config
        if cfg.position_embedding == "learned" and cache_length > cfg.max_positions:
            # Gathers past the position table would silently clamp to its last row.
            raise ValueError(
                f"cache_length={cache_length} exceeds max_positions={cfg.max_positions}."
            )
        cache = self.init_cache(batch, cache_length)
        starts = jnp.zeros((batch,), jnp.int32)
        _, cache = self.extend(params, cache, prompt_tokens, starts)
        return cache, prompt_tokens, prompt_lengths - 1

    def extend(
        self, params: Any, cache: dict[str, jax.Array], tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Feeds tokens [B, K] at per-row starts [B]; returns (logits [B, K, V], cache).

        Row b's tokens go to cache slots positions[b] .. positions[b] + K - 1 (the caller keeps
        them < cache_length); each query attends to slots <= its own position only.
        """
        logits, entries = self.module.apply({"params": params}, tokens, positions, cache)
        return logits, self.write_entries(cache, entries, positions)

    def extend_entries(
        self,
        params: Any,
        cache: dict[str, jax.Array],
        tokens: jax.Array,
        positions: jax.Array,
        pad_to: int | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`extend` that only reads the cache: (logits [B, K, V], entries), the entries
        {'k', 'v'} [num_layers, B, pad_to or K, Hkv, D] that `write_entries` puts in the cache
        (zero past K: slots past a row's accepted tokens are never read, see base.py).

        The decoder picks a verify width inside its loop; a conditional whose branches wrote
        the cache made XLA copy the whole cache every round, one write after it does not.
        """
        logits, entries = self.module.apply({"params": params}, tokens, positions, cache)
        extra = (pad_to or tokens.shape[1]) - tokens.shape[1]
        pad = lambda e: jnp.pad(e, [(0, 0), (0, 0), (0, extra), (0, 0), (0, 0)])
        return logits, jax.tree.map(pad, entries)

    def write_entries(
        self, cache: dict[str, jax.Array], entries: dict[str, jax.Array], positions: jax.Array
    ) -> dict[str, jax.Array]:
        """The cache with `extend_entries`'s entries [L, B, K, Hkv, D] written from each row's
        position [B]: one in-place write per call."""
        write = jax.vmap(layers.write_rows, in_axes=(0, 0, None))
        return {name: write(cache[name], entries[name], positions) for name in ("k", "v")}
