"""DISCO's stop classifier: training data, training, F1 evaluation and storage beside the draft.

DISCO (`../shared/seeds/003_7d9b24111ea17171.txt`, Sec. 3 and App. D) stops drafting once a
small classifier's confidence that the next draft token will be accepted falls below a
threshold. The classifier itself (`distillspec.lookahead.StopClassifier`, features
`lookahead.features`) runs inside the decoder's jitted loop; this module produces it:

  extract_features   App. D.1: the target decodes greedily; the draft predicts every token of
                     that continuation from the target's prefix (one teacher-forced pass);
                     label 1 where the draft's argmax equals the target's token.
  train_classifier   the 2-layer FFN on those examples, binary cross-entropy, Adam.
  classifier_f1      App. D.2 / Table 4 "F1 DISCO": F1 of the accepted class at a threshold.
  static_sl_f1       Table 4 "F1 static-SL": F1 of the rule "accepted iff the token's index in
                     the oracle's speculation round is < k" (see `in_round_index`).
  save_classifier    classifier.safetensors + classifier.json in `classifier_dir(draft)`, with
  load_classifier    a fingerprint of the draft's weights and vocabulary that loading checks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from distillspec import evaluate, lookahead
from distillspec.datagen import is_encoder_decoder
from distillspec.decoding import generate, shared_vocab_size

WEIGHTS_FILE = "classifier.safetensors"
METADATA_FILE = "classifier.json"
REQUIRED_METADATA = ("fingerprint", "vocab_size", "top_k", "hidden")
RETRAIN_HINT = "python -m distillspec.disco"
_STEPS_PER_CALL = 250  # Training steps per jitted lax.scan call.


# --------------------------------------------------------------------------------------------
# Training examples (DISCO App. D.1).
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Examples:
    """Labelled draft tokens: one row per token of the target's greedy continuations.

    Rows of one sequence are stored in increasing `position`. F = top_k + 2 features.
    """

    x: np.ndarray  # [M, F] float32 `lookahead.features` of the draft's distribution.
    y: np.ndarray  # [M] int32, 1 = the draft's argmax equals the target's token (accepted).
    sequence: np.ndarray  # [M] int32, the prompt the token belongs to (see extract_features).
    position: np.ndarray  # [M] int32, tokens generated before this one in its sequence (n).

    def __post_init__(self):
        m = np.shape(self.y)
        if np.ndim(self.x) != 2 or np.shape(self.x)[:1] != m or len(m) != 1:
            raise ValueError(f"Examples needs x [M, F] and y [M]; got {np.shape(self.x)}, {m}")
        if np.shape(self.sequence) != m or np.shape(self.position) != m:
            raise ValueError(
                f"Examples needs sequence and position of shape {m}; got "
                f"{np.shape(self.sequence)} and {np.shape(self.position)}"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def top_k(self) -> int:
        """The top_k the features were extracted with (F - 2)."""
        return int(self.x.shape[1]) - 2

    def select(self, mask: np.ndarray) -> Examples:
        """The rows where the [M] bool mask is True (e.g. a split by `sequence`)."""
        mask = np.asarray(mask, bool)
        return Examples(self.x[mask], self.y[mask], self.sequence[mask], self.position[mask])


@functools.lru_cache(maxsize=32)
def _features_fn(draft, top_k: int, vocab_size: int):
    """Jitted (params, packed batch, weights [B, L], completion [B, N]) -> (x [B, N, F], y)."""

    def fn(params, batch, weights, completion):
        logits = draft.logits(params, batch)  # [B, L, V]; position t predicts token t + 1.
        # The weighted positions of a row are the ones predicting completion tokens 0 .. n-1
        # (pack_teacher_forcing, either family): the first of them predicts token 0.
        offset = jnp.argmax(weights > 0, axis=1).astype(jnp.int32)
        n = jnp.arange(completion.shape[1], dtype=jnp.int32)
        index = jnp.minimum(offset[:, None] + n, logits.shape[1] - 1)  # [B, N]
        picked = jnp.take_along_axis(logits, index[..., None], axis=1)  # [B, N, V]
        x = lookahead.features(picked, jnp.broadcast_to(n, index.shape), top_k, vocab_size)
        guess = jnp.argmax(picked[..., :vocab_size], axis=-1)
        return x, (guess == completion).astype(jnp.int32)

    return jax.jit(fn)


def extract_features(
    target,
    target_params,
    draft,
    draft_params,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    top_k: int = 8,
    vocab_size: int | None = None,
) -> Examples:
    """Labelled classifier examples along the target's greedy continuations (DISCO App. D.1).

    For every valid prompt row the target decodes greedily (`decoding.generate`). One
    teacher-forced pass of the draft over prompt + that continuation then gives, at each
    generated position n (0 .. length - 1), the draft's logits predicting token n from the
    target's prefix: the example's features are `lookahead.features(logits, n, top_k,
    vocab_size)`, and its label is 1 (accepted) if the draft's argmax over the first vocab_size
    ids equals the target's token n, else 0 (rejected). Progress goes to stderr.

    Args:
      target, target_params: the target model and its parameters.
      draft, draft_params: the draft model (same family as the target, with a `logits`
        teacher-forcing method) and its parameters.
      batches: prompt batches {'prompt_tokens' [B, P], 'prompt_lengths' [B], optional
        'valid' [B] bool} (`tasks.prompt_batches`); rows with valid=False are skipped.
      max_new_tokens: N, tokens the target generates per prompt at most.
      eos_id: the target stops after emitting it (the EOS token is an example too); None: never.
      top_k: top draft probabilities in the features, in [1, vocab_size].
      vocab_size: the shared vocabulary (`decoding.shared_vocab_size`); None: the models'.

    Returns:
      Examples; `sequence` numbers the valid prompt rows 0, 1, ... in the order they are met
      across batches, and `position` is n.
    """
    vocab = shared_vocab_size(target, draft, vocab_size)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be an integer in [1, vocab_size={vocab}], got {top_k!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if is_encoder_decoder(target) != is_encoder_decoder(draft):
        raise ValueError("target and draft must both be decoder-only or both encoder-decoder")
    if not hasattr(draft, "logits"):
        raise ValueError(
            f"the draft ({type(draft).__name__}) has no teacher-forcing `logits` method; "
            "extract_features needs a DecoderOnlyLM or T5LM draft"
        )
    fn = _features_fn(draft, top_k, vocab)
    xs, ys, sequences, positions = [], [], [], []
    num_sequences = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = tqdm.tqdm(batches, total=total, desc="disco features", unit="batch", file=sys.stderr)
    for i, batch in enumerate(bar):
        if "prompt_tokens" not in batch or "prompt_lengths" not in batch:
            raise ValueError(f"batches[{i}] lacks 'prompt_tokens' / 'prompt_lengths'")
        valid = evaluate.valid_rows(batch).astype(bool)
        if not valid.any():
            continue
        decodable = evaluate.decodable(batch)
        prompt_tokens, prompt_lengths = decodable["prompt_tokens"], decodable["prompt_lengths"]
        result = generate(
            target, target_params, prompt_tokens, prompt_lengths,
            max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab,
        )  # fmt: skip
        packed, weights = evaluate.pack_teacher_forcing(
            prompt_tokens, prompt_lengths, result.tokens, result.lengths,
            encoder_decoder=is_encoder_decoder(draft),
        )  # fmt: skip
        completion = jnp.asarray(result.tokens, jnp.int32)
        x, y = jax.device_get(fn(draft_params, packed, weights, completion))
        n = np.arange(result.tokens.shape[1])
        keep = valid[:, None] & (n < np.asarray(result.lengths)[:, None])  # [B, N]
        rows = np.cumsum(valid) - 1 + num_sequences  # Sequence ids of the valid rows.
        xs.append(np.asarray(x, np.float32)[keep])
        ys.append(np.asarray(y, np.int32)[keep])
        sequences.append(np.broadcast_to(rows[:, None], keep.shape)[keep].astype(np.int32))
        positions.append(np.broadcast_to(n, keep.shape)[keep].astype(np.int32))
        num_sequences += int(valid.sum())
        bar.set_postfix(prompts=num_sequences, tokens=sum(len(v) for v in ys))
    bar.close()
    if not xs:
        raise ValueError("batches holds no valid prompt rows (none, or every row valid=False)")
    return Examples(
        np.concatenate(xs), np.concatenate(ys), np.concatenate(sequences), np.concatenate(positions)
    )


# --------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------


def _check_examples(examples: Examples, what: str) -> None:
    if len(examples) == 0:
        raise ValueError(f"{what}: examples is empty (no labelled tokens)")
    if examples.top_k < 1:
        raise ValueError(
            f"{what}: examples.x must have top_k + 2 >= 3 columns, got shape {examples.x.shape}"
        )


def train_classifier(
    examples: Examples,
    *,
    hidden: int = 32,
    steps: int = 2000,
    learning_rate: float = 1e-2,
    batch_size: int = 1024,
    seed: int = 0,
) -> dict[str, Any]:
    """Trains DISCO's stop classifier (`lookahead.StopClassifier`) on labelled examples.

    The 'norm' collection holds the mean and standard deviation (floored at 1e-6) of the
    training features; the FFN minimises the binary cross-entropy of its logit against the
    labels with Adam, on minibatches drawn (with replacement) by a numpy RNG seeded with `seed`,
    which also seeds the initialisation: the result is a function of the arguments.

    Args:
      examples: training examples (`extract_features`), with both labels present.
      hidden: width of the hidden layer, >= 1.
      steps: optimisation steps, >= 1.
      learning_rate: Adam's step size, > 0.
      batch_size: examples per step, >= 1.
      seed: initialisation and minibatch order.

    Returns:
      variables {'params': ..., 'norm': {'mean': [F], 'std': [F]}} for
      `lookahead.classifier_confidence`.
    """
    _check_examples(examples, "train_classifier")
    for name, value in (("hidden", hidden), ("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not float(learning_rate) > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    labels = np.unique(examples.y)
    if not set(labels.tolist()) <= {0, 1}:
        raise ValueError(f"labels must be 0 or 1, got values {labels.tolist()}")
    if len(labels) < 2:
        raise ValueError(
            f"every training label is {int(labels[0])}: a classifier needs both accepted (1) "
            "and rejected (0) tokens; extract features from more prompts, or a draft that "
            "differs from the target"
        )
    x = np.asarray(examples.x, np.float32)
    y = np.asarray(examples.y, np.float32)
    norm = {"mean": x.mean(0), "std": np.maximum(x.std(0), 1e-6)}
    module = lookahead.StopClassifier(hidden)
    params = module.init(jax.random.PRNGKey(seed), jnp.zeros((1, x.shape[1])))["params"]
    optimizer = optax.adam(learning_rate)

    def step(params, opt_state, norm, xb, yb):
        def loss_fn(params):
            logits = module.apply({"params": params, "norm": norm}, xb)
            return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, yb))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def run(params, opt_state, norm, x, y, rows):  # rows [S, batch_size]: S steps in one call.
        def body(carry, batch_rows):
            params, opt_state = carry
            params, opt_state, loss = step(params, opt_state, norm, x[batch_rows], y[batch_rows])
            return (params, opt_state), loss

        return jax.lax.scan(body, (params, opt_state), rows)[0]

    rng = np.random.default_rng(seed)
    opt_state = optimizer.init(params)
    data = jnp.asarray(x), jnp.asarray(y)
    norm = jax.tree.map(jnp.asarray, norm)
    for start in range(0, steps, _STEPS_PER_CALL):
        rows = rng.integers(0, len(y), size=(min(_STEPS_PER_CALL, steps - start), batch_size))
        params, opt_state = run(params, opt_state, norm, *data, jnp.asarray(rows, jnp.int32))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _plain_dict(params))
    return {"params": params, "norm": norm}


def _plain_dict(tree: Any) -> Any:
    """Nested Mapping (flax FrozenDict included) -> nested dict."""
    if isinstance(tree, Mapping):
        return {k: _plain_dict(v) for k, v in tree.items()}
    return tree


# --------------------------------------------------------------------------------------------
# F1 scores (DISCO App. D.2, Table 4).
# --------------------------------------------------------------------------------------------


def f1_score(pred: np.ndarray, label: np.ndarray) -> float:
    """F1 of the positive class (1 = accepted): 2 TP / (2 TP + FP + FN).

    Args:
      pred, label: [M] arrays of 0/1 (or bool), the same shape.

    Returns:
      The F1 score; 0.0 when neither pred nor label holds a positive (as scikit-learn).
    """
    pred, label = np.asarray(pred), np.asarray(label)
    if pred.shape != label.shape or pred.ndim != 1:
        raise ValueError(
            f"pred and label must be [M] of one shape, got {pred.shape}, {label.shape}"
        )
    for name, a in (("pred", pred), ("label", label)):
        if not set(np.unique(a).tolist()) <= {0, 1}:
            raise ValueError(f"{name} must hold only 0/1 values, got {np.unique(a).tolist()}")
    pred, label = pred.astype(bool), label.astype(bool)
    tp = int(np.sum(pred & label))
    denominator = 2 * tp + int(np.sum(pred & ~label)) + int(np.sum(~pred & label))
    return 2.0 * tp / denominator if denominator else 0.0


@jax.jit
def _confidence(variables, x):
    return lookahead.classifier_confidence(variables, x)


def classifier_confidences(variables: Any, examples: Examples) -> np.ndarray:
    """[M] float32 classifier confidences C_i of the examples."""
    _check_examples(examples, "classifier_confidences")
    if lookahead.classifier_top_k(variables) != examples.top_k:
        raise ValueError(
            f"the classifier was built for top_k={lookahead.classifier_top_k(variables)} but "
            f"the examples have top_k={examples.top_k} (x has {examples.x.shape[1]} columns)"
        )
    return np.asarray(jax.device_get(_confidence(variables, jnp.asarray(examples.x))))


def classifier_f1(variables: Any, examples: Examples, threshold: float = 0.5) -> float:
    """F1 of the classifier's accepted class: a token is predicted accepted iff its confidence
    is >= threshold (the decoder keeps drafting exactly then; it stops below the threshold)."""
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    return f1_score(classifier_confidences(variables, examples) >= threshold, examples.y)


def in_round_index(examples: Examples) -> np.ndarray:
    """Each token's index inside the oracle's speculation round: [M] int64, in examples' order.

    Greedy speculative decoding with the oracle lookahead (DISCO Sec. 2) splits a continuation
    into rounds "accepted ... accepted rejected": the draft proposes until its first mismatch,
    and the next round starts at the token after the rejected one. Along each sequence, ordered
    by position, the index is 0 at the first token, resets to 0 on the token after each token
    with label 0, and otherwise grows by 1. For labels 1 1 0 1 0 0 1 1 it is 0 1 2 0 1 0 0 1.
    """
    _check_examples(examples, "in_round_index")
    order = np.lexsort((examples.position, examples.sequence))
    seq, pos, y = examples.sequence[order], examples.position[order], examples.y[order]
    same = seq[1:] == seq[:-1]
    if np.any(same & (pos[1:] == pos[:-1])):
        raise ValueError("examples hold two tokens with the same (sequence, position)")
    start = np.ones(len(order), bool)
    start[1:] = ~same | (y[:-1] == 0)
    index = np.arange(len(order))
    index = index - np.maximum.accumulate(np.where(start, index, 0))
    out = np.empty_like(index)
    out[order] = index
    return out


def static_sl_f1(examples: Examples, k: int) -> float:
    """F1 of static SL-k as a classifier: a token is predicted accepted iff its
    `in_round_index` is < k. Our operationalisation of DISCO Table 4's "F1 static-SL"."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"static SL k must be an integer >= 1, got {k!r}")
    return f1_score(in_round_index(examples) < k, examples.y)


def best_static_sl(examples: Examples, ks: Iterable[int] = range(1, 17)) -> tuple[int, float]:
    """The k of `ks` whose static SL-k rule has the highest F1 (the smallest k on ties), and
    that F1 (DISCO Table 4's "F1 static-SL", see `in_round_index`)."""
    ks = list(ks)
    if not ks:
        raise ValueError("ks is empty: pass at least one static SL k >= 1")
    index, y = in_round_index(examples), examples.y
    best_k, best = None, -1.0
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"static SL k must be an integer >= 1, got {k!r} in ks")
        f1 = f1_score(index < k, y)
        if f1 > best:
            best_k, best = int(k), f1
    return best_k, best


# --------------------------------------------------------------------------------------------
# Fingerprint and storage beside the draft.
# --------------------------------------------------------------------------------------------


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


def _write_atomic(path: str, write) -> None:
    """Calls write(temporary path) in path's directory, then renames it to path."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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
    _write_atomic(os.path.join(directory, WEIGHTS_FILE), lambda tmp: save_file(tensors, tmp))

    def write_json(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _write_atomic(os.path.join(directory, METADATA_FILE), write_json)


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


# --------------------------------------------------------------------------------------------
# The run: train, tune on validation, save beside the draft, evaluate every policy.
# --------------------------------------------------------------------------------------------


def tune_policies(
    target, target_params, draft, draft_params, prompts, classifier, *, static_sl: Sequence[int],
    sl_max_grid: Sequence[int], threshold_grid: Sequence[float],
    keep_last_grid: Sequence[bool] = (True, False), max_new_tokens: int,
    eos_id: int | None, vocab_size: int | None = None, timing_repeats: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """DISCO App. E: the static SL, and threshold, SL_max (and keep_last) of the confidence and
    DISCO rules, with the lowest latency per token on `prompts` (batch-1 (tokens, lengths)
    pairs). Latency is `evaluate.modeled_latency_ms`: the decoding runs' counted calls priced
    with call costs measured here, which ranks 50-odd configurations without the timing noise
    of a shared machine (measured wall-clock latencies are kept beside it).

    Returns:
      {'static_opt': k, 'confidence': {'threshold', 'sl_max', 'keep_last'}, 'disco': {...},
       'latency_ms': {policy label: ms per token}} (labels like 'disco@8/0.5/keep').
    """
    grid = {f"static-{k}": lookahead.Lookahead("static", k) for k in static_sl}
    for kind, sl_max, keep_last, threshold in itertools.product(
        ("confidence", "disco"), sl_max_grid, keep_last_grid, threshold_grid
    ):
        label = f"{kind}@{sl_max}/{threshold:g}/{'keep' if keep_last else 'drop'}"
        grid[label] = lookahead.Lookahead(kind, sl_max, threshold=threshold, keep_last=keep_last)
    widths = {w for la in grid.values() for w in lookahead.verify_widths(la)}
    costs = evaluate.measure_call_costs(
        target, target_params, draft, draft_params, prompts[0], widths,
        max_new_tokens=max_new_tokens,
    )  # fmt: skip
    measured = evaluate.measure_policies(
        target, target_params, draft, draft_params, prompts, grid, classifier=classifier,
        costs=costs, max_new_tokens=max_new_tokens, eos_id=eos_id, vocab_size=vocab_size,
        timing_repeats=timing_repeats, desc="tuning",
    )  # fmt: skip
    modeled = {name: m["modeled_latency_ms"] for name, m in measured.items()}
    best = lambda prefix: min((n for n in grid if n.startswith(prefix)), key=modeled.get)
    out: dict[str, Any] = {
        "static_opt": grid[best("static-")].sl_max,
        "modeled_latency_ms": modeled,
        "latency_ms": {name: m["latency_ms"] for name, m in measured.items()},
        "call_costs_ms": costs,
    }
    for kind in ("confidence", "disco"):
        chosen = grid[best(kind + "@")]
        out[kind] = {
            "threshold": chosen.threshold,
            "sl_max": chosen.sl_max,
            "keep_last": chosen.keep_last,
        }
    return out


def _check_run_args(static_sl, sl_max_grid, threshold_grid, heuristic_start, oracle_sl_max):
    for name, values in (("static_sl", static_sl), ("sl_max_grid", sl_max_grid)):
        if not values or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values
        ):
            raise ValueError(f"{name} must be a non-empty list of SL values >= 1, got {values!r}")
    if not threshold_grid or any(not 0.0 <= float(t) <= 1.0 for t in threshold_grid):
        raise ValueError(f"threshold_grid must hold thresholds in [0, 1], got {threshold_grid!r}")
    lookahead.Lookahead("heuristic", max(sl_max_grid), start=heuristic_start)
    lookahead.Lookahead("oracle", oracle_sl_max)


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
    heuristic_start: int = 5,
    oracle_sl_max: int = 64,
    timing_repeats: int = 1,
    retrain: bool = False,
    seed: int = 0,
    vocabulary: str = "sentencepiece",
    tfds_data_dir: str | None = None,
) -> list[dict[str, Any]]:
    """DISCO for each draft: classifier, tuning, and the DISCO Table 1 evaluation.

    Per draft (a Hugging Face directory): features on num_train_prompts of train_set and on
    num_validation_prompts of validation_set; the classifier; F1 against the best static-SL
    rule on validation (Table 4); latency tuning on validation of static SL-opt and of threshold
    and SL_max for the confidence and DISCO rules; everything saved in `<draft>/disco/` with the
    draft's fingerprint (a rerun reuses it unless retrain=True or the draft changed). Then every
    policy is timed at batch 1 on num_prompts of each eval set (greedy), and one record per
    (eval set, draft, policy) is appended to OUTPUT_DIR/records.jsonl; disco_table.md,
    oracle_sl_hist.png and disco_f1.md (Table 4) are written there and the tables are printed.
    """
    from distillspec import tables
    from distillspec.models import from_pretrained

    _check_run_args(static_sl, sl_max_grid, threshold_grid, heuristic_start, oracle_sl_max)
    vocab, target, target_params = evaluate.open_run(
        "disco", output_dir, target_checkpoint, drafts, vocabulary, tfds_data_dir
    )
    common = dict(max_new_tokens=task_feature_lengths["targets"], eos_id=vocab.eos_id)
    prompt_sets = functools.partial(
        evaluate._prompt_sets, lengths=task_feature_lengths, batch_size=batch_size
    )
    sets = prompt_sets(eval_sets, num_prompts=num_prompts)
    models, f1_rows = {}, []
    for name, path in drafts.items():
        draft, draft_params = from_pretrained(path)
        classifier, metadata = _trained_classifier(
            name, path, target, target_params, draft, draft_params, retrain=retrain,
            prompt_sets=prompt_sets, train_set=train_set, validation_set=validation_set,
            num_train_prompts=num_train_prompts, num_validation_prompts=num_validation_prompts,
            top_k=top_k, hidden=hidden, train_steps=train_steps, learning_rate=learning_rate,
            seed=seed, static_sl=static_sl, sl_max_grid=sl_max_grid,
            threshold_grid=threshold_grid, keep_last_grid=keep_last_grid,
            timing_repeats=timing_repeats, **common,
        )  # fmt: skip
        models[name] = (draft, draft_params, classifier, metadata["tuning"])
        f1_rows.append(
            f"| {name} | {'/'.join(validation_set)} | {metadata['f1_static_sl']:.3f} "
            f"(SL-{metadata['f1_static_sl_k']}) | {metadata['f1_disco']:.3f} |"
        )
    f1_table = "\n".join(
        ["| Draft | Validation set | F1 static-SL | F1 DISCO |", "|---|---|---|---|", *f1_rows]
    )
    with open(os.path.join(output_dir, "disco_f1.md"), "w", encoding="utf-8") as f:
        f.write(f1_table + "\n")
    policies = [f"static-{k}" for k in static_sl] + [
        "static-opt", "heuristic", "confidence", "disco", "oracle",
    ]  # fmt: skip
    records = evaluate.evaluate_policies(
        target, target_params, models, sets, policies, num_prompts=num_prompts,
        records_path=os.path.join(output_dir, "records.jsonl"), timing_repeats=timing_repeats,
        heuristic_sl_max=max(sl_max_grid), heuristic_start=heuristic_start,
        oracle_sl_max=oracle_sl_max, **common,
    )  # fmt: skip
    print(tables.format_report(os.path.join(output_dir, "records.jsonl"), output_dir))
    print("\nClassifier F1 on validation (DISCO Table 4):\n" + f1_table)
    return records


def _trained_classifier(
    name, path, target, target_params, draft, draft_params, *, retrain, prompt_sets, train_set,
    validation_set, num_train_prompts, num_validation_prompts, top_k, hidden, train_steps,
    learning_rate, seed, static_sl, sl_max_grid, threshold_grid, keep_last_grid, timing_repeats,
    max_new_tokens, eos_id,
):  # fmt: skip
    """The draft's classifier and metadata: loaded if saved for this very draft, else made."""
    directory = classifier_dir(path)
    if not retrain and os.path.isfile(os.path.join(directory, METADATA_FILE)):
        try:
            variables, metadata = load_classifier(directory, draft, draft_params)
            if "tuning" in metadata:
                print(f"[disco] {name}: reusing the classifier in {directory}", file=sys.stderr)
                return variables, metadata
        except ValueError as e:  # Another draft's classifier: made anew below.
            print(f"[disco] {name}: {e}", file=sys.stderr)
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id)
    sets = prompt_sets([train_set], num_prompts=num_train_prompts)
    train = extract_features(
        target, target_params, draft, draft_params, sets[tuple(train_set)], top_k=top_k, **common
    )
    valid_batches = prompt_sets([validation_set], num_prompts=num_validation_prompts)[
        tuple(validation_set)
    ]
    valid = extract_features(
        target, target_params, draft, draft_params, valid_batches, top_k=top_k, **common
    )
    variables = train_classifier(
        train, hidden=hidden, steps=train_steps, learning_rate=learning_rate, seed=seed
    )
    static_k, static_f1 = best_static_sl(valid)
    f1 = classifier_f1(variables, valid)
    print(
        f"[disco] {name}: {len(train)} training tokens (accept rate {train.y.mean():.3f}); "
        f"validation F1 DISCO {f1:.3f} vs best static SL-{static_k} {static_f1:.3f}",
        file=sys.stderr,
        flush=True,
    )
    valid_prompts = evaluate.single_prompts(valid_batches)[:num_validation_prompts]
    tuning = tune_policies(
        target, target_params, draft, draft_params, valid_prompts,
        variables, static_sl=static_sl, sl_max_grid=sl_max_grid, threshold_grid=threshold_grid,
        keep_last_grid=keep_last_grid, timing_repeats=timing_repeats, **common,
    )  # fmt: skip
    metadata = {
        "fingerprint": fingerprint(draft, draft_params, None),
        "vocab_size": draft.vocab_size,
        "draft_checkpoint": os.path.abspath(path),
        "train_set": list(train_set),
        "validation_set": list(validation_set),
        "num_train_tokens": len(train),
        "f1_disco": f1,
        "f1_static_sl": static_f1,
        "f1_static_sl_k": static_k,
        "tuning": tuning,
    }
    save_classifier(directory, variables, metadata)
    print(
        f"[disco] {name}: static SL-opt {tuning['static_opt']}, confidence "
        f"{tuning['confidence']}, disco {tuning['disco']}; saved in {directory}",
        file=sys.stderr,
        flush=True,
    )
    return variables, metadata


def main(argv: Sequence[str] | None = None) -> None:
    from distillspec import gin_setup

    gin_setup.parse_command_line(list(argv if argv is not None else sys.argv[1:]), "disco")
    gin_setup.run_function("disco")()


if __name__ == "__main__":
    main()
