"""The online run function: a draft that follows the traffic it serves.

    python -m distillspec.online --gin_file=experiments/online_quickstart.gin [--json FILE]

Every speculative round's verify call computes the target's distribution at the positions it
emits tokens from; the decoder keeps their top-k (`decoding`, record_top_k) and the served-data
buffer holds them (`distillspec.served`). This run closes the loop on a stream of prompts, per
seed: the stream is served in chunks with the current draft, recording; after each chunk the
draft takes a few distillation steps on the buffer (DataMixture lambda0 = 1: the target's
recorded top-k, no teacher pass) and the new draft serves the next chunk. Per chunk it logs
alpha and tau of the served chunk, the batch-1 latency speed-up, the recording's cost (the same
prompts decoded with and without recording, interleaved) and the training time and teacher
passes. At the end the adapted draft (exported to OUTPUT_DIR/seed_<s>/adapted/export) and the
frozen one are evaluated on held-out prompts of the stream and on the draft's original test set
(forgetting), at every gamma and temperature, with paired 90% intervals over prompts.

Resumable per chunk: a rerun skips the chunks in seed_<s>/chunks.jsonl, reuses a chunk already
appended to the buffer and resumes training from the checkpoints.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distillspec import datagen, metrics, served, trainer
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation.drafts import (
    batch1_latencies,
    bootstrap_difference,
    decodable,
    latency_batches,
    plain_call,
    spec_call,
)
from distillspec.feature_converters import valid_rows
from distillspec.records import append_records, read_jsonl, write_json_atomic, write_jsonl_atomic
from distillspec.runs import online_report
from distillspec.runs.common import export, open_run, prompt_sets

CHUNKS_FILE, COMPARED_FILE, RESULT_FILE = "chunks.jsonl", "compared.jsonl", "online.json"
DESCRIBED = (  # The arguments online.json's context repeats.
    "stream", "held_out", "original", "seeds", "warm", "warm_prompts", "buffer_max_examples",
    "chunk_prompts", "steps_per_chunk", "serve_gamma", "serve_temperature", "record_top_k",
    "tail_from_frozen", "target_checkpoint", "draft_checkpoint",
)  # fmt: skip


def _check(chunk_prompts, stream_prompts, steps_per_chunk, record_top_k, seeds, gammas,
           temperatures, checkpoints):  # fmt: skip
    for name, value, least in (
        ("chunk_prompts", chunk_prompts, 1), ("stream_prompts", stream_prompts, 1),
        ("steps_per_chunk", steps_per_chunk, 1), ("record_top_k", record_top_k, 1),
    ):  # fmt: skip
        if not (isinstance(value, int) and value >= least):
            raise ValueError(f"online.{name} must be an integer >= {least}, got {value!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"online.seeds must be distinct seeds, at least one, got {seeds!r}")
    if not gammas or not temperatures:
        raise ValueError("online.gammas and online.temperatures must each hold a value")
    for name, path in checkpoints.items():
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"online.{name}_checkpoint = {path!r} does not exist (the embedded default's "
                "models come from the first command, python -m distillspec.quickstart)"
            )


def _stream_rows(batches, count: int, seed: int) -> dict[str, np.ndarray]:
    """The stream's first `count` valid prompts in the order seed `seed` serves them."""
    rows = {k: [] for k in ("prompt_tokens", "prompt_lengths")}
    for batch in batches:
        keep = valid_rows(batch) > 0
        for key in rows:
            rows[key].append(np.asarray(batch[key])[keep])
    rows = {k: np.concatenate(v)[:count] for k, v in rows.items()}
    order = np.random.default_rng([seed, 0x5E]).permutation(len(rows["prompt_lengths"]))
    return {k: v[order] for k, v in rows.items()}


def _serve_chunk(target, draft, target_params, params, chunk, rng, context) -> tuple:
    """Serves one chunk in batches of context['serve_batch'] with recording on; returns (the
    buffer chunk, per-row counters summed: accepted, drafted, lengths, target_calls)."""
    parts, sums = [], dict(accepted=0, drafted=0, lengths=0, target_calls=0)
    size, n = context["serve_batch"], len(chunk["prompt_lengths"])
    for i, start in enumerate(range(0, n, size)):
        prompts = chunk["prompt_tokens"][start : start + size]
        lengths = chunk["prompt_lengths"][start : start + size]
        out = spec_call(
            target, draft, target_params, params, rng, context["serve_sampling"],
            dict(context["decode"], gamma=context["serve_gamma"], record_top_k=context["top_k"]),
            i, {"prompt_tokens": prompts, "prompt_lengths": lengths},
        )  # fmt: skip
        parts.append(served.records(prompts, lengths, out, context["vocab_size"]))
        for key in sums:
            sums[key] += int(np.sum(getattr(out, key)))
    joined = {k: np.concatenate([p[k] for p in parts]) for k in served.FIELDS}  # Fixed shapes.
    return dict(joined, vocab_size=context["vocab_size"]), sums


def _latency(target, draft, target_params, params, singles, rng, context) -> dict[str, float]:
    """Batch-1 latency of the chunk's first prompts: plain, speculative, and speculative with
    recording, interleaved prompt by prompt."""
    common = dict(context["decode"], gamma=context["serve_gamma"])
    sampling = context["serve_sampling"]
    spec = lambda **kw: functools.partial(
        spec_call, target, draft, target_params, params, rng, sampling, dict(common, **kw)
    )
    fields, _, _ = batch1_latencies(
        functools.partial(plain_call, target, target_params, rng, sampling, context["decode"]),
        {"off": spec(), "on": spec(record_top_k=context["top_k"])},
        singles, context["timing_repeats"],
    )  # fmt: skip
    return {
        "latency_speedup": fields["off"]["latency_speedup"],
        "latency_ms": fields["off"]["latency_ms"],
        "recording_latency_ms": fields["on"]["latency_ms"],
        "recording_cost_pct": 100 * (fields["on"]["latency_ms"] / fields["off"]["latency_ms"] - 1),
    }


def _train_chunk(directory, models, params, buffer, chunk_index, context) -> tuple:
    """steps_per_chunk distillation steps on the buffer (the run's schedule spans every
    chunk's steps: `LoopConfig.stop_at`); returns (params, seconds, teacher passes)."""
    data = served.read(buffer, models.student.encoder_decoder, context["vocab_size"])
    steps = context["steps_per_chunk"]
    loop = trainer.LoopConfig(
        train_steps=steps * context["num_chunks"], stop_at=steps * (chunk_index + 1),
        batch_size=context["batch_size"], seed=context["seed"], checkpoint_period=steps,
    )  # fmt: skip
    started = time.perf_counter()
    params = trainer.fit(  # A copy: fit donates its parameters (the frozen draft's included).
        directory, models, jax.tree.map(jnp.copy, params), data.store, loop, context["loss"],
        context["optimizer"],
        mixture=datagen.DataMixture(served_data_fraction=1.0), served=data, console=False,
        tail_params=context["tail_params"],
        description=f"adapting the draft on {len(data)} served examples",
    )  # fmt: skip
    seconds = time.perf_counter() - started
    logged = [r for r in metrics.read_metrics(directory) if "loss" in r]
    window = range(steps * chunk_index + 1, steps * (chunk_index + 1) + 1)
    passes = int(sum(r.get("teacher_forward_passes", 0) for r in logged if r["step"] in window))
    return params, seconds, passes


def _chunk_file(buffer: str, number: int) -> str:
    return os.path.join(buffer, f"{served.PREFIX}{number:012d}{served.SUFFIX}")


def _warm(seed_dir, target, draft, target_params, draft_params, rows, context) -> int:
    """Fills the buffer with the traffic served before the drift: the frozen draft serving the
    `warm` prompts, recorded, no training. Returns the chunk files it took (resumable)."""
    buffer, size = os.path.join(seed_dir, "buffer"), context["chunk_prompts"]
    count = -(-len(rows["prompt_lengths"]) // size)
    if os.path.isfile(os.path.join(seed_dir, "warm.done")):
        return count
    for i in range(count):
        if not os.path.isfile(_chunk_file(buffer, i)):
            part = {k: v[i * size : (i + 1) * size] for k, v in rows.items()}
            rng = jax.random.fold_in(jax.random.PRNGKey(context["seed"]), 10_000 + i)
            records, _ = _serve_chunk(target, draft, target_params, draft_params, part, rng,
                                      context)  # fmt: skip
            served.append(buffer, records, context["buffer_max_examples"])
    open(os.path.join(seed_dir, "warm.done"), "w").close()
    print(f"[online] seed {context['seed']}: the buffer holds {served.count(buffer)} "
          "examples of the traffic before the drift", file=sys.stderr)  # fmt: skip
    return count


def _adapt(seed_dir, target, target_params, draft, draft_params, rows, context, offset=0):
    """The loop over one seed's chunks (their buffer files numbered from `offset`); returns
    (adapted params, chunk records)."""
    buffer, adapted = os.path.join(seed_dir, "buffer"), os.path.join(seed_dir, "adapted")
    log = os.path.join(seed_dir, CHUNKS_FILE)
    done = read_jsonl(log) if os.path.isfile(log) else []
    models = trainer.Models(draft, target, target_params)
    params, size = draft_params, context["chunk_prompts"]
    if done:  # Resume: the draft after the last finished chunk (its checkpoint, no step run).
        params, _, _ = _train_chunk(adapted, models, params, buffer, len(done) - 1, context)
    for c in range(len(done), context["num_chunks"]):
        chunk = {k: v[c * size : (c + 1) * size] for k, v in rows.items()}
        rng = jax.random.fold_in(jax.random.PRNGKey(context["seed"]), c)
        started = time.perf_counter()
        part, sums = _serve_chunk(target, draft, target_params, params, chunk, rng, context)
        serve_seconds = time.perf_counter() - started
        if not os.path.isfile(_chunk_file(buffer, offset + c)):  # Not appended before a stop.
            served.append(buffer, part, context["buffer_max_examples"])
        singles = latency_batches([dict(chunk, valid=np.ones_like(chunk["prompt_lengths"]))],
                                  context["latency_prompts"])  # fmt: skip
        timing = _latency(target, draft, target_params, params, singles, rng, context)
        params, train_seconds, passes = _train_chunk(adapted, models, params, buffer, c, context)
        record = {
            "seed": context["seed"], "chunk": c,
            "prompts_served": min((c + 1) * size, len(rows["prompt_lengths"])),
            "alpha": sums["accepted"] / max(sums["drafted"], 1),
            "tau": sums["lengths"] / max(sums["target_calls"], 1),
            **timing, "serve_seconds": serve_seconds, "train_seconds": train_seconds,
            "teacher_forward_passes": passes, "buffer_examples": served.count(buffer),
        }  # fmt: skip
        append_records(log, [record])
        done.append(record)
        print(online_report.chunk_line(record, context["num_chunks"]), file=sys.stderr, flush=True)
    return params, done


def _counters(target, draft, target_params, params, batches, rng, sampling, decode) -> dict:
    """Per-prompt accepted, drafted, lengths and target_calls over the valid rows."""
    out = {k: [] for k in ("accepted", "drafted", "lengths", "target_calls")}
    for i, batch in enumerate(batches):
        result = spec_call(
            target, draft, target_params, params, rng, sampling, decode, i, decodable(batch)
        )
        keep = valid_rows(batch) > 0
        for key in out:
            out[key].append(np.asarray(getattr(result, key), np.float64)[keep])
    return {k: np.concatenate(v) for k, v in out.items()}


def _compare(target, draft, target_params, frozen, adapted, sets, context) -> list[dict]:
    """Frozen against adapted on each eval set, gamma and temperature: alpha and tau of both,
    the paired 90% interval of the alpha difference and tau's gain, over prompts."""
    rows = []
    for (name, batches), gamma, temperature in (
        (s, g, t) for s in sets.items() for g in context["gammas"] for t in context["temperatures"]
    ):
        run = functools.partial(
            _counters, target, draft, target_params, batches=batches,
            rng=jax.random.PRNGKey(context["seed"]), sampling=SamplingConfig(temperature),
            decode=dict(context["decode"], gamma=gamma),
        )  # fmt: skip
        a, f = run(params=adapted), run(params=frozen)
        ratio = lambda c, n, d: c[n].sum() / max(c[d].sum(), 1.0)
        low, high = bootstrap_difference(
            (a["accepted"], a["drafted"]), (f["accepted"], f["drafted"]), confidence=0.9
        )
        rows.append({
            "seed": context["seed"], "set": name, "gamma": gamma, "temperature": temperature,
            "prompts": len(a["lengths"]),
            "alpha_frozen": ratio(f, "accepted", "drafted"),
            "alpha_adapted": ratio(a, "accepted", "drafted"),
            "alpha_gain_interval": [low, high],
            "tau_frozen": ratio(f, "lengths", "target_calls"),
            "tau_adapted": ratio(a, "lengths", "target_calls"),
        })  # fmt: skip
        rows[-1]["alpha_gain"] = rows[-1]["alpha_adapted"] - rows[-1]["alpha_frozen"]
        rows[-1]["tau_gain_pct"] = 100 * (rows[-1]["tau_adapted"] / rows[-1]["tau_frozen"] - 1)
    return rows


def _prompt_sets(
    names, original: bool, warm: bool, lengths, bos, stream, eval_prompts, warm_prompts
):
    """(the stream's batches, {'held_out'[, 'original']: batches}, {warm set: batches} or {})
    from the registered sets `names` (stream, held out[, original][, warm])."""
    (count, batch) = stream
    (stream_batches,) = prompt_sets(names[:1], lengths, count, batch, bos).values()
    one = lambda name: next(iter(prompt_sets([name], lengths, eval_prompts, 32, bos).values()))
    evals = {k: one(name) for k, name in zip(["held_out", "original"], names[1 : 2 + original])}
    warm_batches = prompt_sets(names[-1:], lengths, warm_prompts, batch, bos) if warm else {}
    return stream_batches, evals, warm_batches


def _seed(seed_dir, target, target_params, draft, draft_params, rows, evals, tokenizer, context):
    """One seed: the warm buffer, the chunks, the adapted draft's export, the comparison
    (read back on a rerun). Returns (chunk records, comparison rows)."""
    offset = 0
    if "warm" in rows:
        offset = _warm(seed_dir, target, draft, target_params, draft_params, rows["warm"], context)
    adapted, log = _adapt(seed_dir, target, target_params, draft, draft_params, rows["stream"],
                          context, offset)  # fmt: skip
    export(draft, adapted, tokenizer, os.path.join(seed_dir, "adapted", "export"))
    compared = os.path.join(seed_dir, COMPARED_FILE)
    if not os.path.isfile(compared):
        rows = _compare(target, draft, target_params, draft_params, adapted, evals, context)
        write_jsonl_atomic(compared, rows)
    return log, read_jsonl(compared)


def online(
    output_dir: str,
    target_checkpoint: str,
    draft_checkpoint: str,
    stream: tuple[str, str] = ("pydoc_prose", "train"),
    held_out: tuple[str, str] = ("pydoc_prose", "test"),
    original: tuple[str, str] | None = ("stdlib_code", "test"),
    warm: tuple[str, str] | None = None,
    warm_prompts: int = 1000,
    tail_from_frozen: bool = True,
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},  # noqa: B006
    stream_prompts: int = 1000,
    chunk_prompts: int = 100,
    serve_batch: int = 50,
    serve_gamma: int = 3,
    serve_temperature: float = 1.0,
    record_top_k: int = 32,
    buffer_max_examples: int = 2000,
    steps_per_chunk: int = 25,
    batch_size: int = 16,
    loss: trainer.LossConfig = trainer.LossConfig(divergence="fkl"),
    optimizer: trainer.OptimizerConfig = trainer.OptimizerConfig(
        name="adamw", learning_rate=1e-3, final_fraction=1.0
    ),
    latency_prompts: int = 16,
    timing_repeats: int = 3,
    eval_prompts: int = 128,
    gammas: Sequence[int] = (3, 5),
    temperatures: Sequence[float] = (0.0, 1.0),
    seeds: Sequence[int] = (0, 1),
    json_path: str | None = None,
    vocabulary: str | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Serves `stream` (task, split) with the draft, recording, and distils the draft on what it
    recorded after every chunk of chunk_prompts prompts, once per seed; then compares the
    adapted draft with the frozen one on `held_out` and on `original` (None: no forgetting
    check). Writes OUTPUT_DIR/online.json (and json_path) and online.md; returns the summary
    (see `online_report.summary`).

    warm: the traffic before the drift ((task, split) or None): its first warm_prompts prompts
    are served by the frozen draft into the buffer before the stream (recorded, not trained
    on), so that the buffer, like a serving system's, still holds the older traffic.
    tail_from_frozen: the tail past the recorded top-k keeps the frozen draft's proportions
    (`trainer.train_step`'s tail_params): what the recording does not say stays as it was.

    The target and draft are Hugging Face or T5X checkpoint directories. serve_*: how the
    stream is served (batch, gamma, temperature); record_top_k: the target's top-k kept per
    token; buffer_max_examples: the buffer's cap; steps_per_chunk, batch_size, loss, optimizer:
    the distillation after each chunk (its schedule spans all chunks' steps); latency_prompts,
    timing_repeats: the per-chunk batch-1 timing; eval_prompts, gammas, temperatures: the final
    comparison.
    """
    arguments = dict(locals())
    _check(chunk_prompts, stream_prompts, steps_per_chunk, record_top_k, seeds, gammas,
           temperatures, {"target": target_checkpoint, "draft": draft_checkpoint})  # fmt: skip
    sets_asked = [stream, held_out] + ([original] if original else []) + ([warm] if warm else [])
    tokenizer, target, target_params, models, names = open_run(
        "online", output_dir, target_checkpoint, {"draft": draft_checkpoint}, vocabulary,
        sets_asked, vocab_size, None,
    )  # fmt: skip
    (draft, draft_params), lengths = models["draft"], task_feature_lengths
    stream_batches, evals, warm_batches = _prompt_sets(
        names, bool(original), bool(warm), lengths, tokenizer.prompt_bos,
        (stream_prompts, serve_batch), eval_prompts, warm_prompts,
    )  # fmt: skip
    num_rows = int(sum(valid_rows(b).sum() for b in stream_batches))
    context = dict(
        serve_batch=serve_batch, serve_gamma=serve_gamma, top_k=record_top_k,
        serve_sampling=SamplingConfig(serve_temperature), chunk_prompts=chunk_prompts,
        num_chunks=-(-num_rows // chunk_prompts), steps_per_chunk=steps_per_chunk,
        batch_size=batch_size, loss=loss, optimizer=optimizer, latency_prompts=latency_prompts,
        timing_repeats=timing_repeats, buffer_max_examples=buffer_max_examples,
        gammas=tuple(gammas), temperatures=tuple(temperatures),
        vocab_size=vocab_size or target.vocab_size,
        tail_params=draft_params if tail_from_frozen else None,
        decode=dict(max_new_tokens=lengths["targets"], eos_id=tokenizer.eos_id,
                    vocab_size=vocab_size),
    )  # fmt: skip
    print(f"[online] serving {num_rows} prompts of {stream[0]} ({stream[1]}) in "
          f"{context['num_chunks']} chunks, {steps_per_chunk} steps after each, seeds "
          f"{list(seeds)}; then {list(evals)}: frozen vs adapted", file=sys.stderr)  # fmt: skip
    chunks, comparisons = [], []
    for seed in seeds:
        context["seed"] = seed
        seed_dir = os.path.join(output_dir, f"seed_{seed}")
        rows = {"stream": _stream_rows(stream_batches, stream_prompts, seed)}
        for batches in warm_batches.values():
            rows["warm"] = _stream_rows(batches, warm_prompts, seed)
        log, compared = _seed(seed_dir, target, target_params, draft, draft_params, rows, evals,
                              tokenizer, context)  # fmt: skip
        chunks, comparisons = chunks + log, comparisons + compared
    described = {k: v for k, v in arguments.items() if k in DESCRIBED}
    result = online_report.summary(chunks, comparisons, {**described, "stream_prompts": num_rows})
    for path in filter(None, (os.path.join(output_dir, RESULT_FILE), json_path)):
        write_json_atomic(path, result)
    online_report.write(output_dir, result)
    print(online_report.terminal_summary(result))
    return result
