"""Test-wide settings: a shared XLA compilation cache, a private model cache, JAX's flags.

The suite runs on two pytest-xdist workers (`-n 2 --dist loadfile` in pyproject.toml; `-n 0`
for one process). This file is imported first by the controller process, then by each worker,
which inherits the controller's environment. Timing tests of tiny models time >= 9 calls per
per-call cost, so that the second worker's load does not bring one to <= 0 (one came out
<= 0 once, timed over 1-2 calls).
"""

import atexit
import os
import shutil
import tempfile

if "PYTEST_XDIST_WORKER" not in os.environ:  # The controller, or a run without workers.
    # One persistent compilation cache for the whole run, shared by the workers and by the
    # subprocesses tests start (they inherit the environment): many tests compile the same
    # programs again (the decoders' timing programs for every policy, reruns of a run function,
    # the same tiny models in several modules), and XLA's compile dominates the suite's time on
    # a 2-core CPU. A size limit turns on JAX's file lock, so concurrent writers and readers of
    # one entry are safe. New for every run and removed at its end: no result depends on an
    # earlier run, and the same goes for the model and vocabulary cache ($DISTILLSPEC_CACHE),
    # which also keeps the tests out of the user's ~/.cache/distillspec.
    _RUN_DIR = tempfile.mkdtemp(prefix="distillspec-tests-")
    atexit.register(shutil.rmtree, _RUN_DIR, ignore_errors=True)
    # The workers start with huge pages for their C heap, as the entry points restart with
    # (distillspec.console.restart_with_huge_pages); this process started without them.
    from distillspec import console

    _huge = console.huge_pages_environment(
        dict(os.environ), console.glibc_version(), console.thp_mode()
    )
    if _huge is not None:
        os.environ["GLIBC_TUNABLES"] = _huge["GLIBC_TUNABLES"]
    # XLA:CPU's fusion emitters compile the suite's many small programs ~40% slower than the
    # older code path (a tiny pair's speculative decoder: 8.9 s -> 5.3 s for 4 programs,
    # compile-dominated), and one codegen split saves a little more; both change only how
    # the CPU code is generated. Appended, so a test's own flags (device counts) still apply.
    fast_compile = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fast_compile}".strip()
    # The setting below, for the subprocesses tests start too (they compile as much).
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=os.path.join(_RUN_DIR, "xla"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_COMPILATION_CACHE_MAX_SIZE=str(16 << 30),
        DISTILLSPEC_CACHE=os.path.join(_RUN_DIR, "distillspec"),
    )

# Each worker on its own cores (worker i of n: cores i, i + n, ...), before jax starts XLA's
# threads, which inherit it: the workers' thread pools no longer contend for the same cores (a
# quarter of the suite, the decoder and evaluation tests: 132 s -> 140 s wall without it, two
# paired runs). Subprocesses inherit it too; the multi-process runs take every core back.
if "PYTEST_XDIST_WORKER" in os.environ and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _index = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    if 1 < _count <= len(_cores):
        os.sched_setaffinity(0, _cores[_index::_count])

import jax  # noqa: E402  (reads the settings above)

# The suite compiles many small programs; XLA's optimisation passes cost more than they save
# there (compile time roughly halves). Numerics stay float32.
jax.config.update("jax_disable_most_optimizations", True)

# The files with the most test time first (pytest --durations=60 on a 2-core VM, summed per
# file), then the rest in their usual order. Workers take whole files (--dist loadfile), so a
# long file handed out last kept one worker busy for minutes after the other ran out of work
# (the last 3% of the tests took a fifth of the run). Only the schedule changes; it needs
# --no-loadscope-reorder (pyproject.toml), without which xdist sorts files by their test count.
LONGEST_FIRST = (
    "test_cli.py", "test_benchmarks.py", "test_disco.py", "test_reproducible.py",
    "test_distributed.py", "test_evaluate.py", "test_your_target.py", "test_trainer.py",
    "test_new_user.py", "test_decoding_models.py", "test_plan.py",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: files stay whole.
