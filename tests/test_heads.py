"""Chunked heads and losses (`distillspec.heads`): the chunked step equals the unchunked one.

The reference is the step as it was before chunking: both models' whole [B, N, V] logits, the
loss on them (`losses.distillation_sums` / `losses.cross_entropy`), autodiff through all of
it. The chunked step must give the same sums and gradients (relative 1e-5) for every
divergence, with masked tokens, with a top-k target (its tail in the student's or another
model's proportions), at chunk sizes that do and do not divide the positions, and on 1 x 2 and
2 x 1 meshes (in a subprocess with two host devices).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distillspec import heads, losses, selection, trainer
from distillspec import teacher_cache as cache
from distillspec.models import DecoderOnlyLM, TransformerConfig
from distillspec.models.base import TruncatedVocabulary, with_remat

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 40
TEACHER = DecoderOnlyLM(TransformerConfig(vocab_size=VOCAB, embed_dim=16, num_layers=1,
                                          num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32,
                                          init_std=0.5))  # fmt: skip
# A tied head, and 8 padded ids past the teacher's vocabulary (Qwen2.5-style padding).
STUDENT = TruncatedVocabulary(DecoderOnlyLM(TransformerConfig(
    vocab_size=VOCAB + 8, embed_dim=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
    mlp_dim=16, tie_embeddings=True, init_std=0.3)), VOCAB)  # fmt: skip
KINDS = ("fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda", "ce", "topk", "topk_tail",
         "topk_lk_lambda", "adaspec", "adaspec_topk_lk_alpha")  # fmt: skip
# AdaSPEC's cases: the reference model is the `models` fixture's third parameter set.
DIVERGENCE = {"topk": "fkl", "topk_tail": "fkl", "topk_lk_lambda": "lk_lambda", "adaspec": "fkl",
              "adaspec_topk_lk_alpha": "lk_alpha"}  # fmt: skip
SELECT_FRACTION = 0.4


def _gradient_store() -> optax.GradientTransformation:
    """An 'optimizer' whose state is the last gradient (so a step hands its gradient back)."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def make_batch(rows: int = 4, length: int = 11, positions: int = 7, k: int = 5, seed: int = 0):
    """A packed batch with loss positions, some weights 0, and the teacher's top-k records."""
    rng = np.random.default_rng(seed)
    batch = {
        "decoder_input_tokens": rng.integers(0, VOCAB, (rows, length), dtype=np.int32),
        "targets": rng.integers(0, VOCAB, (rows, length), dtype=np.int32),
        "weights": (rng.random((rows, length)) < 0.8).astype(np.float32),
        "loss_positions": np.sort(
            np.stack([rng.choice(length, positions, replace=False) for _ in range(rows)]), axis=1
        ).astype(np.int32),
    }
    batch["weights"][0] = 0.0  # A whole row masked.
    log_probs = np.log(rng.dirichlet(np.ones(k + 2), size=(rows, length))[..., :k])
    ids = np.argsort(rng.random((rows, length, VOCAB)), axis=-1)[..., :k]
    batch[cache.LOG_PROBS], batch[cache.IDS] = log_probs.astype(np.float32), ids.astype(np.int32)
    return batch


def reference(kind: str, params, teacher_params, tail_params, batch) -> tuple[dict, dict]:
    """(sums, gradient) of the unchunked step: whole logits, autodiff through everything."""
    inputs = {"decoder_input_tokens": batch["decoder_input_tokens"]}
    positions = batch["loss_positions"]
    at = lambda x: trainer._take_positions(jnp.asarray(x), positions)
    weights = at(batch["weights"])

    divergence = DIVERGENCE.get(kind, kind)

    def target_of(logits, shape_params=None):
        if "topk" not in kind:
            return jax.lax.stop_gradient(TEACHER.logits(teacher_params, inputs, positions))
        shape = logits if shape_params is None else STUDENT.logits(shape_params, inputs, positions)
        return losses.topk_teacher_logits(
            at(batch[cache.LOG_PROBS]), at(batch[cache.IDS]), VOCAB, shape
        )

    def objective(params):
        logits = STUDENT.logits(params, inputs, positions)
        if kind == "ce":
            total, count = losses.cross_entropy(logits, at(batch["targets"]), weights)
            return losses.mean(total, count), {"loss_sum": total, "weight_sum": count}
        target = target_of(logits, None if kind.startswith("adaspec") else tail_params)
        selected, seen = weights, None
        if kind.startswith("adaspec"):  # The selection from whole logits, no gradient.
            reference_logits = STUDENT.logits(tail_params, inputs, positions)
            per_token = [
                losses.token_divergence(jax.lax.stop_gradient(x), target_of(x), weights,
                                        divergence, 0.3)
                for x in (logits, reference_logits)
            ]  # fmt: skip
            selected = selection.select_tokens(*per_token, weights, SELECT_FRACTION)
            seen = weights
        sums = losses.distillation_sums(logits, target, selected, divergence, 0.3,
                                        metric_weights=seen)  # fmt: skip
        return losses.mean(sums["loss_sum"], sums["weight_sum"]), sums

    grads, sums = jax.jit(jax.grad(objective, has_aux=True))(params)
    return jax.device_get(sums), jax.device_get(grads)


def chunked(kind: str, params, teacher_params, tail_params, batch, chunk_tokens, mesh=None):
    """(sums, gradient) of `trainer.train_step` at chunk_tokens (on `mesh` when given)."""
    adaspec = kind.startswith("adaspec")
    loss = trainer.LossConfig(divergence=DIVERGENCE.get(kind, kind), beta=0.3,
                              chunk_tokens=chunk_tokens,
                              select_fraction=SELECT_FRACTION if adaspec else 1.0)  # fmt: skip
    optimizer = _gradient_store()
    teacher = None if kind == "ce" else TEACHER  # Pretraining: no teacher.
    step = trainer.compile_train_step(STUDENT, teacher, loss, optimizer, mesh=mesh)
    if "topk" not in kind:
        batch = {k: v for k, v in batch.items() if k not in (cache.LOG_PROBS, cache.IDS)}
    state = trainer.init_state(jax.tree.map(jnp.copy, params), optimizer)
    frozen = None if kind == "ce" else teacher_params
    extra = (None, tail_params) if adaspec else (tail_params,)
    state, sums = step(state, frozen, batch, *extra)
    sums.pop("grad_norm")
    return jax.device_get(sums), jax.device_get(state.opt_state)


def compare(want, got) -> None:
    (want_sums, want_grads), (got_sums, got_grads) = want, got
    assert set(want_sums) == set(got_sums)
    for key in want_sums:
        np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-5, err_msg=key)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_grads))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
        got_grads, want_grads,
    )  # fmt: skip


@pytest.fixture(scope="module")
def models():
    params = STUDENT.init(jax.random.PRNGKey(0))
    tail = STUDENT.init(jax.random.PRNGKey(2))
    return params, TEACHER.init(jax.random.PRNGKey(1)), tail


@pytest.mark.parametrize("kind", KINDS)
def test_the_chunked_step_equals_the_unchunked_step(kind, models):
    params, teacher_params, tail = models
    tail = tail if kind in ("topk_tail", "topk_lk_lambda") or kind.startswith("adaspec") else None
    batch = make_batch()
    want = reference(kind, params, teacher_params, tail, batch)
    # 4 rows x 7 positions: chunks of 1, 2 (3 + a padded 1) and all 7 positions.
    for chunk_tokens in (1, 9, None):
        got = chunked(kind, params, teacher_params, tail, batch, chunk_tokens)
        compare(want, got)


def test_chunk_positions_follow_the_vocabulary_and_the_rows():
    assert heads.default_chunk_tokens(131_072) == 128  # 128 x 131,072 x 4 bytes = 64 MB.
    assert heads.chunk_positions(8, 512, None, 131_072) == 16
    assert heads.chunk_positions(8, 512, None, 2_048) == 512  # One chunk: all positions.
    assert heads.chunk_positions(8, 5, 3, 2_048) == 1  # At least one position per chunk.
    with pytest.raises(ValueError, match="chunk_tokens"):
        trainer.LossConfig(chunk_tokens=0)


_MESH = """
import sys
import jax
from distillspec import partitioning
from tests import test_heads as t

params, teacher_params, tail = (t.STUDENT.init(jax.random.PRNGKey(0)),
    t.TEACHER.init(jax.random.PRNGKey(1)), t.STUDENT.init(jax.random.PRNGKey(2)))
batch = t.make_batch()
for data, model in ((1, 2), (2, 1)):
    mesh = partitioning.make_mesh(data, model)
    for kind in ("fkl", "jsd", "topk_tail", "ce", "lk_lambda", "adaspec"):
        tail_params = tail if kind in ("topk_tail", "adaspec") else None
        want = t.reference(kind, params, teacher_params, tail_params, batch)
        t.compare(want, t.chunked(kind, params, teacher_params, tail_params, batch, 9, mesh))
print("MESH_OK")
"""


def test_the_chunked_step_on_two_devices_equals_the_unchunked_step():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _MESH], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0 and "MESH_OK" in result.stdout, result.stderr[-5000:]


def vocabulary_arrays(hlo: str, vocab_size: int, tokens: int) -> list[str]:
    """The arrays of a compiled program's text that have a vocab_size axis and at least
    tokens x vocab_size elements (one whole [tokens, V] logits array or more)."""
    found = set()
    for dims in re.findall(r"\b(?:f|bf|s|u|pred)\d*\[([\d,]+)\]", hlo):
        shape = [int(d) for d in dims.split(",")]
        if vocab_size in shape and math.prod(shape) >= tokens * vocab_size:
            found.add(str(shape))
    return sorted(found)


def _abstract(model):
    return jax.eval_shape(model.init, jax.random.PRNGKey(0))


def test_the_compiled_step_holds_no_tokens_by_vocabulary_array():
    # V = 131,072 (Llama 3's order), 4 x 256 tokens: a default chunk is 128 tokens.
    vocab, rows, length = 131_072, 4, 256
    config = dict(embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32)
    teacher = DecoderOnlyLM(TransformerConfig(vocab_size=vocab, **config))
    student = DecoderOnlyLM(TransformerConfig(vocab_size=vocab, tie_embeddings=True, **config))
    optimizer = optax.adamw(1e-3)
    params, teacher_params = _abstract(student), _abstract(teacher)
    state = jax.eval_shape(lambda p: trainer.init_state(p, optimizer), params)
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    batch = {"decoder_input_tokens": tokens, "targets": tokens,
             "weights": jax.ShapeDtypeStruct((rows, length), jnp.float32)}  # fmt: skip
    for divergence in ("fkl", "jsd", "ce"):
        loss = trainer.LossConfig(divergence=divergence)
        frozen = None if divergence == "ce" else teacher
        step = trainer.compile_train_step(student, frozen, loss, optimizer)
        hlo = step.lower(state, None if frozen is None else teacher_params, batch).compile()
        assert vocabulary_arrays(hlo.as_text(), vocab, rows * length) == [], divergence

    def planted(params, teacher_params, batch):  # The step's loss as it was before chunking.
        inputs = {"decoder_input_tokens": batch["decoder_input_tokens"]}
        target = jax.lax.stop_gradient(teacher.logits(teacher_params, inputs))
        objective = lambda p: losses.divergence(
            student.logits(p, inputs), target, batch["weights"], "fkl"
        )[0]  # fmt: skip
        return jax.grad(objective)(params)

    hlo = jax.jit(planted).lower(params, teacher_params, batch).compile().as_text()
    assert vocabulary_arrays(hlo, vocab, rows * length)  # The rule catches an unchunked loss.


@pytest.mark.parametrize("remat", ["full", "dots_with_no_batch_dims_saveable"])
def test_rematerialised_student_blocks_give_the_same_step(remat, models):
    params, teacher_params, _ = models
    batch = make_batch()
    want = chunked("jsd", params, teacher_params, None, batch, 9)
    global STUDENT
    plain, STUDENT = STUDENT, with_remat(STUDENT, remat)
    try:
        compare(want, chunked("jsd", params, teacher_params, None, batch, 9))
    finally:
        STUDENT = plain
    with pytest.raises(ValueError, match="remat='some' is not valid; choose one of"):
        with_remat(STUDENT, "some")
