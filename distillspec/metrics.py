"""Training metrics: `MODEL_DIR/metrics.jsonl`, TensorBoard scalars, and a console progress bar.

metrics.jsonl holds one JSON object per `log` call, e.g. {"step": 100, "loss": 2.31, ...}; it is
the record that tables and plots read. TensorBoard event files go to `MODEL_DIR/train/`.

Resuming: lines logged after the last checkpoint and before a crash describe steps the resumed
run will redo. `MetricsLogger` therefore drops every line with step > `start_step` when it
opens the file (`truncate_after`), and every TensorBoard event with step > `start_step`
(`purge_events_after`), so the logs of a resumed run equal an uninterrupted run's.

Multi-process runs log from process 0 only (the trainer opens no logger elsewhere).

TensorFlow is imported lazily, inside `MetricsLogger`, and only for the event writer; reading
and truncating metrics.jsonl needs no TensorFlow.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import tqdm

from distillspec.records import read_jsonl, write_jsonl_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_SUBDIR = "train"


def _metrics_path(model_dir: str) -> str:
    return os.path.join(model_dir, METRICS_FILE)


def read_metrics(model_dir: str) -> list[dict[str, Any]]:
    """All records of `MODEL_DIR/metrics.jsonl` in file order ([] if the file does not exist);
    a torn last line (a kill -9 mid-write) is skipped (`records.read_jsonl`)."""
    path = _metrics_path(model_dir)
    if not os.path.exists(path):
        return []
    return read_jsonl(path)


def truncate_after(model_dir: str, step: int) -> None:
    """Rewrites metrics.jsonl keeping only records with `record['step'] <= step`.

    The rewrite goes to a temporary file that replaces the original with `os.replace`, so a
    crash during it leaves either the old or the new file, never a mix.
    """
    path = _metrics_path(model_dir)
    if not os.path.exists(path):
        return
    write_jsonl_atomic(path, [r for r in read_jsonl(path) if r["step"] <= step])


def _event_files(logdir: str) -> list[str]:
    if not os.path.isdir(logdir):
        return []
    return sorted(os.path.join(logdir, name) for name in os.listdir(logdir) if "tfevents" in name)


def _events(tf: Any, path: str) -> list[bytes]:
    """The serialized events of one file; a torn last record (a kill -9 mid-write) ends it."""
    records = []
    try:
        for record in tf.data.TFRecordDataset(path):
            records.append(record.numpy())
    except tf.errors.DataLossError:
        pass
    return records


def purge_events_after(logdir: str, step: int) -> None:
    """Drops TensorBoard events with step > `step` from the event files under `logdir`.

    Each changed file is rewritten to a temporary file that then replaces it (`os.replace`).
    """
    files = _event_files(logdir)
    if not files:
        return
    tf = _import_tf()
    from tensorflow.core.util import event_pb2

    for path in files:
        records = _events(tf, path)
        kept = [r for r in records if event_pb2.Event.FromString(r).step <= step]
        if len(kept) == len(records):
            continue
        temporary = os.path.join(logdir, ".purge.tmp")
        with tf.io.TFRecordWriter(temporary) as writer:
            for record in kept:
                writer.write(record)
        os.replace(temporary, path)


def read_events(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the scalar events under `logdir`, in file order."""
    tf = _import_tf()
    from tensorflow.core.util import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in _event_files(logdir):
        for record in _events(tf, path):
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    return scalars


def _import_tf() -> Any:
    """TensorFlow with its GPUs hidden, so that it does not take accelerator memory from JAX."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TF already initialised its devices elsewhere; leave that choice.
        pass
    return tf


class _EventWriter:
    """TensorBoard scalar writer on `tf.summary.write`.

    `tf.summary.scalar` needs the `tensorboard` package; `tf.summary.write` with the 'scalars'
    plugin metadata writes the same event without it.
    """

    def __init__(self, logdir: str):
        self._tf = _import_tf()
        from tensorflow.core.framework import summary_pb2

        self._metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DATA_CLASS_SCALAR,
        )
        self._writer = self._tf.summary.create_file_writer(logdir)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        tf = self._tf
        with self._writer.as_default():
            for tag, value in scalars.items():
                tf.summary.write(
                    tag, tf.constant(value, tf.float32), step=step, metadata=self._metadata
                )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class LineProgress:
    """Training progress as a log line every `lines`-th of the run and at its end, for output
    that is not a terminal; the same calls as the tqdm bar it stands in for."""

    def __init__(self, total: int, initial: int = 0, lines: int = 20):
        self.total, self.n, self._initial = total, initial, initial
        self._every = max(1, total // lines)
        self._loss = None
        self._started = time.monotonic()

    def set_postfix(self, loss: str, refresh: bool = False) -> None:
        self._loss = loss

    def update(self, n: int) -> None:
        if n <= 0:
            return
        self.n += n
        if self.n % self._every and self.n != self.total:
            return
        rate = (self.n - self._initial) / max(time.monotonic() - self._started, 1e-9)
        eta = (self.total - self.n) / rate if rate > 0 else float("nan")
        loss = f" loss {self._loss}," if self._loss is not None else ""
        print(
            f"[train] step {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%):{loss} "
            f"{rate:.2f} step/s, ETA {eta:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        pass


class MetricsLogger:
    """Writes each step's scalar metrics to metrics.jsonl, TensorBoard and the console.

    Example:
      logger = MetricsLogger(model_dir, total_steps=1000, start_step=restored_step)
      logger.log(step, {"loss": 2.3, "learning_rate": 1e-3})
      logger.close()
    """

    def __init__(self, model_dir: str, total_steps: int, start_step: int = 0, console: bool = True):
        """Opens the outputs; drops metrics.jsonl records and events with step > `start_step`.

        Args:
          model_dir: the run's MODEL_DIR (created if missing).
          total_steps: the step training ends at; drives the progress bar's ETA.
          start_step: the step training (re)starts from, e.g. the restored checkpoint's.
          console: show a progress bar (step, steps/s, ETA, loss) on stderr.

        Raises:
          ValueError: if `start_step` is not within [0, total_steps].
        """
        if not 0 <= start_step <= total_steps:
            raise ValueError(
                f"start_step must be in [0, total_steps={total_steps}], got {start_step}"
            )
        os.makedirs(model_dir, exist_ok=True)
        self.model_dir = model_dir
        truncate_after(model_dir, start_step)
        purge_events_after(os.path.join(model_dir, TENSORBOARD_SUBDIR), start_step)
        self._file = open(_metrics_path(model_dir), "a")
        self._events = _EventWriter(os.path.join(model_dir, TENSORBOARD_SUBDIR))
        self._bar = None
        if console and sys.stderr.isatty():
            # tqdm's rate counts only updates made here, so steps/s and ETA are right on resume.
            # miniters/mininterval: every update draws once (the trainer logs every step).
            self._bar = tqdm.tqdm(
                total=total_steps, initial=start_step, unit="step", file=sys.stderr,
                dynamic_ncols=True, miniters=1, mininterval=0,
            )  # fmt: skip
        elif console:  # A file or a pipe: log lines, not a bar redrawn with carriage returns.
            self._bar = LineProgress(total_steps, start_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records scalar `metrics` for `step` (values: Python, NumPy or JAX scalars).

        Raises:
          ValueError: if a value is not a scalar, or the metrics contain the key 'step'.
        """
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step'; pass it as `step`")
        scalars = {name: _to_float(name, value) for name, value in metrics.items()}
        # File first: it is the record of truth, and a flushed line survives a kill -9.
        self._file.write(json.dumps({"step": int(step), **scalars}) + "\n")
        self._file.flush()
        self._events.write(int(step), scalars)
        if self._bar is not None:
            self._show_progress(step, scalars)

    def _show_progress(self, step: int, scalars: Mapping[str, float]) -> None:
        # Clamped to total: past it tqdm drops the bar and the ETA.
        if "loss" in scalars:
            self._bar.set_postfix(loss=f"{scalars['loss']:.4g}", refresh=False)
        self._bar.update(max(0, min(step, self._bar.total) - self._bar.n))

    def close(self) -> None:
        """Flushes and closes all outputs."""
        if self._bar is not None:
            self._bar.close()
        self._events.close()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metric {name!r} must be a scalar number, got {value!r}") from e
