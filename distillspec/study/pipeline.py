"""The study's run function: every recipe and grid cell as an ordinary distillation run.

A cell is (divergence, data source, seed): a distillation of the standard draft toward the
target (the distill/ stage of the gin configuration, its loss and data mixture replaced by the
cell's), in OUTPUT_DIR/cells/<cell>/ (an ordinary MODEL_DIR: config.gin, checkpoints/,
metrics.jsonl with the periodic alpha and tau, export/). The data sources, as DistillSpec
Algorithm A.2's (lambda1 = fixed-data fraction, lambda2 = student-data fraction):

  fixed          (1, 0)    the data set's completions
  teacher        (0, 0)    sampled from the target
  student        (0, 1)    sampled from the draft being trained (on-policy)
  mixed          (0, 0.5)  teacher and student samples, half and half
  fixed+student  (0.5, 1)  data set and student samples, half and half (ImitKD)

and the five recipes of Table 1 are cells: Supervised KD = fkl/fixed, SeqKD = fkl/teacher,
ImitKD = fkl/fixed+student, f-Distill = tvd/mixed, GKD = jsd/student (JSD[beta], beta from the
gin configuration).

Each draft (the standard one and every cell) is evaluated the same way on the same prompts:
alpha, tau (each prompt's too) and tau from the TVD at one gamma per temperature
(`evaluation.drafts`), and its quality as a model (`evaluation.quality`: chrF of its greedy
output against the references, the target's NLL of that output). Then the lenience sweep
(`evaluation.lenience`) for the standard draft and one distilled cell. A finished cell's
evaluation is kept in its directory (study_eval.jsonl), so a rerun skips it; an interrupted
cell's training resumes from its checkpoints. OUTPUT_DIR/records.jsonl gathers every record;
`study.report` writes the tables, figures and findings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distillspec import checks, losses, metrics, tasks
from distillspec.decoding.acceptance import LENIENCE_KINDS
from distillspec.evaluation.drafts import GridConfig, evaluate_drafts
from distillspec.evaluation.lenience import lenience_records
from distillspec.evaluation.quality import quality_records
from distillspec.models import load_checkpoint
from distillspec.records import write_jsonl_atomic
from distillspec.runs.common import open_run, prompt_sets
from distillspec.runs.quickstart import BindingsFn, StageFn, pretrained
from distillspec.runs.train import with_defaults
from distillspec.study import report

DATA_SOURCES = {
    "fixed": (1.0, 0.0),
    "teacher": (0.0, 0.0),
    "student": (0.0, 1.0),
    "mixed": (0.0, 0.5),
    "fixed+student": (0.5, 1.0),
}
RECIPES = {
    "supervised_kd": ("fkl", "fixed"),
    "seqkd": ("fkl", "teacher"),
    "imitkd": ("fkl", "fixed+student"),
    "fdistill": ("tvd", "mixed"),
    "gkd": ("jsd", "student"),
}
EVAL_FILE = "study_eval.jsonl"  # A cell's evaluation, written when it is complete.
RECORDS_FILE = "records.jsonl"


@dataclasses.dataclass(frozen=True)
class Cell:
    divergence: str
    data: str
    seed: int
    in_grid: bool = True  # False: a recipe outside the divergence x data-source grid.

    @property
    def recipe_cell(self) -> str:
        return f"{self.divergence}-{self.data}"

    @property
    def name(self) -> str:
        return f"{self.recipe_cell}-s{self.seed}"

    def fields(self) -> dict[str, Any]:
        recipe = [r for r, cell in RECIPES.items() if cell == (self.divergence, self.data)]
        return {
            "cell": self.recipe_cell, "divergence": self.divergence, "data": self.data,
            "seed": self.seed, "recipe": recipe[0] if recipe else None, "in_grid": self.in_grid,
        }  # fmt: skip


def make_cells(
    divergences: Sequence[str], data_sources: Sequence[str], recipes: Sequence[str],
    seeds: Sequence[int], spread_seeds: Sequence[int], spread_cells: Sequence[str] | None,
) -> list[Cell]:  # fmt: skip
    """The grid (divergences x data sources) and the recipes at every seed of `seeds`, then the
    `spread_cells` ('divergence-data'; None = every recipe and every FKL cell) at every seed of
    `spread_seeds`; each cell once. Unknown names fail here, naming the valid ones."""
    for d in divergences:
        if d not in losses.KINDS:
            raise ValueError(f"study.divergences: {d!r} is not one of {losses.KINDS}")
    for s in data_sources:
        if s not in DATA_SOURCES:
            raise ValueError(f"study.data_sources: {s!r} is not one of {tuple(DATA_SOURCES)}")
    for r in recipes:
        if r not in RECIPES:
            raise ValueError(f"study.recipes: {r!r} is not one of {tuple(RECIPES)}")
    grid = [(d, s) for d in divergences for s in data_sources]
    base = grid + [RECIPES[r] for r in recipes if RECIPES[r] not in grid]
    if spread_cells is None:
        spread = [c for c in base if c[0] == "fkl" or c in [RECIPES[r] for r in recipes]]
    else:
        names = {f"{d}-{s}": (d, s) for d, s in base}
        unknown = [c for c in spread_cells if c not in names]
        if unknown:
            raise ValueError(
                f"study.spread_cells {unknown} are not cells of the study: {list(names)}"
            )
        spread = [names[c] for c in spread_cells]
    checks.check_int_list("seeds", seeds, minimum=0)
    cells = [Cell(d, s, seed, (d, s) in grid) for seed in seeds for d, s in base]
    cells += [
        Cell(d, s, seed, (d, s) in grid)
        for seed in spread_seeds for d, s in spread if seed not in seeds
    ]  # fmt: skip
    return cells


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _curve(model_dir: str, fields: Mapping[str, Any]) -> list[dict]:
    """The cell's periodic evaluation (eval_alpha, eval_tau) by step, with the training
    batches' mean 1 - TVD proxy since the previous evaluation."""
    rows = metrics.read_metrics(model_dir)
    out, last = [], 0
    for r in rows:
        if "eval_tau" not in r:
            continue
        proxies = [x["acceptance_proxy"] for x in rows if last < x["step"] <= r["step"]
                   and "acceptance_proxy" in x]  # fmt: skip
        out.append({
            "kind": "curve", **fields, "step": r["step"], "eval_alpha": r["eval_alpha"],
            "eval_tau": r["eval_tau"],
            "acceptance_proxy": sum(proxies) / len(proxies) if proxies else None,
        })  # fmt: skip
        last = r["step"]
    return out


class _Evaluator:
    """Evaluates one draft at a time against the loaded target, on the study's prompts."""

    def __init__(self, target, target_params, tokenizer, batches, grid, vocab_size, task, split):
        self.target, self.target_params, self.tokenizer = target, target_params, tokenizer
        self.batches, self.grid, self.vocab_size = batches, grid, vocab_size
        self.task, self.split = task, split

    def __call__(self, name: str, draft, params, fields: Mapping[str, Any]) -> list[dict]:
        pair = {name: (draft, params)}
        grid = evaluate_drafts(
            self.target, self.target_params, pair, self.batches, self.grid,
            eos_id=self.tokenizer.eos_id, task=self.task, split=self.split,
            vocab_size=self.vocab_size,
        )  # fmt: skip
        quality = quality_records(
            pair, self.batches, max_new_tokens=self.grid.max_new_tokens,
            eos_id=self.tokenizer.eos_id, task=self.task, split=self.split,
            vocab_size=self.vocab_size, vocabulary=self.tokenizer.vocabulary,
            scorer=(self.target, self.target_params),
        )  # fmt: skip
        return [{"kind": "grid", **fields, **r} for r in grid] + [
            {"kind": "quality", **fields, **r} for r in quality
        ]


def _check_fixed_data(task, cells: Sequence[Cell]) -> None:
    """Prompts-only data has no completions to be the fixed data set: say so before any cell."""
    fixed = [c.name for c in cells if DATA_SOURCES[c.data][0] > 0]
    task = tasks.as_task(task)
    if fixed and isinstance(task, tasks.FileTask) and not tasks.has_completions(task):
        raise ValueError(
            f"{task.path!r} holds prompts only, so the cells {fixed} (fixed data) cannot run: "
            "set study.data_sources and study.recipes to model-generated data only, e.g. "
            "study.data_sources = ['teacher', 'student', 'mixed'], study.recipes = "
            "['seqkd', 'fdistill', 'gkd']"
        )


def _check_models_and_lenience(cells, lenience_cell, target_checkpoint, draft_checkpoint):
    if lenience_cell is not None and lenience_cell not in {c.recipe_cell for c in cells}:
        raise ValueError(f"study.lenience_cell {lenience_cell!r} is not a cell of the study")
    if (target_checkpoint is None) != (draft_checkpoint is None):
        raise ValueError("give both study.target_checkpoint and study.draft_checkpoint, or neither")


def _eta(started: float, done: int, todo: int) -> str:
    if not done:
        return "ETA unknown"
    left = (time.perf_counter() - started) / done * todo
    return f"ETA of the cells {int(left // 60)} min {int(left % 60):02d} s"


def study(
    output_dir: str = "runs/study",
    target_checkpoint: str | None = None,
    draft_checkpoint: str | None = None,
    divergences: Sequence[str] = ("fkl", "rkl", "jsd", "tvd"),
    data_sources: Sequence[str] = ("fixed", "teacher", "student", "mixed"),
    recipes: Sequence[str] = tuple(RECIPES),
    seeds: Sequence[int] = (0,),
    spread_seeds: Sequence[int] = (1,),
    spread_cells: Sequence[str] | None = None,
    eval_set: tuple[str, str] = ("stdlib_code", "test"),
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},  # noqa: B006
    num_prompts: int = 64,
    batch_size: int = 32,
    gamma: int = 5,
    temperatures: Sequence[float] = (0.0, 1.0),
    lenience_cell: str | None = "fkl-student",
    lenience_kinds: Sequence[str] = LENIENCE_KINDS,
    epsilons: Sequence[float] = (0.5, 0.2, 0.1, 0.05),
    lenience_prompts: int = 32,
    lenience_temperature: float = 1.0,
    vocabulary: str | None = None,
    vocab_size: int | None = None,
    tfds_data_dir: str | None = None,
    cache_models: bool = True,
    model_cache_dir: str | None = None,
    *,
    stage: StageFn,
    bindings: BindingsFn,
) -> list[dict]:
    """Runs the study (see the module docstring) and writes its report; returns every record.

    Args:
      output_dir: OUTPUT_DIR: cells/, records.jsonl, the tables, figures and findings.md.
      target_checkpoint, draft_checkpoint: your target and standard draft (Hugging Face or
        T5X checkpoint directories); None: the quickstart's, pretrained by the target/ and
        draft/ stages through the model cache (reused when the quickstart made them).
      divergences, data_sources, recipes: the grid and the recipes (`DATA_SOURCES`, `RECIPES`).
      seeds: the seeds of every cell (LoopConfig.seed: data order and sampling);
        spread_seeds, spread_cells: more seeds for the cells that matter ('divergence-data';
        None = every recipe and every FKL cell), for the spread over seeds.
      eval_set: the (task, split) every draft is evaluated on; num_prompts of it, in batches
        of batch_size, at `gamma` and each of `temperatures`, task_feature_lengths long.
      lenience_cell: the distilled cell ('divergence-data', first seed) compared with the
        standard draft under lenience (None: no lenience sweep); lenience_kinds, epsilons,
        lenience_prompts, lenience_temperature: the sweep (`evaluation.lenience`).
      vocabulary, vocab_size, tfds_data_dir: as for `distillspec.evaluate.evaluate`.
      cache_models, model_cache_dir: as for the quickstart.
      stage, bindings: the gin stages (the distill/ stage trains every cell).
    """
    cells = make_cells(divergences, data_sources, recipes, seeds, spread_seeds, spread_cells)
    grid = GridConfig(
        gammas=(gamma,), temperatures=tuple(temperatures),
        max_new_tokens=task_feature_lengths["targets"], latency_prompts=0, per_prompt=True,
    )  # fmt: skip
    distill = with_defaults(bindings("distill", "train"))
    _check_fixed_data(distill["task"], cells)
    _check_models_and_lenience(cells, lenience_cell, target_checkpoint, draft_checkpoint)
    if target_checkpoint is None:
        target_checkpoint, draft_checkpoint = pretrained(
            output_dir, stage, bindings, cache_models, model_cache_dir
        )
    tokenizer, target, target_params, models, names = open_run(
        "study", output_dir, target_checkpoint, {"standard": draft_checkpoint}, vocabulary,
        [tuple(eval_set)], vocab_size, tfds_data_dir,
    )  # fmt: skip
    ((task, split),) = names
    batches = prompt_sets(names, task_feature_lengths, num_prompts, batch_size,
                          tokenizer.prompt_bos)[(task, split)]  # fmt: skip
    evaluate = _Evaluator(target, target_params, tokenizer, batches, grid, vocab_size, task, split)
    cells_dir = os.path.join(output_dir, "cells")
    records = _cached(
        os.path.join(cells_dir, "standard", EVAL_FILE),
        lambda: evaluate("standard", *models["standard"], {"cell": "standard", "seed": None}),
    )
    run_cell = functools.partial(
        _distil_cell, stage("distill", "train"), distill, (target_checkpoint, draft_checkpoint),
        tfds_data_dir or distill["tfds_data_dir"], evaluate,
    )  # fmt: skip
    then = " (then the lenience sweep)" if lenience_cell is not None else ""
    records += _run_cells(cells, run_cell, cells_dir, then)
    if lenience_cell is not None:
        first = next(c for c in cells if c.recipe_cell == lenience_cell)
        distilled = load_checkpoint(os.path.join(cells_dir, first.name, "export"))
        drafts = {"standard": models["standard"], f"distilled ({first.name})": distilled}
        sweep = dict(
            kinds=lenience_kinds, epsilons=epsilons, gamma=gamma,
            temperature=lenience_temperature, max_new_tokens=task_feature_lengths["targets"],
            num_prompts=lenience_prompts, vocab_size=vocab_size,
        )  # fmt: skip
        records += _cached(
            os.path.join(output_dir, "lenience", EVAL_FILE),
            lambda: _lenience(target, target_params, drafts, batches, tokenizer, sweep),
        )
    write_jsonl_atomic(os.path.join(output_dir, RECORDS_FILE), records)
    print(report.write_report(records, output_dir))
    return records


def _distil_cell(train, distill, checkpoints, tfds_data_dir, evaluate, cell: Cell, model_dir):
    """Trains the cell (the distill/ stage with the cell's loss, data and seed) and evaluates
    it: its records."""
    lambda1, lambda2 = DATA_SOURCES[cell.data]
    train(
        model_dir=model_dir, teacher_checkpoint=checkpoints[0], student_checkpoint=checkpoints[1],
        loss=dataclasses.replace(distill["loss"], divergence=cell.divergence),
        mixture=dataclasses.replace(
            distill["mixture"], fixed_data_fraction=lambda1, student_data_fraction=lambda2
        ),
        loop=dataclasses.replace(distill["loop"], seed=cell.seed), tfds_data_dir=tfds_data_dir,
    )  # fmt: skip
    draft, params = load_checkpoint(os.path.join(model_dir, "export"))
    return evaluate(cell.name, draft, params, cell.fields()) + _curve(model_dir, cell.fields())


def _run_cells(cells: Sequence[Cell], run_cell, cells_dir: str, then: str) -> list[dict]:
    """Every cell's records: read from its directory when finished, else `run_cell(cell,
    model_dir)` (which resumes an interrupted training) and kept; a progress line per cell."""
    started, trained, records = time.perf_counter(), 0, []
    for i, cell in enumerate(cells):
        model_dir = os.path.join(cells_dir, cell.name)
        path = os.path.join(model_dir, EVAL_FILE)
        if not os.path.exists(path):
            write_jsonl_atomic(path, run_cell(cell, model_dir))
            trained += 1
        cell_records = [{**r, **cell.fields()} for r in _read_jsonl(path)]  # Current labels.
        records += cell_records
        taus = {r["temperature"]: r["tau"] for r in cell_records if r["kind"] == "grid"}
        print(
            f"[study {i + 1}/{len(cells)}] {cell.name}: tau "
            + ", ".join(f"T={t:g} {v:.3f}" for t, v in taus.items())
            + f"; {_eta(started, trained, len(cells) - i - 1)}{then}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return records


def _lenience(target, target_params, drafts, batches, tokenizer, sweep) -> list[dict]:
    return [
        {"kind": "lenience", **r}
        for r in lenience_records(
            target,
            target_params,
            drafts,
            batches,
            vocabulary=tokenizer.vocabulary,
            eos_id=tokenizer.eos_id,
            **sweep,
        )  # fmt: skip
    ]


def _cached(path: str, compute: Callable[[], list[dict]]) -> list[dict]:
    """The records at `path`, computed and written (atomically) if missing."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_jsonl_atomic(path, compute())
    return _read_jsonl(path)
