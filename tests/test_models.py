"""Model tests without transformers: cached decoding = teacher forcing, dtypes, axes, configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig

VOCAB = 97
GPT2_LIKE = TransformerConfig(
    vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
    mlp_dim=64, position_embedding="learned", max_positions=64, norm="layernorm", norm_eps=1e-5,
    activation="gelu_new", gated_mlp=False, qkv_bias=True, out_bias=True, mlp_bias=True,
    tie_embeddings=True, init_std=0.2,
)  # fmt: skip
LLAMA_LIKE = TransformerConfig(
    vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    mlp_dim=48, qkv_bias=True, init_std=0.2,
)  # fmt: skip
T5_TINY = T5Config(
    vocab_size=VOCAB, embed_dim=32, num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
    head_dim=8, mlp_dim=48, relative_buckets=8, relative_max_distance=20,
)  # fmt: skip
TOL = 1e-4


def _ragged_sequences(batch: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Full token rows [B, L] (ids >= 1) and per-row prompt lengths [B] in [1, L // 2]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(batch, length)).astype(np.int32)
    lengths = rng.integers(1, length // 2 + 1, size=batch).astype(np.int32)
    lengths[0] = length // 2
    return tokens, lengths


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, L, ...] at index [B, K] -> [B, K, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def _decode_and_compare(model, params, cache, full, tokens, positions, k, steps):
    """Feeds true tokens k at a time from per-row `positions`; every logit must match `full`."""
    extend = jax.jit(model.extend)
    for _ in range(steps):
        index = positions[:, None] + jnp.arange(k)
        logits, cache = extend(params, cache, _gather(tokens, index), positions)
        np.testing.assert_allclose(logits, _gather(full, index), atol=TOL, rtol=0)
        positions = positions + k
    return cache, positions


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def decoder_only(request):
    config = GPT2_LIKE if request.param == "gpt2" else LLAMA_LIKE
    model = DecoderOnlyLM(config)
    return model, model.init(jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def t5():
    model = T5LM(T5_TINY)
    return model, model.init(jax.random.PRNGKey(2))


def test_decoder_only_cached_decoding_matches_teacher_forcing(decoder_only):
    model, params = decoder_only
    tokens, lengths = _ragged_sequences(batch=3, length=16)
    full = jax.jit(model.logits)(params, {"decoder_input_tokens": tokens})
    assert full.shape == (3, 16, VOCAB) and full.dtype == jnp.float32
    assert float(jnp.std(full)) > 0.3  # Logits are far from trivially small.
    prompt_len = int(lengths.max())
    prompts = np.where(np.arange(prompt_len) < lengths[:, None], tokens[:, :prompt_len], 0)
    prefill = jax.jit(model.prefill, static_argnums=3)
    cache, prefix, last = prefill(params, prompts, lengths, 20)
    np.testing.assert_array_equal(prefix, prompts)
    np.testing.assert_array_equal(last, lengths - 1)
    # One token at a time, re-feeding the last prompt token first (as the decoders do).
    cache, positions = _decode_and_compare(model, params, cache, full, tokens, last, 1, 2)
    # Rejected drafts: garbage at the next 3 positions, then the true tokens one by one.
    garbage = jnp.full((3, 3), 5, jnp.int32)
    _, cache = jax.jit(model.extend)(params, cache, garbage, positions)
    cache, positions = _decode_and_compare(model, params, cache, full, tokens, positions, 1, 1)
    # Three tokens per call, at per-row different positions.
    _decode_and_compare(model, params, cache, full, tokens, positions, 3, 2)


def test_t5_cached_decoding_matches_teacher_forcing(t5):
    model, params = t5
    decoder_tokens, _ = _ragged_sequences(batch=3, length=12, seed=1)
    decoder_tokens[:, 0] = 0  # Decoder start token.
    encoder_tokens, encoder_lengths = _ragged_sequences(batch=3, length=18, seed=2)
    encoder_lengths[1] = 18
    encoder_tokens = np.where(np.arange(18) < encoder_lengths[:, None] * 2, encoder_tokens, 0)
    batch = {"encoder_input_tokens": encoder_tokens, "decoder_input_tokens": decoder_tokens}
    full = jax.jit(model.logits)(params, batch)
    assert full.shape == (3, 12, VOCAB) and float(jnp.std(full)) > 0.3
    prefill = jax.jit(model.prefill, static_argnums=3)
    cache, prefix, last = prefill(params, encoder_tokens, encoder_lengths, 14)
    np.testing.assert_array_equal(prefix, np.zeros((3, 1)))
    np.testing.assert_array_equal(last, np.zeros(3))
    cache, _ = _decode_and_compare(model, params, cache, full, decoder_tokens, last, 1, 3)
    # Rows restart at different valid positions (rewrites of identical content are harmless).
    positions = jnp.array([1, 2, 3], jnp.int32)
    garbage = jnp.full((3, 3), 7, jnp.int32)
    _, cache = jax.jit(model.extend)(params, cache, garbage, positions)
    _decode_and_compare(model, params, cache, full, decoder_tokens, positions, 3, 2)


def test_t5_encoder_padding_is_masked(t5):
    """Extra right padding of the encoder input changes no logit."""
    model, params = t5
    encoder = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
    decoder = np.array([[0, 3, 4], [0, 5, 6]], np.int32)
    logits_fn = jax.jit(model.logits)
    logits = logits_fn(params, {"encoder_input_tokens": encoder, "decoder_input_tokens": decoder})
    padded = np.pad(encoder, ((0, 0), (0, 5)))
    logits_padded = logits_fn(
        params, {"encoder_input_tokens": padded, "decoder_input_tokens": decoder}
    )
    np.testing.assert_allclose(logits, logits_padded, atol=TOL)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_bfloat16_compute_is_close_to_float32(family):
    if family == "t5":
        model32 = T5LM(T5_TINY)
        model16 = T5LM(dataclasses.replace(T5_TINY, dtype="bfloat16"))
    else:
        model32 = DecoderOnlyLM(LLAMA_LIKE)
        model16 = DecoderOnlyLM(dataclasses.replace(LLAMA_LIKE, dtype="bfloat16"))
    params = model32.init(jax.random.PRNGKey(3))
    tokens, _ = _ragged_sequences(batch=2, length=8)
    batch = {"decoder_input_tokens": tokens, "encoder_input_tokens": tokens}
    logits32 = jax.jit(model32.logits)(params, batch)
    logits16 = jax.jit(model16.logits)(params, batch)
    assert logits16.dtype == jnp.float32
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x: x.dtype == jnp.float32, params))
    error = float(jnp.max(jnp.abs(logits16 - logits32)))
    assert error < 0.05 * float(jnp.max(jnp.abs(logits32))), error
    prefill = jax.jit(model16.prefill, static_argnums=3)
    cache, _, _ = prefill(params, tokens, np.array([8, 8], np.int32), 10)
    leaves = jax.tree_util.tree_leaves(cache)
    assert any(leaf.dtype == jnp.bfloat16 for leaf in leaves)


@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE, T5_TINY], ids=["gpt2", "llama", "t5"])
def test_logical_axes_cover_every_param(config):
    model = T5LM(config) if isinstance(config, T5Config) else DecoderOnlyLM(config)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    axes = model.logical_axes()
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    flat_axes, axes_tree = jax.tree_util.tree_flatten(axes, is_leaf=is_spec)
    flat_params, params_tree = jax.tree_util.tree_flatten(params)
    assert axes_tree == params_tree
    for spec, leaf in zip(flat_axes, flat_params, strict=True):
        assert is_spec(spec) and len(spec) == leaf.ndim and all(isinstance(a, str) for a in spec)
    assert all(
        spec[0] == "layers"
        for spec, leaf in zip(flat_axes, flat_params, strict=True)
        if leaf.ndim == 4
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads=3"),
        ({"dtype": "float16"}, r"dtype='float16'.*'bfloat16', 'float32'"),
        ({"norm": "batchnorm"}, r"norm='batchnorm'.*layernorm"),
        ({"embed_dim": 0}, "embed_dim=0"),
    ],
)
def test_bad_config_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**kwargs)


def test_bad_t5_config_value_is_named():
    with pytest.raises(ValueError, match="dtype='int8'"):
        T5Config(dtype="int8")


def test_unrolled_teacher_forcing_equals_the_scanned_stack(decoder_only, monkeypatch):
    # Shallow stacks run teacher-forced calls unrolled (decoder_only.UNROLL_MAX_LAYERS): the same
    # parameters, logits and gradients, bit for bit, as the scanned stack that decoding uses.
    from distillspec.models import decoder_only as module

    model, params = decoder_only
    tokens, _ = _ragged_sequences(2, 12, seed=5)
    batch = {"decoder_input_tokens": tokens}
    score = lambda p: jnp.sum(model.logits(p, batch) ** 2)  # noqa: E731
    assert model.config.num_layers <= module.UNROLL_MAX_LAYERS
    unrolled = jax.jit(model.logits)(params, batch), jax.jit(jax.grad(score))(params)
    monkeypatch.setattr(module, "UNROLL_MAX_LAYERS", 0)
    scanned = jax.jit(model.logits)(params, batch), jax.jit(jax.grad(score))(params)
    hlo = jax.jit(model.logits).lower(params, batch).as_text()
    assert "while" in hlo  # The patched call really ran the scan.
    for got, want in zip(jax.tree.leaves(unrolled), jax.tree.leaves(scanned)):
        np.testing.assert_array_equal(got, want)


def test_prefill_rejects_prompt_longer_than_cache(decoder_only):
    model, params = decoder_only
    with pytest.raises(ValueError, match="cache_length=4"):
        model.prefill(params, jnp.ones((1, 6), jnp.int32), jnp.array([6]), 4)
    if model.config.position_embedding == "learned":
        with pytest.raises(ValueError, match="max_positions=64"):
            model.prefill(params, jnp.ones((1, 6), jnp.int32), jnp.array([6]), 65)


# ---------------------------------------------------------------- the dense layers' backward pass

CONTRACTIONS = [((3, 5, 8), (8, 6), 1), ((3, 5, 8), (8, 2, 3), 1), ((3, 5, 2, 4), (2, 4, 6), 2)]


def _plain_contract(x, kernel, num_in_axes):
    return jnp.tensordot(x, kernel, axes=num_in_axes, preferred_element_type=jnp.float32)


def _plain_contract_rows(x, table):
    return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("x_shape,kernel_shape,num_in_axes", CONTRACTIONS)
def test_contract_gradients_equal_autodiffs(x_shape, kernel_shape, num_in_axes, dtype):
    from distillspec.models import layers

    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(keys[0], x_shape).astype(dtype)
    kernel = jax.random.normal(keys[1], kernel_shape).astype(dtype)
    loss = lambda fn: lambda x, k: jnp.sum(jnp.sin(fn(x, k, num_in_axes)))  # noqa: E731
    got = jax.value_and_grad(loss(layers.contract), argnums=(0, 1))(x, kernel)
    want = jax.value_and_grad(loss(_plain_contract), argnums=(0, 1))(x, kernel)
    _assert_same_gradients(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_rows_gradients_equal_autodiffs(dtype):
    from distillspec.models import layers

    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    x = jax.random.normal(keys[0], (3, 5, 8)).astype(dtype)
    table = jax.random.normal(keys[1], (11, 8)).astype(dtype)
    loss = lambda fn: lambda x, t: jnp.sum(jnp.sin(fn(x, t)))  # noqa: E731
    got = jax.value_and_grad(loss(layers.contract_rows), argnums=(0, 1))(x, table)
    want = jax.value_and_grad(loss(_plain_contract_rows), argnums=(0, 1))(x, table)
    _assert_same_gradients(got, want, dtype)


def _assert_same_gradients(got, want, dtype):
    (value, grads), (want_value, want_grads) = got, want
    # float32: the same products, up to summation order; bfloat16: up to one rounding of it.
    rtol, atol = (1e-5, 1e-6) if dtype == "float32" else (2e-2, 2e-2)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    for grad, want_grad in zip(grads, want_grads):
        assert grad.dtype == want_grad.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(
            np.float32(grad), np.float32(want_grad), rtol=rtol, atol=atol * np.abs(want_grad).max()
        )


@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE, T5_TINY], ids=["gpt2", "llama", "t5"])
def test_model_gradients_equal_plain_autodiffs(config, monkeypatch):
    """Every parameter's gradient (lm head, tied embedding, SwiGLU gate, attention projections)
    through the layers' custom VJP equals jax.grad of the plain contractions."""
    from distillspec.models import layers

    model = T5LM(config) if isinstance(config, T5Config) else DecoderOnlyLM(config)
    params = model.init(jax.random.PRNGKey(2))
    tokens, _ = _ragged_sequences(2, 12, seed=3)
    batch = {"decoder_input_tokens": tokens, "encoder_input_tokens": tokens}
    targets = np.roll(tokens, -1, axis=1)

    def loss(params):
        log_q = jax.nn.log_softmax(model.logits(params, batch))
        return -jnp.mean(jnp.take_along_axis(log_q, targets[..., None], axis=-1))

    got = jax.jit(jax.value_and_grad(loss))(params)
    monkeypatch.setattr(layers, "contract", _plain_contract)
    monkeypatch.setattr(layers, "contract_rows", _plain_contract_rows)
    want = jax.jit(jax.value_and_grad(loss))(params)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    flat, want_flat = jax.tree.leaves_with_path(got[1]), jax.tree.leaves(want[1])
    # Absolute tolerance on the largest gradient's scale: some are 0 but for rounding (GPT-2's
    # key bias: softmax ignores a shift shared by all keys), 1e-9 either way.
    scale = max(float(np.abs(g).max()) for g in want_flat)
    for (path, grad), want_grad in zip(flat, want_flat):
        np.testing.assert_allclose(
            grad, want_grad, rtol=1e-4, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path)
        )
