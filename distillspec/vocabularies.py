"""Vocabularies: the embedded default's SentencePiece model (trained once, cached) and bytes.

`get_vocabulary('sentencepiece')` is BPE trained on the stdlib_code train split, with byte
fallback and whitespace and newlines kept exactly, cached on disk under `default_cache_dir()`
(`$DISTILLSPEC_CACHE`, else ~/.cache/distillspec); 'byte' is UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np
import sentencepiece as spm
import seqio

from distillspec import console, corpus
from distillspec.tokenizer_files import (  # noqa: F401  (checkpoint_special_ids: re-exported)
    TOKENIZER_FILES,
    checkpoint_special_ids,
    token_strings,
)
from distillspec.tokenizer_files import first_id as _first_id
from distillspec.tokenizer_files import read_json as _read_json
from distillspec.tokenizer_files import tokenizer_file as _tokenizer_file

CACHE_ENV_VAR = "DISTILLSPEC_CACHE"
VOCABULARY_NAMES = ("sentencepiece", "byte")
DEFAULT_VOCAB_SIZE = 2048
# Lines sampled for SentencePiece training; the full train split (~72k lines) trains in ~1 s
# with BPE, so this cap only matters for larger custom corpora.
_SPM_MAX_LINES = 200_000


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
    return _QuietSentencePieceVocabulary(str(path))


# ----------------------------------------------------------------------------------------------
# A user's tokenizer: Hugging Face tokenizer.json, a SentencePiece model, or a checkpoint's.

# Files copied beside them into an export so that `AutoTokenizer.from_pretrained` works.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HFTokenizerVocabulary(seqio.Vocabulary):
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) as a seqio vocabulary.

    Text is encoded without the tokenizer's special tokens (prompt and completion are joined
    by the pipeline, which adds BOS and EOS itself, see `Tokenizer`).
    """

    def __init__(self, path: str | os.PathLike, *, eos_id: int | None, bos_id: int | None):
        import tokenizers

        self.path = os.fspath(path)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file.
            raise ValueError(f"cannot read the tokenizer {self.path!r}: {e}") from None
        self._eos_id, self._bos_id = eos_id, bos_id
        super().__init__(extra_ids=0)

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def unk_id(self) -> int | None:
        model = self._tokenizer.model
        unk = getattr(model, "unk_token", None)
        return self._tokenizer.token_to_id(unk) if unk else None

    @property
    def _base_vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _encode(self, s: str) -> list[int]:
        return self._tokenizer.encode(s, add_special_tokens=False).ids

    def _decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _encode_tf(self, s):
        import tensorflow as tf

        encode = lambda x: np.asarray(self._encode(x.numpy().decode("utf-8")), np.int32)
        ids = tf.py_function(encode, [s], tf.int32)
        ids.set_shape([None])
        return ids

    def _decode_tf(self, ids):
        import tensorflow as tf

        text = tf.py_function(lambda x: self._decode(x.numpy().tolist()), [ids], tf.string)
        text.set_shape([])
        return text

    def prepends_bos(self) -> bool:
        """Whether the tokenizer's own post-processor puts BOS first (as Llama's does)."""
        with_special = self._tokenizer.encode("a", add_special_tokens=True).ids
        return bool(self._bos_id is not None and with_special[:1] == [self._bos_id])

    def __eq__(self, other) -> bool:
        return isinstance(other, HFTokenizerVocabulary) and (
            self.path,
            self._eos_id,
            self._bos_id,
        ) == (other.path, other._eos_id, other._bos_id)

    def __hash__(self) -> int:
        return hash((self.path, self._eos_id, self._bos_id))


class _QuietSentencePieceVocabulary(seqio.SentencePieceVocabulary):
    """seqio's SentencePiece vocabulary with one TF tokenizer, loaded quietly.

    seqio builds a new TF Text tokenizer at every `tf_tokenizer` access, and each one loads the
    model when a tf.data pipeline first runs it, logging "precompiled_charsmap is empty" from C++
    (outside any Python block that could silence it). This one is built once, its model loaded
    eagerly (`tf.init_scope`, even when first asked for inside a pipeline's graph) under
    `console.native_logs_silenced()`; pipelines then capture the loaded model.
    """

    @functools.cached_property
    def tf_tokenizer(self):
        import tensorflow as tf  # seqio imports it already.

        with tf.init_scope(), console.native_logs_silenced():
            tokenizer = super().tf_tokenizer
            tokenizer.tokenize("")  # Loads the model now, once.
        return tokenizer


class _SentencePieceWithIds(_QuietSentencePieceVocabulary):
    """A SentencePiece model whose EOS / BOS ids come from its checkpoint's config."""

    def __init__(self, path: str, *, eos_id: int | None, bos_id: int | None):
        super().__init__(path)
        self._eos_override, self._bos_override = eos_id, bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_override

    @property
    def bos_id(self) -> int | None:
        return self._bos_override


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A vocabulary with the special tokens the models were trained with.

    The pipeline prepends `bos_id` to every prompt when `add_bos` (the tokenizer's own
    post-processor would), ends completions with `eos_id`, pads with `pad_id` (masked
    everywhere by lengths and weights), and ends encoder-decoder prompts with EOS.
    """

    vocabulary: seqio.Vocabulary
    bos_id: int | None  # Beginning of sequence; None when the tokenizer has none.
    eos_id: int | None  # End of sequence: completions end with it, decoding stops at it.
    pad_id: int  # Padding id of the models' config (0 for T5 and the built-ins).
    add_bos: bool  # Prepend BOS to prompts.
    source: str  # Where it came from: a built-in name or a file.
    files: tuple[tuple[str, str], ...] = ()  # (file, name in an export) to copy on export.

    @property
    def size(self) -> int:
        """Number of ids the tokenizer can produce (every id < size)."""
        return int(self.vocabulary.vocab_size)

    @property
    def prompt_bos(self) -> int | None:
        """The id put before every prompt, or None."""
        return self.bos_id if self.add_bos else None

    @property
    def special_ids(self) -> dict[str, int | None]:
        """{'bos', 'eos', 'pad'} as a checkpoint's config states them."""
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}

    def save(self, directory: str) -> list[str]:
        """Copies the tokenizer files into `directory` (an export), with a tokenizer_config.json
        when the source has none, so that `transformers.AutoTokenizer` loads them.

        Returns:
          The names written ([] for the byte vocabulary, which has no file).
        """
        os.makedirs(directory, exist_ok=True)
        written = []
        for source, name in self.files:
            shutil.copyfile(source, os.path.join(directory, name))
            written.append(name)
        if written and "tokenizer_config.json" not in written:
            config = {
                "tokenizer_class": "LlamaTokenizer" if written[0] == "tokenizer.model" else None,
                "add_bos_token": self.add_bos, "add_eos_token": False, "legacy": False,
                "add_prefix_space": False, "model_max_length": 1 << 20,
            }  # fmt: skip
            config = {k: v for k, v in config.items() if v is not None}
            for key, value in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id)):
                if value is not None and 0 <= value < self.size:
                    config[f"{key}_token"] = self.vocabulary.decode([value]) or None
            write = os.path.join(directory, "tokenizer_config.json")
            with open(write, "w", encoding="utf-8") as f:
                json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)
            written.append("tokenizer_config.json")
        return written

    def describe(self) -> str:
        """One line for the run's log and config.gin."""
        bos = f"BOS {self.bos_id} prepended" if self.add_bos else f"BOS {self.bos_id} not added"
        return (
            f"tokenizer {self.source}: {self.size} ids; EOS {self.eos_id}, {bos}, pad {self.pad_id}"
        )


def check_same_vocabulary(checkpoints_by_name: Mapping[str, str | None]) -> None:
    """Checkpoint directories that hold tokenizer files must hold the same vocabulary (the
    same token at every id); else ValueError naming both files and how many ids agree.

    Two tokenizers of one size with the same special ids still map most ids to other tokens,
    and speculative decoding compares the models' distributions id by id: such a draft
    accepts almost nothing, so its alpha would be a wrong number, not a measurement.
    """
    files = {
        name: found
        for name, path in checkpoints_by_name.items()
        if path and os.path.isdir(path) and (found := _tokenizer_file(path)) is not None
    }
    if len(files) < 2:
        return
    (first, first_file), *rest = files.items()
    reference = token_strings(first_file)
    for name, path in rest:
        tokens = token_strings(path)
        if tokens == reference:
            continue
        agree = sum(a == b for a, b in zip(tokens, reference))
        raise ValueError(
            f"the tokenizers differ: {name} has {path} ({len(tokens)} ids) and {first} has "
            f"{first_file} ({len(reference)} ids), which give the same token for only {agree} "
            "ids; speculative decoding and distillation compare the models id by id, so the "
            f"{name} must use the {first}'s tokenizer (a draft trained with "
            "train.teacher_checkpoint = the target exports the target's tokenizer)"
        )


def load_tokenizer(spec: str | seqio.Vocabulary | None, checkpoint: str | None = None) -> Tokenizer:
    """The tokenizer of a run, with the special tokens of the checkpoint it serves.

    Args:
      spec: 'sentencepiece' or 'byte' (built in); a path to a Hugging Face `tokenizer.json`, a
        SentencePiece `.model`, or a directory holding one (`TOKENIZER_FILES`); a
        `seqio.Vocabulary`; or None: the tokenizer files of `checkpoint` (an error when it has
        none), or the embedded default 'sentencepiece' when there is no checkpoint.
      checkpoint: the target (teacher) checkpoint directory, whose config.json /
        generation_config.json give the special token ids.

    Raises:
      ValueError / FileNotFoundError: an unknown name, a missing or unreadable file, or special
        tokens of the checkpoint that the chosen vocabulary does not have.
    """
    ids = checkpoint_special_ids(checkpoint if checkpoint and os.path.isdir(checkpoint) else None)
    if spec is None and checkpoint and os.path.isdir(checkpoint):
        spec = _tokenizer_file(checkpoint)
        if spec is None:  # Guessing the embedded default for a user's model would be silent.
            raise ValueError(
                f"the checkpoint {checkpoint!r} holds no tokenizer file {TOKENIZER_FILES}; pass "
                "its tokenizer as vocabulary = <path of tokenizer.json or the SentencePiece "
                "model> (e.g. --gin.train.vocabulary=...), or 'sentencepiece' / 'byte' for the "
                "built-in ones"
            )
    spec = "sentencepiece" if spec is None else spec
    if isinstance(spec, seqio.Vocabulary) or spec in VOCABULARY_NAMES:
        vocab = spec if isinstance(spec, seqio.Vocabulary) else get_vocabulary(spec)
        source = type(vocab).__name__ if isinstance(spec, seqio.Vocabulary) else f"'{spec}'"
        for name, own in (("eos", vocab.eos_id), ("pad", vocab.pad_id)):
            if ids[name] is not None and ids[name] != own:
                raise ValueError(
                    f"the checkpoint {checkpoint!r} says {name}_token_id={ids[name]}, but the "
                    f"vocabulary {source} uses {own}; pass the target's own tokenizer "
                    "(vocabulary = the path of its tokenizer.json or SentencePiece model)"
                )
        files = ()
        if isinstance(vocab, seqio.SentencePieceVocabulary):  # The embedded default's model.
            files = ((vocab.sentencepiece_model_file, "tokenizer.model"),)
        bos, eos = _first_id(vocab.bos_id), _first_id(vocab.eos_id)
        return Tokenizer(vocab, bos, eos, vocab.pad_id, False, source, files)
    return _tokenizer_from_path(os.fspath(spec), ids)


def _tokenizer_from_path(path: str, ids: dict[str, int | None]) -> Tokenizer:
    valid = (
        f"valid: {VOCABULARY_NAMES}, a tokenizer.json, a SentencePiece .model, or a directory "
        f"holding one of {TOKENIZER_FILES}"
    )
    if os.path.isdir(path):
        found = _tokenizer_file(path)
        if found is None:
            raise FileNotFoundError(f"no tokenizer file in {path!r}; {valid}")
        path = found
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"vocabulary {path!r} is neither a built-in name nor a file; {valid}"
        )
    directory = os.path.dirname(path)
    side = tuple(
        p for p in (os.path.join(directory, n) for n in TOKENIZER_SIDE_FILES) if os.path.isfile(p)
    )
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    if path.endswith(".json"):
        probe = HFTokenizerVocabulary(path, eos_id=None, bos_id=None)._tokenizer
        named = lambda key: _token_id(probe.token_to_id, config.get(key))
        eos = _first_id(ids["eos"], named("eos_token"))
        bos = _first_id(ids["bos"], named("bos_token"))
        vocab = HFTokenizerVocabulary(path, eos_id=eos, bos_id=bos)
        add_bos = vocab.prepends_bos()
    else:
        try:
            model = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"cannot read the SentencePiece model {path!r}: {e}") from None
        own = lambda i: i if i >= 0 else None
        eos = _first_id(ids["eos"], own(model.eos_id()))
        bos = _first_id(ids["bos"], own(model.bos_id()))
        vocab = _SentencePieceWithIds(path, eos_id=eos, bos_id=bos)
        add_bos = bool(bos is not None and config.get("add_bos_token", False))
    if eos is None:
        raise ValueError(f"the tokenizer {path!r} has no EOS token and the checkpoint names none")
    pad = _first_id(ids["pad"], 0)
    files = ((path, os.path.basename(path)), *((p, os.path.basename(p)) for p in side))
    return Tokenizer(vocab, bos, eos, pad, add_bos, path, files)


def _token_id(token_to_id, token) -> int | None:
    """The id of a token given as tokenizer_config.json writes it (a string or a dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token_to_id(token) if token else None
