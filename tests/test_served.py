"""The served-data buffer (`distillspec.served`) and training on it (DataMixture lambda0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from distillspec import datagen, metrics, served, trainer
from distillspec.decoding import speculative_generate
from distillspec.decoding.sampling import SamplingConfig
from tests.test_utils import markov_pair, ragged_prompts, tiny_lm

V = 16


def _chunk(seed: int, rows: int = 4, k: int = 3) -> dict:
    """A real recording: a Markov pair's speculative decoding with record_top_k."""
    target, draft = markov_pair(vocab=V, seed=0, noise=1.0)
    prompts, lengths = ragged_prompts(rows, 5, V, seed=seed)
    out = speculative_generate(
        target, draft, None, None, prompts, lengths, jax.random.PRNGKey(seed), gamma=3,
        max_new_tokens=8, sampling=SamplingConfig(1.0), eos_id=2, record_top_k=k,
    )  # fmt: skip
    return served.records(prompts, lengths, out, V)


def test_chunks_round_trip_in_order_and_the_cap_drops_the_oldest(tmp_path):
    buffer = str(tmp_path / "buffer")
    parts = [_chunk(seed) for seed in range(3)]
    for part in parts:
        served.append(buffer, part, max_examples=100)
    data = served.read(buffer, vocab_size=V)
    assert len(data) == 12 and data.vocab_size == V
    np.testing.assert_array_equal(
        data.store.completions, np.concatenate([p["tokens"] for p in parts])
    )
    n = data.store.completion_lengths
    inside = np.arange(8) < n[:, None]
    recorded = np.concatenate([p["top_k_log_probs"] for p in parts])
    np.testing.assert_array_equal(data.top_k.log_probs[inside], recorded[inside])
    # Past a row's end: a uniform top-k over distinct ids (no weight in the loss).
    assert np.all(data.top_k.log_probs[~inside] == np.float32(-np.log(3)))
    assert all(len(set(ids)) == 3 for ids in data.top_k.ids[~inside])
    # Cap 6 rows: after a fourth chunk, the oldest chunks go until at most 6 remain.
    served.append(buffer, _chunk(9), max_examples=6)
    left = served.chunks(buffer)
    assert [os.path.basename(p) for p in left] == ["served-000000000003.npz"]
    np.testing.assert_array_equal(served.read(buffer).store.completions, _chunk(9)["tokens"])
    served.append(buffer, _chunk(10, rows=9), max_examples=6)  # Larger than the cap: newest 6.
    assert len(served.read(buffer)) == 6


def _writer(buffer: str) -> subprocess.Popen:
    code = (
        "import numpy as np, sys\n"
        "from distillspec import served\n"
        "rng = np.random.default_rng(0)\n"
        "i = 0\n"
        "while True:\n"
        "    n, steps, k = 64, 256, 8\n"
        "    log_probs = -rng.random((n, steps, k)).astype(np.float32)\n"
        "    served.append(sys.argv[1], dict(prompt_tokens=np.ones((n, 4), np.int32),\n"
        "        prompt_lengths=np.full(n, 4, np.int32),\n"
        "        tokens=np.full((n, steps), i % 7, np.int32),\n"
        "        lengths=np.full(n, steps, np.int32), top_k_log_probs=log_probs,\n"
        "        top_k_ids=np.broadcast_to(np.arange(k, dtype=np.int32), (n, steps, k)),\n"
        "        vocab_size=16), max_examples=256)\n"
        "    i += 1\n"
        "    print(i, flush=True)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, buffer], stdout=subprocess.PIPE, text=True)


def test_a_killed_writer_leaves_a_readable_buffer(tmp_path):
    """kill -9 a process appending chunks in a loop, at a moment of its choosing: the buffer
    reads, every chunk whole, within the cap; the next append clears the leftover .tmp."""
    buffer = str(tmp_path / "buffer")
    writer = _writer(buffer)
    try:
        for _ in range(6):  # Wait for several appends (so that the cap has dropped chunks).
            assert writer.stdout.readline(), "the writer died before it was killed"
        time.sleep(0.05)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    data = served.read(buffer, vocab_size=16)
    assert 0 < len(data) <= 256 + 64 and len(data) % 64 == 0
    assert all(len(set(row)) == 1 for row in data.store.completions)  # No chunk mixed.
    with open(os.path.join(buffer, "served-999999999999.npz.tmp"), "wb") as f:
        f.write(b"half a chunk")  # What a writer killed inside np.savez leaves.
    assert len(served.read(buffer)) == len(data)  # Ignored by readers.
    served.append(buffer, _chunk(1), max_examples=10_000)
    assert not [n for n in os.listdir(buffer) if n.endswith(".tmp")]


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: c.update(top_k_ids=c["top_k_ids"] + V), r"token ids outside \[0, 16\)"),
        (lambda c: c.update(top_k_log_probs=c["top_k_log_probs"] * np.nan), "not finite"),
        (lambda c: c.update(lengths=c["lengths"] + 9), r"lengths outside \[0, 8\]"),
        (lambda c: c.update(tokens=c["tokens"][:, :5]), r"tokens has shape \(4, 5\)"),
    ],
)
def test_a_wrong_chunk_is_refused_by_name(tmp_path, change, message):
    chunk = _chunk(0)
    change(chunk)
    with pytest.raises(ValueError, match=message):
        served.append(str(tmp_path / "b"), chunk, max_examples=10)


def test_reading_refuses_an_empty_buffer_and_another_targets_vocabulary(tmp_path):
    with pytest.raises(FileNotFoundError, match="no served data in"):
        served.read(str(tmp_path))
    served.append(str(tmp_path), _chunk(0), max_examples=10)
    with pytest.raises(ValueError, match="vocabulary of 16 ids, but the models have 32"):
        served.read(str(tmp_path), vocab_size=32)


def test_served_steps_train_as_the_teacher_would_without_running_it(tmp_path):
    """With k = V recorded, a served step's loss equals the loss of the same rows as fixed
    data with the teacher run on them (so every recorded distribution sits at its position),
    and it logs zero teacher forward passes where the fixed-data run logs one per step."""
    vocab = 32
    (teacher, teacher_params), (student, _) = tiny_lm(vocab), tiny_lm(vocab)
    student_params = jax.tree.map(lambda x: x * 0.5, teacher_params)  # Another model.
    prompts, lengths = ragged_prompts(8, 4, vocab, seed=5)
    out = speculative_generate(
        teacher, student, teacher_params, student_params, prompts, lengths,
        jax.random.PRNGKey(0), gamma=3, max_new_tokens=6, sampling=SamplingConfig(1.0),
        record_top_k=vocab,
    )  # fmt: skip
    buffer = str(tmp_path / "buffer")
    served.append(buffer, served.records(prompts, lengths, out, vocab), max_examples=100)
    data = served.read(buffer, vocab_size=vocab)
    models = trainer.Models(student, teacher, teacher_params)
    loop = trainer.LoopConfig(train_steps=3, batch_size=4, checkpoint_period=10)
    run = lambda name, mixture, **kw: trainer.fit(  # A copy of the parameters: fit donates.
        str(tmp_path / name), models, jax.tree.map(np.array, student_params), data.store, loop,
        trainer.LossConfig(divergence="fkl"), trainer.OptimizerConfig(name="adamw"),
        mixture=mixture, console=False, **kw,
    )  # fmt: skip
    run("served", datagen.DataMixture(served_data_fraction=1.0), served=data)
    run("fixed", datagen.DataMixture(fixed_data_fraction=1.0))
    logs = {n: metrics.read_metrics(str(tmp_path / n)) for n in ("served", "fixed")}
    assert [r["teacher_forward_passes"] for r in logs["served"]] == [0, 0, 0]
    assert [r["teacher_forward_passes"] for r in logs["fixed"]] == [1, 1, 1]
    assert [r["data_served"] for r in logs["served"]] == [1.0] * 3
    for a, b in zip(logs["served"], logs["fixed"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    with pytest.raises(ValueError, match="no served buffer was given"):
        run("none", datagen.DataMixture(served_data_fraction=1.0))
    # tail_params: the tail past the top k in another model's proportions (the draft before
    # adaptation). With k < V: the first step (its parameters are those) loses the same; later
    # steps, whose student has moved, do not.
    small = served.read(buffer, vocab_size=vocab)
    small = served.ServedData(
        small.store,
        type(small.top_k)(small.top_k.log_probs[..., :4], small.top_k.ids[..., :4], False),
        vocab,
    )
    initial = jax.tree.map(np.array, student_params)
    run("own", datagen.DataMixture(served_data_fraction=1.0), served=small)
    run("frozen", datagen.DataMixture(served_data_fraction=1.0), served=small, tail_params=initial)
    own, frozen = (metrics.read_metrics(str(tmp_path / n)) for n in ("own", "frozen"))
    assert own[0]["loss"] == pytest.approx(frozen[0]["loss"], rel=1e-6)
    assert own[-1]["loss"] != pytest.approx(frozen[-1]["loss"], rel=1e-6)


def test_lambda0_zero_leaves_the_data_order_and_lambda0_draws_whole_batches():
    base = datagen.DataMixture(fixed_data_fraction=0.3, student_data_fraction=0.5)
    with_zero = datagen.DataMixture(0.3, 0.5, served_data_fraction=0.0)
    for step in range(20):
        np.testing.assert_array_equal(
            datagen.step_sources(1, step, 4, base), datagen.step_sources(1, step, 4, with_zero)
        )
    half = datagen.DataMixture(0.3, 0.5, served_data_fraction=0.5)
    sources = np.array([datagen.step_sources(1, s, 4, half) for s in range(400)])
    served_steps = np.all(sources == datagen.SERVED, axis=1)
    assert 0.4 < served_steps.mean() < 0.6 and not np.any(sources[~served_steps] == datagen.SERVED)
    with pytest.raises(ValueError, match=r"served_data_fraction \(lambda0\) must be in \[0, 1\]"):
        datagen.DataMixture(served_data_fraction=1.5)
