"""DISCO's classifier beside its draft: DRAFT/disco/classifier.safetensors + classifier.json.

The metadata holds a fingerprint of the draft's weights and vocabulary, which loading checks, so
a classifier is never used with a draft it was not trained for.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distillspec.decoding import lookahead
from distillspec.records import write_atomic, write_text_atomic

WEIGHTS_FILE = "classifier.safetensors"
METADATA_FILE = "classifier.json"
REQUIRED_METADATA = ("fingerprint", "vocab_size", "top_k", "hidden")
RETRAIN_HINT = "python -m distillspec.disco"


def fingerprint(model, params, vocab_size: int | None) -> str:
    """sha256 hex digest identifying a draft: class name, config, vocab_size and every weight.

    Leaves are hashed in the order of their key paths (path, shape, dtype, bytes), so any change
    to a weight, the architecture or the vocabulary changes the digest. vocab_size None reads as
    the model's own `vocab_size` (what the decoders use then).
    """
    vocab = model.vocab_size if vocab_size is None else vocab_size
    digest = hashlib.sha256()

    def add(data: bytes) -> None:  # Length-prefixed, so fields cannot run into each other.
        digest.update(len(data).to_bytes(8, "little") + data)

    add(type(model).__name__.encode())
    add(repr(getattr(model, "config", model)).encode())
    add(str(int(vocab)).encode())
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(
        ((jax.tree_util.keystr(p), x) for p, x in leaves), key=lambda item: item[0]
    ):
        array = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
        add(path.encode())
        add(repr(array.shape).encode())
        add(str(array.dtype).encode())
        add(array.tobytes())
    return digest.hexdigest()


def classifier_dir(draft_checkpoint: str) -> str:
    """Where the classifier of a draft checkpoint lives: DRAFT_CHECKPOINT/disco."""
    return os.path.join(os.fspath(draft_checkpoint), "disco")


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for key, value in tree.items():
        if "/" in str(key):
            raise ValueError(f"variable names must not contain '/', got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = np.ascontiguousarray(np.asarray(jax.device_get(value), np.float32))
    return flat


def _unflatten(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return tree


def _check_variables(variables: Any, where: str) -> tuple[int, int]:
    """(top_k, hidden) of classifier variables; ValueError if they are not StopClassifier's."""
    try:
        kernel = variables["params"]["hidden"]["kernel"]
        width = np.shape(variables["norm"]["mean"])[0]
        if np.shape(variables["norm"]["std"]) != (width,) or "out" not in variables["params"]:
            raise KeyError("'out' or a norm 'std' of the width of 'mean'")
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(
            f"{where}: not StopClassifier variables {{'params': {{'hidden', 'out'}}, "
            f"'norm': {{'mean', 'std'}}}} (missing {e})"
        ) from None
    if width != np.shape(kernel)[0]:
        raise ValueError(f"{where}: norm has {width} features, the FFN {np.shape(kernel)[0]}")
    return lookahead.classifier_top_k(variables), int(np.shape(kernel)[1])


def save_classifier(directory: str, variables: Any, metadata: Mapping[str, Any]) -> None:
    """Writes DIRECTORY/classifier.safetensors (variables, '/'-joined keys) and
    DIRECTORY/classifier.json (metadata), each atomically (temporary file + os.replace).

    Args:
      directory: created if missing; conventionally `classifier_dir(draft_checkpoint)`.
      variables: StopClassifier variables {'params', 'norm'} (`train_classifier`).
      metadata: JSON-serialisable; must hold 'fingerprint' (`fingerprint` of the draft) and
        'vocab_size'; 'top_k' and 'hidden' are filled in from the variables (a passed value
        must agree with them); anything else (thresholds, F1 scores) is kept as is.
    """
    top_k, hidden = _check_variables(variables, "save_classifier")
    metadata = dict(metadata)
    for key in ("fingerprint", "vocab_size"):
        if key not in metadata:
            raise ValueError(
                f"save_classifier: metadata lacks {key!r}; it needs {REQUIRED_METADATA}"
            )
    for key, value in (("top_k", top_k), ("hidden", hidden)):
        if metadata.setdefault(key, value) != value:
            raise ValueError(
                f"save_classifier: metadata[{key!r}]={metadata[key]!r} but the variables have "
                f"{key}={value}"
            )
    text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"  # Fails before any write.
    tensors = _flatten(variables)
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    write_atomic(os.path.join(directory, WEIGHTS_FILE), lambda tmp: save_file(tensors, tmp))
    write_text_atomic(os.path.join(directory, METADATA_FILE), text)


def load_classifier(
    directory: str, draft=None, draft_params=None, vocab_size: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads a classifier written by `save_classifier`, checking it fits the draft.

    Args:
      directory: the classifier's directory (`classifier_dir(draft_checkpoint)`).
      draft, draft_params: if given (both), the draft the classifier will serve: its
        `fingerprint` (with vocab_size, else the draft's own) must equal the stored one.
      vocab_size: if given, must equal the stored vocab_size.

    Returns:
      (variables for `lookahead.classifier_confidence`, metadata dict).

    Raises:
      FileNotFoundError: a file is missing (train one with `python -m distillspec.disco`).
      ValueError: the classifier was trained for another draft or vocabulary.
    """
    directory = os.fspath(directory)
    for name in (WEIGHTS_FILE, METADATA_FILE):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no DISCO classifier at {path}; train one for this draft with {RETRAIN_HINT}"
            )
    with open(os.path.join(directory, METADATA_FILE), encoding="utf-8") as f:
        metadata = json.load(f)
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:
        raise ValueError(
            f"{os.path.join(directory, METADATA_FILE)} lacks {missing}; retrain the classifier "
            f"with {RETRAIN_HINT}"
        )
    from safetensors.numpy import load_file

    variables = _unflatten(load_file(os.path.join(directory, WEIGHTS_FILE)))
    top_k, hidden = _check_variables(variables, f"classifier in {directory}")
    if (top_k, hidden) != (metadata["top_k"], metadata["hidden"]):
        raise ValueError(
            f"classifier in {directory}: weights have top_k={top_k}, hidden={hidden} but "
            f"{METADATA_FILE} says top_k={metadata['top_k']}, hidden={metadata['hidden']}"
        )
    if vocab_size is not None and vocab_size != metadata["vocab_size"]:
        raise ValueError(
            f"classifier in {directory} was trained for vocab_size={metadata['vocab_size']}, "
            f"but vocab_size={vocab_size} was requested; retrain it with {RETRAIN_HINT}"
        )
    if (draft is None) != (draft_params is None):
        raise ValueError("load_classifier: pass both draft and draft_params, or neither")
    if draft is not None:
        expected = fingerprint(draft, draft_params, vocab_size)
        if expected != metadata["fingerprint"]:
            raise ValueError(
                f"classifier in {directory} was trained for a different draft or vocabulary "
                f"(fingerprint {metadata['fingerprint']} != {expected}); retrain it with "
                f"{RETRAIN_HINT}"
            )
    return variables, metadata
