"""T5 v1.1 encoder-decoder: RMSNorm, gated-GELU MLP, relative position buckets, no biases.

As in HF / Mesh TF: attention logits are not scaled by 1/sqrt(d) (the init absorbs it), the
relative-position bias is computed once per stack and shared by all its layers (HF stores it in
layer 0), the encoder buckets are bidirectional and the decoder's causal. Token 0 is both the
padding id and the decoder start token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from distillspec.models import layers
from distillspec.models.base import FlaxModel
from distillspec.models.decoder_only import DTYPES, check_dtypes, check_positive

PAD_ID = 0  # Encoder padding id.
DECODER_START_ID = 0  # First decoder input token.


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Architecture of a T5 v1.1 model (defaults: a tiny one)."""

    vocab_size: int = 256  # Rows of the shared token embedding and columns of the lm head.
    embed_dim: int = 64  # Model width (HF d_model).
    num_encoder_layers: int = 2  # Encoder blocks (HF num_layers).
    num_decoder_layers: int = 2  # Decoder blocks (HF num_decoder_layers).
    num_heads: int = 4  # Attention heads.
    head_dim: int = 16  # Width of one head (HF d_kv).
    mlp_dim: int = 128  # Hidden width of the gated-GELU block (HF d_ff).
    relative_buckets: int = 32  # Relative-position buckets (HF relative_attention_num_buckets).
    relative_max_distance: int = 128  # Distance of the last log-spaced bucket.
    norm_eps: float = 1e-6  # Epsilon inside the RMSNorms (HF layer_norm_epsilon).
    tie_embeddings: bool = False  # lm head = transposed shared embedding (False in v1.1).
    scale_decoder_outputs: bool = False  # Decoder output * d**-0.5 before the head (original T5).
    dtype: str = "float32"  # Compute dtype, 'float32' or 'bfloat16'; params stay float32.
    cache_dtype: str | None = None  # Self-attention cache dtype when decoding; None: dtype.
    # What a differentiated call keeps of each block for the backward pass
    # (`layers.REMAT_POLICIES`: 'none', 'full' or a jax.checkpoint_policies name).
    remat: str = "none"

    def __post_init__(self):
        layers.check_remat(self.remat)
        check_positive(
            self, ("vocab_size", "embed_dim", "num_encoder_layers", "num_decoder_layers")
        )
        check_positive(self, ("num_heads", "head_dim", "mlp_dim", "relative_buckets", "norm_eps"))
        if self.relative_max_distance <= self.relative_buckets // 2:
            raise ValueError(
                f"relative_max_distance={self.relative_max_distance} must exceed "
                f"relative_buckets // 2 = {self.relative_buckets // 2}."
            )
        check_dtypes(self)

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def kv_cache_dtype(self) -> Any:
        return DTYPES[self.cache_dtype or self.dtype]


def _attention(cfg: T5Config, name: str) -> layers.Attention:
    """Unscaled attention with T5X's init (query init shrunk by head_dim**-0.5 instead)."""
    return layers.Attention(
        cfg.num_heads, cfg.num_heads, cfg.head_dim, cfg.embed_dim, cfg.compute_dtype,
        scale_logits=False, kernel_init=layers.fan_in_init(1.0, 1),
        query_init=layers.fan_in_init(1.0 / cfg.head_dim, 1),
        out_init=layers.fan_in_init(1.0, 2), name=name,
    )  # fmt: skip


def _mlp(cfg: T5Config) -> layers.Mlp:
    return layers.Mlp(
        cfg.mlp_dim, cfg.embed_dim, "gelu_new", True, dtype=cfg.compute_dtype,
        kernel_init=layers.fan_in_init(1.0, 1), name="mlp",
    )  # fmt: skip


def _norm(cfg: T5Config, name: str) -> layers.Norm:
    return layers.Norm(cfg.norm_eps, center=False, dtype=cfg.compute_dtype, name=name)


def _relative_bias(cfg: T5Config, bidirectional: bool) -> layers.RelativePositionBias:
    return layers.RelativePositionBias(
        cfg.relative_buckets, cfg.relative_max_distance, cfg.num_heads, bidirectional,
        embedding_init=nn.initializers.normal(cfg.embed_dim**-0.5), name="relpos",
    )  # fmt: skip


class _EncoderBlock(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x, mask, bias):
        """x [B, Le, E]; mask [B, 1, 1, Le] (keys that are not padding); bias [1, H, Le, Le]."""
        cfg = self.config
        positions = jnp.zeros(x.shape[:2], jnp.int32)  # Unused: T5 has no rotary embedding.
        h, _ = _attention(cfg, "attn").self_attention(
            _norm(cfg, "attn_norm")(x), mask, positions, None, bias
        )
        x = x + h
        return layers.constrain_rows(x + _mlp(cfg)(_norm(cfg, "mlp_norm")(x))), None


class _DecoderBlock(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x, self_mask, self_bias, cross_mask, positions, encoded, cache):
        """One decoder block; `cache` is this layer's slice.

        Args:
          x: [B, T, E] decoder states at positions [B, T].
          self_mask: [B, 1, T, S]; self_bias: [B, H, T, S]; cross_mask: [B, 1, 1, Le].
          positions: [B, T] int.
          encoded: [B, Le, E] encoder output, or None when cache holds the cross k/v.
          cache: {} (teacher forcing), {'self'} (prefill: cross k/v get computed and returned),
            or {'self', 'cross'} (decoding). 'self'/'cross' are {'k','v'} / (k, v) arrays.
        """
        cfg = self.config
        self_cache = cache.get("self")
        h, self_cache = _attention(cfg, "self_attn").self_attention(
            _norm(cfg, "self_attn_norm")(x), self_mask, positions, self_cache, self_bias
        )
        x = x + h
        cross = _attention(cfg, "cross_attn")
        kv = cache["cross"] if "cross" in cache else cross.project_kv(encoded)
        x = x + cross.cross_attention(_norm(cfg, "cross_attn_norm")(x), cross_mask, kv)
        x = x + _mlp(cfg)(_norm(cfg, "mlp_norm")(x))
        return layers.constrain_rows(x), ({"self": self_cache, "cross": kv} if cache else {})


class _Encoder(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x [B, Le, E] embedded input, mask [B, Le] bool (not padding) -> [B, Le, E]."""
        cfg = self.config
        positions = jnp.arange(x.shape[1])[None]  # [1, Le]
        bias = _relative_bias(cfg, bidirectional=True)(positions, x.shape[1])
        stack = layers.scan_layers(
            _EncoderBlock, cfg.num_encoder_layers, (nn.broadcast, nn.broadcast), remat=cfg.remat
        )
        x, _ = stack(cfg, name="layers")(x, mask[:, None, None, :], bias)
        return _norm(cfg, "final_norm")(x)


class _Decoder(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x, positions, key_length, encoder_mask, encoded, cache):
        """x [B, T, E] embedded decoder input at positions [B, T]; the rest as in _DecoderBlock."""
        cfg = self.config
        bias = _relative_bias(cfg, bidirectional=False)(positions, key_length)
        self_mask = layers.causal_mask(positions, key_length)
        in_axes = (nn.broadcast,) * 5 + (0,)
        stack = layers.scan_layers(_DecoderBlock, cfg.num_decoder_layers, in_axes, remat=cfg.remat)
        x, cache = stack(cfg, name="layers")(
            x, self_mask, bias, encoder_mask[:, None, None, :], positions, encoded, cache
        )
        return _norm(cfg, "final_norm")(x), cache


class T5Transformer(nn.Module):
    """The flax module; use it through `T5LM`."""

    config: T5Config

    def setup(self):
        cfg = self.config
        self.embed = layers.Embed(
            cfg.vocab_size, cfg.embed_dim, dtype=cfg.compute_dtype,
            embedding_init=nn.initializers.normal(1.0),
        )  # fmt: skip
        self.encoder = _Encoder(cfg)
        self.decoder = _Decoder(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = layers.DenseGeneral(
                (cfg.vocab_size,), ("embed", "vocab"), dtype=cfg.compute_dtype,
                out_dtype=jnp.float32, kernel_init=layers.fan_in_init(1.0, 1),
            )  # fmt: skip

    def encode(self, encoder_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """encoder_tokens [B, Le] (0 = padding) -> (encoded [B, Le, E], mask [B, Le] bool)."""
        mask = encoder_tokens != PAD_ID
        return self.encoder(self.embed(encoder_tokens), mask), mask

    def decode(self, tokens, starts, key_length, encoder_mask, encoded, cache):
        """tokens [B, T] at positions starts[b] + i -> (logits [B, T, V] f32, cache)."""
        x, cache = self.decode_features(tokens, starts, key_length, encoder_mask, encoded, cache)
        return self.head(x), cache

    def decode_features(self, tokens, starts, key_length, encoder_mask, encoded, cache):
        """`decode` up to the head: (hidden states [B, T, E], cache)."""
        positions = starts[:, None] + jnp.arange(tokens.shape[1])
        x, cache = self.decoder(
            self.embed(tokens), positions, key_length, encoder_mask, encoded, cache
        )
        if self.config.scale_decoder_outputs:
            x = x * (self.config.embed_dim**-0.5)
        return x, cache

    def head(self, x: jax.Array) -> jax.Array:
        """Hidden states [..., E] -> logits [..., V] float32."""
        logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32)

    def __call__(self, encoder_tokens: jax.Array, decoder_tokens: jax.Array) -> jax.Array:
        """Teacher forcing: [B, Le], [B, L] -> logits [B, L, V] float32."""
        return self.head(self.features(encoder_tokens, decoder_tokens))

    def features(self, encoder_tokens: jax.Array, decoder_tokens: jax.Array) -> jax.Array:
        """Teacher forcing up to the head: [B, Le], [B, L] -> hidden states [B, L, E]."""
        encoded, mask = self.encode(encoder_tokens)
        starts = jnp.zeros((decoder_tokens.shape[0],), jnp.int32)
        length = decoder_tokens.shape[1]
        return self.decode_features(decoder_tokens, starts, length, mask, encoded, {})[0]


class T5LM(FlaxModel):
    """A T5 v1.1 model implementing `distillspec.models.base.DecodingModel`.

    The cache is {'layers': {'self': {'k','v'} [Ld, B, S, H, D], 'cross': (k, v) [Ld, B, Le, H, D]},
    'encoder_mask': [B, Le] bool}: the encoder runs once, in `prefill`.
    """

    def __init__(self, config: T5Config):
        self.config = config
        self.vocab_size = config.vocab_size
        self.encoder_decoder = True
        self.module = T5Transformer(config)

    def _init_variables(self, rng: jax.Array) -> Any:
        tokens = jnp.ones((1, 1), jnp.int32)
        return self.module.init(rng, tokens, tokens)

    def logits(
        self, params: Any, batch: dict[str, jax.Array], positions: jax.Array | None = None
    ) -> jax.Array:
        """Teacher-forced logits.

        Args:
          params: model parameters.
          batch: {'encoder_input_tokens': [B, Le] int, 'decoder_input_tokens': [B, L] int}.
            Both are right-padded. Encoder token id 0 is padding and is masked out of attention.
            Decoder inputs start with the start token 0 (targets shifted right); decoder
            attention is causal, so real positions never attend to right padding, and logits at
            padding positions are meaningless (losses weight them out).
          positions: optional [B, N] int: only the logits at these positions.

        Returns:
          [B, L, V] (or [B, N, V]) float32 logits.
        """
        return self.head(self.head_params(params), self.features(params, batch, positions))

    def features(
        self, params: Any, batch: dict[str, jax.Array], positions: jax.Array | None = None
    ) -> jax.Array:
        """`logits` before the head: decoder hidden states [B, L, E] (or [B, N, E])."""
        x = self.module.apply(
            {"params": params}, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
            method="features",
        )  # fmt: skip
        if positions is None:  # (The packed T5 batch has no prompt positions to leave out.)
            return x
        return jnp.take_along_axis(x, positions[..., None], axis=1)

    def head_params(self, params: Any) -> Any:
        """The part of params the head reads (the tied embedding or the lm head)."""
        name = "embed" if self.config.tie_embeddings else "lm_head"
        return {name: params[name]}

    def head(self, head_params: Any, x: jax.Array) -> jax.Array:
        """Hidden states [..., E] -> logits [..., V] float32, from `head_params` alone."""
        return self.module.apply({"params": head_params}, x, method="head")

    def prefill(
        self, params: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_length: int
    ) -> tuple[dict[str, Any], jax.Array, jax.Array]:
        """Encodes prompt_tokens [B, P] (0 = padding; prompt_lengths is implied by it).

        Also precomputes every decoder layer's cross-attention keys/values, by feeding the start
        token at position 0 (the decoders feed it again; the rewrite is identical).

        Returns:
          (cache, zeros [B, 1] int32 (the start token), zeros [B] int32).
        """
        del prompt_lengths  # The padding mask comes from the token ids, as in `logits`.
        cfg, batch = self.config, prompt_tokens.shape[0]
        encoded, mask = self.module.apply({"params": params}, prompt_tokens, method="encode")
        shape = (cfg.num_decoder_layers, batch, cache_length, cfg.num_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, cfg.kv_cache_dtype)
        start = jnp.full((batch, 1), DECODER_START_ID, jnp.int32)
        starts = jnp.zeros((batch,), jnp.int32)
        _, layer_cache = self.module.apply(
            {"params": params}, start, starts, cache_length, mask, encoded,
            {"self": {"k": zeros, "v": zeros}}, method="decode",
        )  # fmt: skip
        cache = {"layers": layer_cache, "encoder_mask": mask}
        return cache, start, starts

    def extend(
        self, params: Any, cache: dict[str, Any], tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Feeds decoder tokens [B, K] at per-row starts [B]; returns (logits [B, K, V], cache)."""
        key_length = cache["layers"]["self"]["k"].shape[2]
        logits, layer_cache = self.module.apply(
            {"params": params}, tokens, positions, key_length, cache["encoder_mask"], None,
            cache["layers"], method="decode",
        )  # fmt: skip
        return logits, {"layers": layer_cache, "encoder_mask": cache["encoder_mask"]}
