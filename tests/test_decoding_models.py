"""Exactness of speculative decoding on the real model families (decoder-only and T5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec.decoding import generate, speculative_generate
from distillspec.decoding.sampling import SamplingConfig
from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig
from distillspec.models.base import for_decoding
from tests.test_utils import ragged_prompts

VOCAB = 48
MAX_NEW = 20

FAMILIES = {
    "llama": lambda: DecoderOnlyLM(
        TransformerConfig(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, mlp_dim=64, init_std=0.3)
    ),
    "gpt2": lambda: DecoderOnlyLM(
        TransformerConfig(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4,
                          num_kv_heads=4, head_dim=8, mlp_dim=64, position_embedding="learned",
                          max_positions=64, norm="layernorm", norm_eps=1e-5,
                          activation="gelu_new", gated_mlp=False, qkv_bias=True, out_bias=True,
                          mlp_bias=True, tie_embeddings=True, init_std=0.3)
    ),
    "t5": lambda: T5LM(
        T5Config(vocab_size=VOCAB, embed_dim=32, num_encoder_layers=2, num_decoder_layers=2,
                 num_heads=4, head_dim=8, mlp_dim=64)
    ),
}  # fmt: skip


def _perturbed(params, noise, seed):
    """A draft: the target's parameters plus relative Gaussian noise (alpha strictly in (0, 1))."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [x + noise * x.std() * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


@functools.cache
def _family(name, dtype="float32", cache_dtype="auto"):
    """(model, target params, draft params) of a family, built once per test session, decoding
    in dtype (`models.base.for_decoding`: parameters and activations; logits float32)."""
    model = FAMILIES[name]()
    params = model.init(jax.random.PRNGKey(0))
    draft_params = _perturbed(params, 0.05, seed=1)
    decoding_model, params = for_decoding(model, params, dtype, cache_dtype)
    return decoding_model, params, for_decoding(model, draft_params, dtype, cache_dtype)[1]


# gamma 1..8 at batch 4 and a few at batch 1; gpt2 shares every code path with llama but its
# configuration, so it gets fewer cases.
CASES = [(g, 4) for g in range(1, 9)] + [(1, 1), (3, 1), (8, 1)]
PARAMS = [(name, g, b) for name in ("llama", "t5") for g, b in CASES]
PARAMS += [("gpt2", g, b) for g, b in [(1, 4), (4, 4), (8, 4), (2, 1)]]
PARAMS = [(*p, "float32") for p in PARAMS]
# bfloat16 against the bfloat16 target: every family, a few cases each, with the default
# cache ('auto': float32 on the CPU) and with a bfloat16 cache.
PARAMS += [("llama", 3, 4, "bfloat16"), ("gpt2", 5, 1, "bfloat16"), ("t5", 3, 4, "bfloat16")]
PARAMS = [(*p, "auto") for p in PARAMS]
PARAMS += [("llama", 3, 4, "bfloat16", "bfloat16"), ("t5", 2, 1, "bfloat16", "bfloat16")]


@pytest.mark.parametrize("name,gamma,batch,dtype,cache_dtype", PARAMS)
def test_greedy_speculative_equals_greedy_target(name, gamma, batch, dtype, cache_dtype):
    model, params, draft_params = _family(name, dtype, cache_dtype)
    prompts, lengths = ragged_prompts(batch, 6, VOCAB, seed=gamma)
    plain = generate(model, params, prompts, lengths, max_new_tokens=MAX_NEW)
    spec = speculative_generate(
        model, model, params, draft_params, prompts, lengths, gamma=gamma, max_new_tokens=MAX_NEW
    )
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.alpha > 0  # Drafts were accepted ...
    if batch > 1:
        assert spec.alpha < 1  # ... and rejected: both paths of the rule ran.


@pytest.mark.parametrize(
    "name,dtype", [(name, "float32") for name in sorted(FAMILIES)] + [("llama", "bfloat16")]
)
def test_sampling_runs_and_draft_equal_target_accepts_all(name, dtype):
    model, params, _ = _family(name, dtype)
    prompts, lengths = ragged_prompts(4, 6, VOCAB, seed=0)
    out = speculative_generate(
        model, model, params, params, prompts, lengths, jax.random.PRNGKey(0),
        gamma=4, max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature=1.0),
    )  # fmt: skip
    assert out.accepted.sum() == out.drafted.sum() > 0
    assert out.tokens.shape == (4, MAX_NEW) and out.tokens.max() < VOCAB


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_dynamic_lookahead_keeps_greedy_output_exact(name):
    from distillspec.decoding.lookahead import Lookahead
    from tests.test_lookahead import random_classifier

    model, params, draft_params = _family(name)
    prompts, lengths = ragged_prompts(4, 6, VOCAB, seed=0)
    plain = generate(model, params, prompts, lengths, max_new_tokens=MAX_NEW)
    cases = [
        (Lookahead("disco", 6, threshold=0.5), dict(classifier=random_classifier(4))),
        (Lookahead("confidence", 6, threshold=0.3), {}),
        (Lookahead("heuristic", 6, start=3), {}),
        (Lookahead("oracle", 6), dict(oracle_tokens=plain.tokens)),
    ]
    if name == "t5":  # Same decoder code as llama; the family only changes the model calls.
        cases = cases[::3]
    for policy, kwargs in cases:
        spec = speculative_generate(
            model, model, params, draft_params, prompts, lengths, lookahead=policy,
            max_new_tokens=MAX_NEW, **kwargs,
        )  # fmt: skip
        np.testing.assert_array_equal(spec.tokens, plain.tokens, err_msg=policy.name)
        if policy.kind != "disco":  # (A random classifier may well stop at the same place.)
            assert len(np.flatnonzero(spec.sl_histogram.sum(0))) >= 2, policy.name


def _steps(model, params, prompts, lengths):
    """(logits [B, 1 + 3, V], cache) of a one-token then a three-token call after the prompt,
    jitted."""

    @jax.jit
    def steps(params):
        cache, _, position = model.prefill(params, prompts, lengths, 16)
        first, cache = model.extend(params, cache, prompts[:, :1], position)
        then, cache = model.extend(params, cache, prompts[:, 1:4], position + 1)
        return jnp.concatenate([first, then], axis=1), cache

    return steps(params)


def test_for_decoding_casts_parameters_and_activations_not_logits():
    model, params, _ = _family("llama", "bfloat16")
    assert model.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    prompts, lengths = ragged_prompts(2, 6, VOCAB, seed=0)
    logits, cache = _steps(model, params, prompts, lengths)
    assert logits.dtype == jnp.float32
    # The bfloat16 target really differs from the float32 one (the tests above are not vacuous).
    f32, f32_params, _ = _family("llama")
    f32_logits, _ = _steps(f32, f32_params, prompts, lengths)
    assert not np.array_equal(np.asarray(logits), np.asarray(f32_logits))
    np.testing.assert_allclose(logits, f32_logits, atol=0.1 * float(np.abs(f32_logits).max()))
    with pytest.raises(
        ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\), got 'fp16'"
    ):
        for_decoding(f32, f32_params, "fp16")
    with pytest.raises(
        ValueError,
        match=r"cache_dtype must be 'auto' or one of \('float32', 'bfloat16'\), got 'int8'",
    ):
        for_decoding(f32, f32_params, "bfloat16", cache_dtype="int8")
    assert for_decoding(f32, f32_params, "float32")[0] is f32  # Nothing to change.


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_float32_cache_gives_bfloat16_decoding_the_same_logits(name):
    """'auto' keeps the cache in float32 on the CPU: it holds the same bfloat16-rounded keys
    and values, and XLA's CPU backend computes bfloat16 attention in float32 anyway."""
    prompts, lengths = ragged_prompts(2, 6, VOCAB, seed=0)
    results = {}
    for cache_dtype in ("auto", "float32", "bfloat16"):
        model, params, _ = _family(name, "bfloat16", cache_dtype)
        results[cache_dtype] = _steps(model, params, prompts, lengths)
    wide, narrow = results["auto"][1], results["bfloat16"][1]
    assert jax.default_backend() == "cpu"
    # (T5's cross-attention keys and values are computed once per prompt, in bfloat16.)
    assert jnp.dtype(jnp.float32) in {x.dtype for x in jax.tree.leaves(wide) if x.ndim >= 3}
    assert {x.dtype for x in jax.tree.leaves(narrow) if x.ndim >= 3} == {jnp.dtype(jnp.bfloat16)}
    for cache_dtype in ("auto", "float32"):
        np.testing.assert_array_equal(results[cache_dtype][0], results["bfloat16"][0])
        for x, y in zip(jax.tree.leaves(results[cache_dtype][1]), jax.tree.leaves(narrow)):
            np.testing.assert_array_equal(x, np.asarray(y, np.float32))
