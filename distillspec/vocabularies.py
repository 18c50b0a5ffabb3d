"""Vocabularies: the embedded default's SentencePiece model (trained once, cached) and bytes.

`get_vocabulary('sentencepiece')` is BPE trained on the stdlib_code train split, with byte
fallback and whitespace and newlines kept exactly, cached on disk under `default_cache_dir()`
(`$DISTILLSPEC_CACHE`, else ~/.cache/distillspec); 'byte' is UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import tempfile
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm
import seqio

from distillspec import corpus

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
    return seqio.SentencePieceVocabulary(str(path))
