"""Exactness of speculative decoding on the real model families (decoder-only and T5)."""

import functools

import jax
import numpy as np
import pytest

from distillspec.decoding import generate, speculative_generate
from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig
from distillspec.sampling import SamplingConfig
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
def _family(name):
    """(model, target params, draft params) of a family, built once per test session."""
    model = FAMILIES[name]()
    params = model.init(jax.random.PRNGKey(0))
    return model, params, _perturbed(params, 0.05, seed=1)


# gamma 1..8 at batch 4 and a few at batch 1; gpt2 shares every code path with llama but its
# configuration, so it gets fewer cases.
CASES = [(g, 4) for g in range(1, 9)] + [(1, 1), (3, 1), (8, 1)]
PARAMS = [(name, g, b) for name in ("llama", "t5") for g, b in CASES]
PARAMS += [("gpt2", g, b) for g, b in [(1, 4), (4, 4), (8, 4), (2, 1)]]


@pytest.mark.parametrize("name,gamma,batch", PARAMS)
def test_greedy_speculative_equals_greedy_target(name, gamma, batch):
    model, params, draft_params = _family(name)
    prompts, lengths = ragged_prompts(batch, 6, VOCAB, seed=gamma)
    plain = generate(model, params, prompts, lengths, max_new_tokens=MAX_NEW)
    spec = speculative_generate(
        model, model, params, draft_params, prompts, lengths, gamma=gamma, max_new_tokens=MAX_NEW
    )
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.alpha > 0  # Drafts were accepted ...
    if batch > 1:
        assert spec.alpha < 1  # ... and rejected: both paths of the rule ran.


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_sampling_runs_and_draft_equal_target_accepts_all(name):
    model, params, _ = _family(name)
    prompts, lengths = ragged_prompts(4, 6, VOCAB, seed=0)
    out = speculative_generate(
        model, model, params, params, prompts, lengths, jax.random.PRNGKey(0),
        gamma=4, max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature=1.0),
    )  # fmt: skip
    assert out.accepted.sum() == out.drafted.sum() > 0
    assert out.tokens.shape == (4, MAX_NEW) and out.tokens.max() < VOCAB


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_dynamic_lookahead_keeps_greedy_output_exact(name):
    from distillspec.lookahead import Lookahead
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
