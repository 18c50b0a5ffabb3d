"""Will a distillation recipe fit? The step compiled ahead of time at its real shapes, no weights.

    python -m distillspec.benchmarks.memory --target_config T --draft_config D \
        --divergence jsd --tokens_per_device 4096 --mesh 8 [--fsdp] [--remat full] \
        [--teacher_dtype bfloat16] [--run_steps K] --json OUT

T and D are Hugging Face config.json files (or directories holding one; configs/shapes/ has
Llama 3 and Gemma 2 shapes) or names of configs/models/ gin files (t5_1_1_xl, t5_1_1_small, ...).
The step is `trainer.train_step` itself, on abstract parameters (`jax.eval_shape`) placed on a
simulated mesh of `--mesh` host devices (data parallel; --fsdp also splits every parameter over
them), compiled by XLA; its memory figures are XLA's own accounting of the compiled program per
device (`memory_analysis`). FLOPs are counted from the step's jaxpr (every product, scanned
layers and chunks by their trip counts; XLA's cost analysis counts a loop's body once).
`--run_steps K` also runs K real steps at these shapes on this machine's one device (keep the
shapes small) and reports the process's peak RSS beside the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time

# Peak bf16 dense FLOP/s per chip and memory per chip, from the vendors' public specifications.
ACCELERATORS = {
    "tpu-v4": (275e12, 32e9),
    "tpu-v5e": (197e12, 16e9),
    "tpu-v5p": (459e12, 95e9),
    "a100-40gb": (312e12, 40e9),
    "a100-80gb": (312e12, 80e9),
    "h100-80gb": (989e12, 80e9),
}
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda", "lk_lambda_mean", "ce")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--target_config", required=True, help="config.json (or its directory), or a gin name")
    add("--draft_config", required=True, help="config.json (or its directory), or a gin name")
    add("--divergence", default="fkl", choices=DIVERGENCES)
    add("--tokens_per_device", type=int, default=4096, help="loss tokens per device per step")
    add("--sequence_length", type=int, default=512, help="tokens per row (rows = tokens / this)")
    add("--vocab_size", type=int, default=None, help="both models at this vocabulary instead")
    add("--mesh", type=int, default=1, help="devices, data parallel")
    add("--fsdp", action="store_true", help="also split parameters over the devices")
    add("--remat", default="none", help="the student's blocks: none, full, or a policy name")
    add("--teacher_dtype", default="float32", choices=("float32", "bfloat16"))
    add("--optimizer", default="adamw", choices=("adamw", "adafactor"))
    add("--chunk_tokens", type=int, default=None, help="tokens per loss chunk (default: by V)")
    add("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the projected time")
    add("--run_steps", type=int, default=0, help="also run K real steps here (small shapes)")
    add("--time_pairs", type=int, default=0, help="also time P step pairs against --baseline")
    add("--baseline", default="unchunked", choices=("unchunked", "no_remat", "float32_teacher"))
    add("--json", default=None, help="write the result here")
    return parser


def _gemma_as_llama(hf: dict) -> dict:
    """A Gemma (1/2/3) config.json read for its shapes: a Llama-shaped model whose feed-forward
    block is GeGLU, with tied embeddings (soft-capping and sliding windows change no shape)."""
    return {**hf, "model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": True}


def load_model(spec: str, dtype: str = "float32"):
    """The model a config.json (file or directory) or a configs/models/ gin name describes."""
    from distillspec.models import T5LM, DecoderOnlyLM
    from distillspec.models.decoder_only import TransformerConfig
    from distillspec.models.loading import config_from_hf

    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise SystemExit(f"model config {spec!r}: no such file")
        with open(path) as f:
            hf = json.load(f)
        hf.pop("rope_scaling", None)  # Changes no shape.
        gemma = str(hf.get("model_type", "")).startswith("gemma")
        config = config_from_hf(_gemma_as_llama(hf) if gemma else hf, dtype)
        if gemma:
            config = dataclasses.replace(config, activation="gelu_new")
        return DecoderOnlyLM(config) if isinstance(config, TransformerConfig) else T5LM(config)
    from distillspec.convert import resolve_config

    try:
        return T5LM(_with_dtype(resolve_config(spec), dtype))
    except ValueError as error:
        raise SystemExit(
            f"model {spec!r} is neither a config.json nor a configs/models/ T5 name: {error}"
        ) from None


def load_pair(args):
    """(target in --teacher_dtype, draft with --remat), both at --vocab_size when given."""
    from distillspec.models.base import with_remat

    models = []
    for spec, dtype in ((args.target_config, args.teacher_dtype), (args.draft_config, "float32")):
        model = load_model(spec, dtype)
        if args.vocab_size:
            model = type(model)(dataclasses.replace(model.config, vocab_size=args.vocab_size))
        models.append(model)
    return models[0], with_remat(models[1], args.remat)


def _with_dtype(config, dtype: str):
    return dataclasses.replace(config, dtype=dtype)


def _abstract(model, dtype: str):
    """The model's parameters as ShapeDtypeStructs in dtype (no weights are made)."""
    import jax
    import jax.numpy as jnp

    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), shapes)


def _batch(model, rows: int, length: int) -> dict:
    import jax
    import jax.numpy as jnp

    spec = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype)
    batch = {"decoder_input_tokens": spec(jnp.int32), "targets": spec(jnp.int32)}
    batch["weights"] = spec(jnp.float32)
    if model.encoder_decoder:
        batch["encoder_input_tokens"] = spec(jnp.int32)
    return batch


def _device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs) placed on `shardings`."""
    import math

    import jax

    if tree is None:
        return 0
    pieces = jax.tree.map(
        lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize, tree, shardings
    )
    return sum(jax.tree.leaves(pieces))


def dry_run(args) -> dict:
    """The compiled step's per-device figures (see the module docstring)."""
    import jax

    from distillspec import partitioning, trainer
    from distillspec.benchmarks.flops import jaxpr_flops

    if args.tokens_per_device % args.sequence_length:
        raise SystemExit(
            f"--tokens_per_device {args.tokens_per_device} must be a multiple of "
            f"--sequence_length {args.sequence_length}"
        )
    teacher, student = load_pair(args)
    if teacher.vocab_size != student.vocab_size:
        raise SystemExit(
            f"target vocabulary {teacher.vocab_size} != draft vocabulary {student.vocab_size}"
        )
    if args.divergence == "ce":
        teacher = None
    rows = args.tokens_per_device // args.sequence_length * args.mesh
    mesh = partitioning.make_mesh(args.mesh, 1, jax.devices()[: args.mesh])
    rules = partitioning.param_rules(args.fsdp)
    loss = trainer.LossConfig(divergence=args.divergence, chunk_tokens=args.chunk_tokens)
    optimizer = trainer.make_optimizer(trainer.OptimizerConfig(name=args.optimizer), 1000)
    params = _abstract(student, "float32")
    shard = lambda m, tree: partitioning.shardings_for(tree, m.logical_axes(), mesh, rules)
    state = jax.eval_shape(lambda p: trainer.init_state(p, optimizer), params)
    state_shardings = trainer.state_shardings(optimizer, params, shard(student, params), mesh)
    teacher_params = None if teacher is None else _abstract(teacher, args.teacher_dtype)
    teacher_shardings = None if teacher is None else shard(teacher, teacher_params)
    batch = _batch(student, rows, args.sequence_length)
    batch_shardings = {k: partitioning.batch_sharding(mesh) for k in batch}
    step = trainer.compile_train_step(student, teacher, loss, optimizer, state_shardings, mesh)
    started = time.perf_counter()
    lowered = step.lower(
        _placed(state, state_shardings), _placed(teacher_params, teacher_shardings),
        _placed(batch, batch_shardings),
    )  # fmt: skip
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    flops = jaxpr_flops(step.trace(state, teacher_params, batch).jaxpr)
    devices = args.mesh
    param_bytes = _device_bytes(params, state_shardings.params)
    optimizer_bytes = _device_bytes(state.opt_state, state_shardings.opt_state)
    teacher_bytes = _device_bytes(teacher_params, teacher_shardings)
    peak = (
        memory.argument_size_in_bytes + memory.output_size_in_bytes
        - memory.alias_size_in_bytes + memory.temp_size_in_bytes
    )  # fmt: skip
    per_device_flops = flops / devices
    return {
        "target_config": args.target_config,
        "draft_config": args.draft_config,
        "divergence": args.divergence,
        "tokens_per_device": args.tokens_per_device,
        "sequence_length": args.sequence_length,
        "mesh": devices,
        "fsdp": args.fsdp,
        "remat": args.remat,
        "teacher_dtype": args.teacher_dtype,
        "optimizer": args.optimizer,
        "vocab_size": student.vocab_size,
        "chunk_tokens": args.chunk_tokens,
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "peak_bytes_per_device": peak,
        "param_bytes": param_bytes,
        "optimizer_bytes": optimizer_bytes,
        "teacher_bytes": teacher_bytes,
        "flops_per_step": per_device_flops,
        "fits": {name: peak <= hbm for name, (_, hbm) in ACCELERATORS.items()},
        "projected_step_s": {
            name: per_device_flops / (rate * args.mfu) for name, (rate, _) in ACCELERATORS.items()
        },
        "mfu": args.mfu,
        "compile_s": time.perf_counter() - started,
    }


def _placed(tree, shardings):
    """ShapeDtypeStructs carrying their shardings (what `lower` compiles for)."""
    import jax

    if tree is None:
        return None
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _real_step(args, chunk_tokens):
    """(step, state, teacher params, batch) of the recipe with real weights on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from distillspec import trainer
    from distillspec.models.base import cast_params

    teacher, student = load_pair(args)
    rows = args.tokens_per_device // args.sequence_length
    loss = trainer.LossConfig(divergence=args.divergence, chunk_tokens=chunk_tokens)
    optimizer = trainer.make_optimizer(trainer.OptimizerConfig(name=args.optimizer), 1000)
    teacher = None if args.divergence == "ce" else teacher
    step = trainer.compile_train_step(student, teacher, loss, optimizer)
    state = trainer.init_state(student.init(jax.random.PRNGKey(0)), optimizer)
    teacher_params = None
    if teacher is not None:
        teacher_params = cast_params(teacher.init(jax.random.PRNGKey(1)), args.teacher_dtype)
    rng = np.random.default_rng(0)
    shape = (rows, args.sequence_length)
    batch = {
        "decoder_input_tokens": jnp.asarray(rng.integers(0, student.vocab_size, shape, np.int32)),
        "targets": jnp.asarray(rng.integers(0, student.vocab_size, shape, np.int32)),
        "weights": jnp.ones(shape, jnp.float32),
    }
    if student.encoder_decoder:
        batch["encoder_input_tokens"] = batch["decoder_input_tokens"]
    return step, state, teacher_params, batch


def run_steps(args, steps: int) -> int:
    """Runs `steps` real steps of the recipe here (one device); the process's peak RSS."""
    import jax

    step, state, teacher_params, batch = _real_step(args, args.chunk_tokens)
    for _ in range(steps):
        state, metrics = step(state, teacher_params, batch)
        jax.block_until_ready(metrics)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --time_pairs' baselines: the recipe with one of its settings undone.
BASELINES = {
    "unchunked": {"chunk_tokens": None},  # One chunk of every token (set below).
    "no_remat": {"remat": "none"},
    "float32_teacher": {"teacher_dtype": "float32"},
}


def time_against_baseline(args, pairs: int) -> dict:
    """Median seconds of the recipe's step and of its `--baseline` (the recipe with a setting
    undone: 'unchunked' is one chunk of every token), interleaved over `pairs` pairs after a
    compiling call each, and the median of the pairs' ratios."""
    import statistics

    import jax

    baseline = argparse.Namespace(**{**vars(args), **BASELINES[args.baseline]})
    if args.baseline == "unchunked":
        baseline.chunk_tokens = args.tokens_per_device
    runs = {}
    for name, recipe in (("recipe", args), ("baseline", baseline)):
        runs[name] = list(_real_step(recipe, recipe.chunk_tokens))
    times = {name: [] for name in runs}
    for i in range(pairs + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run[1], metrics = run[0](run[1], run[2], run[3])
            jax.block_until_ready(metrics)
            if i:  # The first call compiles.
                times[name].append(time.perf_counter() - started)
    ratios = [a / b for a, b in zip(times["recipe"], times["baseline"])]
    return {
        "step_s": statistics.median(times["recipe"]),
        f"{args.baseline}_step_s": statistics.median(times["baseline"]),
        f"over_{args.baseline}": statistics.median(ratios),
        "timed_pairs": pairs,
    }


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.mesh < 1 or args.tokens_per_device < 1 or args.sequence_length < 1:
        raise SystemExit("--mesh, --tokens_per_device and --sequence_length must be >= 1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and args.mesh > 1:
        # The simulated mesh: set before jax starts its backend.
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.mesh}"
    result = dry_run(args)
    if args.run_steps:
        result["measured_peak_rss_bytes"] = run_steps(args, args.run_steps)
    if args.time_pairs:
        result.update(time_against_baseline(args, args.time_pairs))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
