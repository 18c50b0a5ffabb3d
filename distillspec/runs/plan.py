"""The plan run function: which draft to train for a target, before the long distillation.

    python -m distillspec.plan --gin_file=runs/plan.gin --gin.TEACHER_CHECKPOINT=\\"DIR\\" \\
        --gin.MIXTURE_OR_TASK_NAME=\\"DATA\\" --gin.OUTPUT_DIR=\\"OUT\\" [--gin.PILOT_STEPS=0]
        [--profile FILE | --measure_profile FILE] [--validate [--json FILE]]

For each candidate draft (`planning.default_candidates`: fresh shapes, the target's own first
layers, checkpoints given) it measures the costs at batch 1 with random weights (or reads them
from a profile measured on the serving machine), lists the acceptance rate each needs to break
even, runs a short pilot distillation of each (the recipe's own `train`, its steps cut to
pilot_steps) and estimates its acceptance on held-out prompts, predicts its batch-1 speed-up
per gamma and ranks the candidates. OUTPUT_DIR receives plan.json, plan.md, plan.png and
draft.gin (the chosen draft, for `python -m distillspec.train --gin_file=runs/distill.gin`).
validate: pilots and trains every candidate with the recipe's full steps (one marked never
wins too, which checks the mark), evaluates each with the speculative decoder at every gamma
and writes validation.json (predicted against measured speed-up, Spearman) and validation.md.
Pilots and full runs resume from their MODEL_DIRs under OUTPUT_DIR.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from distillspec import checkpoints, metrics, tasks
from distillspec.decoding.sampling import SamplingConfig
from distillspec.evaluation import planning
from distillspec.evaluation.drafts import mean_tvd, plain_call
from distillspec.evaluation.timing import until_timed
from distillspec.models import load_checkpoint
from distillspec.models.base import for_decoding
from distillspec.models.drafts import DraftSpec
from distillspec.records import write_json_atomic
from distillspec.runs import plan_report, quickstart
from distillspec.runs.common import check_models_serve, prompt_sets
from distillspec.runs.train import with_defaults
from distillspec.vocabularies import load_tokenizer

RECIPE = "distill"  # The gin scope whose `train` bindings are the recipe (unscoped ones apply).
PROXY_SHARE = 0.25  # The trainer's acceptance proxy averaged over the pilot's last quarter.


def _check(pilot_steps, estimate, profile, measure_profile, gammas, temperatures, validate):
    if not (isinstance(pilot_steps, int) and pilot_steps >= 0):
        raise ValueError(f"plan.pilot_steps must be an integer >= 0 (0: no pilot), got "
                         f"{pilot_steps!r}")  # fmt: skip
    valid = [*planning.ESTIMATES, *(e + "+curve" for e in planning.ESTIMATES)]
    if estimate not in valid:
        raise ValueError(f"plan.estimate must be one of {valid}, got {estimate!r}")
    if profile and measure_profile:
        raise ValueError("give at most one of --profile (price with it) and --measure_profile "
                         "(write one here)")  # fmt: skip
    if not gammas or any(not (isinstance(g, int) and 1 <= g <= 32) for g in gammas):
        raise ValueError(f"plan.gammas must be integers in [1, 32], got {gammas!r}")
    for temperature in temperatures:
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ValueError(f"plan.temperature(s) must be >= 0, got {temperature!r}")
        if estimate.startswith("proxy") and temperature != 1:
            raise ValueError("plan.estimate = 'proxy' is the trainer's acceptance at T = 1; at "
                             f"temperature {temperature} use 'held_out'")  # fmt: skip
    if len(temperatures) > 1 and (validate or measure_profile):
        raise ValueError(f"--validate and --measure_profile take one temperature, got "
                         f"{list(temperatures)}: run them once per temperature")  # fmt: skip
    if validate and not pilot_steps:
        raise ValueError("--validate checks the pilot's predictions: set plan.pilot_steps > 0")


def plan(
    output_dir: str,
    teacher_checkpoint: str | None = None,
    candidates: Sequence[DraftSpec] | None = None,
    checkpoints_given: Sequence[str] = (),
    gammas: Sequence[int] = tuple(range(1, 9)),
    temperature: float | None = None,
    temperatures: Sequence[float] | None = None,
    pilot_steps: int = 50,
    estimate: str = "held_out+curve",
    eval_split: str = "validation",
    num_prompts: int = 32,
    timing_repeats: int = 5,
    profile: str | None = None,
    measure_profile: str | None = None,
    validate: bool = False,
    json_path: str | None = None,
    validate_prompts: int = 64,
    latency_prompts: int = 16,
    seed: int = 0,
    cache_models: bool = True,
    model_cache_dir: str | None = None,
    *,
    stage: quickstart.StageFn,
    bindings: quickstart.BindingsFn,
) -> dict[str, Any]:
    """Plans (and with `validate` checks) which draft to train; returns plan.json's content
    (the first temperature's).

    Args:
      output_dir: OUTPUT_DIR (plan.*, draft.gin, drafts/, pilot/<candidate>,
        validate/<candidate>; a second temperature's plan in temperature-<T>/).
      teacher_checkpoint: the target (Hugging Face or T5X directory); None: the embedded
        default's target (the quickstart's target/ stage, through the model cache).
      candidates: DraftSpecs to price (named by their sizes) instead of the default grid.
      checkpoints_given: draft checkpoint directories priced beside them (warm starts).
      gammas: lookaheads priced.
      temperature / temperatures: the serving temperature, or several planned in one run
        (costs and pilots shared; the first one's plan in output_dir); None: the target's own
        (`target_temperature`: greedy, T = 0, unless its generation_config.json samples).
      pilot_steps: steps of each pilot distillation (0: no pilot, candidates ranked by the
        acceptance rate they need to break even).
      estimate: the pilot draft's acceptance: 'held_out' (1 - mean TVD to the target on
        num_prompts prompts of eval_split) or 'proxy' (the trainer's, at T = 1); with
        '+curve', extended to the full run along the pilot's learning curve
        (`planning.pilot_alphas`). Every estimate's prediction is kept in plan.json; the
        default ranked the embedded default's full runs right in both checks.
      timing_repeats: interleaved timings per cost (medians).
      profile / measure_profile: price with a profile from the serving machine / only measure
        one here and write it (`planning.measure_plan_profiles`).
      validate, json_path, validate_prompts, latency_prompts: the check (module docstring).
      seed: the candidates' random weights and the pilots' data order.
      stage, bindings: the gin layer's run functions and their arguments (the recipe: the
        distill/ scope's `train`; the check's `evaluate` under evaluate/).
    """
    explicit = _explicit_temperatures(temperature, temperatures)
    _check(pilot_steps, estimate, profile, measure_profile, gammas, explicit, validate)
    gammas = sorted(set(gammas))
    checkpoints.check_writable(output_dir)
    recipe = with_defaults(bindings(RECIPE, "train"))
    if teacher_checkpoint is None:  # The embedded default's target.
        teacher_checkpoint = quickstart.pretrained(
            output_dir, stage, bindings, cache_models, model_cache_dir, names=("target",)
        )[0]
    temps, source = (explicit, None) if explicit else target_temperature(teacher_checkpoint)
    _check(pilot_steps, estimate, profile, measure_profile, gammas, temps, validate)
    target, target_params, chosen, drafts, task, bos = _open(
        teacher_checkpoint, candidates, checkpoints_given, recipe, seed
    )
    lengths = recipe["task_feature_lengths"]
    batches = prompt_sets([(task, eval_split)], lengths, num_prompts, min(num_prompts, 16),
                          bos)[(task, eval_split)]  # fmt: skip
    decoding = lambda pair: for_decoding(*pair, "float32")
    target, target_params = decoding((target, target_params))
    profiles = _costs(profile, target, target_params, {n: decoding(p) for n, p in drafts.items()},
                      batches[0], gammas, lengths["targets"], timing_repeats, temps)  # fmt: skip
    if measure_profile:
        return _write_profile(measure_profile, profiles[temps[0]], len(drafts))
    rows = {t: {c.name: _priced(c, profiles[t], gammas) for c in chosen} for t in temps}
    if pilot_steps:
        _pilot_all(
            chosen, rows, profiles, output_dir, pilot_steps, teacher_checkpoint, recipe, stage,
            (target, target_params), batches, estimate, gammas, validate, seed,
        )  # fmt: skip
    results = {}
    for t in temps:
        context = dict(teacher_checkpoint=teacher_checkpoint, gammas=gammas, temperature=t,
                       temperature_source=source, temperatures=temps, pilot_steps=pilot_steps,
                       estimate=estimate, profile=profile)  # fmt: skip
        results[t] = plan_report.finish(
            temperature_dir(output_dir, t, temps), chosen, rows[t], profiles[t],
            _context(recipe, **context),
        )  # fmt: skip
    result = results[temps[0]]
    if validate:
        check = _validate(output_dir, chosen, result, teacher_checkpoint, recipe, stage,
                          temps[0], validate_prompts, latency_prompts)  # fmt: skip
        plan_report.write_validation(output_dir, check, json_path)
        result["validation"] = check
    return result


def _pilot_all(chosen, rows, profiles, output_dir, steps, teacher_checkpoint, recipe, stage,
               target, batches, estimate, gammas, validate, seed) -> None:  # fmt: skip
    """Pilots each candidate that can win at some temperature (every one under validate: its
    prediction for a candidate marked never wins is checked too); one pilot serves every
    temperature, each with its own held-out acceptance and prediction in rows[temperature]."""
    lengths = recipe["task_feature_lengths"]
    references = {t: _continuations(*target, batches, t, lengths, seed) for t in rows}
    for candidate in chosen:
        if not validate and all(rows[t][candidate.name]["never_wins"] for t in rows):
            continue
        common, held_out = _pilot(
            candidate, os.path.join(output_dir, "pilot", candidate.name), steps,
            teacher_checkpoint, recipe, stage, target, references, recipe.get("vocab_size"),
        )  # fmt: skip
        for t, by_name in rows.items():
            row = by_name[candidate.name]
            row["pilot"] = dict(common, held_out=held_out[t])
            _predict(candidate.name, row, profiles[t], estimate, gammas, lengths["targets"])


def _explicit_temperatures(temperature, temperatures) -> list:
    """The temperatures the configuration names ([]: the target's own)."""
    if temperature is not None and temperatures is not None:
        raise ValueError(f"give plan.temperature ({temperature!r}) or plan.temperatures "
                         f"({temperatures!r}, --temperatures), not both")  # fmt: skip
    if temperatures is not None and (isinstance(temperatures, (str, int, float))
                                     or not temperatures):  # fmt: skip
        raise ValueError(f"plan.temperatures must be a non-empty list, got {temperatures!r}")
    found = list(temperatures) if temperatures is not None else []
    found += [temperature] if temperature is not None else []
    if len(set(found)) != len(found):
        raise ValueError(f"plan.temperatures lists a temperature twice: {found}")
    return found


def target_temperature(checkpoint: str) -> tuple[list[float], str]:
    """([the temperature the target serves at], why): its generation_config.json's, read as
    `transformers` reads it (no file, or no do_sample: greedy, T = 0; do_sample true: its
    temperature, 1 if unset)."""
    path = os.path.join(checkpoint, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        config = None
    if config and config.get("do_sample"):
        value = float(config.get("temperature", 1.0))
        return [
            value
        ], f"the target's generation_config.json: do_sample true, temperature {value:g}"
    if config is None:
        return [0.0], "greedy: the target has no generation_config.json"
    said = "do_sample false" if "do_sample" in config else "no do_sample"
    return [0.0], f"greedy: the target's generation_config.json has {said}"


def temperature_dir(output_dir: str, temperature: float, temperatures: Sequence[float]) -> str:
    """Where the plan at `temperature` goes: output_dir for the first, else a subdirectory."""
    if temperature == temperatures[0]:
        return output_dir
    return os.path.join(output_dir, f"temperature-{temperature:g}")


def _write_profile(path: str, costs: dict[str, Any], count: int) -> dict[str, Any]:
    untimed = planning.untimed(costs)
    if untimed:
        raise RuntimeError(
            f"these costs came out <= 0 (the machine was busy while timing): {untimed}; "
            "measure again on a quiet machine or with more --gin.plan.timing_repeats"
        )
    write_json_atomic(path, costs)
    print(f"[plan] cost profile of {count} candidates written to {path}", file=sys.stderr)
    return costs


def _open(teacher_checkpoint, candidates, checkpoints_given, recipe, seed):
    """(target, params, candidates, {name: (model, params)} with random weights, the data's
    registered task, the prompts' BOS), checked to serve each other."""
    tokenizer = load_tokenizer(recipe.get("vocabulary"), teacher_checkpoint)
    target, target_params = load_checkpoint(teacher_checkpoint)
    chosen = [planning.Candidate(_spec_name(s), spec=s) for s in candidates or ()]
    chosen = (chosen or planning.default_candidates(target, ())) + [
        c for c in planning.default_candidates(target, checkpoints_given) if c.checkpoint
    ]
    names = [c.name for c in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"plan.candidates: two candidates share a name in {names}; give each "
                         "DraftSpec a different num_layers / embed_dim")  # fmt: skip
    drafts = {c.name: planning.build(c, target, target_params, seed) for c in chosen}
    check_models_serve({"target": target, **{n: m for n, (m, _) in drafts.items()}}, tokenizer,
                       recipe.get("vocab_size"), "train.vocab_size")  # fmt: skip
    task = tasks.register_task(
        tasks.as_task(recipe["task"]), tokenizer.vocabulary,
        tfds_data_dir=recipe.get("tfds_data_dir"), inputs_eos=target.encoder_decoder,
        bos_id=tokenizer.prompt_bos,
    )  # fmt: skip
    return target, target_params, chosen, drafts, task, tokenizer.prompt_bos


def _context(recipe, **context) -> dict[str, Any]:
    """What plan.json, plan.md and draft.gin say of the plan's setting and recipe."""
    task = recipe["task"] if isinstance(recipe["task"], str) else repr(recipe["task"])
    return dict(context, task=task, train_steps=recipe["loop"].train_steps,
                recipe=recipe_gin(recipe))  # fmt: skip


RECIPE_CONFIGS = ("loop", "loss", "optimizer", "mixture")  # train's config objects.
# runs/distill.gin's macros: a binding it makes through one stays a macro (still a flag).
DISTILL_MACROS = {
    "LoopConfig.train_steps": "TRAIN_STEPS", "LoopConfig.batch_size": "BATCH_SIZE",
    "OptimizerConfig.learning_rate": "LEARNING_RATE",
    "OptimizerConfig.warmup_steps": "WARMUP_STEPS", "LossConfig.divergence": "DIVERGENCE",
    "LossConfig.beta": "JSD_BETA", "DataMixture.fixed_data_fraction": "LAMBDA1",
    "DataMixture.student_data_fraction": "LAMBDA2", "DataMixture.temperature": "TEMPERATURE",
    "train.task": "MIXTURE_OR_TASK_NAME", "train.task_feature_lengths": "TASK_FEATURE_LENGTHS",
}  # fmt: skip


def recipe_gin(recipe: dict[str, Any]) -> str:
    """The recipe the plan priced as gin lines that, after runs/distill.gin, make `train` run
    it exactly: every field of its config objects, its data and lengths (as runs/distill.gin's
    macros where it has one, so --gin.TRAIN_STEPS=... still works; a task given as an object,
    not a name, is left to the user's own flags)."""
    values = {}
    for key in RECIPE_CONFIGS:
        config = recipe.get(key)
        for field in dataclasses.fields(config) if config is not None else ():
            values[f"{type(config).__name__}.{field.name}"] = getattr(config, field.name)
    for key in ("task", "task_feature_lengths", "vocabulary", "vocab_size"):
        value = recipe.get(key)
        if isinstance(value, (str, int, dict)) or value is None:
            values[f"train.{key}"] = dict(value) if isinstance(value, dict) else value
    lines = [f"{DISTILL_MACROS.get(name, name)} = {value!r}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def _spec_name(spec: DraftSpec) -> str:
    if spec.from_target_layers:
        return f"target-layers-{spec.from_target_layers}"
    return f"fresh-{spec.num_layers or 'auto'}x{spec.embed_dim or 'auto'}"


def _costs(profile, target, target_params, drafts, batch, gammas, max_new_tokens, repeats,
           temperatures):  # fmt: skip
    """{temperature: the plan's profile}: read from `profile` (checked against the candidates),
    else measured here on the first held-out prompt (again, up to 3 times, while a cost times
    <= 0)."""
    if profile:
        costs = planning.load_plan_profile(profile)
        for temperature in temperatures:
            planning.check_profile_covers(costs, list(drafts), gammas, temperature)
        return {t: costs for t in temperatures}
    print(
        f"[plan] timing {len(drafts)} candidates at batch 1 with random weights "
        f"(gammas {gammas[0]}..{gammas[-1]}, {repeats} repeats)",
        file=sys.stderr,
        flush=True,
    )
    prompt = (np.asarray(batch["prompt_tokens"])[:1], np.asarray(batch["prompt_lengths"])[:1])
    measure = lambda: planning.measure_plan_profiles(
        target, target_params, drafts, prompt, gammas, max_new_tokens, repeats, temperatures
    )
    untimed = lambda found: [u for p in found.values() for u in planning.untimed(p)]
    return until_timed(measure, untimed)[0]  # The caller refuses what stays untimed.


def _priced(candidate, costs, gammas) -> dict[str, Any]:
    """A plan row before any pilot: sizes, c, r_gamma, the alpha needed per S*, never_wins."""
    entry = costs["candidates"][candidate.name]
    c, r = planning.call_ratios(costs, candidate.name, gammas)
    needed = {
        f"{s:g}": {g: planning.alpha_needed(costs, candidate.name, g, s) for g in gammas}
        for s in planning.SPEEDUPS
    }
    return {
        "kind": candidate.kind, "params": entry["params"], "megabytes": entry["megabytes"],
        "c": c, "r_gamma": r, "alpha_needed": needed,
        "never_wins": planning.never_wins(costs, candidate.name, gammas),
        "ceiling": planning.ceiling(costs, candidate.name, gammas),
        "gin": candidate.gin(), "pilot": None, "alpha": None, "predicted_speedup": None,
    }  # fmt: skip


def _continuations(target, target_params, batches, temperature, lengths, seed):
    """The target's own continuations of the held-out prompts (the TVD is taken along them)."""
    sampling = SamplingConfig(temperature=temperature)
    rng = jax.random.PRNGKey(seed)
    kwargs = dict(max_new_tokens=lengths["targets"], eos_id=None)
    results = [plain_call(target, target_params, rng, sampling, kwargs, i, b)
               for i, b in enumerate(batches)]  # fmt: skip
    return batches, results, sampling


def _pilot(candidate, model_dir, steps, teacher_checkpoint, recipe, stage, target, references,
           vocab_size) -> tuple[dict[str, Any], dict[float, float | None]]:  # fmt: skip
    """The first `steps` steps of the candidate's run with the recipe (`LoopConfig.stop_at`:
    the full run's schedule, so the pilot is that run's prefix): its steps, seconds, the
    trainer's acceptance proxy and how far its learning curve says the full run's disagreement
    shrinks (`curve_ratio`); and {temperature: its held-out acceptance} for each reference."""
    start = time.perf_counter()
    loop = dataclasses.replace(recipe["loop"], stop_at=min(steps, recipe["loop"].train_steps))
    log = model_dir + ".log"  # The pilot's whole [train] output; the console gets one line.
    os.makedirs(os.path.dirname(log), exist_ok=True)
    try:
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            _train(stage, candidate, model_dir, teacher_checkpoint, loop)
    except BaseException:
        print(f"[plan] pilot of {candidate.name} failed; its log: {log}", file=sys.stderr)
        raise
    seconds = time.perf_counter() - start
    draft, draft_params = for_decoding(*load_checkpoint(os.path.join(model_dir, "export")),
                                       "float32")  # fmt: skip
    held_out = {}
    for temperature, (batches, continuations, sampling) in references.items():
        tvd = mean_tvd(*target, draft, draft_params, batches, continuations, sampling, vocab_size)
        held_out[temperature] = 1.0 - tvd if math.isfinite(tvd) else None
    curve = [(m["step"], m["acceptance_proxy"])
             for m in metrics.read_metrics(model_dir)
             if m.get("acceptance_proxy") is not None]  # fmt: skip
    tail = [p for _, p in curve[-max(1, int(len(curve) * PROXY_SHARE)) :]]
    said = ", ".join(f"T = {t:g}: {_two(a)}" for t, a in held_out.items())
    print(f"[plan] pilot of {candidate.name}: {steps} steps in {seconds:.0f} s, held-out "
          f"acceptance {said} (log: {log})", file=sys.stderr, flush=True)  # fmt: skip
    return {
        "steps": steps, "seconds": round(seconds, 1),
        "proxy": statistics.fmean(tail) if tail else None,
        "curve_ratio": planning.curve_ratio(curve, recipe["loop"].train_steps),
    }, held_out  # fmt: skip


def _two(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _train(stage, candidate, model_dir, teacher_checkpoint, loop) -> str:
    stage(RECIPE, "train")(
        model_dir=model_dir, teacher_checkpoint=teacher_checkpoint, student=candidate.spec,
        student_checkpoint=candidate.checkpoint, loop=loop,
    )  # fmt: skip
    return os.path.join(model_dir, "export")


def _predict(name, row, costs, estimate, gammas, max_new_tokens) -> None:
    alphas = planning.pilot_alphas(row["pilot"])
    if estimate not in alphas:  # A proxy may be missing (no step logged one).
        return
    row["alpha"] = alphas[estimate]
    row["predicted_by_estimate"] = {
        e: planning.predicted_speedup(costs, name, planning.taus_from_alpha(a, gammas),
                                      max_new_tokens)
        for e, a in alphas.items()
    }  # fmt: skip
    row["predicted_speedup"] = row["predicted_by_estimate"][estimate]


def _validate(output_dir, chosen, result, teacher_checkpoint, recipe, stage, temperature,
              num_prompts, latency_prompts) -> dict[str, Any]:  # fmt: skip
    """Trains each piloted candidate (every one under validate, never-wins marks included) with
    the full recipe and measures it with the speculative decoder at every gamma of the plan;
    `plan_report.validation` compares."""
    measured = {}
    for candidate in chosen:
        row = result["candidates"][candidate.name]
        if not row["predicted_speedup"]:
            continue
        directory = os.path.join(output_dir, "validate", candidate.name)
        print(
            f"[plan] validation: training {candidate.name} fully "
            f"({recipe['loop'].train_steps} steps)",
            file=sys.stderr,
            flush=True,
        )
        export = _train(stage, candidate, directory, teacher_checkpoint, recipe["loop"])
        records = stage("evaluate", "evaluate")(
            output_dir=os.path.join(directory, "evaluate"), target_checkpoint=teacher_checkpoint,
            drafts={candidate.name: export}, eval_sets=[(recipe["task"], "test")],
            task_feature_lengths=recipe["task_feature_lengths"], num_prompts=num_prompts,
            gammas=result["context"]["gammas"], temperatures=[temperature],
            latency_prompts=latency_prompts,
            quality=False, policies=(), vocabulary=recipe.get("vocabulary"),
            vocab_size=recipe.get("vocab_size"), tfds_data_dir=recipe.get("tfds_data_dir"),
        )  # fmt: skip
        measured[candidate.name] = {r["gamma"]: r for r in records}
    return plan_report.validation(result, measured)
