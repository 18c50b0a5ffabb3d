"""Tests for distillspec.tables (hand-made records; no JAX)."""

from __future__ import annotations

import csv
import json
import pathlib
import subprocess
import sys

import pytest

from distillspec import tables

REPO = pathlib.Path(__file__).resolve().parents[1]


def _record(draft, gamma, temperature, tau, speedup, task="xsum", split="validation"):
    return {
        "draft": draft, "gamma": gamma, "temperature": temperature, "alpha": 0.5, "tau": tau,
        "tau_theory": tau + 0.1, "speedup": speedup, "num_prompts": 8, "task": task,
        "split": split, "max_new_tokens": 16, "tokens_per_s": 100.0 * speedup,
        "target_tokens_per_s": 100.0, "mean_tvd": 0.3,
    }  # fmt: skip


# Values of the first rows of the paper's Table C.1 (XSum, T5-XL target, T = 0).
RECORDS = [
    _record("standard", 3, 0.0, 2.31, 1.44),
    _record("distilled", 3, 0.0, 2.62, 1.58),
    _record("standard", 5, 0.0, 2.57, 1.43),
    _record("distilled", 5, 0.0, 3.08, 1.62),
    _record("standard", 3, 1.0, 2.19, 1.40),
    _record("distilled", 3, 1.0, 2.58, 1.57),
]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_table_c1_layout_and_differences():
    rows = tables.records_to_table(RECORDS)
    assert [(r["temperature"], r["gamma"]) for r in rows] == [(0.0, 3), (0.0, 5), (1.0, 3)]
    first = rows[0]
    assert (first["task"], first["split"]) == ("xsum", "validation")
    assert (first["tau_baseline"], first["speedup_baseline"]) == (2.31, 1.44)
    assert (first["tau_distilled"], first["speedup_distilled"]) == (2.62, 1.58)
    assert first["tau_improvement_pct"] == pytest.approx(100 * (2.62 / 2.31 - 1))  # 13.42%.
    assert first["speedup_difference"] == pytest.approx(0.14)  # The paper's "+0.14".
    assert rows[1]["speedup_difference"] == pytest.approx(0.19)


def test_missing_draft_at_a_grid_point_is_none_and_later_records_win():
    records = RECORDS + [_record("standard", 7, 0.0, 2.68, 1.36), _record("standard", 3, 0.0, 9, 9)]
    rows = tables.records_to_table(records)
    by_gamma = {(r["temperature"], r["gamma"]): r for r in rows}
    assert by_gamma[0.0, 7]["tau_distilled"] is None
    assert by_gamma[0.0, 7]["tau_improvement_pct"] is None
    assert by_gamma[0.0, 3]["tau_baseline"] == 9  # The appended re-run replaces the first.
    assert "–" in tables.to_markdown(rows)


def test_other_draft_names_fall_back_to_one_column_pair_per_draft():
    records = [_record("fkl", 3, 0.0, 2.5, 1.5), _record("jsd", 3, 0.0, 2.7, 1.6)]
    (row,) = tables.records_to_table(records)
    assert row["tau[fkl]"] == 2.5 and row["speedup[jsd]"] == 1.6
    assert "tau_improvement_pct" not in row
    # Extra drafts next to the compared pair get their own columns too.
    (row,) = tables.records_to_table(RECORDS[:2] + [_record("gkd", 3, 0.0, 2.9, 1.7)])
    assert row["tau_distilled"] == 2.62 and row["tau[gkd]"] == 2.9


def test_markdown_text(tmp_path):
    rows = tables.records_to_table(RECORDS)
    text = tables.write_markdown(rows, tmp_path / "t.md")
    assert text == (tmp_path / "t.md").read_text()
    lines = text.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    assert "τ w/o distillation" in lines[0] and "Δτ (%)" in lines[0]
    assert "| xsum | validation | T=0 | 3 | 2.31 | 1.44× | 2.62 | 1.58× | +13.4% | +0.14 |" in text


def test_csv_parses_back(tmp_path):
    rows = tables.records_to_table(RECORDS)
    tables.write_csv(rows, tmp_path / "sub" / "t.csv")
    with open(tmp_path / "sub" / "t.csv", newline="") as f:
        parsed = list(csv.DictReader(f))
    assert len(parsed) == len(rows)
    for row, back in zip(rows, parsed):
        assert list(back) == list(row)
        assert back["task"] == row["task"] and int(back["gamma"]) == row["gamma"]
        for key in ("tau_baseline", "speedup_distilled", "tau_improvement_pct"):
            assert float(back[key]) == pytest.approx(row[key])


def test_plot_is_a_png(tmp_path):
    records = RECORDS + [_record("standard", 5, 0.0, 2.5, 1.4, task="gsm8k", split="test")]
    tables.plot_tau_vs_gamma(records, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_report_and_cli(tmp_path):
    records_path = _write_jsonl(tmp_path / "records.jsonl", RECORDS)
    text = tables.format_report(records_path, tmp_path / "report")
    for name in ("table.md", "table.csv", "tau_vs_gamma.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert text == (tmp_path / "report" / "table.md").read_text()
    out = subprocess.run(
        [sys.executable, "-m", "distillspec.tables", str(records_path)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert out.stdout == text
    assert (tmp_path / "table.md").exists()  # Default out_dir: next to the records.


def test_empty_records_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        tables.format_report(_write_jsonl(tmp_path / "r.jsonl", []), tmp_path)


def test_import_does_not_load_jax():
    code = "import distillspec.tables, sys; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
