"""Quiet start-up for the command-line entry points (`python -m distillspec.<run>`).

Importing TensorFlow (seqio's data pipeline) prints about seven lines of C++ logs on every
start (oneDNN, "Could not find cuda drivers", absl's "All log messages before
absl::InitializeLog()", and "failed call to cuInit" on a machine without a GPU), and
SentencePiece logs "precompiled_charsmap is empty" each time a model loads. None of it is about
the run. `quiet_startup` silences them unless the command line says --verbose; it must run
before anything imports TensorFlow, so the entry modules call it first.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys

VERBOSE_FLAG = "--verbose"  # Keeps the third-party start-up logs.
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


def quiet_startup(argv: list[str] | None = None) -> bool:
    """Silences third-party start-up logs unless `argv` (default sys.argv) has --verbose.

    Chooses JAX's CPU platform on a machine with no accelerator device (so nothing probes
    CUDA), hides GPUs from TensorFlow (it only feeds data; on a GPU machine this also keeps it
    from reserving memory JAX needs), and turns TensorFlow's, absl's and SentencePiece's logs
    down to errors. Returns whether the run is verbose.
    """
    global _quiet
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
