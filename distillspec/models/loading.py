"""One entry point for checkpoints: tells a T5X checkpoint from a Hugging Face directory.

`load_checkpoint(path)` is what run functions call for TEACHER/STUDENT/TARGET checkpoints; the
format is read off the directory's contents, never off its name.
"""

from __future__ import annotations

import os
from typing import Any

HF = "hf"
T5X = "t5x"
_EXPECTED = (
    "a Hugging Face directory (config.json + model.safetensors or model.safetensors.index.json), "
    "a T5X step directory (checkpoint_<step>/ holding a msgpack 'checkpoint' file), or a T5X "
    "model directory holding checkpoint_<step>/ directories"
)


def checkpoint_format(path: str) -> str:
    """'hf' or 't5x', from the files in `path`.

    Raises:
      FileNotFoundError: if `path` does not exist.
      ValueError: if `path` is neither format, or both; the message says what was expected.
    """
    from distillspec.models import t5x_store

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}: it does not exist.")
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    is_hf = "config.json" in names
    try:
        t5x_store.find_step_dir(path)
        is_t5x = True
    except FileNotFoundError:
        is_t5x = False
    if is_hf and is_t5x:
        raise ValueError(
            f"{path!r} holds both a Hugging Face config.json and T5X checkpoints; pass the "
            "checkpoint_<step>/ directory or a directory with the Hugging Face files only."
        )
    if is_hf:
        return HF
    if is_t5x:
        return T5X
    shown = names[:10] + (["..."] if len(names) > 10 else [])
    raise ValueError(
        f"{path!r} is not a recognised checkpoint: expected {_EXPECTED}; it holds {shown}."
    )


def load_checkpoint(path: str, **kwargs: Any) -> tuple[Any, Any]:
    """(model, params) of a T5X checkpoint (`from_t5x`) or a Hugging Face directory
    (`from_pretrained`), detected by `checkpoint_format`.

    Args:
      path: the checkpoint directory.
      **kwargs: `dtype` (compute dtype, both formats); `shardings` (a pytree of shardings like
        the params, or `shardings(model, abstract params) -> that pytree`: both formats load
        straight into them, T5X slice by slice, Hugging Face tensor by tensor); `config` and
        `progress` (T5X only: a Hugging Face directory has config.json).
    """
    from distillspec.models import hf_interop, t5x

    if checkpoint_format(path) == T5X:
        return t5x.from_t5x(path, **kwargs)
    shardings = kwargs.pop("shardings", None)
    unsupported = sorted(set(kwargs) - {"dtype"})
    if unsupported:
        raise ValueError(
            f"{path!r} is a Hugging Face checkpoint; {unsupported} apply to T5X checkpoints only "
            "(its config comes from config.json)."
        )
    if shardings is not None and not callable(shardings):
        shardings = (lambda tree: lambda model, shapes: tree)(shardings)
    return hf_interop.from_pretrained(path, shardings=shardings, **kwargs)


def config_from_hf(hf_config: dict[str, Any], dtype: str = "float32") -> Any:
    """The model config a Hugging Face config.json describes, read without its weights (a T5's
    lm head is untied unless tie_word_embeddings says otherwise)."""
    from distillspec.models import hf_interop

    model_type = hf_config.get("model_type")
    supported = hf_interop.SUPPORTED_MODEL_TYPES
    if model_type not in supported:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported: {list(supported)}."
        )
    tied = hf_config.get("tie_word_embeddings", model_type != "t5")
    names = set() if tied else {"lm_head.weight"}
    return hf_interop._CONFIG_READERS[model_type](hf_config, names, dtype)


def expected_hf_tensors(hf_config: dict[str, Any], names: set[str]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} that a Hugging Face checkpoint with this config.json must hold, as
    `from_pretrained` reads it (GPT-2's c_attn fused; `names`: the tensors it does hold, for
    T5's untied head), computed from the model's abstract params (nothing allocated)."""
    import re

    import jax

    from distillspec.models import T5LM, DecoderOnlyLM, hf_interop

    model_type = hf_config.get("model_type")
    config_from_hf(hf_config)  # An unsupported model_type: the error that lists the supported.
    config = hf_interop._CONFIG_READERS[model_type](hf_config, names, "float32")
    model = T5LM(config) if model_type == "t5" else DecoderOnlyLM(config)
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    shapes = {}
    for rule in hf_interop._RULES[model_type](config):
        leaf = hf_interop._get(abstract, rule.path)
        one = jax.ShapeDtypeStruct(leaf.shape[1:] if rule.layers else leaf.shape, leaf.dtype)
        shape = tuple(jax.eval_shape(rule.to_hf, one).shape)
        for i in range(rule.layers) if rule.layers else [None]:
            shapes[rule.hf.format(i=i)] = shape
    fused = {}
    for name, shape in shapes.items():  # GPT-2 stores q, k, v as one c_attn tensor.
        match = re.fullmatch(r"(.*\.c_attn)\.[qkv]\.(weight|bias)", name)
        if match:
            key = f"{match[1]}.{match[2]}"
            width = fused.get(key, (*shape[:-1], 0))[-1]
            fused[key] = (*shape[:-1], width + shape[-1])
        else:
            fused[name] = shape
    return fused


def ignored_tensor(name: str) -> bool:
    """Whether `from_pretrained` skips a checkpoint tensor of this name (buffers of old exports,
    T5's per-stack copies of the shared embedding)."""
    from distillspec.models import hf_interop

    return bool(hf_interop._IGNORED.match(name))
