"""Quiet start-up for the command-line entry points (`python -m distillspec.<run>`).

Importing TensorFlow (seqio's data pipeline) prints about seven lines of C++ logs on every
start (oneDNN, "Could not find cuda drivers", absl's "All log messages before
absl::InitializeLog()", and "failed call to cuInit" on a machine without a GPU), and
SentencePiece logs "precompiled_charsmap is empty" each time a model loads. None of it is about
the run. `quiet_startup` silences them unless the command line says --verbose; it must run
before anything imports TensorFlow, so the entry modules call it first.

It also restarts an entry point (`python -m distillspec.<run>`, `python scripts/versus_trl.py`)
once, before those imports, with glibc's malloc asked to back the C heap with transparent huge
pages (`huge_pages_environment`): XLA:CPU allocates each program's buffers afresh per call, and
on a kernel whose huge pages are opt-in (`madvise`, the common default) every call then faults
in and zeroes 4 KiB pages one at a time (87 M page faults, 154 s of system time in one main
job). DISTILLSPEC_HUGE_PAGES=0 keeps the process as launched. What it gains:
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys

VERBOSE_FLAG = "--verbose"  # Keeps the third-party start-up logs.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) its heap.
HUGE_PAGES_ENV = "DISTILLSPEC_HUGE_PAGES"  # "0": start as launched, the C heap untouched.
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_quiet = False  # Set by quiet_startup: the run asked for no third-party logs.


def accelerator_present() -> bool:
    """Whether this machine has a GPU or TPU device node (checked without loading a driver)."""
    patterns = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")
    return any(glob.glob(p) for p in patterns)


def native_logs_silenced() -> contextlib.AbstractContextManager:
    """Silences C++ logs written to fd 2 inside the block, only after `quiet_startup` did so.

    For libraries that log through their own copy of a logger (TensorFlow Text's SentencePiece
    logs "precompiled_charsmap is empty" on loading a model, whatever
    `sentencepiece.set_min_log_level` says). Python exceptions pass through unchanged.
    """
    return _stderr_silenced() if _quiet else contextlib.nullcontext()


@contextlib.contextmanager
def _stderr_silenced():
    """Sends file descriptor 2 (where C++ libraries log) to /dev/null for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def glibc_version() -> tuple[int, ...] | None:
    """(major, minor) of the C library when it is glibc, else None (musl, macOS, Windows)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ('always', 'madvise', 'never'), None if unknown."""
    try:
        with open(THP_MODE_FILE, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_environment(
    environ: dict[str, str], glibc: tuple[int, ...] | None, thp_mode: str | None
) -> dict[str, str] | None:
    """environ with glibc's malloc asked for transparent huge pages (GLIBC_TUNABLES, appended to
    any tunables already there), or None where that would change nothing: not glibc >= 2.35,
    the kernel's mode not 'madvise' ('always' has them already, 'never' has none), the
    tunable already set, or DISTILLSPEC_HUGE_PAGES=0."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (
        environ.get(HUGE_PAGES_ENV) == "0"
        or glibc is None
        or glibc < (2, 35)
        or thp_mode != "madvise"
        or "glibc.malloc.hugetlb=" in tunables
    ):
        return None
    return dict(environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, HUGE_PAGES_TUNABLE])))


def huge_pages_on() -> bool:
    """Whether this process's C heap asked for transparent huge pages (benchmarks record it)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return HUGE_PAGES_TUNABLE in tunables.split(":") or thp_mode() == "always"


def restart_with_huge_pages(argv: list[str]) -> None:
    """Replaces this process by `argv` (argv[0]: the interpreter) under `huge_pages_environment`;
    returns without doing anything where that is None. Call it before anything is printed or
    loaded: the new process starts from the beginning."""
    environ = huge_pages_environment(dict(os.environ), glibc_version(), thp_mode())
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], environ)


SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _launched_as_entry_point(argv: list[str]) -> bool:
    """Whether the interpreter's own command line (sys.orig_argv) runs `-m distillspec...` or a
    script of this repository's scripts/ (e.g. `python scripts/versus_trl.py`)."""
    options = iter(argv[1:])
    for option in options:
        if option in ("-X", "-W"):  # The interpreter's options that take a value.
            next(options, None)
        elif option == "-m":
            return next(options, "").startswith("distillspec.")
        elif option == "-c":
            return False
        elif not option.startswith("-"):  # A script's path.
            return os.path.dirname(os.path.abspath(option)) == SCRIPTS_DIR
    return False


def quiet_startup(argv: list[str] | None = None) -> bool:
    """Silences third-party start-up logs unless `argv` (default sys.argv) has --verbose.

    Chooses JAX's CPU platform on a machine with no accelerator device (so nothing probes
    CUDA), hides GPUs from TensorFlow (it only feeds data; on a GPU machine this also keeps it
    from reserving memory JAX needs), and turns TensorFlow's, absl's and SentencePiece's logs
    down to errors. Returns whether the run is verbose.

    Launched as `python -m distillspec.<run>` (or a script of scripts/), the process first
    restarts itself once with huge pages for the C heap (`restart_with_huge_pages`; see the
    module docstring).
    """
    global _quiet
    if _launched_as_entry_point(sys.orig_argv):
        restart_with_huge_pages(sys.orig_argv)
    argv = sys.argv[1:] if argv is None else argv
    if VERBOSE_FLAG in argv:
        return True
    _quiet = True
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "JAX_PLATFORMS" not in os.environ and not accelerator_present():
        os.environ["JAX_PLATFORMS"] = "cpu"
    with _stderr_silenced():  # Import-time C++ logs ignore TF_CPP_MIN_LOG_LEVEL.
        import tensorflow as tf

        tf.config.set_visible_devices([], "GPU")  # Probes CUDA once, here, silenced.
    import absl.logging
    import sentencepiece

    absl.logging.set_verbosity(absl.logging.ERROR)
    sentencepiece.set_min_log_level(2)
    return False
