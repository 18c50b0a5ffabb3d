"""Speculative versus plain decoding on a reference pair, judged against the ideal speed-up.

    python -m distillspec.benchmarks.speculative --json OUT.json [--dtype float32 bfloat16]
    python -m distillspec.benchmarks.speculative --target runs/quickstart/target/export \
        --draft runs/quickstart/distilled/export --json OUT.json    # your pair, task prompts

Measures in one process, with compilation excluded and the plain runs, the speculative runs and
the call timers below interleaved (one of each per repeat), one record per (dtype, batch):
  alpha, tau          acceptance rate and tokens per target call of the speculative runs;
  c                   draft step / target step, the draft measured in the loop's context:
                      (a jitted loop of rounds alternating gamma draft steps with the target's
                      gamma + 1 wide scoring call, `timing.round_timer`) - (the target's scoring
                      call alone), / gamma; the draft's weights pass through the caches between
                      target calls as in a real round;
  c_isolated          draft step / target step, the draft timed in a loop of draft calls alone
                      (its weights stay cache-hot: a lower bound on c);
  r_gamma             target time to score gamma + 1 positions / to score 1 (`timing.step_timer`;
                      the target's weights do not fit the caches, so in context and alone agree);
  speedup             speculative tokens/s / plain target tokens/s (end to end, prompt included);
  speedup_ideal       tau / (gamma * c + r_gamma), what a zero-overhead loop would reach;
  efficiency          speedup / speedup_ideal (eta);
  speedup_ideal_isolated, efficiency_isolated   the same with c_isolated;
  target_ms, verify_ms, draft_ms, draft_ms_isolated   ms per call behind c and r_gamma: target
                      at width 1, at gamma + 1, draft in context, draft alone;
  loop_ms, spec_loop_ms   the loop's own work outside the model calls per plain step / per
                      speculative round of gamma drafts (`timing.call_costs`: rounds of the
                      decoder itself, `timing.decoder_round_timers`, at 1 and gamma drafts,
                      minus their model calls, the target's `step_timer` / `timing.round_timer`);
  plain_fixed_ms, spec_fixed_ms   a run's cost outside its rounds (prefill, dispatch, output),
                      from the same decoder timers;
  plain_latency_ms, speculative_latency_ms              measured ms per generated token;
  plain_modeled_latency_ms, speculative_modeled_latency_ms   `timing.modeled_latency_ms` of the
                      run's counted calls (rows run in lockstep: the busiest row's rounds) priced
                      at the in-context costs above, plus the run's fixed part;
  plain_modeled_over_measured, speculative_modeled_over_measured   modeled / measured latency;
  exact_greedy        whether every speculative greedy output equals the plain greedy output.
  untimed             the costs among TIMED still <= 0 after 3 measurements (a busy machine).
  speedup_interval, efficiency_interval, plain_modeled_over_measured_interval,
  speculative_modeled_over_measured_interval   [low, high]: 90% bootstrap intervals of those
                      figures over the repeats (`timing.repeats_interval`): what this run can
                      tell apart (on the 2-core VM eta's is about +-12% at 15 repeats).
Ratios are medians over the interleaved repeats; absolute times are context only. `--dtype`
decodes in 'float32' or 'bfloat16' (parameters and activations; logits stay float32), or in
both, one record each; each record names its dtype and its KV caches' `cache_dtype`
(`--cache_dtype`, by default float32 on the CPU, see `models.base.decode_cache_dtype`).

With --target and --draft (checkpoint directories), the pair is yours and the prompts are the
first B prompts of --task's --split (default the embedded stdlib_code test split), tokenised
with the target's tokenizer; the records are the same.

The reference pair (see `reference_pair`): a Llama-style target of >= 50 MB float32 weights, so
that a decode step on a CPU is memory-bound, and an early-exit draft made of the target's own
embedding, first layer(s), final norm and head (>= 10x smaller). In a randomly initialised target
every layer adds noise of the same size to the residual stream and a one-layer draft agrees with
it on ~nothing; in trained models later layers refine rather than overwrite, which
`--deep_residual_scale` mimics by scaling down the residual contributions of the layers the
draft lacks. That single knob sets alpha; the output records it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import operator
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import console
from distillspec.benchmarks import emit
from distillspec.decoding import DecodeResult, generate, speculative_generate
from distillspec.decoding.lookahead import Lookahead
from distillspec.evaluation.timing import (
    call_cost_timers,
    call_costs,
    in_context_draft,
    interleaved,
    megabytes,
    modeled_latency_ms,
    repeats_interval,
    until_timed,
)
from distillspec.models import DecoderOnlyLM, TransformerConfig
from distillspec.models.base import DECODE_DTYPES, decode_cache_dtype, for_decoding

TARGET = TransformerConfig(
    vocab_size=4096,
    embed_dim=512,
    num_layers=16,
    num_heads=8,
    num_kv_heads=8,
    head_dim=64,
    mlp_dim=1408,
    tie_embeddings=True,
)


# The figures whose 90% bootstrap interval over the repeats a record gives ('<figure>_interval').
INTERVALS = ("speedup", "efficiency", "plain_modeled_over_measured",
             "speculative_modeled_over_measured")  # fmt: skip


def reference_pair(draft_layers: int, deep_residual_scale: float, seed: int = 0):
    """(target, target_params, draft, draft_params, description) of the early-exit pair."""
    target = DecoderOnlyLM(TARGET)
    params = target.init(jax.random.PRNGKey(seed))
    depth = jnp.arange(TARGET.num_layers) >= draft_layers
    scale = jnp.where(depth, deep_residual_scale, 1.0)

    def scale_outputs(path, leaf):
        names = [getattr(key, "key", "") for key in path]
        if names[-2:] in (["o", "kernel"], ["wo", "kernel"]):
            return leaf * scale.reshape((-1,) + (1,) * (leaf.ndim - 1))
        return leaf

    params = dict(params, layers=jax.tree_util.tree_map_with_path(scale_outputs, params["layers"]))
    draft = DecoderOnlyLM(dataclasses.replace(TARGET, num_layers=draft_layers))
    draft_params = dict(params, layers=jax.tree.map(lambda x: x[:draft_layers], params["layers"]))
    description = (
        f"early-exit draft: the target's embedding, first {draft_layers} of "
        f"{TARGET.num_layers} layers, final norm and tied head; target layers >= {draft_layers} "
        f"have their residual output projections scaled by {deep_residual_scale}"
    )
    return target, params, draft, draft_params, description


def in_dtype(pair, dtype: str, cache_dtype: str = "auto"):
    """The pair decoding in dtype with its KV caches in cache_dtype (`models.base.for_decoding`),
    its description unchanged."""
    target, target_params, draft, draft_params, description = pair
    return (*for_decoding(target, target_params, dtype, cache_dtype),
            *for_decoding(draft, draft_params, dtype, cache_dtype), description)  # fmt: skip


def in_context_costs(seconds: Mapping[Any, Sequence[Any]], costs: Mapping[str, Any],
                     gamma: int, timed_gamma: int) -> dict[str, float]:  # fmt: skip
    """The record's cost figures at this gamma: c, c_isolated and r_gamma (medians of
    per-repeat ratios of `timing.call_cost_timers`' interleaved seconds, whose static rounds
    have timed_gamma drafts) and the ms of `timing.call_costs` behind them (see the module
    docstring)."""
    target = seconds["target", 1]
    ratio = lambda values: statistics.median(x / y for x, y in zip(values, target))
    return {
        "c": ratio(in_context_draft(seconds, timed_gamma)),
        "c_isolated": ratio(seconds["draft", 1]),
        "r_gamma": ratio(seconds["target", gamma + 1]),
        "target_ms": costs["target"][1],
        "verify_ms": costs["target"][gamma + 1],
        "draft_ms": costs["draft"][1],
        "draft_ms_isolated": costs["draft_isolated"][1],
        "loop_ms": costs["round"],
        "spec_loop_ms": costs["spec_round"]["static"] + gamma * costs["per_draft"]["static"],
        "plain_fixed_ms": costs["fixed"]["plain"],
        "spec_fixed_ms": costs["fixed"]["static"],
    }


def modeled_ms_per_token(out: DecodeResult, gamma: int, costs: Mapping[str, Any]) -> float:
    """`timing.modeled_latency_ms` of one run (gamma 0: plain) at `timing.call_costs`.

    The rows of a batch run in lockstep, so the run lasts as many rounds as its busiest row
    makes (its target calls) and each round is one batched call of each model."""
    steps, draft_calls = int(out.target_calls.max()), int(out.draft_calls.max())
    policy = Lookahead("static", gamma) if gamma else None
    histogram = [0] * gamma + [steps]
    return modeled_latency_ms(policy, histogram, draft_calls, int(out.lengths.sum()), costs)


def random_prompts(vocab_size: int, batch: int, prompt_len: int):
    """[batch, prompt_len] random ids (the reference pair's prompts) and their lengths."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(1, vocab_size, (batch, prompt_len)).astype(np.int32)
    return prompts, np.full((batch,), prompt_len, np.int32)


def task_prompts(
    checkpoint: str, task: str, split: str, batch: int, prompt_len: int, vocabulary=None
):
    """The first `batch` prompts of a task's split, tokenised with the checkpoint's tokenizer
    (right-padded to prompt_len) and their lengths."""
    from distillspec import tasks
    from distillspec.runs.common import prompt_sets
    from distillspec.vocabularies import load_tokenizer

    tokenizer = load_tokenizer(vocabulary, checkpoint)
    name = tasks.register_task(task, tokenizer.vocabulary, bos_id=tokenizer.prompt_bos)
    lengths = {"inputs": prompt_len, "targets": 1}
    (first, *_) = prompt_sets([(name, split)], lengths, batch, batch, tokenizer.prompt_bos)[
        (name, split)
    ]
    return np.asarray(first["prompt_tokens"], np.int32), np.asarray(first["prompt_lengths"])


def checkpoint_pair(target_dir: str, draft_dir: str):
    """(target, params, draft, params, description) of two checkpoint directories."""
    from distillspec.models import load_checkpoint

    return (*load_checkpoint(target_dir), *load_checkpoint(draft_dir),
            f"target {target_dir}, draft {draft_dir}")  # fmt: skip


# The record's costs that a busy machine can time <= 0 (per-call differences of two timers).
TIMED = ("target_ms", "verify_ms", "draft_ms", "plain_modeled_over_measured",
         "speculative_modeled_over_measured")  # fmt: skip


def measure(pair, gamma: int, batch: int, max_new_tokens: int, prompts, repeats: int):
    """One configuration: interleaved plain / speculative runs and call timers -> a record,
    measured again (up to 3 times) while one of its `TIMED` costs comes out <= 0; a record
    left so names them in 'untimed'.

    prompts: (tokens [batch, P], lengths [batch]) (`random_prompts`, `task_prompts`)."""
    once = lambda: _measure_once(pair, gamma, batch, max_new_tokens, prompts, repeats)
    record, untimed = until_timed(once, lambda r: [k for k in TIMED if not r[k] > 0])
    return {**record, "untimed": untimed}


def _measure_once(pair, gamma: int, batch: int, max_new_tokens: int, prompts, repeats: int):
    target, target_params, draft, draft_params, description = pair
    prompts, lengths = prompts
    prompt_len = int(prompts.shape[1])
    plain = lambda: generate(target, target_params, prompts, lengths, max_new_tokens=max_new_tokens)
    spec = lambda: speculative_generate(
        target, draft, target_params, draft_params, prompts, lengths,
        gamma=gamma, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    timers, calls, timed_gamma = call_cost_timers(
        target, target_params, draft, draft_params, (prompts, lengths),
        [Lookahead("static", gamma)], max_new_tokens=max_new_tokens,  # Caches as the runs'.
    )  # fmt: skip
    plain(), spec()  # Compiles both.
    runs, seconds = interleaved({"plain": plain, "spec": spec, **timers}, repeats)
    plain_out, spec_out = runs["plain"][-1], runs["spec"][-1]
    measured = {"plain": (seconds["plain"], plain_out), "speculative": (seconds["spec"], spec_out)}

    def figures(indices: Sequence[int]) -> tuple[dict, dict]:  # Of the repeats at these indices.
        pick = lambda values: [values[i] for i in indices]
        timed = {name: pick(runs[name]) for name in timers}
        model_costs = call_costs(timed, calls, timed_gamma)
        costs = in_context_costs(timed, model_costs, gamma, timed_gamma)
        ideal = lambda c: spec_out.tau / (gamma * c + costs["r_gamma"])
        speedup = statistics.median(map(operator.truediv, pick(seconds["plain"]),
                                        pick(seconds["spec"])))  # fmt: skip
        latency = {name: 1e3 * statistics.median(pick(s)) / int(out.lengths.sum())
                   for name, (s, out) in measured.items()}  # fmt: skip
        modeled = {name: modeled_ms_per_token(out, gamma if name != "plain" else 0, model_costs)
                   for name, (_, out) in measured.items()}  # fmt: skip
        return costs, {
            "speedup": speedup,
            "speedup_ideal": ideal(costs["c"]),
            "efficiency": speedup / ideal(costs["c"]),
            "speedup_ideal_isolated": ideal(costs["c_isolated"]),
            "efficiency_isolated": speedup / ideal(costs["c_isolated"]),
            **{f"{name}_latency_ms": v for name, v in latency.items()},
            **{f"{name}_modeled_latency_ms": v for name, v in modeled.items()},
            **{f"{name}_modeled_over_measured": modeled[name] / latency[name] for name in latency},
        }

    costs, ratios = figures(range(repeats))
    intervals = [[None, None]] * len(INTERVALS)  # Unknown from one repeat.
    if repeats > 1:
        intervals = repeats_interval(lambda i: [figures(i)[1][k] for k in INTERVALS], repeats).T
    tokens = batch * max_new_tokens
    return {
        "gamma": gamma,
        "batch": batch,
        "dtype": str(jax.tree.leaves(target_params)[0].dtype),
        "temperature": 0.0,
        "alpha": round(spec_out.alpha, 4),
        "tau": round(spec_out.tau, 4),
        **{k: round(v, 4) for k, v in costs.items()},
        **{k: round(v, 4) for k, v in ratios.items()},
        **{
            f"{k}_interval": [None if v is None else round(float(v), 4) for v in interval]
            for k, interval in zip(INTERVALS, intervals)
        },  # fmt: skip
        "exact_greedy": bool(np.array_equal(spec_out.tokens, plain_out.tokens)),
        "plain_tokens_per_s": round(tokens / statistics.median(seconds["plain"]), 1),
        "speculative_tokens_per_s": round(tokens / statistics.median(seconds["spec"]), 1),
        "max_new_tokens": max_new_tokens,
        "prompt_length": prompt_len,
        "repeats": repeats,
        "target_mb": round(megabytes(target_params), 1),
        "draft_mb": round(megabytes(draft_params), 1),
        "pair": description,
        "backend": jax.default_backend(),
        "huge_pages": console.huge_pages_on(),
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here too (a JSON list)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs of runs (>= 5)")
    parser.add_argument("--draft_layers", type=int, default=1)
    parser.add_argument("--deep_residual_scale", type=float, default=0.1)
    parser.add_argument("--target", help="a target checkpoint instead of the reference pair")
    parser.add_argument("--draft", help="its draft checkpoint (with --target)")
    parser.add_argument("--task", default="stdlib_code", help="prompts for --target (task)")
    parser.add_argument("--split", default="test", help="prompts for --target (split)")
    parser.add_argument("--vocabulary", help="tokenizer (default: the --target checkpoint's)")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        help=f"decoding dtypes, of {tuple(DECODE_DTYPES)}",
    )
    parser.add_argument(
        "--cache_dtype",
        default="auto",
        help="KV cache dtype: 'auto' (float32 on the CPU, else the decoding dtype) or one of "
        f"{tuple(DECODE_DTYPES)}",
    )
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    cache_dtypes = {}
    for dtype in args.dtype:
        try:
            cache_dtypes[dtype] = decode_cache_dtype(dtype, args.cache_dtype)
        except ValueError as e:
            parser.error(f"--dtype / --cache_dtype: {e}")
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together (two checkpoint directories)")
    if args.target:
        pair = checkpoint_pair(args.target, args.draft)
        prompts = lambda batch: task_prompts(
            args.target, args.task, args.split, batch, args.prompt_length, args.vocabulary
        )
    else:
        pair = reference_pair(args.draft_layers, args.deep_residual_scale)
        prompts = lambda batch: random_prompts(pair[0].vocab_size, batch, args.prompt_length)
    records = []
    for dtype in args.dtype:
        decoding_pair = in_dtype(pair, dtype, cache_dtypes[dtype])
        for batch in args.batch:
            print(f"measuring {dtype} gamma={args.gamma} batch={batch} ...", file=sys.stderr)
            record = measure(
                decoding_pair, args.gamma, batch, args.max_new_tokens, prompts(batch), args.repeats
            )
            records.append({**record, "cache_dtype": cache_dtypes[dtype]})
            print(json.dumps(records[-1]), flush=True)
    return emit(records, args.json, echo=False)


if __name__ == "__main__":
    main()
