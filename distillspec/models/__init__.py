"""Models: a decoder-only Transformer (GPT-2 / Llama / Qwen2), T5 v1.1, HF and T5X checkpoints.

Every model implements `distillspec.models.base.DecodingModel` plus `init`, `logical_axes` and
teacher-forced `logits`. The heavy modules (flax, safetensors) load on first use of a name.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TransformerConfig": "distillspec.models.decoder_only",
    "DecoderOnlyLM": "distillspec.models.decoder_only",
    "T5Config": "distillspec.models.t5",
    "T5LM": "distillspec.models.t5",
    "from_pretrained": "distillspec.models.hf_interop",
    "save_pretrained": "distillspec.models.hf_interop",
    "from_t5x": "distillspec.models.t5x",
    "save_t5x": "distillspec.models.t5x",
    "checkpoint_format": "distillspec.models.loading",
    "load_checkpoint": "distillspec.models.loading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Imports the defining module lazily (PEP 562), so `import distillspec.models` stays light."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
