"""Shared test helpers: stub models with exactly known distributions, tiny configs."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

# The tests' tiny gin configs.
TEST_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tests"

# --------------------------------------------------------------------------------------------
# Stub models for the decoders.
# --------------------------------------------------------------------------------------------

TRACE_COUNTS: dict[str, int] = {}


class MarkovStub:
    """A second-order Markov 'language model' implementing the DecodingModel interface.

    The logits at position t are table[token[t - 1], token[t]] (token[-1] reads as 0). The
    cache is the token sequence itself, so a decoder that feeds a wrong token, or feeds one at
    the wrong position, changes the distributions and is caught by the exactness tests.
    """

    def __init__(self, table: np.ndarray, name: str = "stub", dtype: str = "float32"):
        # [V, V, V] logits in the decoding dtype: a 'bfloat16' stub returns bfloat16 logits, and
        # its exact distribution (next_probs) is that of the rounded table.
        self.table = jnp.asarray(table, jnp.float32).astype(dtype)
        self.vocab_size = int(table.shape[-1])
        self.encoder_decoder = False
        self.name = name

    def prefill(self, params, prompt_tokens, prompt_lengths, cache_length):
        cache = jnp.zeros((prompt_tokens.shape[0], cache_length), jnp.int32)
        _, cache = self.extend(params, cache, prompt_tokens, jnp.zeros_like(prompt_lengths))
        return cache, prompt_tokens, prompt_lengths - 1

    def extend(self, params, cache, tokens, positions):
        # MarkovStub's own: WritingMarkovStub hides extend_entries from the decoders only.
        logits, entries = MarkovStub.extend_entries(self, params, cache, tokens, positions)
        return logits, self.write_entries(cache, entries, positions)

    def extend_entries(self, params, cache, tokens, positions, pad_to=None):
        """`extend` that reads the cache only (the decoders' dynamic rounds): the entries are
        the tokens, padded with 0 to pad_to; a decoder that read a padded slot before
        rewriting it would condition on token 0 and fail the exactness tests."""
        TRACE_COUNTS[self.name] = TRACE_COUNTS.get(self.name, 0) + 1
        first = jnp.take_along_axis(cache, jnp.maximum(positions - 1, 0)[:, None], 1)
        first = jnp.where(positions[:, None] > 0, first, 0)
        prev = jnp.concatenate([first, tokens[:, :-1].astype(jnp.int32)], axis=1)
        table = self.table if params is None else params
        extra = (pad_to or tokens.shape[1]) - tokens.shape[1]
        return table[prev, tokens], jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, extra)))

    def write_entries(self, cache, entries, positions):
        write = lambda row, t, p: jax.lax.dynamic_update_slice(row, t, (p,))
        return jax.vmap(write)(cache, entries, positions)

    def next_probs(self, prev: int, last: int) -> np.ndarray:
        """Exact next-token distribution after (prev, last)."""
        return np.asarray(jax.nn.softmax(self.table[prev, last].astype(jnp.float32)), np.float64)


class WritingMarkovStub(MarkovStub):
    """A MarkovStub without the optional extend_entries: the decoders' dynamic rounds then
    verify through `extend` inside each width's branch (the path of models such as T5)."""

    extend_entries = None


def markov_pair(vocab: int, seed: int, noise: float, scale: float = 2.0, dtype: str = "float32"):
    """A target stub and a draft stub whose table is the target's plus Gaussian noise, both
    with logits in dtype."""
    rng = np.random.default_rng(seed)
    table = scale * rng.standard_normal((vocab, vocab, vocab))
    draft_table = table + noise * rng.standard_normal(table.shape)
    return (
        MarkovStub(table, f"target{seed}{dtype}", dtype),
        MarkovStub(draft_table, f"draft{seed}{dtype}", dtype),
    )


def ragged_prompts(batch: int, length: int, vocab: int, seed: int = 0):
    """Right-padded random prompts [B, P] with lengths in [1, P] (the first row is full)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[0] = length
    tokens = rng.integers(1, vocab, size=(batch, length))
    tokens = np.where(np.arange(length) < lengths[:, None], tokens, 0)
    return tokens.astype(np.int32), lengths.astype(np.int32)


def perturbed(params, noise: float, seed: int):
    """params plus Gaussian noise of standard deviation noise (a draft close to a target)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [x + noise * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def tiny_lm(vocab: int):
    """A tiny random decoder-only model (2 layers, width 32) and its parameters."""
    from distillspec.models import DecoderOnlyLM, TransformerConfig

    config = TransformerConfig(
        vocab_size=vocab, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
        mlp_dim=64, init_std=0.3,
    )  # fmt: skip
    model = DecoderOnlyLM(config)
    return model, model.init(jax.random.PRNGKey(0))
