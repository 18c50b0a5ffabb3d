"""The start-up the run functions share: tokenizer, tasks, models and their checks, exports."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from distillspec import checkpoints, serving, tasks
from distillspec.feature_converters import prompt_batches
from distillspec.models import load_checkpoint, save_pretrained
from distillspec.models.loading import HF, checkpoint_format
from distillspec.vocabularies import (
    Tokenizer,
    check_same_vocabulary,
    checkpoint_special_ids,
    load_tokenizer,
)


def check_models_serve(
    models: Mapping[str, Any], tokenizer: Tokenizer, vocab_size: int | None, flag: str
) -> None:
    """Every id the tokenizer can produce must be inside every model's embedding, and all
    models of a run must be of one family; else ValueError naming the sizes and `flag`.

    An id past an embedding reads garbage (NaN on some backends) and makes every metric
    meaningless, so this runs before any decoding or training.
    """
    families = {name: m.encoder_decoder for name, m in models.items()}
    if len(set(families.values())) > 1:
        kinds = {n: "encoder-decoder" if e else "decoder-only" for n, e in families.items()}
        raise ValueError(f"the models must all be decoder-only or all encoder-decoder: {kinds}")
    sizes = {name: m.vocab_size for name, m in models.items()}
    if vocab_size is None and len(set(sizes.values())) > 1:
        raise ValueError(
            f"the models' embeddings differ in size: {sizes}. If they share one tokenizer and "
            f"only pad their embeddings differently, set {flag} = <the tokenizer's size> "
            f"({tokenizer.size} for the {tokenizer.source} tokenizer); otherwise give them one "
            "tokenizer"
        )
    if vocab_size is not None and not tokenizer.size <= vocab_size <= min(sizes.values()):
        raise ValueError(
            f"{flag} = {vocab_size} must lie between the tokenizer's size ({tokenizer.size}) "
            f"and the smallest model embedding {sizes}"
        )
    small = {name: size for name, size in sizes.items() if size < tokenizer.size}
    if small:
        raise ValueError(
            f"the {tokenizer.source} tokenizer has {tokenizer.size} ids but the embedding of "
            f"{small} is smaller, so ids past it would read garbage: use the models' own "
            "tokenizer (vocabulary = its tokenizer.json or SentencePiece model)"
        )


def check_special_tokens(checkpoints_by_name: Mapping[str, str | None]) -> None:
    """Checkpoints that state special token ids (config.json / generation_config.json) must
    state the same ones: a draft trained to stop on another EOS than its target's would draft
    past the end. Checkpoints with tokenizer files must also hold the same vocabulary
    (`vocabularies.check_same_vocabulary`)."""
    stated = {
        name: checkpoint_special_ids(path)
        for name, path in checkpoints_by_name.items()
        if path and os.path.isdir(path)
    }
    for key in ("bos", "eos", "pad"):
        values = {name: ids[key] for name, ids in stated.items() if ids[key] is not None}
        if len(set(values.values())) > 1:
            raise ValueError(
                f"the checkpoints disagree on {key}_token_id: {values}; target and draft must "
                "share one tokenizer and its special tokens"
            )
    check_same_vocabulary(checkpoints_by_name)


def export(model, params, tokenizer: Tokenizer, directory: str) -> None:
    """A servable Hugging Face directory: weights, config.json with the special token ids,
    generation_config.json and the tokenizer files."""
    save_pretrained(model, params, directory, special_tokens=tokenizer.special_ids)
    tokenizer.save(directory)


def report_serving(
    draft_dir: str, target_checkpoint: str | None, gamma: int, source: str, show: bool = True,
    write: bool = True,
) -> dict[str, Any] | None:  # fmt: skip
    """The serve check of an export beside its target (`serving.check`), written to its
    SERVING.md and, with `show`, printed with the ready engines' commands; None for a
    draft that is no Hugging Face directory (a T5X checkpoint: nothing to serve as is)."""
    if checkpoint_format(draft_dir) != HF:
        return None
    hf_target = target_checkpoint and checkpoint_format(target_checkpoint) == HF
    report = serving.check(draft_dir, target_checkpoint if hf_target else None)
    if write:
        serving.write_serving(report, gamma, source, draft_dir)
    if show:
        print(serving.summary(report, gamma, source), flush=True)
    return report


def open_run(
    run: str, output_dir, target_checkpoint, drafts, vocabulary, eval_sets, vocab_size,
    tfds_data_dir, references: bool = False,
):  # fmt: skip
    """A run function's common start: checks OUTPUT_DIR, drafts and eval sets (before any
    model is loaded), loads the tokenizer, target and drafts, checks that they serve each
    other, registers the eval sets. references: the run scores the eval sets' reference
    completions (evaluate's quality), so prompts-only data is an error.

    Returns:
      (tokenizer, target model, target params, {draft name: (model, params)},
       [(seqio task name, split)] in the order of eval_sets).
    """
    checkpoints.check_writable(output_dir)
    if not drafts:
        raise ValueError(f"{run} needs at least one draft: drafts = {{name: checkpoint_dir}}")
    sets = [(tasks.as_task(task), split) for task, split in eval_sets]
    for task, _ in sets if references else ():
        if isinstance(task, tasks.FileTask) and not tasks.has_completions(task):
            raise ValueError(
                f"{task.path!r} holds prompts only (no {task.completion_key!r} key), but "
                f"{run}'s quality table scores reference completions: give them under that key "
                f"(or set FileTask.completion_key), or set {run}.quality = False"
            )
    tokenizer = load_tokenizer(vocabulary, target_checkpoint)
    check_special_tokens({"target": target_checkpoint, **drafts})
    target, target_params = load_checkpoint(target_checkpoint)
    models = {name: load_checkpoint(path) for name, path in drafts.items()}
    flag = f"{run}.vocab_size"
    check_models_serve(
        {"target": target, **{n: m for n, (m, _) in models.items()}}, tokenizer, vocab_size, flag
    )
    register = lambda task: tasks.register_task(
        task, tokenizer.vocabulary, tfds_data_dir=tfds_data_dir,
        inputs_eos=target.encoder_decoder, bos_id=tokenizer.prompt_bos,
    )  # fmt: skip
    names = [(register(task), split) for task, split in sets]
    return tokenizer, target, target_params, models, names


def prompt_sets(
    eval_sets: Iterable[tuple[str, str]], lengths: Mapping[str, int], num_prompts: int,
    batch_size: int, bos_id: int | None = None,
) -> dict[tuple[str, str], list[dict[str, np.ndarray]]]:  # fmt: skip
    """{(task, split): [prompt batches]} holding the first num_prompts prompts of each set
    (a prompt truncated from the left keeps its BOS `bos_id`). Rows past num_prompts in the
    last batch are marked invalid ('valid' False), so every figure counts exactly the prompts
    asked for (or all the split has, if fewer)."""
    sets: dict[tuple[str, str], Any] = {}
    for task, split in eval_sets:
        batches, seen = [], 0
        for batch in prompt_batches(
            task,
            split,
            batch_size,
            lengths["inputs"],
            lengths["targets"],
            shuffle=False,
            bos_id=bos_id,
        ):
            valid = np.asarray(batch["valid"]).astype(bool)
            valid &= np.cumsum(valid) <= num_prompts - seen
            batches.append({**batch, "valid": valid.astype(np.asarray(batch["valid"]).dtype)})
            seen += int(valid.sum())
            if seen >= num_prompts:
                break
        sets[(task, split)] = batches
    return sets
