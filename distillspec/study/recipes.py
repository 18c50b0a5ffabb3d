"""The recipes comparison: DistillSpec's divergences, the LK losses and AdaSPEC under one budget
and one exact decoder (`python -m distillspec.study --gin_file=experiments/recipes_quickstart.gin
--json OUT`).

Every run is the distill/ stage of the gin configuration (the main job's steps, batch and
optimiser) from the standard draft, with its loss, data and seed replaced:

  * DistillSpec recipes '<divergence>-<data>': each of `divergences` (FKL, TVD, JSD[beta], LK^alpha,
    LK^lambda by default) on each of `data_sources` ('student': on-policy samples of the draft
    being trained, 'teacher': the target's samples);
  * AdaSPEC on the data its paper uses ('adaspec-fkl-fixed': forward KL on the data set's
    completions): its reference stage first ('fkl-fixed', the same recipe without selection,
    a DistillSpec recipe of its own: supervised KD), then the draft again from the standard
    draft, the loss keeping `select_fraction` of each batch's tokens (`distillspec.selection`);
  * AdaSPEC's selection on top of the best on-policy divergence ('adaspec-<best>-student', the
    best by alpha at gamma 5, T 1 on the first eval set): its reference is that divergence's
    on-policy run of the same seed, already trained.

Each run is trained at every seed of `seeds` (LoopConfig.seed: data order and sampling) into
OUTPUT_DIR/runs/<recipe>-s<seed>/ (an ordinary MODEL_DIR) and evaluated at `gammas` x
`temperatures` on `num_prompts` prompts of each eval set; its records (the evaluation with each
prompt's counts, and the training's wall-clock seconds and final acceptance proxy) are kept in
its directory (recipes_eval.jsonl), so a rerun skips it and an interrupted one resumes from its
checkpoints. An AdaSPEC run's seconds include its reference's: its budget. OUTPUT_DIR/
records.jsonl gathers every record; `study.recipes_report` summarises them (the --json OUT) and
`python -m distillspec.report --recipes_json OUT` writes docs/results/recipes.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from distillspec import checks, losses, metrics
from distillspec.evaluation.drafts import GridConfig, evaluate_drafts
from distillspec.models import load_checkpoint
from distillspec.records import write_jsonl_atomic
from distillspec.runs.common import open_run, prompt_sets
from distillspec.runs.quickstart import BindingsFn, StageFn, pretrained
from distillspec.runs.train import with_defaults
from distillspec.study import recipes_report
from distillspec.study.pipeline import DATA_SOURCES, _cached, _read_jsonl

EVAL_FILE = "recipes_eval.jsonl"
RECORDS_FILE = "records.jsonl"


@dataclasses.dataclass(frozen=True)
class Recipe:
    divergence: str
    data: str  # A key of `pipeline.DATA_SOURCES`.
    select: bool = False  # AdaSPEC's token selection, with `reference` as its reference model.
    reference: str | None = None  # The recipe whose run of the same seed is the reference.

    @property
    def name(self) -> str:
        base = f"{self.divergence}-{self.data}"
        return f"adaspec-{base}" if self.select else base

    @property
    def family(self) -> str:
        return "adaspec" if self.select else "distillspec"


def grid_recipes(divergences: Sequence[str], data_sources: Sequence[str]) -> list[Recipe]:
    """The DistillSpec recipes; unknown names fail here, naming the valid ones."""
    for d in divergences:
        if d not in losses.KINDS:
            raise ValueError(f"recipes.divergences: {d!r} is not one of {losses.KINDS}")
    for s in data_sources:
        if s not in DATA_SOURCES:
            raise ValueError(f"recipes.data_sources: {s!r} is not one of {tuple(DATA_SOURCES)}")
    return [Recipe(d, s) for d in divergences for s in data_sources]


def adaspec_recipes(divergence: str | None, data: str, best: str | None) -> list[Recipe]:
    """AdaSPEC on its paper's recipe (its reference stage first) and on the best on-policy
    divergence `best` (None: not run)."""
    out = []
    if divergence is not None:
        out += [Recipe(divergence, data), Recipe(divergence, data, True, f"{divergence}-{data}")]
    if best is not None:
        out.append(Recipe(best, "student", True, f"{best}-student"))
    return out


def best_on_policy(records: Sequence[Mapping[str, Any]], divergences: Sequence[str]) -> str:
    """The divergence whose on-policy run has the highest mean alpha (PRIMARY figure)."""
    alphas: dict[str, list[float]] = {}
    for r in records:
        if r.get("kind") == "grid" and r.get("data") == "student" and not r.get("select"):
            key = recipes_report.figure_key(r["task"], r["temperature"], r["gamma"])
            if key == recipes_report.PRIMARY and r["divergence"] in divergences:
                alphas.setdefault(r["divergence"], []).append(r["alpha"])
    if not alphas:
        raise ValueError(
            f"recipes: no on-policy run was evaluated at {recipes_report.PRIMARY} (set/T/gamma) "
            "to pick the best on-policy divergence: include 'student' in recipes.data_sources, "
            "stdlib_code in recipes.eval_sets, gamma 5 and T 1, or set recipes.adaspec_on_best "
            "= False"
        )
    return max(alphas, key=lambda d: sum(alphas[d]) / len(alphas[d]))


def _final_proxy(model_dir: str) -> float | None:
    """The training batches' acceptance proxy over the last tenth of the run's steps."""
    rows = [r for r in metrics.read_metrics(model_dir) if "acceptance_proxy" in r]
    if not rows:
        return None
    tail = rows[-max(1, len(rows) // 10) :]
    return sum(r["acceptance_proxy"] for r in tail) / len(tail)


class _Runner:
    """Trains and evaluates one (recipe, seed) at a time; keeps each run's records."""

    def __init__(self, train, distill, pair, tfds_data_dir, evaluate, runs_dir, select_fraction):
        self.train, self.distill, self.pair = train, distill, pair
        self.tfds_data_dir, self.evaluate, self.runs_dir = tfds_data_dir, evaluate, runs_dir
        self.select_fraction = select_fraction

    def model_dir(self, name: str, seed: int) -> str:
        return os.path.join(self.runs_dir, f"{name}-s{seed}")

    def __call__(self, recipe: Recipe, seed: int) -> list[dict]:
        path = os.path.join(self.model_dir(recipe.name, seed), EVAL_FILE)
        return _cached(path, lambda: self._run(recipe, seed))

    def _run(self, recipe: Recipe, seed: int) -> list[dict]:
        model_dir = self.model_dir(recipe.name, seed)
        fields = {"recipe": recipe.name, "family": recipe.family, "divergence": recipe.divergence,
                  "data": recipe.data, "select": recipe.select, "seed": seed}  # fmt: skip
        reference, reference_seconds = None, 0.0
        if recipe.select:
            ref_dir = self.model_dir(recipe.reference, seed)
            (ref,) = [r for r in _read_jsonl(os.path.join(ref_dir, EVAL_FILE))
                      if r["kind"] == "train"]  # fmt: skip
            reference, reference_seconds = os.path.join(ref_dir, "export"), ref["seconds"]
        lambda1, lambda2 = DATA_SOURCES[recipe.data]
        loss = dataclasses.replace(
            self.distill["loss"], divergence=recipe.divergence,
            select_fraction=self.select_fraction if recipe.select else 1.0,
        )  # fmt: skip
        started = time.perf_counter()
        self.train(
            model_dir=model_dir, teacher_checkpoint=self.pair[0], student_checkpoint=self.pair[1],
            reference_checkpoint=reference, loss=loss,
            mixture=dataclasses.replace(
                self.distill["mixture"], fixed_data_fraction=lambda1, student_data_fraction=lambda2
            ),
            loop=dataclasses.replace(self.distill["loop"], seed=seed),
            tfds_data_dir=self.tfds_data_dir,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        train = {"kind": "train", **fields, "seconds": seconds, "steps": loss_steps(self.distill),
                 "reference_seconds": reference_seconds, "reference": recipe.reference,
                 "acceptance_proxy": _final_proxy(model_dir)}  # fmt: skip
        draft, params = load_checkpoint(os.path.join(model_dir, "export"))
        return [train] + [{**r, **fields} for r in self.evaluate(recipe.name, draft, params)]


def loss_steps(distill: Mapping[str, Any]) -> int:
    return int(distill["loop"].stop_at or distill["loop"].train_steps)


class _Evaluator:
    """Every draft on every eval set at the grid, against the loaded target."""

    def __init__(self, target, target_params, eos_id, sets, grid, vocab_size):
        self.target, self.target_params, self.eos_id = target, target_params, eos_id
        self.sets, self.grid, self.vocab_size = sets, grid, vocab_size

    def __call__(self, name: str, draft, params) -> list[dict]:
        out = []
        for (task, split), batches in self.sets.items():
            out += [
                {"kind": "grid", **r}
                for r in evaluate_drafts(
                    self.target,
                    self.target_params,
                    {name: (draft, params)},
                    batches,
                    self.grid,
                    eos_id=self.eos_id,
                    task=task,
                    split=split,
                    vocab_size=self.vocab_size,
                )  # fmt: skip
            ]
        return out


def recipes(
    output_dir: str = "runs/recipes",
    json_path: str | None = None,
    target_checkpoint: str | None = None,
    draft_checkpoint: str | None = None,
    divergences: Sequence[str] = ("fkl", "tvd", "jsd", "lk_alpha", "lk_lambda"),
    data_sources: Sequence[str] = ("student", "teacher"),
    adaspec_divergence: str | None = "fkl",
    adaspec_data: str = "fixed",
    adaspec_on_best: bool = True,
    select_fraction: float = 0.4,
    seeds: Sequence[int] = (0, 1, 2),
    eval_sets: Sequence[tuple[str, str]] = (("stdlib_code", "test"), ("humaneval", "test")),
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},  # noqa: B006
    num_prompts: int = 64,
    batch_size: int = 32,
    gammas: Sequence[int] = (3, 5),
    temperatures: Sequence[float] = (0.0, 1.0),
    vocabulary: str | None = None,
    vocab_size: int | None = None,
    tfds_data_dir: str | None = None,
    cache_models: bool = True,
    model_cache_dir: str | None = None,
    *,
    stage: StageFn,
    bindings: BindingsFn,
) -> dict[str, Any]:
    """Runs the comparison (see the module docstring); returns the summary (the --json OUT).

    Args:
      output_dir: OUTPUT_DIR: runs/, records.jsonl, summary.json.
      json_path: also write the summary here (the CLI's --json OUT).
      target_checkpoint, draft_checkpoint: your target and standard draft; None: the main
        job's, pretrained by the target/ and draft/ stages through the model cache.
      divergences, data_sources: the DistillSpec recipes (`losses.KINDS`, `DATA_SOURCES`).
      adaspec_divergence, adaspec_data: AdaSPEC's own recipe (None: not run); adaspec_on_best:
        also AdaSPEC's selection on the best on-policy divergence; select_fraction: the
        fraction of tokens AdaSPEC keeps (its paper's k).
      seeds: the training seeds of every recipe.
      eval_sets, task_feature_lengths, num_prompts, batch_size, gammas, temperatures: the
        evaluation of every run (α, τ and each prompt's counts).
      vocabulary, vocab_size, tfds_data_dir, cache_models, model_cache_dir: as for the study.
      stage, bindings: the gin stages (the distill/ stage trains every run).
    """
    grid_list = grid_recipes(divergences, data_sources)
    if adaspec_divergence is not None:
        grid_recipes([adaspec_divergence], [adaspec_data])  # Validates them.
    checks.check_int_list("seeds", seeds, minimum=0)
    if not 0 < select_fraction < 1:
        raise ValueError(f"recipes.select_fraction must be in (0, 1), got {select_fraction!r}")
    distill = with_defaults(bindings("distill", "train"))
    if (target_checkpoint is None) != (draft_checkpoint is None):
        raise ValueError("give both recipes.target_checkpoint and draft_checkpoint, or neither")
    if target_checkpoint is None:
        target_checkpoint, draft_checkpoint = pretrained(
            output_dir, stage, bindings, cache_models, model_cache_dir
        )
    tokenizer, target, target_params, _, names = open_run(
        "recipes", output_dir, target_checkpoint, {"standard": draft_checkpoint}, vocabulary,
        [tuple(s) for s in eval_sets], vocab_size, tfds_data_dir,
    )  # fmt: skip
    sets = prompt_sets(names, task_feature_lengths, num_prompts, batch_size, tokenizer.prompt_bos)
    grid = GridConfig(
        gammas=tuple(gammas), temperatures=tuple(temperatures),
        max_new_tokens=task_feature_lengths["targets"], latency_prompts=0, per_prompt=True,
    )  # fmt: skip
    evaluate = _Evaluator(target, target_params, tokenizer.eos_id, sets, grid, vocab_size)
    run = _Runner(
        stage("distill", "train"), distill, (target_checkpoint, draft_checkpoint),
        tfds_data_dir or distill["tfds_data_dir"], evaluate, os.path.join(output_dir, "runs"),
        select_fraction,
    )  # fmt: skip
    records = _run_all(grid_list, seeds, run, [])
    best = best_on_policy(records, divergences) if adaspec_on_best else None
    extra = [r for r in adaspec_recipes(adaspec_divergence, adaspec_data, best)
             if r not in grid_list]  # fmt: skip
    records = _run_all(extra, seeds, run, records)
    write_jsonl_atomic(os.path.join(output_dir, RECORDS_FILE), records)
    summary = recipes_report.summarize(records)
    for path in filter(None, (os.path.join(output_dir, "summary.json"), json_path)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    print(recipes_report.markdown(summary))
    return summary


def _run_all(recipe_list: Sequence[Recipe], seeds, run: _Runner, records: list[dict]):
    """records + every (recipe, seed)'s, one progress line each."""
    todo = [(r, s) for s in seeds for r in recipe_list]
    started = time.perf_counter()
    for i, (recipe, seed) in enumerate(todo):
        records = records + run(recipe, seed)
        (train,) = [r for r in records if r["kind"] == "train" and r["recipe"] == recipe.name
                    and r["seed"] == seed]  # fmt: skip
        print(
            f"[recipes {i + 1}/{len(todo)}] {recipe.name} seed {seed}: trained in "
            f"{train['seconds']:.0f} s; {time.perf_counter() - started:.0f} s so far",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return records
