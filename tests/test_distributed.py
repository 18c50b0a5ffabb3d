"""Multi-process training on this CPU machine: 2 processes x 2 CPU devices on 127.0.0.1.

Every run is a subprocess tree (a process group, killed whatever happens) started through
`scripts/local_multiprocess.sh`, the launcher the README documents, on the tiny config
configs/tests/tiny_multiprocess.gin (2 x 2 mesh, parameters sharded over 'data', 2 data
shards). All runs share one persistent compilation cache, so only the first compiles; runs
that do not depend on each other start together.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

from distillspec import gin_setup, metrics, quickstart, trainer
from distillspec.models import from_pretrained

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tests" / "tiny_multiprocess.gin")
LAUNCH = str(REPO / "scripts" / "local_multiprocess.sh")
TIMEOUT_S = 420  # For a whole group of runs; each takes seconds to a minute on a busy machine.


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        JAX_PLATFORMS="cpu",
        # The same XLA setting as tests/conftest.py.
        JAX_DISABLE_MOST_OPTIMIZATIONS="true",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    return env


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _running(*commands: tuple[list[str], dict, pathlib.Path]):
    """Starts each (command, env, log file) in its own process group; yields the Popens and,
    on the way out, kills whatever still runs (no orphans, whatever the test did)."""
    procs = []
    pinned = os.sched_getaffinity(0)  # A test worker's own cores (tests/conftest.py).
    try:
        os.sched_setaffinity(0, range(os.cpu_count()))  # The runs inherit every core.
        try:
            for command, env, log in commands:
                with open(log, "w") as out:
                    procs.append(
                        subprocess.Popen(
                            command,
                            env=env,
                            cwd=REPO,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )  # fmt: skip
                    )
        finally:
            os.sched_setaffinity(0, pinned)
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(*commands: tuple[list[str], dict, pathlib.Path]) -> list[tuple[int, str, float]]:
    """Runs the commands together; [(exit status, output, seconds it ran)] once all ended."""
    started = time.monotonic()
    ended: dict[int, float] = {}
    with _running(*commands) as procs:
        while len(ended) < len(procs):
            if time.monotonic() - started > TIMEOUT_S:
                raise TimeoutError(f"runs still going after {TIMEOUT_S} s: {commands}")
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.monotonic() - started
            time.sleep(0.1)
    return [
        (proc.returncode, log.read_text(), ended[i])
        for i, (proc, (_, _, log)) in enumerate(zip(procs, commands))
    ]


def _train_flags(model_dir: pathlib.Path, *bindings: str) -> list[str]:
    return [f"--gin_file={TINY}", f"--gin.MODEL_DIR={model_dir}", *bindings]


def _two_processes(model_dir, env, log, *, wrapper: str | None = None, grace: int = 10):
    program = ["-c", wrapper] if wrapper else ["-m", "distillspec.train"]
    command = [LAUNCH, "2", "--cpu_devices", "2", "--grace", str(grace), "--", sys.executable]
    return command + program + _train_flags(model_dir), env, log


def _losses(model_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read_metrics(str(model_dir))}


def _exported(model_dir):
    return from_pretrained(str(pathlib.Path(model_dir) / "export"))[1]


def _assert_close_trees(a, b, atol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=atol), a, b)


# ------------------------------------------------------------------------------------------------
# The runs that do not depend on each other start together: the tiny run in 1 process x 4
# devices and in 2 processes x 2 devices, the first leg of the preemption test (SIGTERM), and
# two processes started with different seeds. Processes waiting for each other (one compiles,
# the other waits in a collective) leave a core idle that the other runs use.

_SIGNAL_AFTER_STEP = """
import os, signal, sys
import jax
from distillspec import gin_setup, trainer

check = trainer.check_finite

def check_then_signal(record, step, *args):
    check(record, step, *args)
    if step == int(os.environ["SIGNAL_STEP"]) and jax.process_index() == 1:
        os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL_NAME"]))

trainer.check_finite = check_then_signal
gin_setup.main("train", sys.argv[1:])
"""


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, env) -> tuple[pathlib.Path, dict[str, tuple[int, str, float]]]:
    """(root, {name: (exit status, output, seconds)}) of the runs started together."""
    root = tmp_path_factory.mktemp("multiprocess")
    python = [sys.executable, "-m", "distillspec.train"]
    flags = env.get("XLA_FLAGS", "")  # The suite's compile flags (tests/conftest.py) kept.
    four = dict(env, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4")
    two = dict(env, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2")
    port = f"--coordinator_address=127.0.0.1:{_free_port()}"

    def seeds(index: int):
        flags = _train_flags(root / "seeds", f"--gin.LoopConfig.seed={index}")
        command = [*python, "--multiprocess", port, "--process_count=2", f"--process_index={index}"]
        return command + flags, two, root / f"seed_{index}.log"

    # SIGTERM to process 1 after step 2: both processes save at a step they agree on, exit 75.
    term = dict(env, SIGNAL_STEP="2", SIGNAL_NAME="SIGTERM")
    runs = {
        "one": ([*python, *_train_flags(root / "one")], four, root / "one.log"),
        "two": _two_processes(root / "two", env, root / "two.log"),
        "term": _two_processes(
            root / "interrupted", term, root / "term.log", wrapper=_SIGNAL_AFTER_STEP
        ),
        "seed 0": seeds(0),
        "seed 1": seeds(1),
    }
    return root, dict(zip(runs, _run(*runs.values())))


def test_two_processes_log_the_losses_and_export_the_student_of_one(first_runs):
    root, runs = first_runs
    for name in ("one", "two"):
        assert runs[name][0] == 0, runs[name][1][-4000:]
    one, two = _losses(root / "one"), _losses(root / "two")
    assert sorted(one) == sorted(two) == list(range(1, 9))
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-5)
    _assert_close_trees(_exported(root / "two"), _exported(root / "one"), atol=1e-5)
    # Process 0 alone writes the logs and config: one metrics line per step, one event file.
    assert [r["step"] for r in metrics.read_metrics(str(root / "two"))] == list(range(1, 9))
    assert len(os.listdir(root / "two" / "train")) == 1
    assert "train.fsdp = True" in (root / "two" / "config.gin").read_text()
    assert sorted(int(s) for s in os.listdir(root / "two" / "checkpoints")) == [4, 8]
    # Bytes per device at start-up: sharded over the 4 devices of the 2 x 2 mesh.
    for name in ("teacher", "student", "optimizer state"):
        line = next(x for x in runs["two"][1].splitlines() if x.startswith(f"{name}: "))
        assert "per device (largest of this process's 2 devices)" in line
        assert float(line.rsplit("(1/", 1)[1].rstrip(")")) > 3.5, line


def test_preempted_then_killed_run_resumes_to_the_uninterrupted_losses(tmp_path, env, first_runs):
    root, runs = first_runs
    model_dir = root / "interrupted"
    # The first leg (in first_runs): SIGTERM to process 1 after step 2.
    status, output, _ = runs["term"]
    assert status == trainer.PREEMPTED_EXIT_CODE, output[-4000:]  # Passed on by the launcher.
    saved = sorted(int(s) for s in os.listdir(model_dir / "checkpoints"))
    stopped = saved[-1]  # The preemption's save; the periodic one at step 4 may precede it.
    assert 2 < stopped < 8 and set(saved) <= {4, stopped}, saved
    assert f"preempted: saved checkpoint step {stopped}" in output
    assert sorted(_losses(model_dir)) == list(range(1, stopped + 1))
    # SIGKILL to process 1 two steps after the next checkpoint (4, or the preemption's).
    kill_step = max(stopped, 4) + 2
    kill = dict(env, SIGNAL_STEP=str(kill_step), SIGNAL_NAME="SIGKILL")
    [(status, output, _)] = _run(
        _two_processes(model_dir, kill, tmp_path / "kill.log", wrapper=_SIGNAL_AFTER_STEP, grace=2)
    )
    assert status != 0, output[-4000:]
    assert f"process 1 exited with status {128 + signal.SIGKILL}" in output
    assert max(_losses(model_dir)) >= kill_step - 1
    # The same command as the uninterrupted run.
    [(status, output, _)] = _run(_two_processes(model_dir, env, tmp_path / "resume.log"))
    assert status == 0, output[-4000:]
    assert [r["step"] for r in metrics.read_metrics(str(model_dir))] == list(range(1, 9))
    resumed, reference = _losses(model_dir), _losses(root / "two")
    np.testing.assert_allclose([resumed[s] for s in reference], list(reference.values()), rtol=1e-5)
    # TensorBoard too holds each step once: events written after the restored step are purged.
    events = metrics.read_events(str(model_dir / "train"))
    assert sorted(step for step, _ in events["loss"]) == list(range(1, 9))
    _assert_close_trees(_exported(model_dir), _exported(root / "two"), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Bad input, detected at start-up and named. The first two fail before any connection is made,
# so they run in this process.


def test_a_coordinator_that_never_answers_is_a_clear_error_within_the_timeout(tmp_path):
    flags = _train_flags(tmp_path / "run") + [
        "--multiprocess", f"--coordinator_address=127.0.0.1:{_free_port()}",
        "--process_count=2", "--process_index=1", "--initialization_timeout=2",
    ]  # fmt: skip
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        gin_setup.main("train", flags)
    assert 2 <= time.monotonic() - started < 2 + 5
    message = str(info.value)
    assert "process 1 of 2: the coordinator at 127.0.0.1:" in message
    assert "did not answer within --initialization_timeout=2 s" in message
    assert not jax.distributed.is_initialized()


def test_a_process_count_that_does_not_divide_the_mesh_is_named(tmp_path):
    flags = _train_flags(tmp_path / "run", "--gin.train.mesh_shape=(3, 1)") + [
        "--multiprocess", f"--coordinator_address=127.0.0.1:{_free_port()}",
        "--process_count=2", "--process_index=0",
    ]  # fmt: skip
    with pytest.raises(ValueError) as info:
        gin_setup.main("train", flags)
    assert (
        "train.mesh_shape = (3, 1) has 3 devices, which --process_count=2 processes cannot "
        "share evenly" in str(info.value)
    )
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--process_index=1"], "need --multiprocess"),
        (["--multiprocess", "--initialization_timeout=0"], "initialization_timeout must be"),
        (["--multiprocess", "--coordinator_address=nohost"], "must be 'host:port'"),
        (["--multiprocess", "--process_count=2", "--process_index=2"], r"process_index must be"),
    ],
)
def test_bad_multiprocess_flags_are_rejected(tmp_path, flags, pattern, capsys):
    with pytest.raises((ValueError, SystemExit)) as info:
        gin_setup.main("train", _train_flags(tmp_path / "run") + flags)
    assert re.search(pattern, str(info.value) + capsys.readouterr().err)
    assert not jax.distributed.is_initialized()


def test_runs_without_a_mesh_refuse_multiprocess():
    with pytest.raises(ValueError, match=r"distillspec.evaluate runs in one process"):
        gin_setup.main("evaluate", ["--multiprocess"])
    with pytest.raises(ValueError, match=r"distillspec.quickstart runs in one process"):
        quickstart.main(["--multiprocess"])
    assert not jax.distributed.is_initialized()


def test_processes_with_different_seeds_stop_at_start_up_naming_them(first_runs):
    root, runs = first_runs
    for name in ("seed 0", "seed 1"):
        status, output, _ = runs[name]
        assert status == 1, output[-3000:]
        assert "started with different settings" in output
        assert "LoopConfig.seed: process 0 has '0', process 1 has '1'" in output
        assert "the configuration (config.gin) differs between process 0 and process 1" in output
        assert "+LoopConfig.seed = 1" in output
    assert not (root / "seeds" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# Launchers: no TPU or cluster is reachable from here, so they are checked for syntax and their
# --dry_run output (the commands they would run).

SCRIPTS = [LAUNCH, str(REPO / "scripts/tpu/distill.sh"), str(REPO / "scripts/slurm/distill.sbatch")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: pathlib.Path(s).name)
def test_launcher_syntax(script):
    subprocess.run(["bash", "-n", script], check=True, timeout=30)


def _dry_run(command: list[str], **env: str) -> list[str]:
    out = subprocess.run(
        command, env=dict(os.environ, **env), capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    return out.stdout.splitlines()


def test_local_launcher_dry_run_starts_n_processes_on_loopback():
    lines = _dry_run([LAUNCH, "3", "--cpu_devices", "2", "--port", "1234", "--dry_run", "--x=1"])
    assert len(lines) == 3
    for index, line in enumerate(lines):
        assert "--xla_force_host_platform_device_count=2" in line
        assert line.split("--x=1 ")[1].split() == [
            "--multiprocess", "--coordinator_address=127.0.0.1:1234", "--process_count=3",
            f"--process_index={index}",
        ]  # fmt: skip
        assert " -m distillspec.train " in line


def test_tpu_launcher_dry_run_prints_the_gcloud_commands():
    lines = _dry_run(
        [SCRIPTS[1], "--dry_run", "create", "copy", "install", "train", "delete", "--",
         "--gin_file=experiments/gkd.gin"],
        TPU_NAME="slice", ZONE="europe-west4-a", ACCELERATOR_TYPE="v5litepod-16", SPOT="1",
    )  # fmt: skip
    assert lines[0].startswith("gcloud compute tpus tpu-vm create slice --zone=europe-west4-a")
    assert "--accelerator-type=v5litepod-16" in lines[0] and lines[0].rstrip().endswith("--spot")
    train = [x for x in lines if "distillspec.train" in x]
    assert len(train) == 1 and "--worker=all" in train[0]
    assert "--multiprocess\\ --gin_file=experiments/gkd.gin" in train[0]
    assert lines[-1].startswith("gcloud compute tpus tpu-vm delete slice")


def test_slurm_script_dry_run_prints_srun():
    [line] = _dry_run(["bash", SCRIPTS[2], "--gin_file=x.gin"], DRY_RUN="1")
    assert line.split() == [
        "srun", "--kill-on-bad-exit=1", "--gpus-per-task=1", "python", "-m",
        "distillspec.train", "--multiprocess", "--gin_file=x.gin",
    ]  # fmt: skip


def test_slurm_script_requeues_a_preempted_job(tmp_path):
    """A run that exits with the preemption status (75) is requeued; others are not."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexit {trainer.PREEMPTED_EXIT_CODE}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.txt\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42")
    run = subprocess.run(["bash", SCRIPTS[2], "--gin_file=x.gin"], env=env, capture_output=True)
    assert run.returncode == 75 and (tmp_path / "scontrol.txt").read_text() == "requeue 42\n"
