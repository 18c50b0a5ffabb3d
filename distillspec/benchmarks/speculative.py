"""Speculative versus plain decoding on a reference pair, judged against the ideal speed-up.

    python -m distillspec.benchmarks.speculative --json OUT.json

Measures in one process, with compilation excluded and plain/speculative runs interleaved:
  alpha, tau          acceptance rate and tokens per target call of the speculative runs;
  c                   draft step time / target step time (one token, cache in use);
  r_gamma             target time to score gamma + 1 positions / to score 1;
  speedup             speculative tokens/s / plain target tokens/s (end to end, prompt included);
  speedup_ideal       tau / (gamma * c + r_gamma), what a zero-overhead loop would reach;
  efficiency          speedup / speedup_ideal;
  exact_greedy        whether every speculative greedy output equals the plain greedy output.
Ratios are medians over the interleaved repeats; absolute times are context only. `--dtype`
decodes in 'float32' or 'bfloat16' (parameters and activations; logits stay float32), or in
both, one record each; each record names its dtype.

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
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from distillspec.benchmarks import emit
from distillspec.decoding import generate, speculative_generate
from distillspec.evaluation.timing import interleaved, megabytes, step_timer
from distillspec.models import DecoderOnlyLM, TransformerConfig
from distillspec.models.base import DECODE_DTYPES, check_decode_dtype, for_decoding

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


def in_dtype(pair, dtype: str):
    """The pair decoding in dtype (`models.base.for_decoding`), its description unchanged."""
    target, target_params, draft, draft_params, description = pair
    return (*for_decoding(target, target_params, dtype), *for_decoding(draft, draft_params, dtype),
            description)  # fmt: skip


def measure(pair, gamma: int, batch: int, max_new_tokens: int, prompt_len: int, repeats: int):
    """One configuration: interleaved plain / speculative runs and step timers -> a record."""
    target, target_params, draft, draft_params, description = pair
    rng = np.random.default_rng(batch)
    prompts = rng.integers(1, target.vocab_size, (batch, prompt_len)).astype(np.int32)
    lengths = np.full((batch,), prompt_len, np.int32)
    plain = lambda: generate(target, target_params, prompts, lengths, max_new_tokens=max_new_tokens)
    spec = lambda: speculative_generate(
        target, draft, target_params, draft_params, prompts, lengths,
        gamma=gamma, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    calls = max(8, max_new_tokens // (gamma + 1))
    timers = {
        "draft": step_timer(draft, draft_params, prompts, lengths, 1, calls),
        "target": step_timer(target, target_params, prompts, lengths, 1, calls),
        "verify": step_timer(target, target_params, prompts, lengths, gamma + 1, calls),
    }
    plain(), spec()  # Compiles both.
    runs, seconds = interleaved({"plain": plain, "spec": spec, **timers}, repeats)
    plain_out, spec_out = runs["plain"][-1], runs["spec"][-1]
    plain_s, spec_s = seconds["plain"], seconds["spec"]
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(a, b))
    speedup = ratio(plain_s, spec_s)
    c, r_gamma = ratio(runs["draft"], runs["target"]), ratio(runs["verify"], runs["target"])
    ideal = spec_out.tau / (gamma * c + r_gamma)
    tokens = batch * max_new_tokens
    return {
        "gamma": gamma,
        "batch": batch,
        "dtype": str(jax.tree.leaves(target_params)[0].dtype),
        "temperature": 0.0,
        "alpha": round(spec_out.alpha, 4),
        "tau": round(spec_out.tau, 4),
        "c": round(c, 4),
        "r_gamma": round(r_gamma, 4),
        "speedup": round(speedup, 4),
        "speedup_ideal": round(ideal, 4),
        "efficiency": round(speedup / ideal, 4),
        "exact_greedy": bool(np.array_equal(spec_out.tokens, plain_out.tokens)),
        "plain_tokens_per_s": round(tokens / statistics.median(plain_s), 1),
        "speculative_tokens_per_s": round(tokens / statistics.median(spec_s), 1),
        "max_new_tokens": max_new_tokens,
        "prompt_length": prompt_len,
        "repeats": repeats,
        "target_mb": round(megabytes(target_params), 1),
        "draft_mb": round(megabytes(draft_params), 1),
        "pair": description,
        "backend": jax.default_backend(),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here too (a JSON list)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs of runs (>= 5)")
    parser.add_argument("--draft_layers", type=int, default=1)
    parser.add_argument("--deep_residual_scale", type=float, default=0.1)
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        help=f"decoding dtypes, of {tuple(DECODE_DTYPES)}",
    )
    args = parser.parse_args(argv)
    for dtype in args.dtype:
        try:
            check_decode_dtype(dtype)
        except ValueError as e:
            parser.error(f"--dtype: {e}")
    pair = reference_pair(args.draft_layers, args.deep_residual_scale)
    records = []
    for dtype in args.dtype:
        decoding_pair = in_dtype(pair, dtype)
        for batch in args.batch:
            print(f"measuring {dtype} gamma={args.gamma} batch={batch} ...", file=sys.stderr)
            records.append(
                measure(
                    decoding_pair,
                    args.gamma,
                    batch,
                    args.max_new_tokens,
                    args.prompt_length,
                    args.repeats,
                )  # fmt: skip
            )
            print(json.dumps(records[-1]), flush=True)
    return emit(records, args.json, echo=False)


if __name__ == "__main__":
    main()
