"""The trainer: config validation, schedule, train_step, and whole runs through gin.

Whole runs use configs/tests/tiny_distill.gin (a self-made teacher, a smaller student, byte
vocabulary, 64 examples). Gin is global state, so every test here starts and ends with a clean
configuration (`clean_gin`). Runs that must die (kill -9) or need several host devices happen in
subprocesses, with the same XLA setting as this process so that numbers compare exactly.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from distillspec import checkpoints, datagen, gin_setup, metrics, tasks, trainer, vocabularies
from distillspec import teacher_cache as cache
from distillspec.models import DecoderOnlyLM, TransformerConfig, from_pretrained
from tests.test_utils import ragged_prompts

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tests" / "tiny_distill.gin")
LOGGED_KEYS = {"step", "loss", "learning_rate", "tokens_per_s", "acceptance_proxy"}


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


# ------------------------------------------------------------------------------------------------
# Config validation.


@pytest.mark.parametrize("divergence", ["kl", "FKL", "js", ""])
def test_loss_config_rejects_unknown_divergence_listing_valid_ones(divergence):
    with pytest.raises(ValueError) as info:
        trainer.LossConfig(divergence=divergence)
    message = str(info.value)
    assert "LossConfig.divergence" in message and repr(divergence) in message
    for valid in ("fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda", "lk_lambda_mean", "ce"):
        assert repr(valid) in message


@pytest.mark.parametrize("beta", [-0.01, 1.01, float("nan")])
def test_loss_config_rejects_beta_outside_unit_interval(beta):
    with pytest.raises(ValueError, match=r"LossConfig\.beta must be in \[0, 1\]"):
        trainer.LossConfig(divergence="jsd", beta=beta)


def test_loss_config_accepts_beta_endpoints():
    assert trainer.LossConfig(divergence="jsd", beta=0.0).beta == 0.0
    assert trainer.LossConfig(divergence="jsd", beta=1.0).beta == 1.0


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"name": "sgd"}, r"OptimizerConfig\.name must be one of \('adafactor', 'adamw'\)"),
        ({"learning_rate": 0.0}, r"OptimizerConfig\.learning_rate must be > 0"),
        ({"learning_rate": -1e-3}, r"OptimizerConfig\.learning_rate must be > 0"),
        ({"warmup_steps": -1}, r"warmup_steps >= 0"),
        ({"final_fraction": 1.5}, r"final_fraction in \[0, 1\]"),
        ({"clip_norm": -1.0}, r"clip_norm >= 0"),
    ],
)
def test_optimizer_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        trainer.OptimizerConfig(**kwargs)


@pytest.mark.parametrize(
    "field", ["train_steps", "batch_size", "checkpoint_period", "keep_checkpoints"]
)
@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_loop_config_validation(field, value):
    with pytest.raises(ValueError, match=rf"LoopConfig\.{field} must be an integer >= 1"):
        trainer.LoopConfig(**{field: value})


# ------------------------------------------------------------------------------------------------
# Schedule.


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_final_fraction():
    config = trainer.OptimizerConfig(learning_rate=2.0, warmup_steps=10, final_fraction=0.1)
    schedule = trainer.make_schedule(config, total_steps=110)
    lr = np.array([float(schedule(s)) for s in range(111)])
    np.testing.assert_allclose(lr[:11], 2.0 * np.arange(11) / 10, rtol=1e-6, atol=1e-7)
    # Cosine from the peak (step 10) to 0.1 x peak (step 110): halfway is the midpoint.
    np.testing.assert_allclose(lr[60], 0.5 * (2.0 + 0.2), rtol=1e-5)
    t = (np.arange(10, 111) - 10) / 100
    np.testing.assert_allclose(lr[10:], 0.2 + 1.8 * 0.5 * (1 + np.cos(np.pi * t)), rtol=1e-5)
    np.testing.assert_allclose(lr[110], 0.2, rtol=1e-6)
    assert (np.diff(lr[10:]) <= 1e-7).all()


def test_schedule_without_warmup_starts_at_the_peak():
    config = trainer.OptimizerConfig(learning_rate=1e-3, final_fraction=0.1)
    schedule = trainer.make_schedule(config, total_steps=50)
    np.testing.assert_allclose(float(schedule(0)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(50)), 1e-4, rtol=1e-5)


def test_schedule_with_warmup_longer_than_the_run_still_reaches_the_peak():
    config = trainer.OptimizerConfig(learning_rate=1.0, warmup_steps=100)
    schedule = trainer.make_schedule(config, total_steps=5)
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(float(schedule(4)), 1.0, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# train_step.

VOCAB = 32
STUDENT = DecoderOnlyLM(
    TransformerConfig(
        vocab_size=VOCAB, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
        mlp_dim=32,
    )
)  # fmt: skip
TEACHER = DecoderOnlyLM(
    TransformerConfig(
        vocab_size=VOCAB, embed_dim=24, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
        mlp_dim=48, init_std=0.5,
    )
)  # fmt: skip


def _batch(completion_length: int = 5) -> dict:
    prompts, prompt_lengths = ragged_prompts(4, 6, VOCAB, seed=1)
    rng = np.random.default_rng(2)
    completions = rng.integers(1, VOCAB, size=(4, 5)).astype(np.int32)
    # Extra columns are padding (with junk in it: lengths say where completions end).
    completions = np.pad(completions, ((0, 0), (0, completion_length - 5)), constant_values=9)
    completion_lengths = np.array([5, 3, 1, 4], np.int32)
    return datagen.pack_decoder_only(prompts, prompt_lengths, completions, completion_lengths)


@pytest.fixture(scope="module")
def params():
    return STUDENT.init(jax.random.PRNGKey(0)), TEACHER.init(jax.random.PRNGKey(1))


def _copy(tree):
    return jax.tree.map(np.array, tree)


def _step_fn(divergence: str, learning_rate: float = 3e-2):
    optimizer = trainer.make_optimizer(
        trainer.OptimizerConfig(name="adamw", learning_rate=learning_rate), total_steps=100
    )
    teacher = None if divergence == "ce" else TEACHER
    loss = trainer.LossConfig(divergence=divergence)
    return trainer.compile_train_step(STUDENT, teacher, loss, optimizer), optimizer


@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda", "ce"])
def test_train_step_decreases_the_loss_and_leaves_the_teacher_alone(divergence, params):
    student_params, teacher_params = params
    teacher_before = _copy(teacher_params)
    step, optimizer = _step_fn(divergence)
    state = trainer.init_state(jax.tree.map(jnp.copy, student_params), optimizer)  # Donated.
    # The optimizer state holds the student's shapes only: no teacher leaf in the train state.
    student_shapes = {np.shape(x) for x in jax.tree.leaves(student_params)} | {()}
    assert {np.shape(x) for x in jax.tree.leaves(state.opt_state)} <= student_shapes
    assert jax.tree.structure(state.params) == jax.tree.structure(student_params)
    batch = _batch()
    frozen = teacher_params if divergence != "ce" else None
    losses = []
    for _ in range(6):
        state, out = step(state, frozen, batch)
        losses.append(float(out["loss_sum"] / out["weight_sum"]))
    assert int(state.step) == 6
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
    assert float(out["weight_sum"]) == float(np.sum(batch["weights"])) == 13.0
    assert np.isfinite(float(out["grad_norm"]))
    assert ("acceptance_sum" in out) == (divergence != "ce")
    # The teacher is neither donated nor updated.
    for leaf in jax.tree.leaves(teacher_params):
        assert not leaf.is_deleted()
    jax.tree.map(np.testing.assert_array_equal, _copy(teacher_params), teacher_before)


def test_loss_positions_cover_every_weighted_position():
    batch = _batch(completion_length=7)
    weights, positions = np.asarray(batch["weights"]), np.asarray(batch["loss_positions"])
    assert positions.shape == (4, 7)
    for row in range(4):
        assert set(np.flatnonzero(weights[row])) <= set(positions[row])
        assert len(set(positions[row])) == 7 and positions[row].max() < weights.shape[1]


@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd", "tvd", "ce", "topk"])
def test_the_step_at_the_loss_positions_equals_the_step_over_every_position(divergence, params):
    # The trainer runs both heads and the loss on `loss_positions` only; without them it runs
    # over every position and the weights leave the prompt out: the same step.
    student_params, teacher_params = params
    step, optimizer = _step_fn("fkl" if divergence == "topk" else divergence)
    batch = _batch(completion_length=7)
    if divergence == "topk":  # The teacher's cached top-k laid out as `TeacherTopK.rows` does.
        rng = np.random.default_rng(3)
        log_probs = np.log(rng.dirichlet(np.ones(6), size=(4, 13))[..., :4]).astype(np.float32)
        ids = np.argsort(rng.random((4, 13, VOCAB)), axis=-1)[..., :4].astype(np.int32)
        batch = {**batch, cache.LOG_PROBS: log_probs, cache.IDS: ids}

    def run(batch):
        state = trainer.init_state(jax.tree.map(jnp.copy, student_params), optimizer)  # Donated.
        state, out = step(state, None if divergence == "ce" else teacher_params, batch)
        return jax.device_get(out), _copy(state.params)

    everywhere = {k: v for k, v in batch.items() if k != "loss_positions"}
    (at, params_at), (full, params_full) = run(batch), run(everywhere)
    assert set(at) == set(full)
    for key in at:
        np.testing.assert_allclose(at[key], full[key], rtol=2e-5, atol=1e-6, err_msg=key)
    # Adam divides by the gradient's scale, so float reordering shows in the update at ~1e-5 of
    # the learning rate's step (3e-2); a wrong position would move parameters by ~the step.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=3e-5), params_at, params_full)


@pytest.mark.parametrize("divergence", ["fkl", "ce"])
def test_prompt_and_padding_positions_do_not_affect_the_step(divergence, params):
    student_params, teacher_params = params
    step, optimizer = _step_fn(divergence)
    frozen = teacher_params if divergence != "ce" else None

    def run(batch):
        state = trainer.init_state(jax.tree.map(jnp.copy, student_params), optimizer)  # Donated.
        state, out = step(state, frozen, batch)
        return float(out["loss_sum"]), float(out["weight_sum"]), _copy(state.params)

    batch = _batch()
    base = run(batch)
    weights = np.asarray(batch["weights"])
    # Targets where the weight is 0 (prompt and padding) are never read.
    junk_targets = np.where(
        weights == 0, (np.asarray(batch["targets"]) + 7) % VOCAB, batch["targets"]
    )
    # Tokens after each row's end (prompt + completion) are right padding: causal attention
    # never lets a weighted position read them.
    lengths = np.array([np.flatnonzero(w).max() + 2 for w in weights])
    past_end = np.arange(weights.shape[1]) >= lengths[:, None]
    assert past_end.any()
    junk_tokens = np.where(past_end, 5, batch["decoder_input_tokens"])
    for changed in (
        {**batch, "targets": jnp.asarray(junk_targets)},
        {**batch, "decoder_input_tokens": jnp.asarray(junk_tokens)},
    ):
        loss_sum, weight_sum, new_params = run(changed)
        np.testing.assert_allclose(loss_sum, base[0], rtol=1e-6)
        assert weight_sum == base[1]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), new_params, base[2])
    # More right padding (a longer N) changes nothing either.
    loss_sum, weight_sum, _ = run(_batch(completion_length=9))
    np.testing.assert_allclose(loss_sum, base[0], rtol=1e-5)
    assert weight_sum == base[1]
    # ...while a weighted position does matter (so the checks above can fail): its target for
    # cross-entropy, its input token for a divergence.
    row, col = np.argwhere(weights == 1)[1]
    key = "targets" if divergence == "ce" else "decoder_input_tokens"
    values = np.array(batch[key])
    values[row, col] = (values[row, col] + 1) % VOCAB
    assert run({**batch, key: jnp.asarray(values)})[0] != pytest.approx(base[0], rel=1e-4)


# ------------------------------------------------------------------------------------------------
# Whole runs through gin.


def _train(model_dir, *bindings: str, files=(TINY,)):
    """Parses the config with MODEL_DIR and `bindings` and runs distillspec.train.train."""
    gin_setup.load_config(list(files), [f"MODEL_DIR = {str(model_dir)!r}", *bindings])
    return gin_setup.run_function("train")(console=False)


def _losses(model_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read_metrics(str(model_dir))}


def _assert_same_params(a, b, atol=0.0):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=atol), _copy(a), _copy(b)
    )


def _export_logits(model_dir, params):
    model, exported = from_pretrained(os.path.join(model_dir, "export"))
    batch = _batch()
    return model, np.asarray(model.logits(exported, batch)), np.asarray(model.logits(params, batch))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted tiny distillation: (MODEL_DIR, final params, losses by step)."""
    gin.clear_config()
    model_dir = tmp_path_factory.mktemp("reference") / "run"
    params = _train(model_dir)
    gin.clear_config()
    return model_dir, _copy(params), _losses(model_dir)


def test_tiny_distill_end_to_end(reference_run):
    model_dir, params, _ = reference_run
    assert sorted(os.listdir(model_dir)) == [
        "checkpoints", "config.gin", "export", "metrics.jsonl", "train",
    ]  # fmt: skip
    config = (model_dir / "config.gin").read_text()
    assert "LossConfig.divergence = 'fkl'" in config and "MODEL_DIR = " in config
    assert sorted(int(s) for s in os.listdir(model_dir / "checkpoints")) == [4, 8]
    events = [f for f in os.listdir(model_dir / "train") if f.startswith("events.out.tfevents")]
    assert events and os.path.getsize(model_dir / "train" / events[0]) > 0
    records = metrics.read_metrics(str(model_dir))
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        assert LOGGED_KEYS <= set(r), r
        assert all(np.isfinite(r[k]) for k in LOGGED_KEYS)
        assert 0 <= r["acceptance_proxy"] <= 1 and r["tokens_per_s"] > 0
        assert r["data_student"] == 1.0  # The tiny run is on-policy (lambda1 = 0, lambda2 = 1).
    # The learning rate logged at step s is the one its update used: adamw's cosine from 0.01.
    assert records[0]["learning_rate"] == pytest.approx(0.01)
    assert records[-1]["learning_rate"] == pytest.approx(
        0.001 + 0.009 * (1 + math.cos(math.pi * 7 / 8)) / 2
    )
    # The export is the final student.
    model, exported, final = _export_logits(model_dir, params)
    assert model.config.embed_dim == 16 and model.vocab_size == 260
    np.testing.assert_allclose(exported, final, rtol=0, atol=1e-6)


def test_a_run_stopped_early_is_the_prefix_of_the_full_run(tmp_path, reference_run):
    """LoopConfig.stop_at (the plan's pilots): the first steps exactly as the full run takes
    them (its schedule), and the same command without it goes on to the full run's result."""
    _, reference_params, reference_losses = reference_run
    model_dir = tmp_path / "run"
    gin.clear_config()
    try:
        _train(model_dir, "LoopConfig.stop_at = 3")
        assert _losses(model_dir) == pytest.approx({s: reference_losses[s] for s in (1, 2, 3)})
        gin.clear_config()
        params = _train(model_dir)
    finally:
        gin.clear_config()
    assert sorted(_losses(model_dir)) == list(range(1, 9))
    _assert_same_params(params, reference_params, atol=1e-6)
    with pytest.raises(ValueError, match=r"LoopConfig.stop_at must be None or an integer in"):
        trainer.LoopConfig(train_steps=4, stop_at=5)


# ------------------------------------------------------------------------------------------------
# Resume after kill -9, and after a corrupted checkpoint.

_DIE_AFTER_STEP = """
import os, signal, sys
from distillspec import gin_setup, metrics

log = metrics.MetricsLogger.log

def log_then_die(self, step, record):
    log(self, step, record)
    if step == int(os.environ["DIE_AFTER_STEP"]):
        os.kill(os.getpid(), signal.SIGKILL)  # Nothing gets to clean up.

metrics.MetricsLogger.log = log_then_die
gin_setup.main("train", sys.argv[1:])
"""


def _env(**extra: str) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # The same XLA setting as tests/conftest.py, so subprocess numbers equal this process's.
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
    return env


def _cli(model_dir) -> list[str]:
    return [f"--gin_file={TINY}", f"--gin.MODEL_DIR={model_dir}"]


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path, reference_run):
    _, reference_params, reference_losses = reference_run
    model_dir = tmp_path / "run"
    # Dies right after logging step 6: checkpoint 4 exists, steps 5 and 6 are logged but lost.
    killed = subprocess.run(
        [sys.executable, "-c", _DIE_AFTER_STEP, *_cli(model_dir)],
        env=_env(DIE_AFTER_STEP="6"), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(_losses(model_dir)) == [1, 2, 3, 4, 5, 6]
    assert os.listdir(model_dir / "checkpoints") == ["4"]
    # The very same command again.
    resumed = subprocess.run(
        [sys.executable, "-m", "distillspec.train", *_cli(model_dir)],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in metrics.read_metrics(str(model_dir))]
    assert steps == list(range(1, 9))  # Steps 5 and 6 once each, not twice.
    losses = _losses(model_dir)
    for step in range(1, 9):
        assert losses[step] == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7), step
    _, resumed_params = from_pretrained(str(model_dir / "export"))
    _assert_same_params(resumed_params, reference_params, atol=1e-6)


def test_sigterm_saves_at_the_step_boundary_and_the_same_command_resumes(
    tmp_path, reference_run, monkeypatch, capsys
):
    _, reference_params, reference_losses = reference_run
    model_dir = tmp_path / "run"
    check = trainer.check_finite

    def check_then_terminate(record, step, *args):
        check(record, step, *args)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # As a scheduler would, mid-run.

    monkeypatch.setattr(trainer, "check_finite", check_then_terminate)
    handler = signal.getsignal(signal.SIGTERM)
    # The command line exits with the preemption status (75) after saving step 2.
    with pytest.raises(SystemExit) as stopped:
        gin_setup.main("train", _cli(model_dir))
    assert stopped.value.code == trainer.PREEMPTED_EXIT_CODE == 75
    assert "preempted: saved checkpoint step 2" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == handler  # The run's own handler is gone.
    assert os.listdir(model_dir / "checkpoints") == ["2"]
    assert sorted(_losses(model_dir)) == [1, 2] and not (model_dir / "export").exists()
    monkeypatch.undo()
    gin.clear_config()
    gin_setup.main("train", _cli(model_dir))
    assert [r["step"] for r in metrics.read_metrics(str(model_dir))] == list(range(1, 9))
    for step, loss in _losses(model_dir).items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7)
    _, resumed_params = from_pretrained(str(model_dir / "export"))
    _assert_same_params(resumed_params, reference_params, atol=1e-6)


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference_run):
    reference_dir, reference_params, reference_losses = reference_run
    model_dir = tmp_path / "run"
    shutil.copytree(reference_dir, model_dir)
    # Truncate the biggest file of the newest step, as a full disk or a cut copy would.
    files = [
        os.path.join(root, f)
        for root, _, fs in os.walk(model_dir / "checkpoints" / "8")
        for f in fs
    ]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)
    with pytest.warns(UserWarning, match=r"checkpoint step 8 .* failed to restore"):
        params = _train(model_dir)
    # Restarted from step 4, redid 5..8 and saved step 8 again; the bad copy is set aside.
    assert sorted(int(s) for s in os.listdir(model_dir / "checkpoints")) == [4, 8]
    assert os.listdir(model_dir / checkpoints.CORRUPT_SUBDIR) == ["8"]
    assert [r["step"] for r in metrics.read_metrics(str(model_dir))] == list(range(1, 9))
    for step, loss in _losses(model_dir).items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7)
    _assert_same_params(params, reference_params, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# A (4, 2) mesh trains like one device.

_MESH_RUNS = """
import json, sys
from distillspec import gin_setup, metrics
import gin, jax

assert jax.device_count() == 8, jax.devices()
gin_file, root = sys.argv[1:]
out = {}
for mesh in [(1, 1), (4, 2)]:
    gin.clear_config()
    model_dir = f"{root}/mesh_{mesh[0]}x{mesh[1]}"
    gin_setup.load_config([gin_file], [
        f"MODEL_DIR = {model_dir!r}", f"train.mesh_shape = {mesh}", "TRAIN_STEPS = 4",
        "BATCH_SIZE = 8", "DataMixture.fixed_data_fraction = 1.0",
    ])
    gin_setup.run_function("train")(console=False)
    out[str(mesh)] = [r["loss"] for r in metrics.read_metrics(model_dir)]
print("LOSSES=" + json.dumps(out))
"""


def test_mesh_4x2_logs_the_same_losses_as_one_device(tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = _env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", _MESH_RUNS, TINY, str(tmp_path)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("LOSSES=")][-1]
    losses = json.loads(line[len("LOSSES=") :])
    single, sharded = losses["(1, 1)"], losses["(4, 2)"]
    assert len(single) == len(sharded) == 4
    np.testing.assert_allclose(sharded, single, rtol=1e-4)
    # The sharded run's export loads like any other.
    _, a = from_pretrained(str(tmp_path / "mesh_1x1" / "export"))
    _, b = from_pretrained(str(tmp_path / "mesh_4x2" / "export"))
    _assert_same_params(a, b, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# Bad input stops before training, naming the problem.


def _assert_nothing_trained(model_dir) -> None:
    model_dir = pathlib.Path(model_dir)
    assert not (model_dir / "metrics.jsonl").exists()
    ckpts = model_dir / "checkpoints"
    assert not ckpts.exists() or not os.listdir(ckpts)


def test_vocabulary_mismatch_is_rejected(tmp_path):
    with pytest.raises(
        ValueError, match=r"student's vocabulary \(260 ids\) and the teacher's \(300"
    ):
        _train(tmp_path / "run", "teacher/TransformerConfig.vocab_size = 300")
    _assert_nothing_trained(tmp_path / "run")


@pytest.mark.parametrize(
    "binding, configurable, valid",
    [
        ("train.nonexistent = 1", "train", "model_dir"),
        ("LossConfig.nonexistent = 1", "LossConfig", "divergence"),
    ],
)
def test_binding_to_an_unknown_parameter_lists_the_valid_ones(
    tmp_path, binding, configurable, valid
):
    with pytest.raises(ValueError) as info:
        _train(tmp_path / "run", binding)
    message = str(info.value)
    assert f"'{configurable}' doesn't have a parameter named 'nonexistent'" in message
    assert f"Valid parameters of {configurable}:" in message and valid in message
    assert not (tmp_path / "run").exists()


def test_cli_names_unset_required_macros(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"required gin bindings not set: MODEL_DIR; pass them as --gin\.MODEL_DIR=VALUE",
    ):
        gin_setup.main("train", [f"--gin_file={TINY}"])


@pytest.mark.parametrize(
    "binding, pattern",
    [
        (
            "DataMixture.fixed_data_fraction = 1.5",
            r"fixed_data_fraction \(lambda1\) must be in \[0, 1\]",
        ),
        (
            "DataMixture.fixed_data_fraction = -0.5",
            r"fixed_data_fraction \(lambda1\) must be in \[0, 1\]",
        ),
        (
            "DataMixture.student_data_fraction = 2.0",
            r"student_data_fraction \(lambda2\) must be in \[0, 1\]",
        ),
        ("LossConfig.beta = 1.5", r"LossConfig\.beta must be in \[0, 1\]"),
        ("LossConfig.divergence = 'kl'", r"LossConfig\.divergence must be one of"),
        ("train.max_examples = 0", r"train\.max_examples must be None .* or an integer >= 1"),
        (
            "train.mesh_shape = (4, 1)",
            r"batch_size \(6\) must be a multiple of the mesh's data axis",
        ),
    ],
)
def test_bad_values_stop_before_training(tmp_path, binding, pattern):
    if "mesh_shape" in binding:
        binding = f"{binding}\nBATCH_SIZE = 6"
    with pytest.raises(ValueError, match=pattern):
        _train(tmp_path / "run", *binding.split("\n"))
    _assert_nothing_trained(tmp_path / "run")


def test_unwritable_model_dir_is_rejected(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"model_dir .*a_file/run' is not a writable directory"):
        _train(blocker / "run")


def test_empty_task_is_rejected(tmp_path):
    vocab = vocabularies.get_vocabulary("byte")
    empty = lambda: {"train": {"inputs": [], "targets": []}}  # noqa: E731
    tasks.register_text_task("empty_for_test", empty, ["train"], vocab)
    with pytest.raises(ValueError, match=r"'empty_for_test' split 'train' has no examples"):
        _train(tmp_path / "run", "train.task = 'empty_for_test'")
    _assert_nothing_trained(tmp_path / "run")


def test_teacher_samples_without_a_teacher_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"samples from the teacher .* but no teacher is given"):
        _train(
            tmp_path / "run", "train.teacher = None", "LossConfig.divergence = 'ce'",
            "DataMixture.student_data_fraction = 0.5",
        )  # fmt: skip
    _assert_nothing_trained(tmp_path / "run")


def test_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, reference_run):
    reference_dir, reference_params, _ = reference_run
    model_dir = tmp_path / "run"
    shutil.copytree(reference_dir, model_dir)  # Checkpoints 4 and 8 of a healthy run.
    # Resume for more steps with a learning rate that overflows float32 (fixed data, to skip
    # sampling). Step 9's loss is still finite (computed before its update), but the update
    # makes the parameters inf/NaN: they must not replace checkpoint 8.
    overflow = [
        "TRAIN_STEPS = 12", "DataMixture.fixed_data_fraction = 1.0",
        "OptimizerConfig.learning_rate = 1e39",
    ]  # fmt: skip
    with pytest.raises(
        FloatingPointError, match=r"after step 9 are not finite.*\(step 8\) is kept"
    ):
        _train(model_dir, *overflow, "LoopConfig.checkpoint_period = 1")
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["4", "8"]
    gin.clear_config()
    # With checkpoints further apart, step 10's loss is NaN and stops the run there.
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 10.*\(step 8\) is kept"):
        _train(model_dir, *overflow, "LoopConfig.checkpoint_period = 5")
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["4", "8"]
    assert max(_losses(model_dir)) == 9  # Step 10 (NaN) was never logged.
    # Checkpoint 8 still holds the good parameters.
    step_dir = model_dir / "checkpoints" / "8" / "default"
    restored = ocp.StandardCheckpointer().restore(str(step_dir.resolve()))
    _assert_same_params(restored["params"], reference_params)


# ------------------------------------------------------------------------------------------------
# Periodic evaluation (EvalConfig).


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"period": -1}, r"EvalConfig\.period must be an integer >= 0"),
        ({"num_prompts": 0}, r"EvalConfig\.num_prompts must be an integer >= 1"),
        ({"gamma": 0}, r"EvalConfig\.gamma must be an integer >= 1"),
        ({"temperature": -0.5}, r"EvalConfig\.temperature must be >= 0"),
    ],
)
def test_eval_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        trainer.EvalConfig(**kwargs)


def test_periodic_evaluation_logs_alpha_and_tau_that_the_evaluator_reproduces(tmp_path):
    """alpha and tau logged at steps 0, 4 and 8; the last ones equal the evaluation module's
    (another batching of the same prompts) on the exported student."""
    from distillspec.evaluation.drafts import GridConfig, evaluate_drafts
    from distillspec.runs.common import prompt_sets

    bindings = (
        "train.evaluation = @EvalConfig()", "EvalConfig.period = 4",
        "EvalConfig.num_prompts = 6", "EvalConfig.temperature = 0.0", "EvalConfig.gamma = 3",
    )  # fmt: skip
    _train(tmp_path / "run", *bindings)
    logged = {r["step"]: r for r in metrics.read_metrics(str(tmp_path / "run")) if "eval_tau" in r}
    assert sorted(logged) == [0, 4, 8]
    for r in logged.values():
        assert 0 <= r["eval_alpha"] <= 1 and 1 <= r["eval_tau"] <= 4
    teacher = gin_setup.configured("distillspec.models.DecoderOnlyLM", "teacher")
    teacher_params = teacher.init(jax.random.PRNGKey(1))  # train.teacher_seed's default
    student, student_params = from_pretrained(str(tmp_path / "run" / "export"))
    name = tasks.register_task("stdlib_code", vocabularies.load_tokenizer("byte").vocabulary)
    lengths = {"inputs": 16, "targets": 8}
    batches = prompt_sets([(name, "validation")], lengths, 6, 3)[(name, "validation")]
    grid = GridConfig(gammas=(3,), temperatures=(0.0,), max_new_tokens=8, latency_prompts=0)
    eos = vocabularies.load_tokenizer("byte").eos_id
    (record,) = evaluate_drafts(
        teacher, teacher_params, {"s": (student, student_params)}, batches, grid, eos_id=eos
    )
    assert record["num_prompts"] == 6
    assert logged[8]["eval_tau"] == pytest.approx(record["tau"], rel=1e-6)
    assert logged[8]["eval_alpha"] == pytest.approx(record["alpha"], rel=1e-6)


def test_periodic_evaluation_needs_a_teacher(tmp_path):
    from distillspec.runs.train import train

    with pytest.raises(ValueError, match="EvalConfig.period = 5 .* no teacher"):
        train(
            str(tmp_path / "run"), student=DecoderOnlyLM(TransformerConfig(vocab_size=260)),
            vocabulary="byte", evaluation=trainer.EvalConfig(period=5),
        )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The teacher's top-k cache on fixed data.


def test_topk_teacher_logits_keep_the_top_k_and_give_the_tail_the_students_shape():
    from distillspec import losses

    logits = jax.random.normal(jax.random.PRNGKey(3), (2, 3, 11)) * 2
    log_p = jax.nn.log_softmax(logits)
    values, ids = jax.lax.top_k(log_p, 4)
    dense = np.asarray(losses.topk_teacher_logits(values, ids, 11))
    np.testing.assert_allclose(np.exp(dense).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.take_along_axis(dense, np.asarray(ids), -1), values, rtol=1e-6)
    tail = 1 - np.exp(np.asarray(values)).sum(-1)
    others = np.ones((2, 3, 11), bool)
    np.put_along_axis(others, np.asarray(ids), False, -1)
    np.testing.assert_allclose(
        np.exp(dense)[others].reshape(2, 3, 7), np.repeat(tail[..., None] / 7, 7, -1), rtol=1e-5
    )
    # With the student's logits, the tail keeps the student's proportions and the top-k mass:
    # FKL is then sum_i p_i log(p_i / q_i) + r log(r / Q), whose gradient pushes no tail id
    # against the others (every tail id's gradient is q_j (1 - r / Q)).
    student = jax.random.normal(jax.random.PRNGKey(4), (2, 3, 11))
    shaped = np.asarray(losses.topk_teacher_logits(values, ids, 11, student))
    np.testing.assert_allclose(np.exp(shaped).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.take_along_axis(shaped, np.asarray(ids), -1), values, rtol=1e-6)
    q = np.asarray(jax.nn.softmax(student))
    tail_q = np.where(others, q, 0.0)
    expected = tail[..., None] * tail_q / tail_q.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.exp(shaped)[others], expected[others], rtol=1e-5)

    def fkl(s):
        p = jnp.exp(losses.topk_teacher_logits(values, ids, 11, s))
        return jnp.sum(p * (jnp.log(p) - jax.nn.log_softmax(s)))

    grad = np.asarray(jax.grad(fkl)(student))
    mass = tail_q.sum(-1, keepdims=True)
    np.testing.assert_allclose(grad[others], (q * (1 - tail[..., None] / mass))[others], atol=1e-5)
    full_values, full_ids = jax.lax.top_k(log_p, 11)  # k = V: the distribution itself
    np.testing.assert_allclose(losses.topk_teacher_logits(full_values, full_ids, 11), log_p,
                               atol=1e-6)  # fmt: skip


def test_teacher_topk_cache_with_k_equal_v_trains_exactly_like_the_teacher(tmp_path):
    fixed = ("DataMixture.fixed_data_fraction = 1.0",)
    _train(tmp_path / "plain", *fixed)
    gin.clear_config()
    cache = tmp_path / "topk"
    cached = (*fixed, "train.teacher_top_k = 260", f"train.teacher_cache_dir = {str(cache)!r}")
    _train(tmp_path / "cached", *cached)
    (written,) = os.listdir(cache)
    plain, with_cache = _losses(tmp_path / "plain"), _losses(tmp_path / "cached")
    assert plain.keys() == with_cache.keys()
    for step in plain:
        assert with_cache[step] == pytest.approx(plain[step], rel=1e-4, abs=1e-6), step
    # A second run reuses the cache file; a smaller k approximates the teacher.
    mtime = (cache / written).stat().st_mtime_ns
    gin.clear_config()
    _train(tmp_path / "again", *cached)
    assert (cache / written).stat().st_mtime_ns == mtime and os.listdir(cache) == [written]
    gin.clear_config()
    _train(tmp_path / "small", *fixed, "train.teacher_top_k = 4",
           f"train.teacher_cache_dir = {str(cache)!r}")  # fmt: skip
    assert len(os.listdir(cache)) == 2
    small = _losses(tmp_path / "small")
    assert all(np.isfinite(v) for v in small.values()) and small != plain


def test_teacher_topk_cache_needs_fixed_data(tmp_path):
    with pytest.raises(ValueError, match=r"teacher_top_k = 8 .*\(lambda1\) = 0"):
        _train(tmp_path / "run", "train.teacher_top_k = 8")
