"""Tests for distillspec.metrics: metrics.jsonl, resume truncation, TensorBoard events, progress."""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from distillspec.metrics import (
    MetricsLogger,
    purge_events_after,
    read_events,
    read_metrics,
    truncate_after,
)


def _read_events(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file under `logdir`."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for raw in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(raw.numpy())
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                scalars.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    return scalars


def test_lines_written_and_parseable(tmp_path):
    with MetricsLogger(str(tmp_path), total_steps=3, console=False) as logger:
        logger.log(1, {"loss": 2.5, "lr": np.float32(1e-3)})
        logger.log(2, {"loss": jnp.array(1.5), "lr": 1e-3})
        # Flushed per line: readable while the logger is still open (as after a kill -9).
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 2.5, "lr": pytest.approx(1e-3)},
        {"step": 2, "loss": 1.5, "lr": 1e-3},
    ]


def test_bad_metric_values_raise(tmp_path):
    with MetricsLogger(str(tmp_path), total_steps=3, console=False) as logger:
        with pytest.raises(ValueError, match="'loss' must be a scalar"):
            logger.log(1, {"loss": np.ones(3)})
        with pytest.raises(ValueError, match="key 'step'"):
            logger.log(1, {"step": 1})
    with pytest.raises(ValueError, match="start_step must be in"):
        MetricsLogger(str(tmp_path), total_steps=3, start_step=4)


def test_truncate_after(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    )
    truncate_after(str(tmp_path), 3)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # No temporary file left behind.
    truncate_after(str(tmp_path / "missing"), 3)  # No file: nothing to do.


def test_torn_last_line_is_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 1.0}]
    truncate_after(str(tmp_path), 10)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_corrupt_middle_line_raises(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(str(tmp_path))


def test_resumed_log_equals_uninterrupted(tmp_path):
    def loss(step):
        return 10.0 / step

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    with MetricsLogger(str(full), total_steps=6, console=False) as logger:
        for step in range(1, 7):
            logger.log(step, {"loss": loss(step)})
    # Crash after step 5, last checkpoint at step 3; the resumed run redoes steps 4..6.
    with MetricsLogger(str(resumed), total_steps=6, console=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": loss(step)})
    with MetricsLogger(str(resumed), total_steps=6, start_step=3, console=False) as logger:
        for step in range(4, 7):
            logger.log(step, {"loss": loss(step)})
    assert read_metrics(str(resumed)) == read_metrics(str(full))


def test_event_files_contain_scalars(tmp_path):
    with MetricsLogger(str(tmp_path), total_steps=2, console=False) as logger:
        logger.log(1, {"loss": 2.0, "accuracy": 0.25})
        logger.log(2, {"loss": 1.0, "accuracy": 0.5})
    assert glob.glob(str(tmp_path / "train" / "events.out.tfevents.*"))
    scalars = _read_events(str(tmp_path / "train"))
    assert scalars == {"loss": [(1, 2.0), (2, 1.0)], "accuracy": [(1, 0.25), (2, 0.5)]}


def test_resumed_events_hold_each_step_once(tmp_path):
    # Crash after step 5 (last checkpoint 3), with a torn record at the end of the event file.
    with MetricsLogger(str(tmp_path), total_steps=6, console=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    [events] = glob.glob(str(tmp_path / "train" / "events.out.tfevents.*"))
    with open(events, "ab") as f:
        f.write(b"\x10\x00\x00")
    with MetricsLogger(str(tmp_path), total_steps=6, start_step=3, console=False) as logger:
        for step in range(4, 7):
            logger.log(step, {"loss": 10.0 * step})
    want = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert sorted(_read_events(str(tmp_path / "train"))["loss"]) == want
    assert sorted(read_events(str(tmp_path / "train"))["loss"]) == want
    # A fresh start (nothing restored) keeps no step.
    purge_events_after(str(tmp_path / "train"), 0)
    assert read_events(str(tmp_path / "train")) == {}


def test_progress_reaches_total_and_resumes(tmp_path, capsys):
    with MetricsLogger(str(tmp_path), total_steps=4, start_step=2) as logger:
        logger.log(3, {"loss": 0.5})
        logger.log(4, {"loss": 0.25})
        logger.log(5, {"loss": 0.125})  # Past total_steps: must not crash.
    err = capsys.readouterr().err
    # Not a terminal here: log lines (metrics.LineProgress) instead of a bar.
    assert "4/4" in err and "loss 0.25" in err and "step/s" in err
