"""The on-policy distillation step against TRL's `GKDTrainer` on the same work, in one process.

    pip install -e ".[trl]"     # trl, transformers and the CPU build of torch
    python scripts/versus_trl.py --json OUT.json [--teacher DIR --student DIR] \\
        [--batch_size 16] [--prompt_length 64] [--completion_length 64] [--repeats 10] [--tiny]

The same pair (the quickstart's target and standard draft by default, as
`distillspec.benchmarks.train_step` loads them; `--tiny` for random tiny models), exported with
`models.save_pretrained` and loaded by transformers as float32 Llama models (their logits are
checked against ours before anything is timed: `*_logits_max_abs_diff`), the same prompts in
the same order (step s takes the trainer's batch s of the --task's train split; TRL gets them
left-padded, as its generation needs), the same recipe: every row sampled from the student
(TRL's lmbda = 1) at --temperature up to --completion_length tokens or EOS, forward KL
(TRL's beta = 0, the `generalized_jsd_loss` that agrees with `distillspec.losses`), AdamW at
one learning rate, global-norm clipping at 1, float32, no gradient checkpointing, torch on
--threads threads (default: every core, as XLA:CPU uses).

Timed, interleaved (one call of each per repeat, after two untimed calls each, each call after
an untimed pause that lets the other library's threads go idle; medians in ms):
  trl_step_ms            one step of TRL's training loop as `transformers.Trainer` runs it
                         with one batch per step: `GKDTrainer.training_step` (the student's
                         `generate` on the prompts, the student's forward, the teacher's forward
                         under no_grad, the loss, backward), gradient clipping, the optimizer's
                         and the scheduler's steps, zero_grad;
  distillspec_step_ms    one on-policy step of `distillspec.trainer`'s loop
                         (`train_step.onpolicy_step`: sampling, packing, the jitted full step);
  trl_generate_ms        TRL's generation alone (`GKDTrainer.generate_on_policy_outputs`);
  distillspec_sampling_ms  ours alone (the trainer's jitted batch maker, every row sampled);
  speedup                trl_step_ms / distillspec_step_ms, with `speedup_interval` (90%,
                         bootstrap over whole repeats, `timing.repeats_interval`);
  sampling_speedup       trl_generate_ms / distillspec_sampling_ms.
Both sides feed their updated parameters into their next step, as in training. The figures
are of one machine at one moment: compare them only as ratios measured in one run.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time

from distillspec import console

console.quiet_startup()  # Before anything imports TensorFlow (a script, not `python -m`).

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from distillspec import trainer  # noqa: E402
from distillspec.benchmarks import emit  # noqa: E402
from distillspec.benchmarks import train_step as step_bench  # noqa: E402
from distillspec.evaluation.timing import interleaved, repeats_interval  # noqa: E402
from distillspec.models import save_pretrained  # noqa: E402

SETTLE_S = 0.2  # The pause before each timed call (not timed).
# A script rather than a module of the package: what it imports (trl, torch, transformers,
# datasets) comes with the `trl` extra, not with `pip install -e .`.
LEARNING_RATE = 5e-3  # The main job's distillation rate (the cost does not depend on it).


def _require_trl():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"this benchmark needs TRL and PyTorch ({error}): pip install -e '.[trl]'"
        ) from error


def _unwrapped(model):
    """The DecoderOnlyLM under a model, or a clear stop: TRL needs one shared vocabulary."""
    if hasattr(model, "model"):  # TruncatedVocabulary: the pair's vocabularies differ.
        raise SystemExit(
            "TRL's GKDTrainer needs teacher and student of one vocabulary size; this pair "
            "has a truncated one"
        )
    return model


def _hf_pair(models: trainer.Models, params, tokenizer, directory: str):
    """(HF teacher, HF student, HF tokenizer): the pair saved by `save_pretrained` and loaded
    back by transformers, float32, eval / train mode as TRL sets them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    loaded = []
    for name, model, weights in (
        ("teacher", models.teacher, models.teacher_params),
        ("student", models.student, params),
    ):
        path = f"{directory}/{name}"
        save_pretrained(_unwrapped(model), jax.device_get(weights), path, tokenizer.special_ids)
        loaded.append(AutoModelForCausalLM.from_pretrained(path, dtype="float32"))
    # Token ids go in and out; TRL only reads the pad id from its tokenizer. A word-level
    # stand-in over the same ids (pad 0, the pair's EOS) is enough.
    vocab = {f"<{i}>": i for i in range(models.student.vocab_size)}
    pad = tokenizer.pad_id
    eos = tokenizer.eos_id
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=f"<{pad}>")),
        pad_token=f"<{pad}>", eos_token=None if eos is None else f"<{eos}>",
    )  # fmt: skip
    return loaded[0], loaded[1], hf_tokenizer


def _check_logits(models: trainer.Models, params, teacher_hf, student_hf, local) -> dict:
    """The exported models' logits against ours on the first batch's prompts (a mismatch
    means the two sides would not do the same work: stop)."""
    import torch

    tokens = np.asarray(local["prompt_tokens"])
    lengths = np.asarray(local["prompt_lengths"])
    record = {}
    for name, model, weights, hf in (
        ("teacher", models.teacher, models.teacher_params, teacher_hf),
        ("student", models.student, params, student_hf),
    ):
        ours = np.asarray(model.logits(weights, {"decoder_input_tokens": tokens}))
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        real = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
        diff = float(np.max(np.abs(ours - theirs)[real]))
        scale = float(np.max(np.abs(ours[real])))
        if not diff <= 1e-3 * max(scale, 1.0):
            raise SystemExit(
                f"the exported {name}'s logits differ from ours by {diff:.3g} (scale {scale:.3g}):"
                " the two trainers would not train the same model"
            )
        record[f"{name}_logits_max_abs_diff"] = diff
    return record


def _left_padded(local: dict) -> dict:
    """TRL's inputs for a step: the prompts left-padded (generation appends on the right)."""
    import torch

    tokens, lengths = np.asarray(local["prompt_tokens"]), np.asarray(local["prompt_lengths"])
    width = tokens.shape[1]
    ids = np.zeros_like(tokens)
    mask = np.zeros_like(tokens)
    for row, (token_row, length) in enumerate(zip(tokens, lengths)):
        ids[row, width - length :] = token_row[:length]
        mask[row, width - length :] = 1
    ids, mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    return {
        "prompts": ids, "prompt_attention_mask": mask, "input_ids": ids.clone(),
        "attention_mask": mask.clone(), "labels": torch.full_like(ids, -100),
    }  # fmt: skip


def _trl_fns(teacher_hf, student_hf, hf_tokenizer, data, loop, args, directory: str) -> dict:
    """{'trl_step': one TRL training step, 'trl_generate': its generation alone}."""
    import datasets
    import torch
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    config = GKDConfig(
        output_dir=f"{directory}/trl", per_device_train_batch_size=loop.batch_size,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, lmbda=1.0, beta=0.0, temperature=args.temperature,
        max_new_tokens=args.completion_length, gradient_checkpointing=False, bf16=False,
        fp16=False, use_cpu=True, report_to="none", save_strategy="no", disable_dropout=True,
        seed=args.seed, max_steps=1000,
    )  # fmt: skip
    gkd = GKDTrainer(
        model=student_hf, teacher_model=teacher_hf, args=config, processing_class=hf_tokenizer,
        train_dataset=datasets.Dataset.from_dict({"row": [0]}), data_collator=lambda rows: rows,
    )  # fmt: skip
    gkd.create_optimizer_and_scheduler(num_training_steps=config.max_steps)
    model, steps = gkd.model, itertools.count()
    gkd.current_gradient_accumulation_steps = 1  # As `Trainer`'s loop sets it: one batch a step.

    def step():
        inputs = _left_padded(data.batch(loop.seed, next(steps), loop.batch_size))
        model.train()
        gkd.training_step(model, inputs)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        gkd.optimizer.step()
        gkd.lr_scheduler.step()
        model.zero_grad()

    first = _left_padded(data.batch(loop.seed, 0, loop.batch_size))

    def generate():
        with torch.no_grad():
            gkd.generate_on_policy_outputs(model, first, gkd.generation_config)

    return {"trl_step": step, "trl_generate": generate}


def build_parser() -> argparse.ArgumentParser:
    """train_step's flags that apply here, plus --threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the record here too (a JSON object)")
    for side, default in (("teacher", step_bench.QUICKSTART_TEACHER),
                          ("student", step_bench.QUICKSTART_STUDENT)):  # fmt: skip
        parser.add_argument(f"--{side}", help=f"{side} checkpoint (default {default})")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (tests)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10, help="interleaved calls of each fn")
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--task", default="stdlib_code")
    parser.add_argument("--max_examples", type=int, default=256, help="examples read")
    parser.add_argument("--temperature", type=float, default=1.0, help="on-policy sampling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch's threads (default: every core)")
    parser.set_defaults(vocabulary=None, vocab_size=None, divergence="fkl", optimizer="adamw")
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: at least 2 are needed for a median and interval")
    _require_trl()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models, params, data, tokenizer, loop, loss, _, description = step_bench.prepare(parser, args)
    optimizer = trainer.make_optimizer(
        trainer.OptimizerConfig(name="adamw", learning_rate=LEARNING_RATE), step_bench.TRAIN_STEPS
    )
    with tempfile.TemporaryDirectory() as directory:
        teacher_hf, student_hf, hf_tokenizer = _hf_pair(models, params, tokenizer, directory)
        checks = _check_logits(
            models, params, teacher_hf, student_hf, data.batch(loop.seed, 0, loop.batch_size)
        )
        fns = _trl_fns(teacher_hf, student_hf, hf_tokenizer, data, loop, args, directory)
        _, make = step_bench.onpolicy_batch_maker(models, tokenizer.eos_id, args.temperature)
        fns = {
            "trl_step": fns["trl_step"],
            "distillspec_step": step_bench.onpolicy_step(  # It donates its own copy.
                models,
                jax.tree.map(jnp.copy, params),
                data,
                tokenizer.eos_id,
                loop,
                loss,
                optimizer,
                args.temperature,
            ),  # fmt: skip
            "trl_generate": fns["trl_generate"],
            "distillspec_sampling": step_bench.sampling_call(
                make, params, models.teacher_params, data, loop
            ),
        }
        print(f"measuring TRL against distillspec on {description}, batch {args.batch_size},"
              f" {args.repeats} repeats ...", file=sys.stderr, flush=True)  # fmt: skip
        # A pause before each call lets the other library's worker threads go idle (XLA's and
        # torch's pools spin a while after their work; on two cores a spinning pool slows the
        # next call of the other by about a third).
        settled = {}
        for name, fn in fns.items():
            settled[f"pause before {name}"] = lambda: time.sleep(SETTLE_S)
            settled[name] = fn
        interleaved(settled, 2)  # Untimed: compilation, torch's first calls.
        _, seconds = interleaved(settled, args.repeats)
        seconds = {name: seconds[name] for name in fns}

    def ratios(indices):
        median = {k: statistics.median(seconds[k][i] for i in indices) for k in seconds}
        return [median["trl_step"] / median["distillspec_step"],
                median["trl_generate"] / median["distillspec_sampling"]]  # fmt: skip

    speedup, sampling_speedup = ratios(range(args.repeats))
    low, high = repeats_interval(ratios, args.repeats)
    record = {
        **{f"{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in seconds.items()},
        "speedup": round(speedup, 4),
        "speedup_interval": [round(float(low[0]), 4), round(float(high[0]), 4)],
        "sampling_speedup": round(sampling_speedup, 4),
        "sampling_speedup_interval": [round(float(low[1]), 4), round(float(high[1]), 4)],
        **{k: float(f"{v:.3g}") for k, v in checks.items()},
        "temperature": args.temperature,
        "torch_threads": torch.get_num_threads(),
        "trl_version": __import__("trl").__version__,
        "torch_version": torch.__version__,
        **step_bench.context(args, description),
    }
    return emit(record, args.json)


if __name__ == "__main__":
    main()
