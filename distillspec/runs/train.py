"""The training run function, T5X style: pretraining and distillation of a draft model.

    python -m distillspec.train --gin_file=configs/tests/tiny_distill.gin \\
        --gin.MODEL_DIR=\\"/tmp/run\\" [--gin.TRAIN_STEPS=200] [--gin_search_paths=DIR,...] \\
        [--tfds_data_dir=DIR]

Only this run function and the typed config objects it receives are configurable (registered
in `distillspec.gin_setup` as `distillspec.train.train`); this module knows nothing of gin.
Rerunning the same command after an interruption resumes from MODEL_DIR's latest checkpoint.

MODEL_DIR receives: config.gin (the configuration of the run), checkpoints/ (orbax),
train/ (TensorBoard events), metrics.jsonl (one JSON object per step) and export/ (the
student in Hugging Face format, loadable by `distillspec.models.from_pretrained` and by
transformers).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import jax

from distillspec import checkpoints, datagen, partitioning, tasks, trainer
from distillspec.feature_converters import prompt_batches
from distillspec.models import load_checkpoint, save_pretrained
from distillspec.vocabularies import get_vocabulary

EXPORT_SUBDIR = "export"


def _load_student(student, student_checkpoint, seed):
    if (student is None) == (student_checkpoint is None):
        raise ValueError(
            "give exactly one of train.student (an architecture, initialised from the seed) and "
            "train.student_checkpoint (a Hugging Face or T5X checkpoint directory); got "
            f"student={student!r}, student_checkpoint={student_checkpoint!r}"
        )
    if student_checkpoint is not None:
        return load_checkpoint(student_checkpoint)
    return student, student.init(jax.random.PRNGKey(seed))


def _load_teacher(teacher, teacher_checkpoint, teacher_seed):
    if teacher is not None and teacher_checkpoint is not None:
        raise ValueError("give at most one of train.teacher and train.teacher_checkpoint")
    if teacher_checkpoint is not None:
        return load_checkpoint(teacher_checkpoint)
    if teacher is not None:
        return teacher, teacher.init(jax.random.PRNGKey(teacher_seed))
    return None, None


def _check_compatible(
    student, teacher, loss: trainer.LossConfig, vocab_size: int, mixture: datagen.DataMixture
) -> None:
    if teacher is None and loss.divergence != "ce":
        raise ValueError(
            f"loss divergence {loss.divergence!r} needs a teacher: set train.teacher_checkpoint "
            "(or train.teacher), or use LossConfig.divergence = 'ce' for pretraining"
        )
    # Without this, a pretraining run with lambda1 < 1 and lambda2 < 1 would crash at the
    # first step that draws teacher samples, possibly hours in.
    if teacher is None and mixture.needs_teacher_samples:
        raise ValueError(
            "the data mixture samples from the teacher (DataMixture.fixed_data_fraction "
            f"(lambda1) = {mixture.fixed_data_fraction} < 1 and student_data_fraction (lambda2) "
            f"= {mixture.student_data_fraction} < 1) but no teacher is given; set "
            "train.teacher_checkpoint (or train.teacher), or lambda1 = 1 or lambda2 = 1"
        )
    if teacher is not None and teacher.encoder_decoder != student.encoder_decoder:
        family = lambda m: "an encoder-decoder" if m.encoder_decoder else "decoder-only"
        raise ValueError(
            f"the student is {family(student)} ({type(student).__name__}) and the teacher "
            f"{family(teacher)} ({type(teacher).__name__}); both score the same packed batch, "
            "so they must be of one family (a T5X teacher needs a T5 student: train.student = "
            "@T5LM() or a T5 train.student_checkpoint)"
        )
    if teacher is not None and teacher.vocab_size != student.vocab_size:
        raise ValueError(
            f"the student's vocabulary ({student.vocab_size} ids) and the teacher's "
            f"({teacher.vocab_size} ids) differ; distillation compares their distributions id by "
            "id, so both must use the same tokenizer and embedding size"
        )
    if student.vocab_size < vocab_size:
        raise ValueError(
            f"the model's vocabulary ({student.vocab_size} ids) is smaller than the task "
            f"vocabulary ({vocab_size} ids); set the model's vocab_size >= {vocab_size}"
        )


def _check_run_args(max_examples, loop: trainer.LoopConfig, mesh_shape) -> None:
    """Fails before any model is built on arguments that would only fail later."""
    # A negative value would slice examples off the end ([:-1]) instead of failing.
    if max_examples is not None and not (isinstance(max_examples, int) and max_examples >= 1):
        raise ValueError(
            f"train.max_examples must be None (the whole split) or an integer >= 1, "
            f"got {max_examples!r}"
        )
    data = tuple(mesh_shape)[0]
    if loop.batch_size % data:
        raise ValueError(
            f"LoopConfig.batch_size ({loop.batch_size}) must be a multiple of the mesh's data "
            f"axis size {data} (train.mesh_shape = {tuple(mesh_shape)})"
        )


def _example_store(task, split, lengths, max_examples, batch_size):
    batches = prompt_batches(
        task, split, batch_size=256, prompt_length=lengths["inputs"],
        completion_length=lengths["targets"], shuffle=False, num_epochs=1,
    )  # fmt: skip
    store = datagen.ExampleStore.from_batches(batches, max_examples)
    if len(store) == 0:
        raise ValueError(
            f"task {task!r} split {split!r} has no usable examples; nothing to train on"
        )
    if len(store) < batch_size:
        print(f"warning: {len(store)} examples < batch size {batch_size}; examples repeat within "
              "a batch", file=sys.stderr)  # fmt: skip
    return store


def train(
    model_dir: str,
    task: str = "stdlib_code",
    split: str = "train",
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},
    student=None,
    student_checkpoint: str | None = None,
    teacher=None,
    teacher_checkpoint: str | None = None,
    teacher_seed: int = 1,
    loop: trainer.LoopConfig = trainer.LoopConfig(),
    loss: trainer.LossConfig = trainer.LossConfig(divergence="ce"),
    optimizer: trainer.OptimizerConfig = trainer.OptimizerConfig(),
    mixture: datagen.DataMixture = datagen.DataMixture(fixed_data_fraction=1.0),
    mesh_shape: tuple[int, int] = (1, 1),
    vocabulary: str = "sentencepiece",
    max_examples: int | None = None,
    tfds_data_dir: str | None = None,
    console: bool = True,
    config_text: str = "",
):
    """Trains (pretrains or distils) a student and exports it to MODEL_DIR/export.

    Args:
      model_dir: MODEL_DIR, created if needed; a rerun resumes from its latest checkpoint.
      task, split: seqio task (see `distillspec.tasks`) and split to train on.
      task_feature_lengths: {'inputs': P, 'targets': N}: prompt and completion lengths.
      student / student_checkpoint: an architecture to initialise from loop.seed, or a Hugging
        Face or T5X checkpoint directory to warm-start from (exactly one).
      teacher / teacher_checkpoint: the frozen target: an architecture initialised from
        teacher_seed, or a Hugging Face or T5X checkpoint directory; neither for pretraining.
        Checkpoints load with `models.load_checkpoint`, which tells the formats apart by their
        files (a T5X model directory gives its latest checkpoint_<step>/).
      loop, loss, optimizer, mixture: see their classes.
      mesh_shape: (data, model) device mesh; (1, 1) runs on one device.
      vocabulary: 'sentencepiece' or 'byte' (shared by every model of a project).
      max_examples: use only the first examples of the split (smoke tests).
      tfds_data_dir: where prepared TFDS data sets live (the paper's tasks).
      console: show a progress bar.
      config_text: the run's whole configuration, written to MODEL_DIR/config.gin (the gin
        command line passes the parsed gin config).

    Returns:
      The student's final parameters.
    """
    checkpoints.check_writable(model_dir)
    _check_run_args(max_examples, loop, mesh_shape)
    if tuple(mesh_shape) != (1, 1):
        mesh = partitioning.make_mesh(*mesh_shape)
    else:
        mesh = None
    vocab = get_vocabulary(vocabulary) if isinstance(vocabulary, str) else vocabulary
    tasks.register_tasks(vocab, tfds_data_dir=tfds_data_dir)
    student_model, params = _load_student(student, student_checkpoint, loop.seed)
    teacher_model, teacher_params = _load_teacher(teacher, teacher_checkpoint, teacher_seed)
    _check_compatible(student_model, teacher_model, loss, vocab.vocab_size, mixture)
    store = _example_store(task, split, task_feature_lengths, max_examples, loop.batch_size)
    with open(os.path.join(model_dir, "config.gin"), "w") as f:
        f.write(config_text)
    models = trainer.Models(student_model, teacher_model, teacher_params)
    params = trainer.fit(
        model_dir, models, params, store, loop, loss, optimizer,
        mixture=mixture, eos_id=vocab.eos_id, mesh=mesh, console=console,
    )  # fmt: skip
    save_pretrained(student_model, jax.device_get(params), os.path.join(model_dir, EXPORT_SUBDIR))
    return params
