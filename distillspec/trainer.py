"""The training step (pure, module-level) and the loop that drives it.

One loop serves pretraining (cross-entropy on data, no teacher) and distillation (a divergence
against a frozen teacher's logits on data from `distillspec.datagen`). The teacher is frozen by
construction: its parameters are a separate, non-donated argument, evaluated under
`stop_gradient` outside `value_and_grad`, and they are in neither the optimizer nor the
checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from distillspec import (
    checkpoints,
    datagen,
    distributed,
    heads,
    losses,
    metrics,
    partitioning,
    selection,
    teacher_cache,
)
from distillspec.checks import check_finite, check_finite_params
from distillspec.models.layers import activation_mesh
from distillspec.optimizers import (  # noqa: F401 (trainer.OptimizerConfig is the gin name)
    OPTIMIZERS,
    OptimizerConfig,
    make_optimizer,
    make_schedule,
)
from distillspec.student_eval import EvalConfig, evaluate_student  # noqa: F401 (gin names)

DIVERGENCES = losses.KINDS + ("ce",)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32, optimizer steps taken.
    params: Any  # The student's parameters.
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the student minimises."""

    divergence: str = "fkl"  # One of losses.KINDS against the teacher, or 'ce' on data.
    beta: float = 0.5  # JSD[beta] mixture weight in [0, 1] (only 'jsd' uses it).
    eta: float = losses.LK_ETA  # LK^lambda's lambda = exp(-eta alpha), eta >= 0.
    # AdaSPEC's token selection (`selection`): the fraction of a batch's tokens the loss keeps,
    # those the draft fits worst beside the reference model (fit's reference_params); 1 = all.
    select_fraction: float = 1.0
    # Tokens per device whose logits the heads and the loss compute at once (`heads`); None:
    # a [tokens, V] float32 chunk of about 64 MB (`heads.default_chunk_tokens`).
    chunk_tokens: int | None = None

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(
                f"LossConfig.divergence must be one of {DIVERGENCES}, got {self.divergence!r}"
            )
        if not 0 <= self.beta <= 1:
            raise ValueError(f"LossConfig.beta must be in [0, 1], got {self.beta!r}")
        if not self.eta >= 0:
            raise ValueError(f"LossConfig.eta must be >= 0, got {self.eta!r}")
        if not 0 < self.select_fraction <= 1:
            raise ValueError(
                f"LossConfig.select_fraction must be in (0, 1], got {self.select_fraction!r}"
            )
        tokens = self.chunk_tokens
        if tokens is not None and not (isinstance(tokens, int) and tokens >= 1):
            raise ValueError(
                f"LossConfig.chunk_tokens must be None or an integer >= 1, got {tokens!r}"
            )


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k.endswith("_input_tokens")}


def _take_positions(x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, L, ...] at positions [B, N] -> [B, N, ...]."""
    index = positions.reshape(positions.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def train_step(
    state: TrainState,
    teacher_params,
    batch: dict,
    tail_params=None,
    reference_params=None,
    *,
    student,
    teacher,
    loss: LossConfig,
    optimizer: optax.GradientTransformation,
    data_parallel: int = 1,
) -> tuple[TrainState, dict]:
    """One optimizer step of the student.

    Both models run to their final hidden states; their heads, the loss and the acceptance
    metric then run over chunks of `loss.chunk_tokens` tokens per device (`heads`), so no
    [tokens, V] logits array is ever whole.

    Args:
      state: the student's TrainState (donated by the caller's jit).
      teacher_params: frozen teacher parameters, or None when pretraining ('ce', no teacher).
      batch: decoder_input_tokens [B, L] (+ encoder_input_tokens), targets [B, L],
        weights [B, L] (1 on positions that predict a completion token), optionally
        loss_positions [B, N] (every position with weight, `datagen.pack_decoder_only`: both
        models' heads and the loss then run on those N positions only); with the teacher's
        cached top-k (`teacher_cache`: [B, L, k] log-probabilities and ids), these stand in
        for the teacher's forward (`losses.topk_teacher_logits`).
      tail_params: student parameters whose distribution shapes the tail past a cached or served
        top-k (`losses.topk_teacher_logits`), e.g. the draft before online adaptation; None: the
        student's own.
      reference_params: AdaSPEC's reference model (the student's architecture, distilled
        toward the teacher): the loss then keeps loss.select_fraction of the batch's tokens,
        those where the student's loss exceeds the reference's most (`selection`); the
        acceptance metric still counts every token. None: every token.
      student, teacher: `models.base.ScoringModel`s (split at the head by `heads.head_of`).
      loss: the divergence (or 'ce') and the chunk size.
      optimizer: the optax transformation whose state is in `state`.
      data_parallel: devices the batch's rows are split over (the chunk size is per device).

    Returns:
      (new state, metrics): sums (loss_sum, weight_sum, acceptance_sum when a teacher is
      given) for normalisation on the host, plus grad_norm.
    """
    inputs, positions = _model_inputs(batch), batch.get("loss_positions")
    # Only the positions that can carry weight: the prompt's logits would be weighted out.
    at = lambda x: x if positions is None else _take_positions(x, positions)
    student_head = heads.head_of(student)
    chunked, consts = {"weights": at(batch["weights"])}, {}
    if teacher_cache.LOG_PROBS in batch:  # The teacher's top-k, cached or served.
        chunked["log_probs"] = at(batch[teacher_cache.LOG_PROBS])
        chunked["ids"] = at(batch[teacher_cache.IDS])
        if tail_params is not None:  # The tail in tail_params' proportions, not the student's.
            tail = student_head.features(tail_params, inputs, positions)
            chunked["tail"] = jax.lax.stop_gradient(tail)
            consts["tail"] = student_head.select(tail_params)
    elif teacher is not None:
        hidden = heads.head_of(teacher).features(teacher_params, inputs, positions)
        chunked["teacher"] = jax.lax.stop_gradient(hidden)
        consts["teacher"] = heads.head_of(teacher).select(teacher_params)
    if loss.divergence == "ce":
        chunked["targets"] = at(batch["targets"])
    rows, length = chunked["weights"].shape
    size = heads.chunk_positions(
        max(rows // data_parallel, 1), length, loss.chunk_tokens, student.vocab_size
    )
    # The top-k target's vocabulary (the teacher's); nothing else reads it.
    vocab_size = teacher.vocab_size if teacher_cache.LOG_PROBS in batch else None
    fn = functools.partial(_chunk_sums, student_head, teacher, loss, vocab_size)
    if reference_params is not None:  # AdaSPEC: the loss on the selected tokens only.
        target = functools.partial(_target, student_head, teacher, vocab_size)
        chunked = selection.selected_chunks(
            student_head, target, loss, (state.params, reference_params), (inputs, positions),
            chunked, consts, size,
        )  # fmt: skip

    def objective(params):
        hidden = student_head.features(params, inputs, positions)
        sums = heads.chunked_sums(fn, student_head.select(params), hidden, chunked, consts, size)
        return losses.mean(sums["loss_sum"], sums["weight_sum"]), sums

    grads, sums = jax.grad(objective, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics = {**sums, "grad_norm": optax.global_norm(grads)}
    new_state = TrainState(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state
    )
    return new_state, metrics


def _chunk_sums(student_head, teacher, loss: LossConfig, vocab_size: int, head_params, hidden,
                chunk: dict, consts: dict) -> dict:  # fmt: skip
    """The loss's (and the acceptance metric's) sums over one chunk of positions, from the
    student's hidden states [B, C, E] and `train_step`'s chunked inputs [B, C, ...]."""
    logits = student_head.apply(head_params, hidden)
    if loss.divergence == "ce":
        total, count = losses.cross_entropy(logits, chunk["targets"], chunk["weights"])
        return {"loss_sum": total, "weight_sum": count}
    target = _target(student_head, teacher, vocab_size, logits, chunk, consts)
    # The loss and the acceptance metric share each distribution's log-softmax.
    return losses.distillation_sums(
        logits, target, chunk["weights"], loss.divergence, loss.beta, loss.eta,
        chunk.get("metric_weights"),
    )  # fmt: skip


def _target(student_head, teacher, vocab_size, logits, chunk: dict, consts: dict) -> jax.Array:
    """The teacher's logits over one chunk: its head on its hidden states, or its top-k with
    the tail in the student's (`logits`) or tail_params' proportions."""
    if "teacher" in chunk:
        return heads.head_of(teacher).apply(consts["teacher"], chunk["teacher"])
    shape = logits if "tail" not in chunk else student_head.apply(consts["tail"], chunk["tail"])
    return losses.topk_teacher_logits(chunk["log_probs"], chunk["ids"], vocab_size, shape)


def compile_train_step(
    student, teacher, loss: LossConfig, optimizer, state_shardings=None, mesh=None
):
    """jit of `train_step` with the state donated (and kept on its shardings when given); on a
    `mesh`, the metrics come out replicated, so that every process can read them."""
    data_parallel = 1 if mesh is None else mesh.shape["data"]
    step = functools.partial(
        train_step, student=student, teacher=teacher, loss=loss, optimizer=optimizer,
        data_parallel=data_parallel,
    )  # fmt: skip
    out = None
    if state_shardings is not None or mesh is not None:
        out = (state_shardings, partitioning.replicated(mesh) if mesh is not None else None)
    if mesh is not None:  # The models keep their activations' rows split over 'data'.
        step = functools.partial(_on_mesh, step, mesh)
    return jax.jit(step, donate_argnums=0, out_shardings=out)


def _on_mesh(step, mesh, *args):
    """step(*args) traced with activations' rows on the mesh (`layers.constrain_rows`)."""
    with activation_mesh(mesh):
        return step(*args)


def host_metrics(metrics: dict, learning_rate: float, seconds: float) -> dict:
    """Normalises the step's sums on the host into the logged record (tokens/s counts the
    tokens the loss weighs, i.e. the completion tokens)."""
    metrics = jax.device_get(metrics)
    count = float(metrics["weight_sum"])
    record = {
        "loss": float(losses.mean(metrics["loss_sum"], count)),
        "learning_rate": float(learning_rate),
        "tokens_per_s": count / max(seconds, 1e-9),
        "grad_norm": float(metrics["grad_norm"]),
        "target_tokens": count,
    }
    if "acceptance_sum" in metrics:  # Over every token, also where the loss selects some.
        seen = float(metrics.get("metric_weight_sum", count))
        record["acceptance_proxy"] = float(losses.mean(metrics["acceptance_sum"], seen))
        if "metric_weight_sum" in metrics:
            record["selected_fraction"] = count / max(seen, 1e-9)
    return record


class Timer:
    """Wall time of the step since the last call (host-side, for tokens/s)."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How long and how the loop runs."""

    train_steps: int = 100  # Total optimizer steps (TRAIN_STEPS); a resumed run stops here too.
    # Stop after this step instead: the run's first stop_at steps, exactly as a run of
    # train_steps takes them (the schedule still spans train_steps). None = train_steps.
    stop_at: int | None = None
    batch_size: int = 16  # Sequences per step (BATCH_SIZE), split over the mesh's 'data' axis.
    seed: int = 0  # Data order, data sources and sampling derive from (seed, step).
    checkpoint_period: int = 50  # Steps between checkpoints (and one at the end).
    keep_checkpoints: int = 3  # Newest checkpoints kept in MODEL_DIR/checkpoints.
    # Shards the split is read in (seqio ShardInfo), each giving batch_size / data_shards rows of
    # every batch; None = one per data-parallel process group (1 in one process). The data order
    # depends on it: fix it to compare or resume runs over different numbers of processes.
    data_shards: int | None = None

    def __post_init__(self):
        for name in ("train_steps", "batch_size", "checkpoint_period", "keep_checkpoints"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"LoopConfig.{name} must be an integer >= 1, got {value!r}")
        if self.stop_at is not None and not (
            isinstance(self.stop_at, int) and 1 <= self.stop_at <= self.train_steps
        ):
            raise ValueError(
                f"LoopConfig.stop_at must be None or an integer in [1, train_steps = "
                f"{self.train_steps}], got {self.stop_at!r}"
            )
        shards = self.data_shards
        if shards is not None and not (isinstance(shards, int) and shards >= 1):
            raise ValueError(
                f"LoopConfig.data_shards must be None or an integer >= 1, got {shards!r}"
            )


# The exit status of a run stopped by a preemption request after saving its checkpoint:
# sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry"), distinct from
# success (0, nothing left to do) and from errors (1), so a scheduler's wrapper can requeue on
# it (scripts/slurm/distill.sbatch does). Rerunning the same command resumes.
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """Training stopped early on a preemption request (SIGTERM), after saving a checkpoint."""

    def __init__(self, step: int, model_dir: str):
        super().__init__(
            f"preempted: saved checkpoint step {step} in {model_dir}/checkpoints and stopped; "
            "rerun the same command to resume"
        )
        self.step = step


@dataclasses.dataclass(frozen=True)
class Models:
    """The student being trained and the frozen teacher (None when pretraining)."""

    student: Any
    teacher: Any = None
    teacher_params: Any = None

    @property
    def packer(self) -> Callable[..., dict]:
        return datagen.pack_for(self.student)


def state_shardings(optimizer, params, param_shardings, mesh) -> TrainState:
    """The TrainState's shardings: the optimizer's per-parameter moments as their parameter
    (optax.tree_map_params), anything else replicated. (Left to jit, zero-initialised moments
    come out replicated: the full optimizer state on every device.)"""
    replicated = partitioning.replicated(mesh)
    abstract = jax.eval_shape(optimizer.init, params)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda leaf, sharding, like: sharding if leaf.shape == like.shape else replicated,
        abstract, param_shardings, jax.eval_shape(lambda p: p, params),
        transform_non_params=lambda _: replicated,
    )  # fmt: skip
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def _placed(models: Models, params, optimizer, mesh, rules):
    """(Models with the teacher on the mesh, TrainState on the mesh, the state's shardings).

    Parameters are placed by their logical axes (a no-op for arrays already placed so, e.g. a
    teacher loaded straight into its shardings); without a mesh nothing moves."""
    if mesh is None:
        return models, init_state(params, optimizer), None
    param_shardings = partitioning.shardings_for(params, models.student.logical_axes(), mesh, rules)
    params = jax.device_put(params, param_shardings)
    if models.teacher_params is not None:
        axes = models.teacher.logical_axes()
        shardings = partitioning.shardings_for(models.teacher_params, axes, mesh, rules)
        models = dataclasses.replace(
            models, teacher_params=jax.device_put(models.teacher_params, shardings)
        )
    shardings = state_shardings(optimizer, params, param_shardings, mesh)
    init = functools.partial(init_state, optimizer=optimizer)
    return models, jax.jit(init, out_shardings=shardings)(params), shardings


def _log_bytes(models: Models, state: TrainState) -> None:
    """Parameter bytes per device at start-up (process 0's devices)."""
    trees = {"teacher": models.teacher_params, "student": state.params}
    trees["optimizer state"] = state.opt_state
    for name, tree in trees.items():
        if tree is not None:
            print(partitioning.describe_bytes(name, tree), file=sys.stderr)


def compile_step_batch(models: Models, mixture: datagen.DataMixture, eos_id, mesh=None):
    """jit of (student params, teacher params, data, rng, present) -> the packed batch.

    `data` holds a step's prompt/completion arrays and its [B] `sources`; sampling (the
    student's or the teacher's, per `present`, a static tuple) runs on the devices, on global
    arrays in a multi-process run. On a mesh the batch comes out split over 'data'."""

    def step_batch(params, teacher_params, data, rng, present):
        samplers = {
            datagen.STUDENT: (models.student, params),
            datagen.TEACHER: (models.teacher, teacher_params),
        }
        completions = datagen.step_completions(
            data, data["sources"], samplers, rng, mixture, eos_id, present
        )
        return models.packer(data["prompt_tokens"], data["prompt_lengths"], *completions)

    out = partitioning.batch_sharding(mesh) if mesh is not None else None
    return jax.jit(step_batch, static_argnames="present", out_shardings=out)


def _step_batch(data, step: int, loop: LoopConfig, params, models: Models, mixture, make, mesh,
                served=None):  # fmt: skip
    """The packed training batch of `step` (data order and sources from (seed, step)); a served
    step's batch comes from `served` with the target's recorded top-k in it."""
    sources = datagen.step_sources(loop.seed, step, loop.batch_size, mixture)
    fractions = {
        f"data_{name}": float(np.mean(sources == i)) for i, name in enumerate(datagen.SOURCE_NAMES)
    }
    rng = jax.random.fold_in(jax.random.PRNGKey(loop.seed), step)
    if sources[0] == datagen.SERVED:  # Its rows as they are, with the target's top-k.
        if served is None:
            raise ValueError(
                f"DataMixture.served_data_fraction = {mixture.served_data_fraction} draws served "
                "data, but no served buffer was given (train.served_buffer)"
            )
        local = served.store.batch(loop.seed, step, loop.batch_size)
        batch = make(params, models.teacher_params, {**local, "sources": 0 * sources}, rng, ())
        return _with_cached_teacher(batch, served.top_k, served.store, step, loop), fractions
    local = data.batch(loop.seed, step, loop.batch_size)
    start, stop = partitioning.process_rows(mesh, loop.batch_size)
    local["sources"] = sources[start:stop]
    if mesh is not None:
        local = partitioning.assemble_batch(local, mesh, loop.batch_size)
    present = datagen.present_sources(sources)
    return make(params, models.teacher_params, local, rng, present), fractions


def _with_cached_teacher(batch, topk, store: datagen.ExampleStore, step: int, loop: LoopConfig):
    """The batch of `step` read from `store` with its rows of the teacher's top-k."""
    indices = store.indices(loop.seed, step, loop.batch_size)
    length = batch["decoder_input_tokens"].shape[1]
    return {**batch, **topk.rows(indices, store.prompt_lengths[indices], length)}


def _count_teacher_passes(record: dict, models: Models, batch: dict, fractions: dict) -> None:
    """Logs the teacher's passes in a step (with a teacher): 1 if it scored the batch (no
    recorded or cached top-k in it), plus 1 if it sampled some of its rows."""
    if models.teacher is not None:
        passes = int(teacher_cache.LOG_PROBS not in batch) + int(fractions["data_teacher"] > 0)
        record["teacher_forward_passes"] = passes


def _report_start(description: str, start: int, train_steps: int, model_dir: str, primary: bool,
                  stop_at: int | None = None):  # fmt: skip
    """One line (process 0): what is trained, fresh or resumed from which step."""
    if start > train_steps:
        raise ValueError(
            f"{model_dir}/checkpoints holds step {start}, past TRAIN_STEPS = {train_steps}: "
            "raise TRAIN_STEPS (LoopConfig.train_steps) to train on, or use another MODEL_DIR"
        )
    if primary:
        where = (
            f"resuming from step {start} of {train_steps} ({model_dir}/checkpoints)"
            if start
            else f"starting fresh: {train_steps} steps into {model_dir}"
        )
        if stop_at and stop_at < train_steps:
            where += f", stopping after step {stop_at} (LoopConfig.stop_at)"
        print(f"[train] {description}; {where}", file=sys.stderr, flush=True)


class _NoLogger:
    """What processes other than 0 log to: nothing."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _save(ckpt, state, step: int, last_saved, model_dir: str) -> int:
    """Saves `state` as checkpoint `step` (returned: the new last saved step). The step's loss
    was computed before its update, so a finite loss does not mean finite new parameters (e.g.
    an overflowing learning rate): they are checked before they can replace the last good
    checkpoint."""
    check_finite_params(state.params, step, last_saved, model_dir)
    ckpt.save(step, state)
    return step


def fit(
    model_dir: str,
    models: Models,
    params,
    data: datagen.ShardedData | datagen.ExampleStore,
    loop: LoopConfig,
    loss: LossConfig,
    optimizer_config: OptimizerConfig,
    *,
    mixture: datagen.DataMixture | None = None,
    eos_id: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: partitioning.Rules = partitioning.DEFAULT_RULES,
    console: bool = True,
    evaluation: EvalConfig = EvalConfig(),
    eval_prompts=(),
    eval_max_new_tokens: int = 64,
    teacher_topk: teacher_cache.TeacherTopK | None = None,
    served=None,
    tail_params=None,
    reference_params=None,
    description: str = "training",
):
    """Trains the student from `params`, or resumes from MODEL_DIR's latest checkpoint.

    Every step logs to MODEL_DIR/metrics.jsonl and TensorBoard (process 0 only); a checkpoint
    is written every `checkpoint_period` steps, at the end, and at the step every process
    agrees on after a SIGTERM, which then raises `Preempted`. A NaN/inf loss stops training
    before anything of that step is saved. In a multi-process run every process calls this
    with the same arguments except `data`, its own shards.

    With `evaluation.enabled` (one process, one device, a teacher), the student is also
    evaluated as a draft on `eval_prompts` (prompt batches) every `evaluation.period` steps,
    generating up to `eval_max_new_tokens` tokens (see `EvalConfig`). Process 0 prints one line
    at the start: `description` (what is trained on what), then whether it starts fresh or
    resumes, from which step. With `teacher_topk` (one process, one data shard), steps whose
    every row is fixed data read the teacher's cached top-k instead of running the teacher
    (`teacher_cache`); so do served steps (lambda0) from `served` (`served.ServedData`), the
    tail past the top k shaped by `tail_params` (`train_step`); with `reference_params` (AdaSPEC)
    the loss keeps loss.select_fraction of each batch's tokens. Returns the final parameters."""
    if isinstance(data, datagen.ExampleStore):
        data = datagen.ShardedData({0: data})
    mixture = mixture or datagen.DataMixture(fixed_data_fraction=1.0)
    optimizer = make_optimizer(optimizer_config, loop.train_steps)
    models, state, shardings = _placed(models, params, optimizer, mesh, rules)
    if reference_params is not None and shardings is not None:  # Placed as the student is.
        reference_params = jax.device_put(reference_params, shardings.params)
    primary = jax.process_index() == 0
    if mesh is not None and primary:
        _log_bytes(models, state)
    ckpt = checkpoints.Checkpointer(model_dir, max_to_keep=loop.keep_checkpoints)
    start, state = ckpt.restore_latest(state) or (0, state)  # (step, state) or None.
    _report_start(description, start, loop.train_steps, model_dir, primary, loop.stop_at)
    last = loop.stop_at or loop.train_steps
    step_fn = compile_train_step(models.student, models.teacher, loss, optimizer, shardings, mesh)
    make_batch = compile_step_batch(models, mixture, eos_id, mesh)
    schedule = make_schedule(optimizer_config, loop.train_steps)
    logger = _NoLogger()
    if primary:
        logger = metrics.MetricsLogger(model_dir, last, start, console=console)
    evaluate = lambda: evaluate_student(
        models, state.params, eval_prompts, evaluation, eos_id, eval_max_new_tokens
    )
    if evaluation.enabled and start == 0:
        logger.log(0, evaluate())  # The starting point of the curve.
    timer, last_saved = Timer(), ckpt.latest_step()
    watcher = distributed.PreemptionWatcher(ckpt.reached_preemption)
    # try/finally: a FloatingPointError (or Ctrl-C) still flushes the logs and releases orbax.
    try:
        with watcher:
            for step in range(start, last):
                batch, fractions = _step_batch(
                    data, step, loop, state.params, models, mixture, make_batch, mesh, served
                )
                if teacher_topk is not None and fractions["data_dataset"] == 1.0:
                    (store,) = data.stores.values()
                    batch = _with_cached_teacher(batch, teacher_topk, store, step, loop)
                state, step_metrics = step_fn(
                    state, models.teacher_params, batch, tail_params, reference_params
                )
                record = host_metrics(step_metrics, schedule(step), timer.lap())
                record.update(fractions)
                _count_teacher_passes(record, models, batch, fractions)
                check_finite(record, step + 1, last_saved, model_dir)
                if evaluation.enabled and ((step + 1) % evaluation.period == 0 or step + 1 == last):
                    record.update(evaluate())
                    timer.lap()  # The evaluation's time is not the next step's.
                logger.log(step + 1, record)
                # Asked at every step by every process: they all get the same answer.
                stop = watcher.requested(step + 1) and step + 1 < last
                end = (step + 1) % loop.checkpoint_period == 0 or step + 1 == last
                if (end or stop) and step + 1 != last_saved:
                    last_saved = _save(ckpt, state, step + 1, last_saved, model_dir)
                if stop:
                    raise Preempted(step + 1, model_dir)
    finally:
        logger.close()
        ckpt.close()
    return state.params
