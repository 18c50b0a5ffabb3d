"""Hugging Face checkpoints <-> distillspec models (GPT-2, Llama, Qwen2, T5 v1.1).

`from_pretrained` reads a local directory holding config.json and *.safetensors (one file, or
shards listed in model.safetensors.index.json) with safetensors' numpy API, one tensor at a time
(`safetensors_files`), so torch is not needed at run time, optionally straight into shardings.
`save_pretrained` writes config.json + model.safetensors that `transformers.AutoModelForCausalLM`
/ `AutoModelForSeq2SeqLM` load.

Each family is a table of `_Rule`s: one HF tensor name (with '{i}' for the layer index) <-> one
path in our params, plus the reshape each way. Per-layer tensors are stacked on a leading
[num_layers] axis because our layers are scanned. Layouts: HF nn.Linear weights are [out, in];
GPT-2's Conv1D weights are [in, out] with q, k, v fused in c_attn; ours are [in..., out...],
e.g. a query kernel [embed, heads, head_dim].
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16', which bf16 checkpoints need)
import numpy as np
from safetensors.numpy import save_file

from distillspec.models.decoder_only import DecoderOnlyLM, TransformerConfig
from distillspec.models.safetensors_files import placer, read_tensors
from distillspec.models.t5 import T5LM, T5Config

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "qwen2", "t5")
Array = np.ndarray
Params = dict[str, Any]

# Checkpoint tensors that carry no parameters of ours: attention-mask / rotary buffers of old
# exports, T5's per-stack copies of the shared embedding, and the unused cross-attention bias.
_IGNORED = re.compile(
    r"(.*\.attn\.(masked_)?bias|.*rotary_emb\.inv_freq|(encoder|decoder)\.embed_tokens\.weight"
    r"|decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight)$"
)


def _identity(x: Array) -> Array:
    return x


def _transpose(x: Array) -> Array:
    return x.T


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One HF tensor (per layer if `layers` > 0) <-> one leaf of our params."""

    hf: str  # HF tensor name; '{i}' stands for the layer index.
    path: tuple[str, ...]  # Path of the leaf in our params.
    to_ours: Callable[[Array], Array] = _identity  # One HF tensor -> one (per-layer) slice of ours.
    to_hf: Callable[[Array], Array] = _identity  # The inverse.
    layers: int = 0  # Number of stacked layers; 0 for a tensor outside the layer stack.


def _rule(
    hf: str, path: str, layout: tuple[Callable, Callable] = (_identity, _identity), layers: int = 0
) -> _Rule:
    return _Rule(hf, tuple(path.split("/")), layout[0], layout[1], layers)


# Layouts (to_ours, to_hf). "Linear": HF [out, in]; "Conv1D": HF [in, out] (GPT-2).
_LINEAR = (_transpose, _transpose)


def _conv_to_heads(heads: int) -> tuple[Callable, Callable]:
    """GPT-2 Conv1D [E, heads * D] <-> ours [E, heads, D]."""
    return (lambda w: w.reshape(w.shape[0], heads, -1), lambda k: k.reshape(k.shape[0], -1))


def _conv_from_heads(heads: int) -> tuple[Callable, Callable]:
    """GPT-2 Conv1D [heads * D, E] <-> ours [heads, D, E]."""
    return (lambda w: w.reshape(heads, -1, w.shape[-1]), lambda k: k.reshape(-1, k.shape[-1]))


def _transposed(rule: tuple[Callable, Callable]) -> tuple[Callable, Callable]:
    """A Conv1D rule for an HF Linear, which stores the same matrix transposed."""
    to, back = rule
    return (lambda w: to(w.T), lambda k: back(k).T)


def _linear_to_heads(heads: int) -> tuple[Callable, Callable]:
    """HF Linear [heads * D, E] <-> ours [E, heads, D] (q/k/v projections)."""
    return _transposed(_conv_to_heads(heads))


def _linear_from_heads(heads: int) -> tuple[Callable, Callable]:
    """HF Linear [E, heads * D] <-> ours [heads, D, E] (output projection)."""
    return _transposed(_conv_from_heads(heads))


def _bias_to_heads(heads: int) -> tuple[Callable, Callable]:
    """HF bias [heads * D] <-> ours [heads, D]."""
    return (lambda b: b.reshape(heads, -1), lambda b: b.reshape(-1))


# Configs. ----------------------------------------------------------------------------------------

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
                     "relu": "relu", "silu": "silu"}  # fmt: skip


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"Unsupported checkpoint: {message}")


def _gpt2_config(hf: dict[str, Any], names: set[str], dtype: str) -> TransformerConfig:
    del names
    activation = hf.get("activation_function", "gelu_new")
    _require(
        activation in _GPT2_ACTIVATIONS,
        f"activation_function={activation!r}; supported: {sorted(_GPT2_ACTIVATIONS)}.",
    )
    _require(hf.get("scale_attn_weights", True), "scale_attn_weights=False is not implemented.")
    _require(
        not hf.get("scale_attn_by_inverse_layer_idx", False),
        "scale_attn_by_inverse_layer_idx=True is not implemented.",
    )
    _require(
        not hf.get("add_cross_attention", False), "add_cross_attention=True is not implemented."
    )
    width, heads = hf["n_embd"], hf["n_head"]
    return TransformerConfig(
        vocab_size=hf["vocab_size"], embed_dim=width, num_layers=hf["n_layer"], num_heads=heads,
        num_kv_heads=heads, head_dim=width // heads, mlp_dim=hf.get("n_inner") or 4 * width,
        position_embedding="learned", max_positions=hf["n_positions"], norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=_GPT2_ACTIVATIONS[activation],
        gated_mlp=False, qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True,
        dtype=dtype,
    )  # fmt: skip


def _rope_theta(hf: dict[str, Any]) -> float:
    """The RoPE base; rejects any RoPE scaling (linear, dynamic, yarn, llama3, ...)."""
    parameters = hf.get("rope_parameters") or {}
    for spec in (parameters, hf.get("rope_scaling") or {}):
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        _require(
            rope_type == "default",
            f"rope type {rope_type!r} (rope scaling) is not implemented; only 'default' RoPE is.",
        )
        _require(
            spec.get("partial_rotary_factor", 1.0) == 1.0,
            "partial_rotary_factor != 1 is not implemented.",
        )
    return float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_like_config(
    hf: dict[str, Any], dtype: str, qkv_bias: bool, out_bias: bool, mlp_bias: bool
) -> TransformerConfig:
    _require(
        hf.get("hidden_act", "silu") == "silu",
        f"hidden_act={hf.get('hidden_act')!r}; only 'silu' is implemented.",
    )
    heads = hf["num_attention_heads"]
    return TransformerConfig(
        vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
        position_embedding="rope", max_positions=hf.get("max_position_embeddings", 2048),
        rope_theta=_rope_theta(hf), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation="silu", gated_mlp=True, qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
    )  # fmt: skip


def _llama_config(hf: dict[str, Any], names: set[str], dtype: str) -> TransformerConfig:
    del names
    bias = bool(hf.get("attention_bias", False))
    return _llama_like_config(hf, dtype, bias, bias, bool(hf.get("mlp_bias", False)))


def _qwen2_config(hf: dict[str, Any], names: set[str], dtype: str) -> TransformerConfig:
    del names
    num_layers = hf["num_hidden_layers"]
    sliding = "sliding_attention" in (hf.get("layer_types") or [])
    if hf.get("use_sliding_window", False) and not hf.get("layer_types"):
        sliding = hf.get("max_window_layers", num_layers) < num_layers
    _require(
        not sliding,
        "sliding-window attention (use_sliding_window / layer_types) is not implemented.",
    )
    return _llama_like_config(hf, dtype, qkv_bias=True, out_bias=False, mlp_bias=False)


def _t5_config(hf: dict[str, Any], names: set[str], dtype: str) -> T5Config:
    projection = hf.get("feed_forward_proj", "relu")
    _require(
        projection in ("gated-gelu", "gated-gelu_new"),
        f"feed_forward_proj={projection!r}; only T5 v1.1 'gated-gelu' is implemented "
        "(the original T5 uses 'relu').",
    )
    _require(hf.get("decoder_start_token_id", 0) == 0, "decoder_start_token_id must be 0.")
    _require(hf.get("pad_token_id", 0) == 0, "pad_token_id must be 0.")
    # Old configs signal the output scaling through tie_word_embeddings; transformers >= 5 keeps
    # an explicit scale_decoder_outputs and always ties unless the checkpoint has its own lm_head.
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return T5Config(
        vocab_size=hf["vocab_size"], embed_dim=hf["d_model"], num_encoder_layers=hf["num_layers"],
        num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        num_heads=hf["num_heads"], head_dim=hf["d_kv"], mlp_dim=hf["d_ff"],
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), tie_embeddings="lm_head.weight" not in names,
        scale_decoder_outputs=bool(scale), dtype=dtype,
    )  # fmt: skip


def _model_type(config: TransformerConfig | T5Config) -> str:
    """The HF family that can represent `config`, or ValueError saying why none can."""
    if isinstance(config, T5Config):
        return "t5"
    c = config
    if c.position_embedding == "learned":
        biases = c.qkv_bias and c.out_bias and c.mlp_bias
        heads = c.num_kv_heads == c.num_heads and c.head_dim * c.num_heads == c.embed_dim
        gpt2 = c.norm == "layernorm" and not c.gated_mlp and biases and c.tie_embeddings and heads
        _require(
            gpt2,
            f"learned positions need the GPT-2 layout (LayerNorm, biases, tied, MHA); got {c}.",
        )
        return "gpt2"
    llama = c.norm == "rmsnorm" and c.gated_mlp and c.activation == "silu"
    _require(llama, f"RoPE models need RMSNorm and a SwiGLU MLP (Llama / Qwen2); got {c}.")
    if c.qkv_bias and not c.out_bias and not c.mlp_bias:
        return "qwen2"
    _require(
        c.qkv_bias == c.out_bias, f"no HF family has qkv_bias={c.qkv_bias}, out_bias={c.out_bias}."
    )
    return "llama"


def _hf_config(config: TransformerConfig | T5Config, model_type: str) -> dict[str, Any]:
    """config.json contents for `config` as HF family `model_type`."""
    c = config
    if model_type == "t5":
        return {
            "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
            "vocab_size": c.vocab_size, "d_model": c.embed_dim, "d_kv": c.head_dim,
            "d_ff": c.mlp_dim, "num_layers": c.num_encoder_layers,
            "num_decoder_layers": c.num_decoder_layers,
            "num_heads": c.num_heads, "relative_attention_num_buckets": c.relative_buckets,
            "relative_attention_max_distance": c.relative_max_distance,
            "layer_norm_epsilon": c.norm_eps, "feed_forward_proj": "gated-gelu",
            "is_encoder_decoder": True, "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": 1, "tie_word_embeddings": c.scale_decoder_outputs,
            "scale_decoder_outputs": c.scale_decoder_outputs,
        }  # fmt: skip
    if model_type == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
            "n_positions": c.max_positions, "n_embd": c.embed_dim, "n_layer": c.num_layers,
            "n_head": c.num_heads, "n_inner": c.mlp_dim, "activation_function": c.activation,
            "layer_norm_epsilon": c.norm_eps, "tie_word_embeddings": True,
        }  # fmt: skip
    hf = {
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": model_type, "vocab_size": c.vocab_size, "hidden_size": c.embed_dim,
        "intermediate_size": c.mlp_dim, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.max_positions,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings,
    }  # fmt: skip
    if model_type == "llama":
        hf.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    else:
        hf.update(use_sliding_window=False, max_window_layers=c.num_layers)
    return hf


# Tensor rules. -----------------------------------------------------------------------------------


def _gpt2_rules(c: TransformerConfig) -> list[_Rule]:
    n, h = c.num_layers, c.num_heads
    rules = [
        _rule("transformer.wte.weight", "embed/embedding"),
        _rule("transformer.wpe.weight", "pos_embed/embedding"),
        _rule("transformer.ln_f.weight", "final_norm/scale"),
        _rule("transformer.ln_f.bias", "final_norm/bias"),
    ]
    block = "transformer.h.{i}."
    for hf, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        rules += [_rule(f"{block}{hf}.weight", f"layers/{ours}/scale", layers=n),
                  _rule(f"{block}{hf}.bias", f"layers/{ours}/bias", layers=n)]  # fmt: skip
    for name in "qkv":  # Virtual names: `_normalize_gpt2` un-fuses c_attn.
        hf, ours = f"{block}attn.c_attn.{name}", f"layers/attn/{name}"
        rules += [_rule(f"{hf}.weight", f"{ours}/kernel", _conv_to_heads(h), n),
                  _rule(f"{hf}.bias", f"{ours}/bias", _bias_to_heads(h), n)]  # fmt: skip
    rules += [
        _rule(block + "attn.c_proj.weight", "layers/attn/o/kernel", _conv_from_heads(h), n),
        _rule(block + "attn.c_proj.bias", "layers/attn/o/bias", layers=n),
        _rule(block + "mlp.c_fc.weight", "layers/mlp/wi/kernel", layers=n),
        _rule(block + "mlp.c_fc.bias", "layers/mlp/wi/bias", layers=n),
        _rule(block + "mlp.c_proj.weight", "layers/mlp/wo/kernel", layers=n),
        _rule(block + "mlp.c_proj.bias", "layers/mlp/wo/bias", layers=n),
    ]
    return rules


def _llama_rules(c: TransformerConfig) -> list[_Rule]:
    n, block = c.num_layers, "model.layers.{i}."
    rules = [
        _rule("model.embed_tokens.weight", "embed/embedding"),
        _rule("model.norm.weight", "final_norm/scale"),
        _rule(block + "input_layernorm.weight", "layers/attn_norm/scale", layers=n),
        _rule(block + "post_attention_layernorm.weight", "layers/mlp_norm/scale", layers=n),
        _rule(
            block + "self_attn.o_proj.weight",
            "layers/attn/o/kernel",
            _linear_from_heads(c.num_heads),
            n,
        ),
    ]
    if not c.tie_embeddings:
        rules.append(_rule("lm_head.weight", "lm_head/kernel", _LINEAR))
    for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
        rules.append(
            _rule(
                f"{block}self_attn.{name}_proj.weight",
                f"layers/attn/{name}/kernel",
                _linear_to_heads(heads),
                n,
            )
        )
        if c.qkv_bias:
            rules.append(
                _rule(
                    f"{block}self_attn.{name}_proj.bias",
                    f"layers/attn/{name}/bias",
                    _bias_to_heads(heads),
                    n,
                )
            )
    if c.out_bias:
        rules.append(_rule(block + "self_attn.o_proj.bias", "layers/attn/o/bias", layers=n))
    for hf, ours in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")):
        rules.append(_rule(f"{block}mlp.{hf}.weight", f"layers/mlp/{ours}/kernel", _LINEAR, n))
        if c.mlp_bias:
            rules.append(_rule(f"{block}mlp.{hf}.bias", f"layers/mlp/{ours}/bias", layers=n))
    return rules


def _t5_stack_rules(stack: str, n: int, heads: int, attentions: tuple[str, ...]) -> list[_Rule]:
    """Rules of one T5 stack; `attentions` are our names of HF layer.0 (and layer.1) attentions."""
    block = f"{stack}.block.{{i}}.layer."
    hf_attention = {
        "attn": "SelfAttention",
        "self_attn": "SelfAttention",
        "cross_attn": "EncDecAttention",
    }
    rules = [
        _rule(f"{stack}.final_layer_norm.weight", f"{stack}/final_norm/scale"),
        _rule(
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            f"{stack}/relpos/embedding",
        ),
    ]
    for index, ours in enumerate(attentions):
        prefix = f"{block}{index}.{hf_attention[ours]}."
        rules.append(
            _rule(
                f"{block}{index}.layer_norm.weight", f"{stack}/layers/{ours}_norm/scale", layers=n
            )
        )
        rules += [
            _rule(
                f"{prefix}{name}.weight",
                f"{stack}/layers/{ours}/{name}/kernel",
                _linear_to_heads(heads),
                n,
            )
            for name in "qkv"
        ]
        rules.append(
            _rule(
                f"{prefix}o.weight", f"{stack}/layers/{ours}/o/kernel", _linear_from_heads(heads), n
            )
        )
    mlp = f"{block}{len(attentions)}."
    rules.append(_rule(mlp + "layer_norm.weight", f"{stack}/layers/mlp_norm/scale", layers=n))
    for name in ("wi_0", "wi_1", "wo"):
        rules.append(
            _rule(
                f"{mlp}DenseReluDense.{name}.weight",
                f"{stack}/layers/mlp/{name}/kernel",
                _LINEAR,
                n,
            )
        )
    return rules


def _t5_rules(c: T5Config) -> list[_Rule]:
    rules = [_rule("shared.weight", "embed/embedding")]
    if not c.tie_embeddings:
        rules.append(_rule("lm_head.weight", "lm_head/kernel", _LINEAR))
    rules += _t5_stack_rules("encoder", c.num_encoder_layers, c.num_heads, ("attn",))
    return rules + _t5_stack_rules(
        "decoder", c.num_decoder_layers, c.num_heads, ("self_attn", "cross_attn")
    )


_CONFIG_READERS = {
    "gpt2": _gpt2_config,
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "t5": _t5_config,
}
_RULES = {"gpt2": _gpt2_rules, "llama": _llama_rules, "qwen2": _llama_rules, "t5": _t5_rules}


# GPT-2 name and fusion quirks. -------------------------------------------------------------------


def _normalize_gpt2(tensors: dict[str, Array]) -> dict[str, Array]:
    """Adds the 'transformer.' prefix of GPT2Model exports and un-fuses c_attn into q, k, v."""
    out = {}
    for name, value in tensors.items():
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        match = re.fullmatch(r"(transformer\.h\.\d+\.attn\.c_attn)\.(weight|bias)", name)
        if match:
            for part, piece in zip("qkv", np.split(value, 3, axis=-1), strict=True):
                out[f"{match[1]}.{part}.{match[2]}"] = piece
        else:
            out[name] = value
    out.pop("lm_head.weight", None)  # Tied to wte.
    return out


def _fuse_gpt2(tensors: dict[str, Array]) -> dict[str, Array]:
    """Inverse of `_normalize_gpt2`'s un-fusing: q, k, v -> c_attn."""
    out = {}
    for name, value in tensors.items():
        match = re.fullmatch(r"(.*\.c_attn)\.q\.(weight|bias)", name)
        if match:
            parts = [tensors[f"{match[1]}.{p}.{match[2]}"] for p in "qkv"]
            out[f"{match[1]}.{match[2]}"] = np.concatenate(parts, axis=-1)
        elif not re.fullmatch(r".*\.c_attn\.[kv]\.(weight|bias)", name):
            out[name] = value
    return out


# Conversion. -------------------------------------------------------------------------------------


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def params_from_hf(tensors: Mapping[str, Array], rules: list[_Rule], place=None) -> Params:
    """Our float32 numpy params from HF tensors; errors on missing or unexpected tensors.
    `place(path, value)`, if given, turns each leaf into what the tree holds (a sharded array)."""
    params, used = {}, set()
    for rule in rules:
        names = [rule.hf.format(i=i) for i in range(rule.layers)] if rule.layers else [rule.hf]
        missing = [name for name in names if name not in tensors]
        if missing:
            raise ValueError(
                f"Checkpoint lacks tensor {missing[0]!r} (needed for {'/'.join(rule.path)})."
            )
        slices = [rule.to_ours(np.asarray(tensors[name], np.float32)) for name in names]
        value = np.stack(slices) if rule.layers else slices[0]
        _set(params, rule.path, value if place is None else place(rule.path, value))
        used.update(names)
    unexpected = sorted(name for name in tensors if name not in used and not _IGNORED.match(name))
    if unexpected:
        raise ValueError(
            f"Checkpoint has tensors this converter does not implement: {unexpected[:5]}."
        )
    return params


def params_to_hf(params: Params, rules: list[_Rule]) -> dict[str, Array]:
    """HF tensors (float32, contiguous) from our params."""
    tensors = {}
    for rule in rules:
        value = np.asarray(jax.device_get(_get(params, rule.path)), np.float32)
        for i in range(rule.layers) if rule.layers else [None]:
            piece = value if i is None else value[i]
            tensors[rule.hf.format(i=i)] = np.ascontiguousarray(rule.to_hf(piece))
    return tensors


def _check_shapes(model: DecoderOnlyLM | T5LM, params: Params) -> None:
    """Raises ValueError if params do not have exactly the model's leaves and shapes."""
    expected = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    want = {
        jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(expected)
    }
    got = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    if want != got:
        diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        details = [(k, want.get(k), got.get(k)) for k in diff[:5]]
        raise ValueError(
            f"Converted params do not fit the config; (path, expected, got): {details}."
        )


def from_pretrained(
    path: str, dtype: str = "float32", shardings: Callable | None = None
) -> tuple[DecoderOnlyLM | T5LM, Params]:
    """Loads a local HF checkpoint directory (config.json + *.safetensors).

    Args:
      path: directory with config.json and model.safetensors or sharded files plus
        model.safetensors.index.json.
      dtype: compute dtype of the returned model ('float32' or 'bfloat16'); params are float32.
      shardings: `shardings(model, abstract params) -> tree of Shardings`: load straight into
        them, one tensor at a time, so no host or device holds the whole model (GPT-2 reads
        its fused attention tensors whole first).

    Returns:
      (model, params): a DecoderOnlyLM (gpt2, llama, qwen2) or T5LM (t5), and float32 params.
    """
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}."
        )
    tensors = read_tensors(path)
    if model_type == "gpt2":
        tensors = _normalize_gpt2(tensors)
    config = _CONFIG_READERS[model_type](hf_config, set(tensors), dtype)
    model = T5LM(config) if isinstance(config, T5Config) else DecoderOnlyLM(config)
    place = placer(model, shardings) if shardings is not None else None
    params = params_from_hf(tensors, _RULES[model_type](config), place)
    _check_shapes(model, params)
    return model, params if place else jax.tree_util.tree_map(jnp.asarray, params)


def save_pretrained(
    model: DecoderOnlyLM | T5LM,
    params: Params,
    path: str,
    special_tokens: dict[str, int | None] | None = None,
) -> None:
    """Writes config.json + model.safetensors (float32) loadable by transformers' Auto classes.

    The HF family is chosen from the config (learned positions: gpt2; RoPE with q/k/v bias
    only: qwen2; other RoPE: llama; T5Config: t5); configs no family can express raise
    ValueError. With special_tokens ({'bos', 'eos', 'pad'} ids, None = none) config.json
    states them and generation_config.json is written, so that generation (and assisted
    generation with a draft) stops where the models were trained to stop.
    """
    model_type = _model_type(model.config)
    tensors = params_to_hf(params, _RULES[model_type](model.config))
    if model_type == "gpt2":
        tensors = _fuse_gpt2(tensors)
    if (
        model_type == "t5"
        and model.config.tie_embeddings
        and not model.config.scale_decoder_outputs
    ):
        # A tied but unscaled head (transformers >= 5 builds v1.1 models so): an explicit
        # lm_head with tie_word_embeddings=False is read the same by every transformers version.
        tensors["lm_head.weight"] = tensors["shared.weight"].copy()
    os.makedirs(path, exist_ok=True)
    config = _hf_config(model.config, model_type)
    if special_tokens is not None:
        ids = {f"{k}_token_id": v for k, v in special_tokens.items() if v is not None}
        config.update(ids)
        generation = dict(ids, _from_model_config=True)
        if model_type == "t5":
            generation["decoder_start_token_id"] = config["decoder_start_token_id"]
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
