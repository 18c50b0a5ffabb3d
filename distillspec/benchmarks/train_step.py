"""Where a distillation step's time goes: the trainer's step against its parts.

    python -m distillspec.benchmarks.train_step --json OUT.json [--teacher DIR --student DIR] \\
        [--batch_size 16] [--repeats 20] [--tiny] [--pretrain_batch_size 32 --pretrain_length 128]

Measures in one process, with compilation excluded (every function runs once untimed first)
and the functions below interleaved (one call of each per repeat, `timing.interleaved_items`),
the medians over repeats in ms per step; each call ends with its outputs ready on the devices
(`jax.block_until_ready`):
  teacher_forward_ms    the jitted teacher `logits(params, inputs, loss_positions)` on a packed
                        fixed-data batch, as the step runs it (the head on the completion only);
  student_fwd_bwd_ms    `trainer.train_step` (jitted and donating its state, as
                        `trainer.compile_train_step` makes it) with the teacher forward replaced
                        by precomputed teacher logits: the student's forward and backward, the
                        divergence, the metrics and the optimizer update;
  packing_ms            the jitted `trainer.compile_step_batch` function on fixed data (no
                        generated sources): packing only;
  sampling_ms           the same function with every row student-generated (on-policy):
                        sampling `completion_length` tokens (or to EOS) from the student, then
                        packing;
  batch_fixed_ms        `trainer._step_batch` of a fixed-data step, as the training loop calls
                        it: the step's rows from the ExampleStore, its sources, then packing;
  kd_step_fixed_ms      the real full step, `trainer.compile_train_step(...)` with the teacher,
                        on a fixed-data batch (teacher forward included; batch making not);
  kd_step_onpolicy_ms   one on-policy step of the loop: `trainer._step_batch` with student
                        samples, then the real full step on that batch;
  kd_step_fixed_over_sum      kd_step_fixed_ms / (teacher_forward_ms + student_fwd_bwd_ms): the
                        full step's overhead over its two parts (the project's goal: <= 1.10);
  kd_step_onpolicy_over_sum   kd_step_onpolicy_ms / (teacher_forward_ms + student_fwd_bwd_ms +
                        sampling_ms): the same for an on-policy step, sampling included;
  kd_step_fixed_cached_ms     with --teacher_top_k K: the fixed-data step reading the teacher's
                        cached top-K (`distillspec.teacher_cache`) instead of running the teacher:
                        the batch's rows of the cache assembled on the host, then the step;
  teacher_cache_saving        kd_step_fixed_ms / kd_step_fixed_cached_ms;
  pretrain_step_ms      the teacher's pretraining step: `trainer.compile_train_step` with the
                        teacher as the student, cross-entropy, the same optimizer, on
                        --pretrain_batch_size x --pretrain_length random tokens (the main job
                        pretrains its target at 32 x 128), its state fed back as above;
  matmul_ms, matmul_gflops    a jitted float32 [4096, 256] x [256, 1024] product, interleaved
                        with the rest (so under the same load), the fastest of three back to
                        back per repeat (the first after a part pays for fresh pages): the
                        machine's matmul rate;
  {part}_gflop, {part}_ideal_ms, {part}_utilisation   for part in teacher_forward, sampling,
                        student_fwd_bwd, kd_step_onpolicy (the first three together) and
                        pretrain_step: the part's model matmul FLOPs (`benchmarks.flops`: a
                        backward pass is 2x its forward, sampling runs all completion_length
                        steps), the time they take at matmul_gflops, and ideal / measured. A
                        utilisation of 1 is a part that does nothing but its models' matmuls,
                        at the reference product's rate; what keeps it below is the part's
                        other work (softmaxes, the loss, copies, the optimizer, per-step
                        overheads, small products running below the reference rate). None for
                        a model that is not decoder-only.
  pretrain_step_products_ms   what the pretraining step's products alone take: every dot
                        product of its compiled program (`flops.compiled_products`), each run
                        alone on random operands of its shapes once per repeat (interleaved
                        with the rest), count x median summed; `pretrain_step_products` lists
                        each distinct product (shapes, dimension numbers, count, ms, GFLOP/s),
                        `pretrain_step_products_gflop` their FLOPs (the formula's for an
                        unrolled stack), `pretrain_step_products_count` how many there are,
                        `empty_call_ms` a [1, 1] x [1, 1] product's (each product's time
                        includes one call);
  pretrain_step_products_utilisation   pretrain_step_ideal_ms / pretrain_step_products_ms:
                        the utilisation the step would reach if it did nothing but its
                        products, at the rates XLA:CPU's kernels reach on their shapes (the
                        ceiling that the rest of the step's work lowers);
  pretrain_step_products_share   pretrain_step_products_ms / pretrain_step_ms. Absent for a
                        teacher whose compiled step has a loop (a stack of more than
                        `decoder_only.UNROLL_MAX_LAYERS` layers runs as a scan): its text does
                        not say how often each product runs.
The two timed train steps each feed their returned (donated) state back in, so parameters and
optimizer state evolve as in training. Ratios are of the reported medians; absolute times are
context only (they depend on the machine and its load). Also reported: the shapes, the models'
sizes (MB of parameters), `sampled_tokens_per_row` (mean completion tokens the loss
weighs in an on-policy batch: sampling stops at EOS), the loss and optimizer, and the backend.

The models: --teacher and --student checkpoint directories (default: the quickstart's pair,
runs/quickstart/target/export and runs/quickstart/draft/export), or --tiny: the randomly
initialised teacher and student of configs/tests/tiny_distill.gin, built in-process with the
'byte' tokenizer (for tests). The data: the --task's train split (default the embedded
`stdlib_code`) read as the trainer reads it (`runs.train.example_store`, the first
--max_examples examples), with the teacher checkpoint's tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import console, datagen, tasks, teacher_cache, trainer
from distillspec.benchmarks import emit, flops
from distillspec.evaluation.timing import interleaved_items, megabytes
from distillspec.models import DecoderOnlyLM, TransformerConfig, load_checkpoint
from distillspec.models.base import TruncatedVocabulary
from distillspec.runs.train import common_vocab_size, example_store
from distillspec.vocabularies import load_tokenizer

QUICKSTART_TEACHER = os.path.join("runs", "quickstart", "target", "export")
QUICKSTART_STUDENT = os.path.join("runs", "quickstart", "draft", "export")
# configs/tests/tiny_distill.gin's teacher and student ('byte' tokenizer: 260 ids).
TINY_TEACHER = TransformerConfig(
    vocab_size=260, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    mlp_dim=64, init_std=0.5,
)  # fmt: skip
TINY_STUDENT = TransformerConfig(
    vocab_size=260, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32
)
TRAIN_STEPS = 1000  # The learning-rate schedule's length (its value does not change the cost).
REFERENCE_CALLS = 3  # Reference products per interleaved call; the fastest one is its time.
_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # HLO -> numpy names.


class PrecomputedTeacher:
    """A stand-in teacher whose 'parameters' are its logits: `train_step` given it runs all of
    the step except the teacher forward (the logits pass through `stop_gradient` unchanged)."""

    def logits(self, logits, batch, positions=None):
        del batch, positions  # Computed at the batch's loss positions already.
        return logits


def load_pair(args):
    """(teacher, teacher_params, student, student_params, tokenizer, description)."""
    if args.tiny:
        teacher, student = DecoderOnlyLM(TINY_TEACHER), DecoderOnlyLM(TINY_STUDENT)
        description = "tiny random pair of configs/tests/tiny_distill.gin"
        teacher_params = teacher.init(jax.random.PRNGKey(1))  # tiny_distill's teacher_seed.
        params = student.init(jax.random.PRNGKey(0))  # Its LoopConfig.seed.
        return teacher, teacher_params, student, params, load_tokenizer("byte"), description
    teacher_dir = args.teacher or QUICKSTART_TEACHER
    student_dir = args.student or QUICKSTART_STUDENT
    for flag, path in (("--teacher", teacher_dir), ("--student", student_dir)):
        if not os.path.isdir(path):
            raise SystemExit(
                f"{flag} checkpoint {path!r} not found: pass --teacher DIR --student DIR (Hugging "
                "Face or T5X checkpoint directories), run python -m distillspec.quickstart to "
                "make the default pair, or use --tiny for tiny random models"
            )
    teacher, teacher_params = load_checkpoint(teacher_dir)
    student, student_params = load_checkpoint(student_dir)
    tokenizer = load_tokenizer(args.vocabulary, teacher_dir)
    description = f"teacher {teacher_dir}, student {student_dir}"
    return teacher, teacher_params, student, student_params, tokenizer, description


def _ready(tree) -> None:
    """Waits for the devices (the timers read the clock after this); keeps nothing."""
    jax.block_until_ready(tree)


def _cached_step(models, local, batch, top_k: int, step, state):
    """The fixed-data step reading the teacher's top-k (computed here for the batch's rows, as
    `teacher_cache` computes it for a split): the rows assembled on the host, then the step."""
    rows = datagen.ExampleStore(
        local["prompt_tokens"], local["prompt_lengths"], local["completion_tokens"],
        local["completion_lengths"],
    )  # fmt: skip
    topk = teacher_cache.compute(models.teacher, models.teacher_params, rows, top_k)
    indices, length = np.arange(len(rows)), batch["decoder_input_tokens"].shape[1]
    states = [state]

    def run():
        cached = {**batch, **topk.rows(indices, local["prompt_lengths"], length)}
        states[0], metrics = step(states[0], cached)
        _ready((states[0], metrics))

    return run


def _reference_fns(models: trainer.Models, optimizer, pretrain_shape, seed: int) -> dict:
    """{'pretrain_step': the teacher's pretraining step, 'matmul': the reference product}."""
    rows, length = pretrain_shape
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, models.teacher.vocab_size, size=(rows, length + 1)).astype(np.int32)
    batch = {
        "decoder_input_tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "weights": jnp.ones((rows, length), jnp.float32),
    }
    ce = trainer.LossConfig(divergence="ce")
    states = [trainer.init_state(jax.tree.map(jnp.copy, models.teacher_params), optimizer)]
    # Compiled once: the program both runs and is read for its products.
    jitted = trainer.compile_train_step(models.teacher, None, ce, optimizer)
    step = jitted.lower(states[0], None, batch).compile()

    def pretrain_step():
        states[0], metrics = step(states[0], None, batch)
        _ready((states[0], metrics))

    fns = {"pretrain_step": pretrain_step, "matmul": _reference_product(seed)}
    try:  # A scanned stack (more than UNROLL_MAX_LAYERS layers) has no straight-line count.
        products = flops.compiled_products(step.as_text())
    except ValueError as e:
        print(f"not timing the pretraining step's products alone: {e}", file=sys.stderr)
    else:
        fns["pretrain_products"] = _products_alone(products, seed)
    return fns


def _products_alone(products: list[flops.Product], seed: int):
    """() -> None running each of a step's distinct products (`flops.compiled_products`) once,
    alone, on random operands of its shapes (row-major), after a [1, 1] x [1, 1] product (a
    jitted call's own cost: `run.times[0]`); `run.times[i + 1]` collects product i's seconds.
    What the step would take if it did nothing but its products, at the rates the machine's
    kernels reach on those shapes."""
    empty = flops.Product((1, 1), (1, 1), ("f32", "f32"), (((1,), (0,)), ((), ())))
    calls = []
    for i, product in enumerate([empty, *products]):
        keys = jax.random.split(jax.random.PRNGKey(seed + i), 2)
        dtypes = (jnp.dtype(_DTYPES.get(d, d)) for d in product.dtypes)
        shapes = (product.lhs, product.rhs)
        operands = [jax.random.normal(*args) for args in zip(keys, shapes, dtypes)]
        dot = jax.jit(functools.partial(
            jax.lax.dot_general, dimension_numbers=product.dimension_numbers))  # fmt: skip
        calls.append((dot, operands))

    def run():
        for i, (dot, operands) in enumerate(calls):
            start = time.perf_counter()
            _ready(dot(*operands))
            run.times[i].append(time.perf_counter() - start)

    run.products, run.times = products, [[] for _ in calls]  # times[0]: the empty product's.
    return run


def _products_record(run, repeats: int, step_ms: float, ideal_ms: float | None) -> dict:
    """The pretraining step's products timed alone (`_products_alone`, its last `repeats`
    calls: the first compiled them): their sum, FLOPs, the utilisation they alone would reach
    (the step's ceiling), their share of the step, the number of products in the step, the
    median empty call (each product's time includes one), and each distinct product's count,
    median ms and GFLOP/s."""
    median_ms = [1e3 * float(np.median(times[-repeats:])) for times in run.times]
    rows, total = [], 0.0
    for product, ms in zip(run.products, median_ms[1:]):
        total += product.count * ms
        dimension_numbers = [[list(d) for d in pair] for pair in product.dimension_numbers]
        rows.append({
            "lhs": list(product.lhs), "rhs": list(product.rhs),
            "dimension_numbers": dimension_numbers, "count": product.count,
            "ms": round(ms, 4), "gflops": round(product.flops / (ms * 1e6), 1),
        })  # fmt: skip
    gflop = sum(p.flops * p.count for p in run.products) / 1e9
    ceiling = None if ideal_ms is None else round(ideal_ms / total, 4)
    return {
        "pretrain_step_products_ms": round(total, 4),
        "pretrain_step_products_gflop": round(gflop, 6),
        "pretrain_step_products_utilisation": ceiling,
        "pretrain_step_products_share": round(total / step_ms, 4),
        "pretrain_step_products_count": sum(p.count for p in run.products),
        "empty_call_ms": round(median_ms[0], 4),
        "pretrain_step_products": rows,
    }


def _reference_product(seed: int):
    """() -> None timing REFERENCE_CALLS reference products back to back; its `fastest` list
    gets each call's fastest product in seconds. The first product after another part's call
    pays for the allocator's fresh pages (its rate was 157-245 GFLOP/s across processes, the
    next products' 240-280): the rate is the machine's, so the fastest counts."""
    m, k, n = flops.MATMUL_SHAPE
    a = jax.random.normal(jax.random.PRNGKey(seed), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(seed + 1), (k, n), jnp.float32)
    product = jax.jit(jnp.matmul)

    def run():
        times = []
        for _ in range(REFERENCE_CALLS):
            start = time.perf_counter()
            _ready(product(a, b))
            times.append(time.perf_counter() - start)
        run.fastest.append(min(times))

    run.fastest = []
    return run


def _utilisation(models: trainer.Models, ms: dict, batch, local, pretrain_shape) -> dict:
    """matmul_gflops and every part's ideal time and utilisation (`flops.utilisation`)."""
    gflops = flops.product_flops(*flops.MATMUL_SHAPE) / (ms["matmul_ms"] * 1e6)
    counts = flops.part_flops(
        models.teacher.config, models.student.config, batch["decoder_input_tokens"].shape[0],
        local["prompt_tokens"].shape[1], local["completion_tokens"].shape[1], *pretrain_shape,
    )  # fmt: skip
    return {"matmul_gflops": round(gflops, 3), **flops.utilisation(counts, ms, gflops)}


def onpolicy_batch_maker(models: trainer.Models, eos_id, temperature: float):
    """(mixture, jitted batch maker) with every row sampled from the student at `temperature`."""
    mixture = datagen.DataMixture(
        fixed_data_fraction=0.0, student_data_fraction=1.0, temperature=temperature
    )
    return mixture, trainer.compile_step_batch(models, mixture, eos_id)


def sampling_call(make, params, teacher_params, data, loop):
    """() -> None: step 0's rows sampled from the student and packed by `make` (an
    `onpolicy_batch_maker`), outputs ready."""
    local = dict(
        data.batch(loop.seed, 0, loop.batch_size),
        sources=np.full(loop.batch_size, datagen.STUDENT, np.int32),
    )
    rng = jax.random.PRNGKey(loop.seed)
    return lambda: _ready(make(params, teacher_params, local, rng, present=(datagen.STUDENT,)))


def onpolicy_step(models: trainer.Models, params, data, eos_id, loop, loss, optimizer, temperature):
    """() -> None: one on-policy step of the training loop per call, `trainer._step_batch` with
    student samples of step s's prompts (s = 0, 1, ...), then the jitted full step, its state fed
    back (donated) as in training; each call ends with its outputs ready."""
    mixture, make = onpolicy_batch_maker(models, eos_id, temperature)
    kd_step = trainer.compile_train_step(models.student, models.teacher, loss, optimizer)
    state, steps = [trainer.init_state(params, optimizer)], itertools.count()

    def run():
        step = next(steps)
        batch, _ = trainer._step_batch(
            data, step, loop, state[0].params, models, mixture, make, None
        )
        state[0], metrics = kd_step(state[0], models.teacher_params, batch)
        _ready((state[0], metrics))

    return run


def measure(
    models: trainer.Models,
    params,
    data: datagen.ExampleStore,
    eos_id: int | None,
    loop: trainer.LoopConfig,
    loss: trainer.LossConfig,
    optimizer_config: trainer.OptimizerConfig,
    repeats: int,
    temperature: float = 1.0,
    teacher_top_k: int = 0,
    pretrain_shape: tuple[int, int] = (32, 128),
) -> dict:
    """The interleaved timings of the module docstring -> the record's timing fields."""
    optimizer = trainer.make_optimizer(optimizer_config, TRAIN_STEPS)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # Each donating chain owns its state.
    fixed = datagen.DataMixture(fixed_data_fraction=1.0)
    make_fixed = trainer.compile_step_batch(models, fixed, eos_id)
    _, make_onpolicy = onpolicy_batch_maker(models, eos_id, temperature)
    teacher_params = models.teacher_params
    rng = jax.random.PRNGKey(loop.seed)

    # One step's host data, as `_step_batch` gives it to the jitted batch maker.
    local = data.batch(loop.seed, 0, loop.batch_size)
    as_fixed = dict(local, sources=np.full(loop.batch_size, datagen.DATASET, np.int32))
    as_student = dict(local, sources=np.full(loop.batch_size, datagen.STUDENT, np.int32))
    batch = make_fixed(params, teacher_params, as_fixed, rng, present=())
    inputs, positions = trainer._model_inputs(batch), batch.get("loss_positions")
    teacher_forward = jax.jit(models.teacher.logits)  # As the step runs it: at the loss positions.
    teacher_logits = teacher_forward(teacher_params, inputs, positions)
    sampled = make_onpolicy(params, teacher_params, as_student, rng, present=(datagen.STUDENT,))
    sampled_tokens = float(np.mean(np.sum(np.asarray(sampled["weights"]), axis=1)))

    student_step = trainer.compile_train_step(models.student, PrecomputedTeacher(), loss, optimizer)
    kd_step = trainer.compile_train_step(models.student, models.teacher, loss, optimizer)
    chains = ("student", "fixed")
    states = {name: trainer.init_state(copy(params), optimizer) for name in chains}
    steps = itertools.count()

    def student_fwd_bwd():
        states["student"], metrics = student_step(states["student"], teacher_logits, batch)
        _ready((states["student"], metrics))

    def batch_fixed():
        step = next(steps)
        _ready(trainer._step_batch(data, step, loop, params, models, fixed, make_fixed, None)[0])

    def kd_step_fixed():
        states["fixed"], metrics = kd_step(states["fixed"], teacher_params, batch)
        _ready((states["fixed"], metrics))

    fns = {
        "teacher_forward": lambda: _ready(teacher_forward(teacher_params, inputs, positions)),
        "student_fwd_bwd": student_fwd_bwd,
        "packing": lambda: _ready(make_fixed(params, teacher_params, as_fixed, rng, present=())),
        "sampling": sampling_call(make_onpolicy, params, teacher_params, data, loop),
        "batch_fixed": batch_fixed,
        "kd_step_fixed": kd_step_fixed,
        "kd_step_onpolicy": onpolicy_step(
            models, copy(params), data, eos_id, loop, loss, optimizer, temperature
        ),
        **_reference_fns(models, optimizer, pretrain_shape, loop.seed),
    }
    if teacher_top_k:
        fns["kd_step_fixed_cached"] = _cached_step(
            models, local, batch, teacher_top_k, lambda s, b: kd_step(s, teacher_params, b),
            trainer.init_state(copy(params), optimizer),
        )  # fmt: skip
    _, seconds = interleaved_items(fns, [()], repeats, shape_of=lambda item: ())
    own = ("matmul", "pretrain_products")  # Timed inside: their calls' medians are not figures.
    ms = {f"{name}_ms": 1e3 * s for name, s in seconds.items() if name not in own}
    ms["matmul_ms"] = 1e3 * float(np.median(fns["matmul"].fastest[-repeats:]))
    parts = ms["teacher_forward_ms"] + ms["student_fwd_bwd_ms"]
    extra = _utilisation(models, ms, batch, local, pretrain_shape)
    if "pretrain_products" in fns:
        extra.update(_products_record(fns["pretrain_products"], repeats, ms["pretrain_step_ms"],
                                      extra["pretrain_step_ideal_ms"]))  # fmt: skip
    if teacher_top_k:
        extra["teacher_cache_saving"] = round(
            ms["kd_step_fixed_ms"] / ms["kd_step_fixed_cached_ms"], 4
        )
        extra["teacher_top_k"] = teacher_top_k
    return {
        **extra,
        **{k: round(v, 4) for k, v in ms.items()},
        "kd_step_fixed_over_sum": round(ms["kd_step_fixed_ms"] / parts, 4),
        "kd_step_onpolicy_over_sum": round(
            ms["kd_step_onpolicy_ms"] / (parts + ms["sampling_ms"]), 4
        ),
        "sampled_tokens_per_row": round(sampled_tokens, 2),
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the record here too (a JSON object)")
    parser.add_argument("--teacher", help=f"teacher checkpoint (default {QUICKSTART_TEACHER})")
    parser.add_argument("--student", help=f"student checkpoint (default {QUICKSTART_STUDENT})")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (tests)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20, help="interleaved calls of each fn")
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--task", default="stdlib_code")
    parser.add_argument("--max_examples", type=int, default=256, help="examples read")
    parser.add_argument("--vocabulary", help="tokenizer (default: the teacher checkpoint's)")
    parser.add_argument("--vocab_size", type=int, help="as train.vocab_size")
    parser.add_argument("--divergence", default="fkl", help=f"of {trainer.DIVERGENCES[:-1]}")
    parser.add_argument("--optimizer", default="adamw", help=f"of {trainer.OPTIMIZERS}")
    parser.add_argument("--temperature", type=float, default=1.0, help="on-policy sampling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain_batch_size", type=int, default=32, help="pretraining step")
    parser.add_argument("--pretrain_length", type=int, default=128, help="pretraining step")
    parser.add_argument(
        "--teacher_top_k",
        type=int,
        default=0,
        help="also time the fixed-data step with the teacher's top-k cached",
    )
    return parser


def prepare(parser: argparse.ArgumentParser, args) -> tuple:
    """The parsed flags -> (models, student params, data, tokenizer, loop, loss, optimizer
    config, description), the pair and data as the trainer would have them."""
    if args.tiny and (args.teacher or args.student):
        parser.error("--tiny builds its own models: give it without --teacher / --student")
    if args.divergence == "ce":
        parser.error("--divergence: distillation needs a divergence against the teacher")
    loss = trainer.LossConfig(divergence=args.divergence)
    optimizer = trainer.OptimizerConfig(name=args.optimizer)
    loop = trainer.LoopConfig(batch_size=args.batch_size, seed=args.seed)
    teacher, teacher_params, student, params, tokenizer, description = load_pair(args)
    vocab_size = common_vocab_size(student, teacher, args.vocab_size)
    cut = lambda m: m if vocab_size is None else TruncatedVocabulary(m, vocab_size)
    models = trainer.Models(cut(student), cut(teacher), teacher_params)
    name = tasks.register_task(
        args.task, tokenizer.vocabulary, inputs_eos=student.encoder_decoder,
        bos_id=tokenizer.prompt_bos,
    )  # fmt: skip
    lengths = {"inputs": args.prompt_length, "targets": args.completion_length}
    data = example_store(
        name, "train", lengths, args.max_examples, args.batch_size, tokenizer.prompt_bos
    )
    return models, params, data, tokenizer, loop, loss, optimizer, description


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    models, params, data, tokenizer, loop, loss, optimizer, description = prepare(parser, args)
    print(f"measuring {description}, batch {args.batch_size} ...", file=sys.stderr, flush=True)
    timings = measure(models, params, data, tokenizer.eos_id, loop, loss, optimizer,
                      args.repeats, args.temperature, args.teacher_top_k,
                      (args.pretrain_batch_size, args.pretrain_length))  # fmt: skip
    record = {
        **timings,
        "pretrain_batch_size": args.pretrain_batch_size,
        "pretrain_length": args.pretrain_length,
        "divergence": args.divergence,
        "optimizer": args.optimizer,
        "teacher_mb": round(megabytes(models.teacher_params), 2),
        "student_mb": round(megabytes(params), 2),
        **context(args, description),
    }
    return emit(record, args.json)


def context(args, description: str) -> dict:
    """The record's shapes, repeats, models, task and backend (also scripts/versus_trl.py's)."""
    return {
        "batch_size": args.batch_size,
        "prompt_length": args.prompt_length,
        "completion_length": args.completion_length,
        "repeats": args.repeats,
        "models": description,
        "task": args.task,
        "backend": jax.default_backend(),
        "huge_pages": console.huge_pages_on(),
    }


if __name__ == "__main__":
    main()
