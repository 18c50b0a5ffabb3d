"""The DISCO run function: per draft the stop classifier, its tuning, and DISCO's Table 1.

    python -m distillspec.disco --gin_file=experiments/disco_quickstart.gin

Registered for gin as `distillspec.disco.disco` by `distillspec.gin_setup`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from distillspec import tables
from distillspec.decoding.lookahead import SOURCES
from distillspec.disco import storage
from distillspec.disco.classifier import (
    ClassifierConfig,
    best_static_sl,
    classifier_f1,
    train_classifier,
)
from distillspec.disco.features import extract_features
from distillspec.disco.tuning import CUMULATIVE_THRESHOLDS, TuningConfig, tune_policies
from distillspec.evaluation.policies import evaluate_policies
from distillspec.feature_converters import single_prompts
from distillspec.records import RECORDS_FILE, policy_list, write_text_atomic
from distillspec.runs.common import open_run, prompt_sets

# What a saved tuning must hold to be reused: static SL-opt and every threshold rule's settings.
TUNED_KEYS = ("static_opt", "confidence", "disco", "cumulative")


def disco(
    output_dir: str,
    target_checkpoint: str,
    drafts: Mapping[str, str],
    train_set: tuple[str, str] = ("stdlib_code", "train"),
    validation_set: tuple[str, str] = ("stdlib_code", "validation"),
    eval_sets: Sequence[tuple[str, str]] = (("stdlib_code", "test"), ("humaneval", "test")),
    task_feature_lengths: Mapping[str, int] = {"inputs": 64, "targets": 64},  # noqa: B006
    num_train_prompts: int = 1024,
    num_validation_prompts: int = 32,
    num_prompts: int = 64,
    batch_size: int = 32,
    top_k: int = 8,
    hidden: int = 32,
    train_steps: int = 2000,
    learning_rate: float = 1e-2,
    static_sl: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
    sl_max_grid: Sequence[int] = (4, 8),
    threshold_grid: Sequence[float] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
    keep_last_grid: Sequence[bool] = (True, False),
    cumulative_threshold_grid: Sequence[float] = CUMULATIVE_THRESHOLDS,
    cumulative_sources: Sequence[str] = SOURCES,
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
    timing_repeats: int = 1,
    cost_profile: str | None = None,
    retrain: bool = False,
    seed: int = 0,
    vocabulary: str | None = None,
    vocab_size: int | None = None,
    tfds_data_dir: str | None = None,
) -> list[dict[str, Any]]:
    """DISCO for each draft: classifier, tuning, and the DISCO Table 1 evaluation.

    Per draft (a Hugging Face or T5X checkpoint directory): features on num_train_prompts of
    train_set and num_validation_prompts of validation_set; the classifier; its F1 against the
    best static-SL rule on validation (Table 4); latency tuning on validation of static SL-opt
    and the confidence, DISCO and cumulative rules (`TuningConfig`), all saved in
    `<draft>/disco/` with the draft's fingerprint (reused unless retrain=True, the draft
    changed, or the tuning lacks a rule or is for other costs than cost_profile's). Then every
    policy is timed at batch 1 on num_prompts of each eval set: records to records.jsonl.
    """
    # Every classifier and tuning setting is checked before any model is loaded.
    classifier_config = ClassifierConfig(
        num_train_prompts=num_train_prompts, num_validation_prompts=num_validation_prompts,
        top_k=top_k, hidden=hidden, train_steps=train_steps, learning_rate=learning_rate,
        seed=seed,
    )  # fmt: skip
    tuning_config = TuningConfig(  # Sequences made tuples there, the cost profile loaded.
        static_sl=static_sl, sl_max_grid=sl_max_grid, threshold_grid=threshold_grid,
        keep_last_grid=keep_last_grid, cumulative_threshold_grid=cumulative_threshold_grid,
        cumulative_sources=cumulative_sources, heuristic_start=heuristic_start,
        oracle_sl_max=oracle_sl_max, timing_repeats=timing_repeats, cost_profile=cost_profile,
    )  # fmt: skip
    tokenizer, target, target_params, loaded, names = open_run(
        "disco", output_dir, target_checkpoint, drafts, vocabulary,
        [train_set, validation_set, *eval_sets], vocab_size, tfds_data_dir,
    )  # fmt: skip
    train_set, validation_set, *eval_sets = names
    common = dict(
        max_new_tokens=task_feature_lengths["targets"], eos_id=tokenizer.eos_id,
        vocab_size=vocab_size,
    )  # fmt: skip
    sets_of = functools.partial(
        prompt_sets, lengths=task_feature_lengths, batch_size=batch_size,
        bos_id=tokenizer.prompt_bos,
    )  # fmt: skip
    sets = sets_of(eval_sets, num_prompts=num_prompts)
    models, f1_rows = {}, []
    for name, path in drafts.items():
        draft, draft_params = loaded[name]
        if top_k > (vocab_size or draft.vocab_size):  # Before any feature is extracted.
            raise ValueError(
                f"top_k ({top_k}) exceeds the vocabulary of draft {name!r} "
                f"({vocab_size or draft.vocab_size})"
            )
        classifier, metadata = _trained_classifier(
            name, path, target, target_params, draft, draft_params, retrain=retrain,
            prompt_sets=sets_of, train_set=train_set, validation_set=validation_set,
            config=classifier_config, tuning=tuning_config, **common,
        )  # fmt: skip
        models[name] = (draft, draft_params, classifier, metadata["tuning"])
        f1_rows.append(
            f"| {name} | {'/'.join(validation_set)} | {metadata['f1_static_sl']:.3f} "
            f"(SL-{metadata['f1_static_sl_k']}) | {metadata['f1_disco']:.3f} |"
        )
    f1_table = "\n".join(
        ["| Draft | Validation set | F1 static-SL | F1 DISCO |", "|---|---|---|---|", *f1_rows]
    )
    write_text_atomic(os.path.join(output_dir, "disco_f1.md"), f1_table + "\n")
    records_path = os.path.join(output_dir, RECORDS_FILE)
    records = evaluate_policies(
        target, target_params, models, sets, policy_list(static_sl), num_prompts=num_prompts,
        records_path=records_path, timing_repeats=timing_repeats,
        heuristic_sl_max=max(sl_max_grid), heuristic_start=heuristic_start,
        oracle_sl_max=oracle_sl_max, context={"dtype": "float32"}, **common,
    )  # fmt: skip
    print(tables.format_report(records_path, output_dir))
    print("\nClassifier F1 on validation (DISCO Table 4):\n" + f1_table)
    return records


def _reusable(name: str, directory: str, draft, draft_params, vocab_size: int | None,
              profile: dict[str, Any] | None):  # fmt: skip
    """(variables, metadata) of a saved classifier made for this very draft and tuned for these
    costs (profile: a deployment's, None: this machine's), else None."""
    if not os.path.isfile(os.path.join(directory, storage.METADATA_FILE)):
        return None
    try:
        variables, metadata = storage.load_classifier(directory, draft, draft_params, vocab_size)
    except ValueError as e:  # Another draft's classifier: made anew.
        print(f"[disco] {name}: {e}", file=sys.stderr)
        return None
    missing = [key for key in TUNED_KEYS if key not in metadata.get("tuning", {})]
    if missing:  # Saved before a tuned policy existed (the cumulative rule): made anew.
        print(
            f"[disco] {name}: the saved tuning in {directory} lacks {missing} (saved before "
            "those policies existed); training and tuning again",
            file=sys.stderr,
        )
        return None
    saved = metadata["tuning"].get("cost_profile")
    if json.loads(json.dumps(profile)) != saved:  # The JSON file's keys are strings.
        print(f"[disco] {name}: the saved tuning in {directory} was made for other call costs; "
              "tuning again", file=sys.stderr)  # fmt: skip
        return None
    print(f"[disco] {name}: reusing the classifier in {directory}", file=sys.stderr)
    return variables, metadata


def _trained_classifier(
    name, path, target, target_params, draft, draft_params, *, retrain, prompt_sets, train_set,
    validation_set, config: ClassifierConfig, tuning: TuningConfig, max_new_tokens, eos_id,
    vocab_size,
):  # fmt: skip
    """The draft's classifier and metadata: loaded if saved for this very draft, else made."""
    directory = storage.classifier_dir(path)
    saved = None
    if not retrain:
        saved = _reusable(name, directory, draft, draft_params, vocab_size, tuning.profile)
    if saved is not None:
        return saved
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab_size)
    features = functools.partial(
        extract_features, target, target_params, draft, draft_params, top_k=config.top_k, **common
    )
    train_batches = prompt_sets([train_set], num_prompts=config.num_train_prompts)
    train = features(train_batches[tuple(train_set)])
    valid_batches = prompt_sets([validation_set], num_prompts=config.num_validation_prompts)
    valid_batches = valid_batches[tuple(validation_set)]
    valid = features(valid_batches)
    variables = train_classifier(
        train, hidden=config.hidden, steps=config.train_steps,
        learning_rate=config.learning_rate, seed=config.seed,
    )  # fmt: skip
    static_k, static_f1 = best_static_sl(valid)
    f1 = classifier_f1(variables, valid)
    print(
        f"[disco] {name}: {len(train)} training tokens (accept rate {train.y.mean():.3f}); "
        f"validation F1 DISCO {f1:.3f} vs best static SL-{static_k} {static_f1:.3f}",
        file=sys.stderr,
        flush=True,
    )
    valid_prompts = single_prompts(valid_batches)[: config.num_validation_prompts]
    tuned = tune_policies(
        target, target_params, draft, draft_params, valid_prompts, variables,
        static_sl=tuning.static_sl, sl_max_grid=tuning.sl_max_grid,
        threshold_grid=tuning.threshold_grid, keep_last_grid=tuning.keep_last_grid,
        cumulative_threshold_grid=tuning.cumulative_threshold_grid,
        cumulative_sources=tuning.cumulative_sources, timing_repeats=tuning.timing_repeats,
        profile=tuning.profile, **common,
    )  # fmt: skip
    metadata = {
        "fingerprint": storage.fingerprint(draft, draft_params, vocab_size),
        "vocab_size": vocab_size or draft.vocab_size,
        "draft_checkpoint": os.path.abspath(path),
        "train_set": list(train_set),
        "validation_set": list(validation_set),
        "num_train_tokens": len(train),
        "f1_disco": f1,
        "f1_static_sl": static_f1,
        "f1_static_sl_k": static_k,
        "tuning": tuned,
    }
    storage.save_classifier(directory, variables, metadata)
    print(
        f"[disco] {name}: static SL-opt {tuned['static_opt']}, confidence "
        f"{tuned['confidence']}, disco {tuned['disco']}, cumulative {tuned['cumulative']}; "
        f"saved in {directory}",
        file=sys.stderr,
        flush=True,
    )
    return variables, metadata
