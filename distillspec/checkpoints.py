"""Orbax checkpoints of the train state in a T5X-style MODEL_DIR.

Layout: `MODEL_DIR/checkpoints/<step>/` (one orbax step directory per save). A checkpoint whose
restore fails is moved to `MODEL_DIR/checkpoints_corrupt/<step>/`, outside orbax's view, so the
resumed run can write that step again.

Crash safety comes from orbax: a save writes `<step>.orbax-checkpoint-tmp-*` and renames it to
`<step>` only once every file is on disk, so a `kill -9` mid-save leaves at most a temporary
directory, which the manager ignores (and deletes on the next start). Saves here are synchronous:
when `save` returns, the checkpoint is final.

Multi-process runs: every process calls the same methods in the same order; orbax writes each
array's shards from the processes that hold them and the metadata from process 0 (its primary
host), with barriers in between. MODEL_DIR must be one directory that every process sees.

What a restore cannot catch: OCDBT data is not checksummed, so a flipped bit inside an array
chunk restores silently. Truncated or missing files, the usual result of a full disk or an
interrupted copy, fail the restore and trigger the fallback to the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import tempfile
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

PyTree = Any

CHECKPOINTS_SUBDIR = "checkpoints"
CORRUPT_SUBDIR = "checkpoints_corrupt"


def check_writable(path: str) -> None:
    """Creates `path` if missing and checks that a file can be written there.

    Call it before training so that a bad MODEL_DIR fails in the first second, not at the
    first checkpoint an hour later.

    Raises:
      ValueError: naming `path` and the OS error, if it cannot be created or written.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as e:
        raise ValueError(
            f"model_dir {path!r} is not a writable directory ({type(e).__name__}: {e}); "
            "pass a directory you can create and write files in."
        ) from e


def remove_unstarted(path: str) -> bool:
    """Removes the directory `path` unless it holds a checkpoint step (for a run that failed
    before its first checkpoint, into a MODEL_DIR it created: nothing is left behind to resume
    or to mistake for a run); whether it did."""
    steps = os.path.join(path, CHECKPOINTS_SUBDIR)
    if os.path.isdir(steps) and any(name.isdigit() for name in os.listdir(steps)):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


LOCK_FILE = ".lock"


@contextlib.contextmanager
def model_dir_lock(path: str):
    """Holds MODEL_DIR for one run: a second run into it stops at once, naming the holder.

    An exclusive `flock` on MODEL_DIR/.lock, which holds the holder's process id and host. The
    kernel releases it when the holder exits, however it exits (a crash or SIGKILL included),
    so a lock file left behind is stale by construction: the next run takes it over and says
    so. A run that ends removes it. (flock over NFS needs the server's lock support;
    multi-process runs lock from process 0 only.)

    Raises:
      RuntimeError: naming the directory and the process that holds it.
    """
    lock_path = os.path.join(path, LOCK_FILE)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise RuntimeError(
                f"MODEL_DIR {path!r} is in use by another run ({holder}; lock {lock_path}): "
                "wait for it to finish or stop it, or give this run another MODEL_DIR"
            ) from None
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if previous:
            print(f"[lock] {lock_path}: taking over a stale lock of {previous}, which no longer "
                  "holds it", flush=True)  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        try:
            yield
        finally:
            os.unlink(lock_path)  # Leaves MODEL_DIR as it was; still held until closed below.
    finally:
        os.close(fd)  # Releases the lock.


def _restore_target(template: PyTree) -> PyTree:
    """Abstract restore target: jax.Array leaves keep their sharding, so a sharded run resumes
    sharded; numpy leaves stay numpy."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, template)


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)


def _check_matches(template: PyTree, restored: PyTree, step: int) -> None:
    """Raises ValueError if `restored` differs from `template` in structure, shape or dtype."""
    if jax.tree.structure(template) != jax.tree.structure(restored):
        raise ValueError(
            f"checkpoint step {step}: restored tree structure {jax.tree.structure(restored)} "
            f"differs from the template's {jax.tree.structure(template)}"
        )
    for (path, want), got in zip(
        jax.tree_util.tree_leaves_with_path(template), jax.tree.leaves(restored)
    ):
        if np.shape(want) != np.shape(got) or _dtype(want) != _dtype(got):
            raise ValueError(
                f"checkpoint step {step}: leaf {jax.tree_util.keystr(path)} restored as "
                f"{np.shape(got)} {_dtype(got)}, template wants {np.shape(want)} {_dtype(want)}"
            )


class Checkpointer:
    """Saves and restores train-state pytrees under `MODEL_DIR/checkpoints/`.

    Example:
      ckpt = Checkpointer(model_dir, max_to_keep=3)
      restored = ckpt.restore_latest(state)          # None on a fresh run
      if restored is not None:
          step, state = restored
      ...
      ckpt.save(step, state)
      ckpt.close()
    """

    def __init__(self, model_dir: str, max_to_keep: int = 3):
        """Opens (creating if needed) the checkpoint directory.

        Args:
          model_dir: the run's MODEL_DIR; checkpoints go to `model_dir/checkpoints`.
          max_to_keep: newest checkpoints kept on disk; older ones are deleted after each save.

        Raises:
          ValueError: if `max_to_keep` < 1 or `model_dir` is not writable.
        """
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        check_writable(model_dir)
        self.model_dir = model_dir
        self.directory = os.path.join(os.path.abspath(model_dir), CHECKPOINTS_SUBDIR)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            # Synchronous: a save that returned is a save that survives a crash right after.
            enable_async_checkpointing=False,
            # Temporary directories are the remains of saves killed midway.
            cleanup_tmp_directories=True,
        )
        # An explicit single-item handler: otherwise orbax infers the item layout from the newest
        # step directory, and one empty or damaged directory breaks restoring the older ones.
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    def save(self, step: int, state: PyTree, force: bool = False) -> None:
        """Writes `state` as checkpoint `step` and returns once it is final on disk.

        Args:
          step: training step the state belongs to (the directory name).
          state: pytree of arrays, e.g. {'step', 'params', 'opt_state'}; optax namedtuple
            states are fine.
          force: passed to orbax; saves even if its save policy would skip this step.

        Raises:
          ValueError: if checkpoint `step` already exists.
        """
        if step in self._manager.all_steps():
            raise ValueError(
                f"checkpoint step {step} already exists in {self.directory}; "
                f"existing steps: {list(self._manager.all_steps())}"
            )
        self._manager.save(step, args=ocp.args.StandardSave(state), force=force)
        self._manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        """orbax's preemption signal: True at the step every process agreed to stop at after
        one of them received SIGTERM (multi-process runs only; False otherwise)."""
        return self._manager.reached_preemption(step)

    def all_steps(self) -> list[int]:
        """Finalized checkpoint steps, oldest first (temporary directories excluded)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """Newest finalized checkpoint step, or None if there is none."""
        return self._manager.latest_step()

    def restore_latest(self, template: PyTree) -> tuple[int, PyTree] | None:
        """Restores the newest checkpoint that restores cleanly.

        A checkpoint whose restore fails (truncated or missing files) is reported with a
        warning naming the step and the reason, moved to `MODEL_DIR/checkpoints_corrupt/`, and
        the next older one is tried.

        Args:
          template: pytree with the structure, shapes and dtypes to restore into. Leaves that
            are jax.Arrays also give the sharding each restored array gets.

        Returns:
          (step, state), or None if there is no checkpoint at all.

        Raises:
          RuntimeError: if checkpoints exist but none restores (often a template that does not
            match what was saved, e.g. a changed model config); nothing is moved then.
        """
        target = _restore_target(template)
        failures: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                state = self._manager.restore(step, args=ocp.args.StandardRestore(target))
            except Exception as e:  # Orbax and TensorStore raise many kinds.
                reason = f"{type(e).__name__}: {str(e)[:500]}"
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} failed to restore ({reason}); "
                    "falling back to the previous checkpoint.",
                    stacklevel=2,
                )
                failures.append((step, reason))
                continue
            _check_matches(template, state, step)
            self._quarantine([s for s, _ in failures])
            return step, state
        if failures:
            listing = "\n".join(f"  step {s}: {r}" for s, r in failures)
            raise RuntimeError(
                f"no checkpoint in {self.directory} could be restored; does the template match "
                f"what was saved?\n{listing}"
            )
        return None

    def _quarantine(self, steps: list[int]) -> None:
        """Moves unrestorable step directories aside so the resumed run can save those steps."""
        if not steps:
            return
        if jax.process_index() == 0:  # One mover; the others wait for it below.
            corrupt_root = os.path.join(os.path.dirname(self.directory), CORRUPT_SUBDIR)
            os.makedirs(corrupt_root, exist_ok=True)
            for step in steps:
                src = os.path.join(self.directory, str(step))
                dst = os.path.join(corrupt_root, str(step))
                if os.path.exists(dst):
                    shutil.rmtree(dst)
                shutil.move(src, dst)
                logging.warning("Moved unrestorable checkpoint %s to %s", src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("distillspec_checkpoint_quarantine")
        self._manager.reload()

    def close(self) -> None:
        """Waits for pending work and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
