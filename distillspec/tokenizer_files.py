"""A checkpoint directory's tokenizer files and special-token ids, read without seqio.

`vocabularies` builds a run's tokenizer from them; `serving` (the serve check) compares a
draft's with its target's, and stays cheap to import (no TensorFlow) for that.
"""

from __future__ import annotations

import json
import os

import sentencepiece as spm

# Files a checkpoint directory may hold its tokenizer in, in the order they are preferred.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model")


def read_json(path: str) -> dict:
    """A JSON file's object; {} when there is no such file."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def first_id(*values) -> int | None:
    """The first value that is set; a list (several EOS ids) gives its first element; a
    negative id (SentencePiece's -1 for "none") reads as unset."""
    for value in values:
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None and int(value) >= 0:
            return int(value)
    return None


def checkpoint_special_ids(checkpoint: str | None) -> dict[str, int | None]:
    """{'bos', 'eos', 'pad'} ids of a checkpoint directory's generation_config.json, else its
    config.json (None where neither says)."""
    if not checkpoint:
        return {"bos": None, "eos": None, "pad": None}
    config = read_json(os.path.join(checkpoint, "config.json"))
    generation = read_json(os.path.join(checkpoint, "generation_config.json"))
    return {
        name: first_id(generation.get(f"{name}_token_id"), config.get(f"{name}_token_id"))
        for name in ("bos", "eos", "pad")
    }


def tokenizer_file(directory: str) -> str | None:
    """The directory's first tokenizer file of TOKENIZER_FILES, or None."""
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def token_strings(path: str) -> list[str | None]:
    """The token of each id of a tokenizer file (tokenizer.json or a SentencePiece model),
    for comparing two tokenizers' vocabularies rather than their sizes."""
    if path.endswith(".json"):
        import tokenizers

        try:
            vocab = tokenizers.Tokenizer.from_file(path).get_vocab()
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file.
            raise ValueError(f"cannot read the tokenizer {path!r}: {e}") from None
        out: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            out[i] = token
        return out
    model = spm.SentencePieceProcessor(model_file=path)
    return [model.id_to_piece(i) for i in range(model.get_piece_size())]
