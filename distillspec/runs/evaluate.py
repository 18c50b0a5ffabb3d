"""The evaluation run function: drafts against a target over eval sets, a grid and policies.

    python -m distillspec.evaluate --gin_file=runs/evaluate.gin --gin.OUTPUT_DIR=\"DIR\" \
        --gin.TARGET_CHECKPOINT=\"HF_DIR\" --gin.DRAFTS="{'standard': 'HF_DIR', ...}"

Registered for gin as `distillspec.evaluate.evaluate` by `distillspec.gin_setup`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from distillspec import serving, tables
from distillspec.disco import storage
from distillspec.evaluation.drafts import GridConfig, evaluate_drafts
from distillspec.evaluation.policies import evaluate_policies, resolve_policies
from distillspec.evaluation.quality import quality_records
from distillspec.models.base import decode_cache_dtype, for_decoding
from distillspec.records import RECORDS_FILE, TUNED_POLICIES, append_records, write_jsonl_atomic
from distillspec.runs.common import open_run, prompt_sets, report_serving

QUALITY_FILE = "quality.jsonl"


def _with_classifiers(models, drafts, policies, vocab_size) -> dict[str, tuple]:
    """{name: (model, params, DISCO classifier or None, tuning or None)} for `evaluate_policies`:
    the tuned policies read the classifier and tuning saved beside each draft."""
    out = {}
    for name, (draft, draft_params) in models.items():
        classifier = tuning = None
        if any(p in TUNED_POLICIES for p in policies):
            classifier, metadata = storage.load_classifier(
                storage.classifier_dir(drafts[name]), draft, draft_params, vocab_size
            )
            tuning = metadata.get("tuning")
        out[name] = (draft, draft_params, classifier, tuning)
    return out


def evaluate(
    output_dir: str,
    target_checkpoint: str,
    drafts: Mapping[str, str],
    eval_sets: Sequence[tuple[str, str]] = (("stdlib_code", "test"), ("humaneval", "test")),
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},  # noqa: B006
    num_prompts: int = 64,
    batch_size: int = 16,
    gammas: Sequence[int] = (3, 5, 7),
    temperatures: Sequence[float] = (0.0, 1.0),
    timing_repeats: int = 1,
    seed: int = 0,
    latency_prompts: int | None = None,
    dtype: str = "float32",
    cache_dtype: str = "auto",
    vocabulary: str | None = None,
    vocab_size: int | None = None,
    tfds_data_dir: str | None = None,
    policies: Sequence[str] = (),
    heuristic_sl_max: int = 8,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
    quality: bool = True,
    serve_report: bool = False,
) -> list[dict[str, Any]]:
    """Evaluates drafts against a target over eval sets and a grid; the target and each draft are
    Hugging Face or T5X checkpoint directories (`models.load_checkpoint` tells them apart).

    eval_sets are (task, split) pairs; a task is a built-in name, a path to a .jsonl / .txt
    file or directory (`tasks.FileTask`) or a `tasks.TfdsTaskSpec`. vocabulary: the tokenizer
    (`vocabularies.load_tokenizer`; None = the target checkpoint's tokenizer files, else the
    embedded 'sentencepiece'). dtype: 'float32' or 'bfloat16', the decoders' parameters and
    activations for every decoding and TVD (logits, sampling and acceptance stay float32; see
    `models.base.for_decoding`); cache_dtype: their KV caches' dtype ('auto': float32 on the
    CPU, else dtype; `models.base.decode_cache_dtype`). vocab_size: the tokenizer's size when
    target and drafts pad their embeddings to different sizes (both models' logits are cut to
    it).

    Appends one record per (eval set, draft, gamma, temperature) to OUTPUT_DIR/records.jsonl
    (none if gammas is empty): 'speedup' is the throughput speed-up on batches of batch_size,
    'latency_speedup' the latency speed-up at batch 1 over the first latency_prompts prompts
    of the set (None = all num_prompts, 0 = not measured). With `policies`, one record per
    (eval set, draft, policy): the lookahead policy axis, timed at batch 1 (see
    `evaluation.policies`; the tuned policies read `<draft>/disco/`, written by
    python -m distillspec.disco). Then writes table.md, table.csv, tau_vs_gamma.png (and
    disco_table.md, oracle_sl_hist.png); prints `tables.terminal_summary` last (<= 100 columns).
    With `quality`, also each model's quality as a model, per eval set (`evaluation.quality`:
    NLL of the reference completions, distinct-4, share of looping greedy outputs, chrF of
    the greedy outputs against the references and the target's NLL of them) in
    OUTPUT_DIR/quality.jsonl and quality.md. Last, the serve check (`_report_serving`).
    """
    if not gammas and not policies:
        raise ValueError("nothing to evaluate: gammas and policies are both empty")
    # Bad grid values, dtypes and policy names fail before anything is loaded.
    cache_dtype = decode_cache_dtype(dtype, cache_dtype)
    grid = None if not gammas else GridConfig(
        gammas=tuple(gammas), temperatures=tuple(temperatures),
        max_new_tokens=task_feature_lengths["targets"], timing_repeats=timing_repeats,
        seed=seed, latency_prompts=latency_prompts,
    )  # fmt: skip
    resolve_policies(
        [p for p in policies if p not in TUNED_POLICIES], heuristic_sl_max=heuristic_sl_max,
        heuristic_start=heuristic_start, oracle_sl_max=oracle_sl_max,
    )  # fmt: skip
    tokenizer, target, target_params, models, names = open_run(
        "evaluate", output_dir, target_checkpoint, drafts, vocabulary, eval_sets, vocab_size,
        tfds_data_dir, references=quality,
    )  # fmt: skip
    target, target_params = for_decoding(target, target_params, dtype, cache_dtype)
    models = {name: for_decoding(*pair, dtype, cache_dtype) for name, pair in models.items()}
    records_path = os.path.join(output_dir, RECORDS_FILE)
    sets = prompt_sets(names, task_feature_lengths, num_prompts, batch_size, tokenizer.prompt_bos)
    records = []
    for (task, split), batches in sets.items() if grid else ():
        new = evaluate_drafts(
            target, target_params, models, batches, grid, eos_id=tokenizer.eos_id, task=task,
            split=split, vocab_size=vocab_size,
        )  # fmt: skip
        new = [dict(r, dtype=dtype, cache_dtype=cache_dtype) for r in new]  # Says bfloat16.
        append_records(records_path, new)
        records += new
    if policies:
        with_classifiers = _with_classifiers(models, drafts, policies, vocab_size)
        records += evaluate_policies(
            target, target_params, with_classifiers, sets, policies,
            num_prompts=num_prompts, max_new_tokens=task_feature_lengths["targets"],
            eos_id=tokenizer.eos_id, records_path=records_path, timing_repeats=timing_repeats,
            heuristic_sl_max=heuristic_sl_max, heuristic_start=heuristic_start,
            oracle_sl_max=oracle_sl_max, vocab_size=vocab_size,
            context={"dtype": dtype, "cache_dtype": cache_dtype},
        )  # fmt: skip
    _write_tables(records_path, output_dir, bool(policies))
    if quality:
        _report_quality(
            output_dir, {"target": (target, target_params), **models}, sets,
            task_feature_lengths["targets"], tokenizer, vocab_size,
        )  # fmt: skip
    print(tables.terminal_summary(records, os.path.join(output_dir, "table.md")))
    return _report_serving(records, drafts, target_checkpoint, output_dir, serve_report)


def _report_serving(records, drafts, target_checkpoint, output_dir, show: bool) -> list[dict]:
    """Each Hugging Face draft's serve check (`serving.check`) and commands at the γ of its best
    batch-1 latency speed-up (else what its SERVING.md says): OUTPUT_DIR/SERVING.md, printed
    with `show`, and the export's own SERVING.md updated with the measured γ. Returns records."""
    texts = []
    for name, path in drafts.items():
        measured = serving.best_gamma(records, name)
        gamma, source = serving.serving_gamma(measured, None, None, path)
        report = report_serving(path, target_checkpoint, gamma, source, show=show, write=False)
        if report is None:
            continue
        texts.append(f"<!-- draft {name} -->\n" + serving.serving_text(report, gamma, source))
        own = os.path.join(path, serving.SERVING_FILE)
        if measured is not None and os.path.isfile(own) and os.access(own, os.W_OK):
            serving.write_serving(report, gamma, source, path)
    if texts:
        with open(os.path.join(output_dir, serving.SERVING_FILE), "w", encoding="utf-8") as f:
            f.write("\n".join(texts))
    return records


def _write_tables(records_path: str, output_dir: str, policies: bool) -> None:
    """table.md, disco_table.md and their plots; prints DISCO's table (Table C.1 is too wide for
    a terminal: `tables.terminal_summary` sums it up at the end)."""
    tables.format_report(records_path, output_dir)
    if policies:
        with open(os.path.join(output_dir, "disco_table.md"), encoding="utf-8") as f:
            print(f.read())


def _report_quality(output_dir, models, sets, max_new_tokens, tokenizer, vocab_size) -> None:
    rows = []
    for (task, split), batches in sets.items():
        rows += quality_records(
            models, batches, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id, task=task,
            split=split, vocab_size=vocab_size, vocabulary=tokenizer.vocabulary,
            scorer=models["target"],
        )  # fmt: skip
    write_jsonl_atomic(os.path.join(output_dir, QUALITY_FILE), rows)
    path = os.path.join(output_dir, "quality.md")
    tables.write_markdown(rows, path)
    print(f"Each model's quality (NLL, distinct-4, looping outputs): {path}")
