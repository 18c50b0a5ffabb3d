"""The trained memory-bound reference pair: a trained target made dearer per call, logits unchanged.

`padded_target` appends Transformer blocks to a trained decoder-only target. Each added block's
residual output projections, the attention out-projection `o` and the MLP down-projection `wo`
(their biases too, where the architecture has them), are exactly zero, so the block adds exactly
0 to the residual stream and the padded model's logits are bit-identical to the trained
target's, for a full forward and for incremental decoding with the KV cache alike
(tests/test_benchmarks.py checks both). The blocks' other weights are random, in the trained
blocks' dtype, so every call reads and multiplies them and keeps their KV caches: the target
pays for the added weights as a larger trained model of the same distribution would. The added
blocks have the trained blocks' shape (the blocks are one scanned stack); more blocks, not
wider ones, make the target dearer.

`trained_pair` pads the main job's trained target (python -m distillspec.quickstart) to at least
--target_mb megabytes of weights, enough on a CPU that a batch-1 call streams its weights from
memory (memory-bound: verifying a few more positions costs little, r_gamma near 1) and the
trained drafts cost a small fraction of it (c small); the benchmark measures and prints both.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import checks
from distillspec.models import DecoderOnlyLM

# Modules whose output is added to the residual stream: zero in every added block.
RESIDUAL_OUTPUTS = ("o", "wo")
# The main job's checkpoints, relative to its output directory (python -m distillspec.quickstart).
TARGET_EXPORT = os.path.join("target", "export")
DRAFT_EXPORTS = {
    "standard": os.path.join("draft", "export"),
    "distilled": os.path.join("distilled", "export"),
}


def _check_decoder_only(model) -> None:
    if not isinstance(model, DecoderOnlyLM):
        raise ValueError(
            f"padded_target pads a decoder-only target (DecoderOnlyLM), got {type(model).__name__}"
        )


def padded_target(model, params, extra_layers: int, seed: int = 0):
    """(model, params) of `model` with `extra_layers` blocks appended whose residual outputs are 0.

    Args:
      model: a trained `DecoderOnlyLM` (its blocks are one scanned stack, params['layers'] with a
        leading [num_layers] axis).
      params: its parameters; the added blocks' leaves take the dtype of the trained ones.
      extra_layers: blocks to append, >= 0 (0 returns model and params unchanged).
      seed: the added blocks' random weights.

    Returns:
      (DecoderOnlyLM with num_layers + extra_layers blocks, params): the trained blocks first,
      unchanged, then the added ones; logits bit-identical to the trained model's.
    """
    _check_decoder_only(model)
    checks.check_int("extra_layers", extra_layers, minimum=0)
    if extra_layers == 0:
        return model, params
    extra = DecoderOnlyLM(dataclasses.replace(model.config, num_layers=extra_layers))
    added = extra.init(jax.random.PRNGKey(seed))["layers"]

    def fit(path, new, trained):
        names = [str(getattr(key, "key", key)) for key in path]
        new = jnp.asarray(new, trained.dtype)
        if any(name in RESIDUAL_OUTPUTS for name in names):
            new = jnp.zeros_like(new)
        return jnp.concatenate([jnp.asarray(trained), new], axis=0)

    layers = jax.tree_util.tree_map_with_path(fit, added, params["layers"])
    config = dataclasses.replace(model.config, num_layers=model.config.num_layers + extra_layers)
    return DecoderOnlyLM(config), dict(params, layers=layers)


def layers_to_reach(model, params, megabytes: float) -> int:
    """Blocks to append so the padded target's weights reach `megabytes` (0 if they do)."""
    _check_decoder_only(model)
    nbytes = lambda tree: sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    per_block = nbytes(params["layers"]) / model.config.num_layers
    missing = megabytes * 1e6 - nbytes(params)
    return max(math.ceil(missing / per_block), 0)


def trained_pair(run_dir: str, draft: str, target_mb: float, extra_layers: int | None = None,
                 seed: int = 0):  # fmt: skip
    """(target, target_params, draft, draft_params, description) of the main job's trained
    target, padded to >= target_mb megabytes (or by extra_layers blocks), and its trained draft
    `draft` ('standard' or 'distilled') from run_dir (the quickstart's output directory)."""
    from distillspec.models import load_checkpoint

    if draft not in DRAFT_EXPORTS:
        raise ValueError(f"--draft must be one of {tuple(DRAFT_EXPORTS)}, got {draft!r}")
    paths = {"target": os.path.join(run_dir, TARGET_EXPORT)}
    paths[draft] = os.path.join(run_dir, DRAFT_EXPORTS[draft])
    for name, path in paths.items():
        if not os.path.isdir(path):
            raise SystemExit(
                f"the trained {name} {path!r} is missing: run python -m distillspec.quickstart "
                f"first (or pass --run_dir, the directory it wrote)"
            )
    model, params = load_checkpoint(paths["target"])
    if extra_layers is None:
        extra_layers = layers_to_reach(model, params, target_mb)
    target, target_params = padded_target(model, params, extra_layers, seed)
    draft_model, draft_params = load_checkpoint(paths[draft])
    description = (
        f"trained target {paths['target']} ({model.config.num_layers} blocks) padded with "
        f"{extra_layers} blocks whose attention out-projection and MLP down-projection are "
        f"zero (logits bit-identical to the trained target's; the other weights random), "
        f"{draft} draft {paths[draft]}"
    )
    return target, target_params, draft_model, draft_params, description


def task_prompts(checkpoint: str, vocabulary: str | None, task: str,
                 counts: dict[str, int], prompt_length: int):  # fmt: skip
    """({split: [(prompt_tokens [1, P], prompt_lengths [1])]} of the first counts[split]
    prompts of each split of `task`, tokenised with the checkpoint's tokenizer (or
    `vocabulary`), and the tokenizer's EOS id."""
    from distillspec import tasks
    from distillspec.feature_converters import single_prompts
    from distillspec.runs.common import prompt_sets
    from distillspec.vocabularies import load_tokenizer

    tokenizer = load_tokenizer(vocabulary, checkpoint)
    name = tasks.register_task(task, tokenizer.vocabulary, bos_id=tokenizer.prompt_bos)
    lengths = {"inputs": prompt_length, "targets": 1}
    out = {}
    for split, count in counts.items():
        batches = prompt_sets([(name, split)], lengths, count, 32, tokenizer.prompt_bos)
        out[split] = single_prompts(batches[(name, split)])[:count]
    return out, tokenizer.eos_id
