"""The start-up the evaluation run functions share: output directory, tasks, models, prompts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from distillspec import checkpoints, tasks
from distillspec.feature_converters import prompt_batches
from distillspec.models import load_checkpoint
from distillspec.vocabularies import get_vocabulary


def open_run(run: str, output_dir, target_checkpoint, drafts, vocabulary, tfds_data_dir):
    """A run function's common start: checks OUTPUT_DIR and drafts, registers the tasks,
    loads the target (a Hugging Face or T5X checkpoint directory, told apart by
    `models.load_checkpoint`). Returns (vocabulary, target model, target params)."""
    checkpoints.check_writable(output_dir)
    if not drafts:
        raise ValueError(f"{run} needs at least one draft: drafts = {{name: checkpoint_directory}}")
    vocab = get_vocabulary(vocabulary)
    tasks.register_tasks(vocab, tfds_data_dir=tfds_data_dir)
    return (vocab, *load_checkpoint(target_checkpoint))


def prompt_sets(
    eval_sets: Iterable[tuple[str, str]], lengths: Mapping[str, int], num_prompts: int,
    batch_size: int,
) -> dict[tuple[str, str], list[dict[str, np.ndarray]]]:  # fmt: skip
    """{(task, split): [prompt batches]} holding the first num_prompts prompts of each set."""
    sets: dict[tuple[str, str], Any] = {}
    for task, split in eval_sets:
        batches, seen = [], 0
        for batch in prompt_batches(
            task, split, batch_size, lengths["inputs"], lengths["targets"], shuffle=False
        ):
            batches.append(batch)
            seen += int(batch["valid"].sum())
            if seen >= num_prompts:
                break
        sets[(task, split)] = batches
    return sets
