"""The training run function, T5X style: pretraining and distillation of a draft model.

    python -m distillspec.train --gin_file=configs/tests/tiny_distill.gin \\
        --gin.MODEL_DIR=\\"/tmp/run\\" [--gin.TRAIN_STEPS=200] [--gin_search_paths=DIR,...] \\
        [--tfds_data_dir=DIR]

Only this run function and the typed config objects it receives are configurable (registered
in `distillspec.gin_setup` as `distillspec.train.train`); this module knows nothing of gin.
Rerunning the same command after an interruption resumes from MODEL_DIR's latest checkpoint.

Multi-process runs (`--multiprocess`, see `distillspec.distributed`): every process runs this
function with the same configuration (checked at start-up); each reads only its data shards,
the teacher is created or loaded straight into its shardings, and process 0 alone writes
config.gin, the logs and export/.

MODEL_DIR receives: config.gin (the configuration of the run), checkpoints/ (orbax),
train/ (TensorBoard events), metrics.jsonl (one JSON object per step) and export/ (the
student in Hugging Face format, loadable by `distillspec.models.from_pretrained` and by
transformers).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from distillspec import (
    checkpoints,
    datagen,
    distributed,
    metrics,
    partitioning,
    served,
    serving,
    tasks,
    teacher_cache,
    trainer,
)
from distillspec.evaluation import costs as call_costs
from distillspec.feature_converters import prompt_batches, valid_rows
from distillspec.models import load_checkpoint
from distillspec.models.base import TruncatedVocabulary, for_decoding, with_remat
from distillspec.models.drafts import DraftSpec, make_draft, num_params
from distillspec.runs.common import (
    check_models_serve,
    check_special_tokens,
    export,
    prompt_sets,
    report_serving,
)
from distillspec.vocabularies import Tokenizer, load_tokenizer

EXPORT_SUBDIR = "export"


def _load_teacher(teacher, teacher_checkpoint, teacher_seed, mesh=None, rules=()):
    """The teacher, on a mesh created or loaded straight into its shardings (`rules`)."""
    if teacher is not None and teacher_checkpoint is not None:
        raise ValueError("give at most one of train.teacher and train.teacher_checkpoint")
    place = None
    if mesh is not None:
        place = lambda model, shapes: partitioning.shardings_for(
            shapes, model.logical_axes(), mesh, rules
        )
    if teacher_checkpoint is not None:
        return load_checkpoint(teacher_checkpoint, shardings=place)
    if teacher is not None:
        rng = jax.random.PRNGKey(teacher_seed)
        if mesh is not None:
            return teacher, partitioning.init_sharded(teacher, rng, mesh, rules)
        return teacher, teacher.init(rng)
    return None, None


def _load_student(student, student_checkpoint, seed, teacher, teacher_params):
    if (student is None) == (student_checkpoint is None):
        raise ValueError(
            "give exactly one of train.student (an architecture initialised from the seed, or "
            "@DraftSpec() for a draft made for the teacher) and train.student_checkpoint (a "
            f"checkpoint directory); got student={student!r}, "
            f"student_checkpoint={student_checkpoint!r}"
        )
    if student_checkpoint is not None:
        return load_checkpoint(student_checkpoint)
    if isinstance(student, DraftSpec):
        if teacher is None:
            raise ValueError("train.student = @DraftSpec() makes a draft for the teacher: set "
                             "train.teacher_checkpoint")  # fmt: skip
        return make_draft(student, teacher, teacher_params, seed)
    return student, student.init(jax.random.PRNGKey(seed))


def _load_reference(checkpoint: str | None, loss: trainer.LossConfig, params):
    """AdaSPEC's reference model's parameters (the student's architecture), or None."""
    if (checkpoint is None) != (loss.select_fraction == 1):
        raise ValueError(
            f"train.reference_checkpoint = {checkpoint!r} with LossConfig.select_fraction = "
            f"{loss.select_fraction}: AdaSPEC's token selection needs both (a reference model "
            "and a fraction < 1) or neither"
        )
    if checkpoint is None:
        return None
    reference = load_checkpoint(checkpoint)[1]
    shapes = lambda tree: jax.tree.map(np.shape, tree)
    if jax.tree.structure(reference) != jax.tree.structure(params) or shapes(reference) != (
        shapes(params)
    ):
        raise ValueError(
            f"train.reference_checkpoint {checkpoint!r} is not a model of the student's "
            "architecture: AdaSPEC's reference is a copy of the draft distilled toward the target"
        )
    return reference


def _check_data(task, mixture: datagen.DataMixture) -> None:
    """Prompts-only data cannot be the fixed-data share of a mixture."""
    if (
        mixture.fixed_data_fraction > 0
        and isinstance(task, tasks.FileTask)
        and not tasks.has_completions(task)
    ):
        raise ValueError(
            f"{task.path!r} holds prompts only (no {task.completion_key!r} key), so it cannot "
            f"give the fixed data set's completions: DataMixture.fixed_data_fraction (lambda1) "
            f"= {mixture.fixed_data_fraction} must be 0 (teacher- or student-generated data)"
        )


def common_vocab_size(student, teacher, vocab_size: int | None) -> int | None:
    """The logit width both models are compared over (None: their own, equal, size)."""
    if teacher is None or vocab_size is not None:
        return vocab_size
    if teacher.vocab_size != student.vocab_size:
        raise ValueError(
            f"the student's vocabulary ({student.vocab_size} ids) and the teacher's "
            f"({teacher.vocab_size} ids) differ; distillation compares their distributions id by "
            "id. If they share a tokenizer and only pad the embedding differently, set "
            "train.vocab_size = <the tokenizer's size>; otherwise use the teacher's tokenizer"
        )
    return None


def _check_compatible(
    student, teacher, loss: trainer.LossConfig, tokenizer: Tokenizer, mixture, vocab_size
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
    models = {"student": student, **({"teacher": teacher} if teacher is not None else {})}
    check_models_serve(models, tokenizer, vocab_size, "train.vocab_size")


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


def _check_extras(evaluation: trainer.EvalConfig, top_k: int, multi: bool, teacher, mixture):
    """Periodic evaluation and the teacher cache need a teacher and one device."""
    _check_evaluation(evaluation, multi, teacher)
    _check_teacher_top_k(top_k, multi, teacher, mixture)


def _check_served(buffer: str | None, mixture: datagen.DataMixture, multi: bool) -> None:
    """Served data needs a buffer, and a buffer needs a share of the steps; one device."""
    fraction = mixture.served_data_fraction
    if bool(buffer) != (fraction > 0):
        raise ValueError(
            f"train.served_buffer = {buffer!r} with DataMixture.served_data_fraction (lambda0) = "
            f"{fraction}: give both (a buffer and lambda0 > 0) or neither"
        )
    if buffer and multi:
        raise ValueError(
            "train.served_buffer: served data trains in one process on one device "
            "(train.mesh_shape = (1, 1))"
        )


def _check_evaluation(evaluation: trainer.EvalConfig, multi: bool, teacher) -> None:
    if not evaluation.enabled:
        return
    if teacher is None:
        raise ValueError(
            f"EvalConfig.period = {evaluation.period} evaluates the student as a draft for the "
            "teacher, but this run has no teacher (pretraining): set EvalConfig.period = 0"
        )
    if multi:
        raise ValueError(
            f"EvalConfig.period = {evaluation.period}: periodic evaluation runs in one process "
            "on one device (train.mesh_shape = (1, 1)); set EvalConfig.period = 0 here and "
            "evaluate the exported checkpoints with python -m distillspec.evaluate"
        )


def _check_teacher_top_k(top_k, multi: bool, teacher, mixture) -> None:
    if not top_k:
        return
    if teacher is None:
        raise ValueError(f"train.teacher_top_k = {top_k} caches a teacher, but there is none")
    if multi:
        raise ValueError(
            f"train.teacher_top_k = {top_k}: the teacher cache works in one process on one "
            "device (train.mesh_shape = (1, 1)); set train.teacher_top_k = 0"
        )
    if mixture.fixed_data_fraction == 0:
        raise ValueError(
            f"train.teacher_top_k = {top_k} caches the teacher on the fixed data, but "
            "DataMixture.fixed_data_fraction (lambda1) = 0: no step would read it; set "
            "train.teacher_top_k = 0"
        )


def _teacher_topk(top_k: int, models: trainer.Models, data, cache_dir):
    """The teacher's cached top-k on this process's one data shard, or None for top_k = 0."""
    if not top_k:
        return None
    (store,) = data.stores.values()
    return teacher_cache.load_or_compute(
        models.teacher, models.teacher_params, store, top_k, cache_dir
    )


def _eval_prompts(task: str, evaluation: trainer.EvalConfig, lengths, bos_id) -> list[dict]:
    """The first evaluation.num_prompts prompts of the task's evaluation.split, in batches of
    up to 16 (fails here, before training, on a split the task lacks); () when disabled."""
    if not evaluation.enabled:
        return ()
    batches = prompt_sets(
        [(task, evaluation.split)], lengths, evaluation.num_prompts,
        min(evaluation.num_prompts, 16), bos_id,
    )[(task, evaluation.split)]  # fmt: skip
    if not any(valid_rows(b).any() for b in batches):
        raise ValueError(f"task {task!r} split {evaluation.split!r} has no prompts to evaluate")
    return batches


def example_store(task, split, lengths, max_examples, batch_size, bos_id, shard=0, num_shards=1):
    """Shard `shard` of `num_shards` of the split (seqio ShardInfo), its share of max_examples."""
    if max_examples is not None:
        max_examples = -(-max_examples // num_shards)
    batches = prompt_batches(
        task, split, batch_size=256, prompt_length=lengths["inputs"],
        completion_length=lengths["targets"], shuffle=False, num_epochs=1,
        shard=(shard, num_shards), bos_id=bos_id,
    )  # fmt: skip
    store = datagen.ExampleStore.from_batches(batches, max_examples)
    of = f" (data shard {shard} of {num_shards})" if num_shards > 1 else ""
    if len(store) == 0:
        raise ValueError(
            f"task {task!r} split {split!r}{of} has no usable examples; nothing to train on"
        )
    if num_shards > 1:
        store.shard = (shard,)
    if len(store) < batch_size // num_shards:
        print(f"warning: {len(store)} examples{of} < {batch_size // num_shards} rows per batch; "
              "examples repeat within a batch", file=sys.stderr)  # fmt: skip
    return store


def _sharded_data(task, split, lengths, max_examples, loop: trainer.LoopConfig, mesh, bos_id):
    """This process's data shards (`partitioning.data_shards`) of the training split."""
    num_shards, shards = partitioning.data_shards(mesh, loop.batch_size, loop.data_shards)
    stores = {
        k: example_store(task, split, lengths, max_examples, loop.batch_size, bos_id, k, num_shards)
        for k in shards
    }
    return datagen.ShardedData(stores, num_shards)


def _check_same_everywhere(config_text: str, loop: trainer.LoopConfig, teacher_seed) -> None:
    """Multi-process: every process must run the same configuration and seeds."""
    distributed.check_same_everywhere(
        {
            "LoopConfig.seed": loop.seed,
            "train.teacher_seed": teacher_seed,
            "the configuration (config.gin)": config_text,
        }
    )


def _export(student_model, params, tokenizer: Tokenizer, model_dir: str) -> None:
    """Process 0 writes export/ (the student gathered from every process)."""
    host_params = distributed.fetch(params)
    if distributed.is_primary():
        export(student_model, host_params, tokenizer, os.path.join(model_dir, EXPORT_SUBDIR))
    distributed.barrier("distillspec_export")


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
    reference_checkpoint: str | None = None,
    loop: trainer.LoopConfig = trainer.LoopConfig(),
    loss: trainer.LossConfig = trainer.LossConfig(divergence="ce"),
    optimizer: trainer.OptimizerConfig = trainer.OptimizerConfig(),
    mixture: datagen.DataMixture = datagen.DataMixture(fixed_data_fraction=1.0),
    evaluation: trainer.EvalConfig = trainer.EvalConfig(),
    teacher_top_k: int = 0,
    teacher_cache_dir: str | None = None,
    served_buffer: str | None = None,
    mesh_shape: tuple[int, int] = (1, 1),
    fsdp: bool = False,
    student_remat: str = "none",
    teacher_dtype: str = "float32",
    vocabulary: str | None = None,
    vocab_size: int | None = None,
    max_examples: int | None = None,
    tfds_data_dir: str | None = None,
    console: bool = True,
    config_text: str = "",
    serve_gamma: int | None = None,
    serve_report: bool = False,
):
    """Trains (pretrains or distils) a student and exports it to MODEL_DIR/export.

    Args:
      model_dir: MODEL_DIR, created if needed; a rerun resumes from its latest checkpoint.
      task, split: the data and its split: a built-in task name, a path to a .jsonl / .txt file
        or a directory of them (`tasks.FileTask`), or a `tasks.TfdsTaskSpec`.
      task_feature_lengths: {'inputs': P, 'targets': N}: prompt and completion lengths.
      student / student_checkpoint: an architecture to initialise from loop.seed (or a
        `models.drafts.DraftSpec`: a draft made for the teacher, fresh or from its layers), or
        a checkpoint directory to warm-start from (exactly one).
      teacher / teacher_checkpoint: the frozen target: an architecture initialised from
        teacher_seed, or a Hugging Face or T5X checkpoint directory; neither for pretraining.
      reference_checkpoint: AdaSPEC's reference model, a checkpoint of the student's
        architecture distilled toward the teacher (`distillspec.selection`): with
        LossConfig.select_fraction < 1 (and only then) the loss keeps that fraction of each
        batch's tokens, those where the student's loss exceeds the reference's most.
      loop, loss, optimizer, mixture: see their classes.
      evaluation: alpha and tau of the student as the teacher's draft every few steps
        (`trainer.EvalConfig`); one process, one device.
      teacher_top_k, teacher_cache_dir: k > 0 caches the teacher's top-k on the fixed data
        (`distillspec.teacher_cache`); one process, one device.
      served_buffer: a served-data buffer (`distillspec.served`), the source of the steps that
        mixture.served_data_fraction (lambda0) gives to served data; one process, one device.
      mesh_shape: (data, model) device mesh over every process's devices; (1, 1): one device.
      fsdp: also split the teacher's, the student's and the optimizer state's parameters
        over the mesh's 'data' axis (FSDP style, `partitioning.FSDP_RULES`).
      student_remat: what the student's blocks keep for the backward pass
        (`models.layers.REMAT_POLICIES`: 'none', 'full', or a jax.checkpoint_policies name).
      teacher_dtype: 'float32' or 'bfloat16': the frozen teacher's stored parameters and its
        compute (it has no optimizer state, so bfloat16 halves its bytes).
      vocabulary: the tokenizer (`vocabularies.load_tokenizer`): 'sentencepiece', 'byte', a
        tokenizer.json / SentencePiece model path; None = the teacher's (else the student
        checkpoint's) tokenizer files, or the embedded 'sentencepiece' when there are none.
      vocab_size: the tokenizer's size when teacher and student pad their embeddings to
        different sizes: both models' logits are cut to it.
      max_examples, tfds_data_dir: only the split's first examples (smoke tests); where the
        prepared TFDS data sets live (the paper's tasks).
      console: show a progress bar.
      config_text: the run's whole configuration, written to MODEL_DIR/config.gin.
      serve_gamma: the γ the plan chose (python -m distillspec.plan's draft.gin sets it), for
        the serve commands in export/SERVING.md; None: the recipe's (evaluation.gamma).
      serve_report: also print the export's serve check and commands (the command line does).

    Returns:
      The student's final parameters.
    """
    created = not os.path.exists(model_dir)
    checkpoints.check_writable(model_dir)
    # A second run into the same MODEL_DIR stops here, naming the process that holds it.
    lock = checkpoints.model_dir_lock if distributed.is_primary() else _no_lock
    try:
        with lock(model_dir):
            return _train(**{k: v for k, v in locals().items() if k not in ("lock", "created")})
    except BaseException:
        # A run that fails before its first checkpoint leaves no MODEL_DIR it created.
        if created and distributed.is_primary():
            checkpoints.remove_unstarted(model_dir)
        raise


@contextlib.contextmanager
def _no_lock(model_dir: str):
    yield


def _describe(student_model, teacher_model, task, split, loss: trainer.LossConfig) -> str:
    """'distilling a draft of 0.15 M parameters toward a target of 2.75 M (forward KL) on X'."""
    size = lambda model: f"{num_params(model) / 1e6:.2f} M parameters"
    data = getattr(task, "path", None) or getattr(task, "tfds_name", None) or task
    if teacher_model is None:
        return f"pretraining a model of {size(student_model)} on {data} ({split})"
    return (
        f"distilling a draft of {size(student_model)} toward a target of "
        f"{size(teacher_model)} ({loss.divergence}) on {data} ({split})"
    )


def _report_end(model_dir: str, started: float) -> None:
    """One line: where the export went, the final loss, the time."""
    if not distributed.is_primary():
        return
    losses = [r for r in metrics.read_metrics(model_dir) if "loss" in r]
    final = f"step {losses[-1]['step']}, final loss {losses[-1]['loss']:.4g}" if losses else ""
    print(
        f"[train] done in {time.monotonic() - started:.0f} s ({final or 'no step trained'}); "
        f"student exported to {os.path.join(model_dir, EXPORT_SUBDIR)}",
        file=sys.stderr,
        flush=True,
    )


def _train(
    model_dir, task, split, task_feature_lengths, student, student_checkpoint, teacher,
    teacher_checkpoint, teacher_seed, reference_checkpoint, loop, loss, optimizer, mixture,
    evaluation, teacher_top_k, teacher_cache_dir, served_buffer, mesh_shape, fsdp, student_remat,
    teacher_dtype, vocabulary, vocab_size, max_examples, tfds_data_dir, console, config_text,
    serve_gamma, serve_report,
):  # fmt: skip
    started = time.monotonic()
    _check_run_args(max_examples, loop, mesh_shape)
    _check_same_everywhere(config_text, loop, teacher_seed)
    task = tasks.as_task(task)  # An unknown task or missing file fails before any model loads.
    _check_data(task, mixture)
    tokenizer = load_tokenizer(vocabulary, teacher_checkpoint or student_checkpoint)
    check_special_tokens({"teacher": teacher_checkpoint, "student": student_checkpoint})
    multi = tuple(mesh_shape) != (1, 1) or jax.process_count() > 1
    _check_extras(evaluation, teacher_top_k, multi, teacher or teacher_checkpoint, mixture)
    _check_served(served_buffer, mixture, multi)
    mesh = partitioning.make_mesh(*mesh_shape) if multi else None
    rules = partitioning.param_rules(fsdp)
    teacher_model, teacher_params = _load_teacher(
        teacher, teacher_checkpoint, teacher_seed, mesh, rules
    )
    student_model, params = _load_student(
        student, student_checkpoint, loop.seed, teacher_model, teacher_params
    )
    reference_params = _load_reference(reference_checkpoint, loss, params)
    student_model = with_remat(student_model, student_remat)
    if teacher_model is not None and teacher_dtype != "float32":
        teacher_model, teacher_params = for_decoding(teacher_model, teacher_params, teacher_dtype)
    vocab_size = common_vocab_size(student_model, teacher_model, vocab_size)
    _check_compatible(student_model, teacher_model, loss, tokenizer, mixture, vocab_size)
    name = tasks.register_task(
        task, tokenizer.vocabulary, tfds_data_dir=tfds_data_dir,
        inputs_eos=student_model.encoder_decoder, bos_id=tokenizer.prompt_bos,
    )  # fmt: skip
    data = _sharded_data(
        name, split, task_feature_lengths, max_examples, loop, mesh, tokenizer.prompt_bos
    )
    if distributed.is_primary():
        print(f"[train] {tokenizer.describe()}", file=sys.stderr, flush=True)
        with open(os.path.join(model_dir, "config.gin"), "w") as f:
            f.write(config_text + f"\n# {tokenizer.describe()}\n")
    cut = lambda m: m if m is None or vocab_size is None else TruncatedVocabulary(m, vocab_size)
    models = trainer.Models(cut(student_model), cut(teacher_model), teacher_params)
    params = trainer.fit(
        model_dir, models, params, data, loop, loss, optimizer,
        mixture=mixture, eos_id=tokenizer.eos_id, mesh=mesh, rules=rules, console=console,
        evaluation=evaluation, eval_max_new_tokens=task_feature_lengths["targets"],
        eval_prompts=_eval_prompts(name, evaluation, task_feature_lengths, tokenizer.prompt_bos),
        teacher_topk=_teacher_topk(teacher_top_k, models, data, teacher_cache_dir),
        served=served_buffer and served.read(
            served_buffer, student_model.encoder_decoder, vocab_size or teacher_model.vocab_size
        ),
        description=_describe(student_model, teacher_model, task, split, loss),
        reference_params=reference_params,
    )  # fmt: skip
    _export(student_model, params, tokenizer, model_dir)
    _report_end(model_dir, started)
    if distributed.is_primary():
        gamma = serving.serving_gamma(None, serve_gamma, evaluation.gamma)
        export_dir = os.path.join(model_dir, EXPORT_SUBDIR)
        report_serving(export_dir, teacher_checkpoint, *gamma, show=serve_report)
    if teacher_model is not None and not multi:
        _report_costs(models, params, task_feature_lengths)
    return params


def _report_costs(models: trainer.Models, params, lengths: Mapping[str, int]) -> None:
    """One line after a distillation: the draft's measured call cost c and the acceptance
    rate it needs to speed decoding up (or that it cannot, and what helps)."""
    prompt_length = lengths["inputs"]
    costs = call_costs.measure(
        models.teacher, models.teacher_params, models.student, params,
        np.ones((1, prompt_length), np.int32), np.array([prompt_length], np.int32),
        gammas=(3, 5), max_new_tokens=lengths["targets"],
    )  # fmt: skip
    print(f"[train] {call_costs.break_even_line(costs)}", file=sys.stderr, flush=True)


def with_defaults(bound: Mapping[str, Any]) -> dict[str, Any]:
    """`train`'s arguments: gin's bindings of a stage (`gin_setup.scoped_bindings`) over the
    function's own defaults, so a caller reads any of them, bound or not."""
    defaults = {
        name: p.default for name, p in inspect.signature(train).parameters.items()
        if p.default is not inspect.Parameter.empty
    }  # fmt: skip
    return {**defaults, **bound}
