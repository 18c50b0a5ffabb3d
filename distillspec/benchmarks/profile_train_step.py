"""Where a training step's time goes, op by op: a jax.profiler trace of the jitted steps,
each XLA op's time put in a category from the compiled program.

    python -m distillspec.benchmarks.profile_train_step [--steps 10] [--batch_size 16] \\
        [--prompt_length 64] [--completion_length 64] [--pretrain_batch_size 32] \\
        [--pretrain_length 128] [--top 12]

Runs, on the main job's pair with random weights (the shapes of configs/models/code_target.gin
and code_draft.gin; the weights do not change the cost), three jitted functions as
`distillspec.benchmarks.train_step` times them, each --steps times under the profiler after
two untimed calls:
  pretrain      the target's pretraining step (cross-entropy, AdamW) on pretrain_batch_size x
                pretrain_length tokens;
  student       the distillation step without the teacher forward (teacher logits given):
                the student's forward, forward KL, backward and AdamW update, batch_size x
                (prompt_length + completion_length) tokens;
  teacher       the target's forward on the same batch.
Prints, per function, the wall time per step and the share of the ops' summed time (over all
threads of XLA:CPU, so parallel ops count once per thread) in each category:
  matmul        ops that contain a dot (XLA:CPU's YNNPACK/Eigen products);
  layout        copies and transposes (fusions XLA names after a copy or transpose);
  loss          other ops traced from the loss and the metrics (vocabulary-sized work:
                log-softmax, the divergence and its gradient, the acceptance metric);
  model         other ops traced from the model (norms, attention softmax, activations, the
                embedding's gather and scatter);
  optimizer     the rest of the step (AdamW, clipping, the gradient norm);
  other         ops XLA made without a jax operation behind them (e.g. zero-filled buffers
                that the layer scan stacks its saved activations into).
A fusion goes by what it contains: "matmul" includes the elementwise work fused into a dot.
then the --top ops by time with their category and the jax operation they come from. Figures
are of this machine and its load: compare two commits in one session (run this on both).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import shutil
import tempfile
import time

from distillspec import console

if __name__ == "__main__":  # As the trainer's processes start: huge pages for the C heap.
    console.quiet_startup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.profiler import ProfileData  # noqa: E402

from distillspec import datagen, trainer  # noqa: E402
from distillspec.models import DecoderOnlyLM, TransformerConfig  # noqa: E402

TARGET = TransformerConfig(
    vocab_size=2048, embed_dim=256, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=64,
    mlp_dim=768,
)  # fmt: skip
DRAFT = TransformerConfig(
    vocab_size=2048, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
    mlp_dim=96,
)  # fmt: skip
CATEGORIES = ("matmul", "layout", "loss", "model", "optimizer", "other")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (\w+)\(.*?(?:calls=%(\S+?)[,\s].*?)?$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _computations(hlo: str) -> dict[str, str]:
    """{computation name: its text} of a compiled program's HLO."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            name, out[head.group(1)] = head.group(1), ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def categories(hlo: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (category, jax op_name)} for every instruction of the program."""
    bodies, out = _computations(hlo), {}
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, _, opcode, called = match.groups()
        op_name = (_OP_NAME.search(line) or [None, ""])[1]
        body = bodies.get(called, "") if called else ""
        if opcode in ("dot", "convolution") or " dot(" in body or " convolution(" in body:
            category = "matmul"
        elif opcode in ("copy", "transpose") or re.match(r"(copy|transpose)", name):
            category = "layout"
        elif not op_name:
            category = "other"
        elif "DecoderOnlyTransformer" in op_name:
            category = "model"
        elif "jvp(" in op_name or "log_softmax" in op_name:
            category = "loss"
        else:
            category = "optimizer"
        out[name] = (category, op_name)
    return out


def profile(fn, hlo: str, steps: int, top: int) -> dict:
    """Runs fn `steps` times under jax.profiler; the wall time and the ops' time by category."""
    fn(), fn()
    logdir = tempfile.mkdtemp()
    jax.profiler.start_trace(logdir)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    wall = (time.perf_counter() - start) / steps
    jax.profiler.stop_trace()
    data = ProfileData.from_file(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0])
    shutil.rmtree(logdir)
    kinds, ops = categories(hlo), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in kinds:
                    ops[event.name] += event.duration_ns / 1e6 / steps
    total = sum(ops.values())
    shares = collections.Counter()
    for name, ms in ops.items():
        shares[kinds[name][0]] += ms / total
    return {
        "wall_ms": round(1e3 * wall, 2),
        "ops_ms": round(total, 2),
        **{category: round(shares[category], 3) for category in CATEGORIES},
        "top": [(name, round(ms, 2), *kinds[name]) for name, ms in ops.most_common(top)],
    }


def functions(args) -> dict:
    """{name: (call, compiled HLO text)} of the three profiled functions."""
    target, draft = DecoderOnlyLM(TARGET), DecoderOnlyLM(DRAFT)
    target_params, draft_params = (
        target.init(jax.random.PRNGKey(1)),
        draft.init(jax.random.PRNGKey(0)),
    )
    optimizer = trainer.make_optimizer(trainer.OptimizerConfig(name="adamw"), 1000)
    rng = np.random.default_rng(0)

    def batch(rows, length, first):
        tokens = rng.integers(3, TARGET.vocab_size, size=(rows, length + 1)).astype(np.int32)
        weights = np.zeros((rows, length), np.float32)
        weights[:, first:] = 1
        return {"decoder_input_tokens": jnp.asarray(tokens[:, :-1]),
                "targets": jnp.asarray(tokens[:, 1:]), "weights": jnp.asarray(weights)}  # fmt: skip

    pretrain_batch = batch(args.pretrain_batch_size, args.pretrain_length, 0)
    rows, prompt, completion = args.batch_size, args.prompt_length, args.completion_length
    kd_batch = datagen.pack_decoder_only(  # As the trainer packs it (with its loss_positions).
        rng.integers(3, TARGET.vocab_size, size=(rows, prompt)), np.full(rows, prompt),
        rng.integers(3, TARGET.vocab_size, size=(rows, completion)), np.full(rows, completion),
    )  # fmt: skip
    forward = jax.jit(target.logits)
    teacher_logits = forward(target_params, kd_batch, kd_batch["loss_positions"])

    class Precomputed:  # The teacher whose 'parameters' are its logits (as the benchmark's).
        def logits(self, logits, batch, positions=None):
            return logits

    steps = {
        "pretrain": (trainer.compile_train_step(target, None, trainer.LossConfig("ce"), optimizer),
                     target_params, None, pretrain_batch),
        "student": (trainer.compile_train_step(draft, Precomputed(), trainer.LossConfig("fkl"),
                                               optimizer), draft_params, teacher_logits, kd_batch),
    }  # fmt: skip
    out = {}
    for name, (step, params, teacher_params, data) in steps.items():
        states = [trainer.init_state(jax.tree.map(jnp.copy, params), optimizer)]
        hlo = step.lower(states[0], teacher_params, data).compile().as_text()

        def call(step=step, states=states, teacher_params=teacher_params, data=data):
            states[0], metrics = step(states[0], teacher_params, data)
            jax.block_until_ready((states[0], metrics))

        out[name] = (call, hlo)
    positions = kd_batch["loss_positions"]
    hlo = forward.lower(target_params, kd_batch, positions).compile().as_text()
    out["teacher"] = (
        lambda: jax.block_until_ready(forward(target_params, kd_batch, positions)),
        hlo,
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="profiled calls of each function")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--pretrain_batch_size", type=int, default=32)
    parser.add_argument("--pretrain_length", type=int, default=128)
    parser.add_argument("--top", type=int, default=12, help="ops listed per function")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    results = {}
    for name, (call, hlo) in functions(args).items():
        results[name] = profile(call, hlo, args.steps, args.top)
        record = results[name]
        print(f"{name}: {record['wall_ms']} ms/step wall, ops {record['ops_ms']} ms (all threads)")
        print("  " + ", ".join(f"{c} {record[c]:.1%}" for c in CATEGORIES))
        for op, ms, category, op_name in record["top"]:
            print(f"  {ms:9.2f} ms  {category:9s} {op:32s} {op_name[-70:]}")
    return results


if __name__ == "__main__":
    main()
