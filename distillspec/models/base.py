"""The interface every model offers to the decoders.

The decoders (`distillspec.decoding`) never look inside a model: they
drive any object with the methods below, in the spirit of T5X's `tokens_to_logits` callables. Tests
drive them with stub models whose distributions are known exactly.

Sequence layout on the decoder side: right-padded. Position `t` of row `b` holds the `t`-th token
of that row; the key/value cache has a fixed length `cache_length` and is written in place.

Cache contract (what makes rolling back rejected drafts a per-row index move):
  * `extend(params, cache, tokens[B, K], positions[B])` writes the K tokens of row b at cache
    positions `positions[b] .. positions[b] + K - 1` and returns their logits [B, K, V].
  * The query at position `positions[b] + i` attends to cache positions `<= positions[b] + i`
    only. Whatever lies beyond (padding from a ragged prompt, drafts that were rejected) is never
    read and is simply overwritten later.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Protocol, runtime_checkable

import flax.linen as nn
import jax
import jax.numpy as jnp

Params = Any
Cache = Any


class DecodingModel(Protocol):
    """What a model must provide to be decoded by `distillspec.decoding`."""

    vocab_size: int  # Size of the logits' last axis.
    # True: the prompt is the encoder's input (T5); False: the decoder continues the prompt.
    encoder_decoder: bool

    def prefill(
        self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_length: int
    ) -> tuple[Cache, jax.Array, jax.Array]:
        """Consumes the prompt once and sets up a cache for decoding.

        Args:
          params: the model's parameter pytree.
          prompt_tokens: [B, P] int32, right-padded prompts (decoder-only: the start of the
            decoder sequence; encoder-decoder: the encoder input, 0 = padding).
          prompt_lengths: [B] int32, number of real tokens per row (>= 1 for decoder-only).
          cache_length: fixed length of the decoder-side cache, in positions.

        Returns:
          cache: the decoding state after the prompt.
          prefix: [B, S] int32, the decoder-side sequence so far (decoder-only: the prompt;
            encoder-decoder: the decoder start token, S = 1).
          last_position: [B] int32, position of the last real token of `prefix`. The cache
            holds valid entries for all positions < last_position; the token at last_position
            has not necessarily been fed yet (the decoders feed it, and may rewrite positions
            already written, which is harmless because the content is identical).
        """
        ...

    def extend(
        self, params: Params, cache: Cache, tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, Cache]:
        """Feeds tokens [B, K] at per-row positions [B]; returns (logits [B, K, V] f32, cache)."""
        ...

    # Optional, for dynamic lookahead: `extend` split into a call that only reads the cache and
    # returns this call's entries (padded with zeros to pad_to tokens), and their write:
    #   extend_entries(params, cache, tokens, positions, pad_to=None) -> (logits, entries)
    #   write_entries(cache, entries, positions) -> cache
    # The decoder then verifies at a per-round width with one cache write after the choice of
    # width (a model without them has its cache copied every dynamic round, see
    # `distillspec.decoding._verify`). `entry_writer(model)` says whether a model has them.


def entry_writer(model: Any) -> bool:
    """Whether model offers the optional extend_entries / write_entries pair (see above)."""
    return callable(getattr(model, "extend_entries", None))


@runtime_checkable
class ScoringModel(DecodingModel, Protocol):
    """A decoding model that also scores whole sequences by teacher forcing (training, TVD,
    DISCO features): every model of `distillspec.models` is one."""

    def logits(
        self, params: Params, batch: dict[str, jax.Array], positions: jax.Array | None = None
    ) -> jax.Array:
        """Teacher-forced logits [B, L, V] float32 of a packed batch (`datagen.pack_for`), or
        [B, N, V] at `positions` [B, N] only (the batch's `loss_positions`)."""
        ...

    # Optional, so that no [B, L, V] array need exist (`distillspec.heads`): `logits` split
    # into the final hidden states and the output head, logits = head(head_params(params),
    # features(params, batch, positions)):
    #   features(params, batch, positions=None) -> [B, L or N, E]
    #   head_params(params) -> the subtree the head reads (the lm head or tied embedding)
    #   head(head_params, hidden [..., E]) -> logits [..., V] float32


class FlaxModel(abc.ABC):
    """Parameter plumbing shared by the flax model wrappers.

    Subclasses set `self.module` and `self.config` (a frozen dataclass) and define
    `_init_variables(rng)`, which initialises the module on dummy inputs.
    """

    @abc.abstractmethod
    def _init_variables(self, rng: jax.Array) -> Any:
        """The module's variables, initialised on dummy inputs."""

    # Models of the same class and config are interchangeable: the decoders' compiled programs
    # (cached per model) are then shared, e.g. by a standard and a distilled draft.
    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.config == other.config

    def __hash__(self) -> int:
        return hash((type(self), self.config))

    def init(self, rng: jax.Array) -> Params:
        """Fresh parameters (plain float32 pytree, no flax boxing) from a PRNG key."""
        # One compiled program instead of hundreds of eagerly dispatched initialisers.
        return nn.meta.unbox(jax.jit(self._init_variables)(rng)["params"])

    def logical_axes(self) -> Any:
        """Pytree of `jax.sharding.PartitionSpec` of logical axis names, matching `init`'s."""
        abstract = jax.eval_shape(self._init_variables, jax.random.PRNGKey(0))
        return nn.get_partition_spec(abstract)["params"]


@dataclasses.dataclass(frozen=True)
class TruncatedVocabulary:
    """A model whose logits keep only the first `vocab_size` ids.

    Two models that share a tokenizer but pad their embeddings to different sizes (Qwen2.5
    sizes do) are compared and trained over the tokenizer's ids only: padded ids are never
    sampled, drafted or scored. Everything else (params, init, logical axes) is the model's.
    """

    model: Any
    vocab_size: int

    def __post_init__(self):
        if not 1 <= self.vocab_size <= self.model.vocab_size:
            raise ValueError(
                f"vocab_size must be in [1, {self.model.vocab_size}] (the model's embedding "
                f"size), got {self.vocab_size!r}"
            )

    @property
    def encoder_decoder(self) -> bool:
        return self.model.encoder_decoder

    @property
    def config(self) -> Any:
        return self.model.config

    def prefill(self, params, prompt_tokens, prompt_lengths, cache_length):
        return self.model.prefill(params, prompt_tokens, prompt_lengths, cache_length)

    def extend(self, params, cache, tokens, positions):
        logits, cache = self.model.extend(params, cache, tokens, positions)
        return logits[..., : self.vocab_size], cache

    @property
    def extend_entries(self):
        """The model's extend_entries with logits cut to vocab_size, or None without one."""
        if not entry_writer(self.model):
            return None

        def extend_entries(params, cache, tokens, positions, pad_to=None):
            logits, entries = self.model.extend_entries(params, cache, tokens, positions, pad_to)
            return logits[..., : self.vocab_size], entries

        return extend_entries

    def write_entries(self, cache, entries, positions):
        return self.model.write_entries(cache, entries, positions)

    def logits(self, params, batch, positions=None):
        return self.model.logits(params, batch, positions)[..., : self.vocab_size]

    def features(self, params, batch, positions=None):
        return self.model.features(params, batch, positions)

    def head_params(self, params):
        return self.model.head_params(params)

    def head(self, head_params, x):
        return self.model.head(head_params, x)[..., : self.vocab_size]

    def init(self, rng):
        return self.model.init(rng)

    def logical_axes(self):
        return self.model.logical_axes()


# Decoding dtypes: parameters and activations in this dtype; logits stay float32.
DECODE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_decode_dtype(dtype: Any) -> str:
    """dtype if it is a decoding dtype name; ValueError naming it and the valid ones otherwise."""
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DECODE_DTYPES)}, got {dtype!r}")
    return dtype


def cast_params(params: Params, dtype: str) -> Params:
    """params with every floating-point leaf in dtype (integer leaves untouched)."""
    target = DECODE_DTYPES[check_decode_dtype(dtype)]

    def cast(x):
        return x.astype(target) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x

    return jax.tree.map(cast, params)


def decode_cache_dtype(dtype: str, cache_dtype: str = "auto") -> str:
    """The KV cache dtype for decoding in dtype: cache_dtype, or for 'auto' float32 on XLA's CPU
    backend and dtype elsewhere. ValueError naming a bad value and the valid ones.

    XLA's CPU backend computes a bfloat16 dot in float32, so a bfloat16 cache would be
    converted whole to float32 in every decoding step (README section 3 shows the compiled
    program); a float32 cache holds the same bfloat16-rounded keys and values (the projections
    compute in dtype and round before the cache widens them), so the same numbers enter the
    same float32 arithmetic: the tests find the logits bit-identical (a compiled loop may still
    order a sum differently). On accelerators a bfloat16 cache halves the cache's memory and
    traffic.
    """
    check_decode_dtype(dtype)
    if cache_dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else dtype
    if cache_dtype not in DECODE_DTYPES:
        raise ValueError(
            f"cache_dtype must be 'auto' or one of {tuple(DECODE_DTYPES)}, got {cache_dtype!r}"
        )
    return cache_dtype


def for_decoding(
    model: Any, params: Params, dtype: str, cache_dtype: str = "auto"
) -> tuple[Any, Params]:
    """(model, params) that decode in `dtype` ('float32' or 'bfloat16'): the model computes its
    activations in dtype (its config's compute dtype), keeps its KV cache in
    `decode_cache_dtype(dtype, cache_dtype)` and stores its parameters in dtype (half the weight
    traffic in bfloat16); logits are float32 whatever the dtype, and the decoders sample and
    accept in float32.

    Decoding-only: training keeps float32 master parameters. A model without a config dtype
    (e.g. a stub) is returned as it is, with its params cast.
    """
    cache_dtype = decode_cache_dtype(dtype, cache_dtype)
    if isinstance(model, TruncatedVocabulary):
        inner, params = for_decoding(model.model, params, dtype, cache_dtype)
        return TruncatedVocabulary(inner, model.vocab_size), params
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config) and hasattr(config, "dtype"):
        if (config.dtype, config.cache_dtype or config.dtype) != (dtype, cache_dtype):
            cache = None if cache_dtype == dtype else cache_dtype
            model = type(model)(dataclasses.replace(config, dtype=dtype, cache_dtype=cache))
    return model, cast_params(params, dtype)


def with_remat(model: Any, remat: str) -> Any:
    """model with its blocks rematerialised in differentiated calls as `remat` says
    (`layers.REMAT_POLICIES`); the parameters are the same. ValueError naming a bad policy, or
    a model whose config has no such setting (e.g. a stub) given anything but 'none'."""
    if isinstance(model, TruncatedVocabulary):
        return TruncatedVocabulary(with_remat(model.model, remat), model.vocab_size)
    config = getattr(model, "config", None)
    if not (dataclasses.is_dataclass(config) and hasattr(config, "remat")):
        if remat != "none":
            raise ValueError(f"remat={remat!r}: {type(model).__name__} has no remat setting")
        return model
    return model if config.remat == remat else type(model)(dataclasses.replace(config, remat=remat))
