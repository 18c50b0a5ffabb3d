"""Tests for distillspec.checkpoints: round trips, retention, corruption fallback, bad dirs."""

from __future__ import annotations

import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distillspec.checkpoints import Checkpointer, check_writable


def _params(seed: int) -> dict:
    # Big enough (random, 64 KiB) that OCDBT stores it in its own data file rather than inline.
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "dense": {
            "kernel": jax.random.normal(k1, (128, 128)),
            "bias": jax.random.normal(k2, (128,)),
        }
    }


def _state(tx: optax.GradientTransformation, seed: int, updates: int = 2) -> dict:
    """A train state whose optimizer has taken `updates` steps, so counters/moments are nonzero."""
    params = _params(seed)
    opt_state = tx.init(params)
    for _ in range(updates):
        grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
        upd, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, upd)
    return {"step": jnp.array(seed, jnp.int32), "params": params, "opt_state": opt_state}


def _assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.shape(x) == np.shape(y) and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


ADAFACTOR = optax.adafactor(learning_rate=1e-2)
ADAMW_SCHEDULE = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1),
)


@pytest.mark.parametrize("tx", [ADAFACTOR, ADAMW_SCHEDULE], ids=["adafactor", "adamw_schedule"])
def test_round_trip_exact(tmp_path, tx):
    state = _state(tx, seed=7)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(7, state)
        template = _state(tx, seed=0, updates=0)
        step, restored = ckpt.restore_latest(template)
    assert step == 7
    _assert_trees_equal(restored, state)
    # Optax namedtuple types survive, so the restored state plugs straight into tx.update.
    assert type(restored["opt_state"]) is type(state["opt_state"])
    tx.update(restored["params"], restored["opt_state"], restored["params"])


def test_restore_uses_template_sharding(tmp_path):
    state = _state(ADAFACTOR, seed=1)
    template = _state(ADAFACTOR, seed=0, updates=0)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state)
        _, restored = ckpt.restore_latest(template)
    for want, got in zip(jax.tree.leaves(template), jax.tree.leaves(restored)):
        assert isinstance(got, jax.Array) and got.sharding == want.sharding


def test_latest_step_and_max_to_keep(tmp_path):
    template = _state(ADAFACTOR, seed=0, updates=0)
    with Checkpointer(str(tmp_path), max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.restore_latest(template) is None
        for step in (10, 20, 30):
            ckpt.save(step, _state(ADAFACTOR, seed=step, updates=0))
        assert ckpt.latest_step() == 30
        assert ckpt.all_steps() == [20, 30]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["20", "30"]
    # A fresh process (new Checkpointer) sees the same steps.
    with Checkpointer(str(tmp_path), max_to_keep=2) as ckpt:
        step, restored = ckpt.restore_latest(template)
    assert step == 30
    _assert_trees_equal(restored["params"], _params(30))


def test_save_existing_step_raises(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"x": jnp.ones(3)})
        with pytest.raises(ValueError, match="step 1 already exists"):
            ckpt.save(1, {"x": jnp.ones(3)})


def _save_two(model_dir: str) -> dict:
    template = _state(ADAMW_SCHEDULE, seed=0, updates=0)
    with Checkpointer(model_dir) as ckpt:
        ckpt.save(1, _state(ADAMW_SCHEDULE, seed=1))
        ckpt.save(2, _state(ADAMW_SCHEDULE, seed=2))
    return template


def _largest_file(directory) -> str:
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


def _truncate_largest(step_dir) -> None:
    path = _largest_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _delete_array_data(step_dir) -> None:
    for root, _, files in os.walk(step_dir):
        if os.path.basename(root) == "d":  # OCDBT data files.
            for f in files:
                os.remove(os.path.join(root, f))


def _empty_step_dir(step_dir) -> None:
    # A step directory that exists but holds nothing: e.g. an interrupted rsync.
    for root, dirs, files in os.walk(step_dir, topdown=False):
        for f in files:
            os.remove(os.path.join(root, f))
        for d in dirs:
            os.rmdir(os.path.join(root, d))


# Orbax leaves an asyncio callback behind when a TensorStore read fails; harmless here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", [_truncate_largest, _delete_array_data, _empty_step_dir])
def test_corrupted_latest_falls_back(tmp_path, damage):
    template = _save_two(str(tmp_path))
    damage(tmp_path / "checkpoints" / "2")
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.warns(UserWarning, match="checkpoint step 2 .* failed to restore"):
            step, restored = ckpt.restore_latest(template)
        assert step == 1
        _assert_trees_equal(restored, _state(ADAMW_SCHEDULE, seed=1))
        # The bad step is moved aside, so the resumed run can write step 2 again.
        assert ckpt.all_steps() == [1]
        assert os.path.isdir(tmp_path / "checkpoints_corrupt" / "2")
        ckpt.save(2, _state(ADAMW_SCHEDULE, seed=2))
        assert ckpt.restore_latest(template)[0] == 2


def test_unfinalized_save_is_ignored(tmp_path):
    template = _save_two(str(tmp_path))
    # What a `kill -9` during save leaves behind: orbax's temporary directory, never renamed.
    tmp_dir = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000000000"
    (tmp_dir / "default").mkdir(parents=True)
    (tmp_dir / "default" / "_METADATA").write_text("{trunc")
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.latest_step() == 2
        step, restored = ckpt.restore_latest(template)
    assert step == 2
    _assert_trees_equal(restored, _state(ADAMW_SCHEDULE, seed=2))


def test_all_unrestorable_raises_and_moves_nothing(tmp_path):
    _save_two(str(tmp_path))
    wrong = {"step": jnp.array(0, jnp.int32), "params": {"dense": {"kernel": jnp.ones((3, 3))}}}
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="template match"):
            ckpt.restore_latest(wrong)
        assert ckpt.all_steps() == [1, 2]
    assert not os.path.exists(tmp_path / "checkpoints_corrupt")


def test_unwritable_path_under_a_file(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    bad = str(tmp_path / "file.txt" / "sub")
    with pytest.raises(ValueError, match="file.txt/sub.*not a writable directory"):
        check_writable(bad)
    with pytest.raises(ValueError, match="file.txt/sub"):
        Checkpointer(bad)


def test_unwritable_directory(tmp_path):
    """chmod-based; as root, where chmod does not bind, a path under a file stands in."""
    if os.geteuid() == 0:
        (tmp_path / "file.txt").write_text("x")
        bad = tmp_path / "file.txt" / "sub"
    else:
        bad = tmp_path / "ro"
        bad.mkdir()
        bad.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=str(bad)):
            check_writable(str(bad))
    finally:
        if bad.is_dir():
            bad.chmod(0o700)


def test_check_writable_creates_dir(tmp_path):
    path = tmp_path / "a" / "b"
    check_writable(str(path))
    assert path.is_dir() and os.listdir(path) == []


@flax.struct.dataclass
class _TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def test_flax_struct_state_round_trips(tmp_path):
    plain = _state(ADAFACTOR, seed=3)
    state = _TrainState(**plain)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(3, state)
        _, restored = ckpt.restore_latest(_TrainState(**_state(ADAFACTOR, seed=0, updates=0)))
    assert isinstance(restored, _TrainState)
    _assert_trees_equal(restored, state)
