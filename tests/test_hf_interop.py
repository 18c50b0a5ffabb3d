"""Conformance with Hugging Face transformers on tiny random models built offline.

For each family: transformers model -> save -> our from_pretrained -> logits equal transformers'
float32 logits at real positions of a ragged right-padded batch; our save_pretrained -> reload by
transformers -> same logits.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from distillspec.models import T5LM, DecoderOnlyLM, from_pretrained, layers, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
TOL = 1e-4
LLAMA_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, initializer_range=0.2,
)  # fmt: skip


def _hf_gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _hf_llama_gqa():
    rope = {"rope_type": "default", "rope_theta": 500.0}
    config = transformers.LlamaConfig(
        **LLAMA_SIZES, num_key_value_heads=2, tie_word_embeddings=False, rope_parameters=rope
    )
    return transformers.LlamaForCausalLM(config)


def _hf_llama_tied():
    config = transformers.LlamaConfig(
        **LLAMA_SIZES, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    )
    return transformers.LlamaForCausalLM(config)


def _hf_qwen2():
    config = transformers.Qwen2Config(
        **LLAMA_SIZES, num_key_value_heads=2, tie_word_embeddings=False
    )
    return transformers.Qwen2ForCausalLM(config)


def _hf_t5(untie: bool = True):
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    if untie:  # transformers >= 5 ties the v1.1 head anyway; real v1.1 checkpoints do not.
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32))
    return model


def _hf_t5_tied():
    return _hf_t5(untie=False)


BUILDERS = {
    "gpt2": _hf_gpt2,
    "llama_gqa": _hf_llama_gqa,
    "llama_tied": _hf_llama_tied,
    "qwen2": _hf_qwen2,
    "t5": _hf_t5,
    "t5_tied": _hf_t5_tied,
}


def _random_hf_model(name: str):
    """A tiny transformers model in eval mode with every parameter (biases, norms too) random."""
    torch.manual_seed(0)
    model = BUILDERS[name]()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def _batch() -> dict[str, np.ndarray]:
    """A ragged right-padded batch: decoder tokens [3, 10] (lengths 10, 6, 3), encoder [3, 20]."""
    rng = np.random.default_rng(0)
    lengths = np.array([10, 6, 3])
    mask = np.arange(10) < lengths[:, None]
    decoder = np.where(mask, rng.integers(1, VOCAB, size=(3, 10)), 0).astype(np.int32)
    encoder_mask = np.arange(20) < np.array([20, 13, 4])[:, None]
    encoder = np.where(encoder_mask, rng.integers(1, VOCAB, size=(3, 20)), 0).astype(np.int32)
    t5_decoder = np.concatenate([np.zeros((3, 1), np.int32), decoder[:, :7]], axis=1)
    return {"decoder": decoder, "mask": mask, "encoder": encoder, "t5_decoder": t5_decoder}


def _hf_logits(model, batch, is_t5: bool) -> np.ndarray:
    tensor = lambda x: torch.tensor(np.asarray(x), dtype=torch.long)
    with torch.no_grad():
        if is_t5:
            out = model(
                input_ids=tensor(batch["encoder"]),
                attention_mask=tensor(batch["encoder"] != 0),
                decoder_input_ids=tensor(batch["t5_decoder"]),
            )
        else:
            out = model(input_ids=tensor(batch["decoder"]), attention_mask=tensor(batch["mask"]))
    return out.logits.float().numpy()


def _our_logits(model, params, batch) -> np.ndarray:
    if isinstance(model, T5LM):
        features = {
            "encoder_input_tokens": batch["encoder"],
            "decoder_input_tokens": batch["t5_decoder"],
        }
    else:
        features = {"decoder_input_tokens": batch["decoder"]}
    return np.asarray(jax.jit(model.logits)(params, features))


def _max_error_at_real_positions(ours, theirs, batch, is_t5: bool) -> float:
    weights = np.ones(ours.shape[:2], bool) if is_t5 else batch["mask"]
    return float(np.max(np.abs(ours - theirs) * weights[..., None]))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_logits_match_transformers_both_ways(name, tmp_path):
    is_t5 = name.startswith("t5")
    hf_model = _random_hf_model(name)
    sharded = name == "llama_gqa"  # Exercise the model.safetensors.index.json path once.
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB" if sharded else "1GB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json") == sharded
    batch = _batch()
    expected = _hf_logits(hf_model, batch, is_t5)
    assert expected.std() > 0.3  # Logits are far from trivially small.

    model, params = from_pretrained(str(tmp_path / "hf"))
    assert isinstance(model, T5LM if is_t5 else DecoderOnlyLM)
    ours = _our_logits(model, params, batch)
    assert _max_error_at_real_positions(ours, expected, batch, is_t5) <= TOL

    save_pretrained(model, params, str(tmp_path / "ours"))
    auto = transformers.AutoModelForSeq2SeqLM if is_t5 else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(str(tmp_path / "ours")).eval()
    exported = _hf_logits(reloaded, batch, is_t5)
    assert _max_error_at_real_positions(ours, exported, batch, is_t5) <= TOL
    _, params_again = from_pretrained(str(tmp_path / "ours"))
    if name == "t5_tied":  # Exported with an explicit copy of the head (see save_pretrained).
        embedding = params_again["embed"]["embedding"]
        np.testing.assert_array_equal(params_again.pop("lm_head")["kernel"], embedding.T)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params_again)


def test_bfloat16_checkpoint_loads_as_float32_params(tmp_path):
    hf_model = _random_hf_model("qwen2").to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    model, params = from_pretrained(str(tmp_path), dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)}
    assert dtypes == {np.dtype("float32")}
    embedding = hf_model.model.embed_tokens.weight.float().detach().numpy()
    np.testing.assert_array_equal(params["embed"]["embedding"], embedding)


def _write_checkpoint(path, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({"unused": np.zeros(1, np.float32)}, os.path.join(path, "model.safetensors"))
    return str(path)


def test_unsupported_model_type_lists_supported_ones(tmp_path):
    path = _write_checkpoint(tmp_path, {"model_type": "bert"})
    with pytest.raises(ValueError, match="'bert'") as error:
        from_pretrained(path)
    for supported in ("gpt2", "llama", "qwen2", "t5"):
        assert supported in str(error.value)


LLAMA_JSON = {
    "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 1, "num_attention_heads": 4,
}  # fmt: skip


@pytest.mark.parametrize(
    "config, match",
    [
        ({**LLAMA_JSON, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
        ({**LLAMA_JSON, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
        (
            {
                **LLAMA_JSON,
                "model_type": "qwen2",
                "use_sliding_window": True,
                "max_window_layers": 0,
            },
            "sliding",
        ),
        ({**LLAMA_JSON, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "t5", "feed_forward_proj": "relu"}, "relu"),
        ({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True}, "inverse_layer_idx"),
    ],
    ids=["rope_scaling", "rope_parameters", "sliding_window", "activation", "t5_relu", "gpt2"],
)
def test_unimplemented_features_are_rejected(config, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        from_pretrained(_write_checkpoint(tmp_path, config))


def test_missing_safetensors_is_a_clear_error(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(LLAMA_JSON, f)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(str(tmp_path))


def test_relative_position_buckets_match_transformers():
    t5_module = transformers.models.t5.modeling_t5
    relative = torch.arange(-299, 300)
    for bidirectional in (True, False):
        expected = t5_module.T5Attention._relative_position_bucket(
            relative, bidirectional=bidirectional, num_buckets=32, max_distance=128
        )
        table = layers.relative_position_bucket_table(300, bidirectional, 32, 128)
        np.testing.assert_array_equal(table, expected.numpy())
