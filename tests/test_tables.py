"""Tests for distillspec.tables (hand-made records; no JAX)."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import subprocess
import sys

import pytest

from distillspec import seed_spread, tables

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


def test_intervals_over_prompts_are_shown_beside_their_value(tmp_path):
    with_ci = [dict(r, tau_ci95=0.25, alpha_ci95=0.031) for r in RECORDS]
    rows = tables.records_to_table(with_ci)
    assert rows[0]["tau_baseline_ci95"] == 0.25 and rows[0]["alpha_distilled_ci95"] == 0.031
    text = tables.to_markdown(rows)
    assert "| 2.31 ± 0.25 |" in text and "| 0.500 ± 0.031 |" in text
    assert "ci95" not in text  # No column of its own in Markdown; the CSV keeps it.
    tables.write_csv(rows, tmp_path / "t.csv")
    assert "tau_baseline_ci95" in (tmp_path / "t.csv").read_text().splitlines()[0]
    # Records without intervals (older runs) show the bare value.
    assert "| 2.31 |" in tables.to_markdown(tables.records_to_table(RECORDS))


def test_seed_spread_table_means_and_standard_deviations():
    scale = lambda records, f: [dict(r, tau=r["tau"] * f if r["draft"] == "distilled" else r["tau"])
                                for r in records]  # fmt: skip
    runs = [scale(RECORDS, 1.0), scale(RECORDS, 1.1), scale(RECORDS, 0.9)]
    rows = seed_spread.seed_spread_table(runs)
    first = rows[0]  # T = 0, gamma 3: standard 2.31 every seed, distilled 2.62 * (1, 1.1, 0.9).
    assert first["seeds"] == 3 and first["tau_baseline"] == pytest.approx(2.31)
    assert first["tau_baseline_sd"] == pytest.approx(0.0)
    assert first["tau_distilled"] == pytest.approx(2.62)
    assert first["tau_distilled_sd"] == pytest.approx(0.262)  # sd of (0, +0.262, -0.262).
    assert first["tau_ratio"] == pytest.approx(2.62 / 2.31)
    # Gain 0.31 against a spread of 0.262 over seeds: not more than twice the spread.
    assert first["gain_exceeds_spread"] is False
    tight = seed_spread.seed_spread_table([scale(RECORDS, 1.0), scale(RECORDS, 1.01)])
    assert tight[0]["gain_exceeds_spread"] is True
    assert "2.62 ± 0.26" in tables.to_markdown(rows)
    single = seed_spread.seed_spread_table(runs[:1])[0]  # One seed: no spread, no claim.
    assert math.isnan(single["tau_distilled_sd"]) and single["gain_exceeds_spread"] is False


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
    # Table C.1 shows alpha beside tau.
    assert (first["alpha_baseline"], first["alpha_distilled"]) == (0.5, 0.5)
    assert "α w/o distillation" in tables.to_markdown(rows) and "| 0.500 |" in tables.to_markdown(
        rows
    )


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
    assert "| α fkl | τ fkl | Throughput speed-up fkl |" in tables.to_markdown([row])
    assert "tau_improvement_pct" not in row
    # Extra drafts next to the compared pair get their own columns too.
    (row,) = tables.records_to_table(RECORDS[:2] + [_record("gkd", 3, 0.0, 2.9, 1.7)])
    assert row["tau_distilled"] == 2.62 and row["tau[gkd]"] == 2.9


def test_batch_1_latency_speedup_beside_the_throughput_speedup(tmp_path):
    latency = {"standard": 0.8, "distilled": 1.25}
    records = [dict(r, latency_speedup=latency[r["draft"]] + r["gamma"] / 100) for r in RECORDS]
    rows = tables.records_to_table(records)
    first = rows[0]
    assert first["latency_speedup_baseline"] == pytest.approx(0.83)
    assert first["latency_speedup_distilled"] == pytest.approx(1.28)
    assert first["latency_speedup_difference"] == pytest.approx(0.45)
    assert first["speedup_baseline"] == 1.44  # The throughput speed-up is kept.
    columns = list(first)
    for side in ("baseline", "distilled"):  # Each draft's latency column follows its throughput.
        assert columns.index(f"latency_speedup_{side}") == columns.index(f"speedup_{side}") + 1
    text = tables.to_markdown(rows)
    header = text.splitlines()[0]
    assert (
        "| Throughput speed-up w/o distillation | Batch-1 latency speed-up w/o distillation |"
        in (header)
    )
    assert (
        "| Throughput speed-up with distillation | Batch-1 latency speed-up with distillation |"
        in (header)
    )
    assert "Δ batch-1 latency speed-up" in header and "Δ throughput speed-up" in header
    assert "| 1.44× | 0.83× |" in text and "| 1.58× | 1.28× |" in text and "| +0.45 |" in text
    # Other draft names: one batch-1 latency column each, next to the throughput one.
    (row,) = tables.records_to_table([dict(_record("fkl", 3, 0.0, 2.5, 1.5), latency_speedup=1.1)])
    assert row["latency_speedup[fkl]"] == 1.1
    assert "| Throughput speed-up fkl | Batch-1 latency speed-up fkl |" in tables.to_markdown([row])
    # A grid point whose record predates the latency measurement shows "–".
    (row, *_) = tables.records_to_table(records[1:] + [RECORDS[0]])
    assert row["latency_speedup_baseline"] is None and row["latency_speedup_difference"] is None
    tables.write_csv(rows, tmp_path / "t.csv")
    assert "latency_speedup_distilled" in (tmp_path / "t.csv").read_text().splitlines()[0]


def test_markdown_text(tmp_path):
    rows = tables.records_to_table(RECORDS)
    text = tables.write_markdown(rows, tmp_path / "t.md")
    assert text == (tmp_path / "t.md").read_text()
    lines = text.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    assert "τ w/o distillation" in lines[0] and "Δτ (%)" in lines[0]
    row = "| xsum | validation | T=0 | 3 | 0.500 | 2.31 | 1.44× | 0.500 | 2.62 | 1.58× | +13.4% |"
    assert row in text


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


# DISCO policy records (Table 1 of the DISCO paper; MBPP latencies in ms/token).
def _policy(draft, policy, latency, task="mbpp", split="test", histogram=None, **extra):
    target = 23.21
    histogram = histogram or [1, 2, 3, 0, 4]
    rounds = sum(histogram)
    return {
        "draft": draft, "policy": policy, "sl_max": len(histogram) - 1, "threshold": None,
        "temperature": 0.0, "alpha": 0.7, "tau": 3.1, "mean_sl": tables.sl_stats(histogram)[0],
        "sl_histogram": histogram, "latency_ms": latency, "target_latency_ms": target,
        "speedup": target / latency, "exact": True, "num_prompts": 4, "task": task,
        "split": split, "max_new_tokens": 64, "tokens": 256, "target_calls": rounds,
        "draft_calls": 3 * rounds, **extra,
    }  # fmt: skip


POLICY_RECORDS = [
    _policy("standard", "oracle", 10.18, histogram=[0, 1, 0, 2, 5]),
    _policy("standard", "static-10", 16.0),
    _policy("standard", "disco", 12.58, threshold=0.35),
    _policy("standard", "target", 23.21),
    _policy("standard", "static-2", 15.88),
    _policy("standard", "static-opt", 14.16),
    _policy("standard", "heuristic", 20.07),
    _policy("standard", "confidence", 13.5, threshold=0.6),
    _policy("standard", "zz-new", 13.0),
    _policy("standard", "aa-new", 13.1),
    _policy("distilled", "disco", 11.0),
    _policy("distilled", "target", 23.21),
    _policy("distilled", "oracle", 9.0),
    _policy("standard", "target", 40.0, task="alpaca"),
]


def test_policy_table_order():
    rows = tables.policy_table(POLICY_RECORDS)
    keys = [(r["task"], r["split"], r["draft"], r["policy"]) for r in rows]
    assert keys == [
        ("alpaca", "test", "standard", "target"),
        *[
            ("mbpp", "test", "standard", p)
            for p in (
                "target",
                "static-2",
                "static-10",
                "static-opt",
                "heuristic",
                "confidence",
                "disco",
                "oracle",
                "aa-new",
                "zz-new",
            )  # fmt: skip
        ],
        ("mbpp", "test", "distilled", "target"),
        ("mbpp", "test", "distilled", "disco"),
        ("mbpp", "test", "distilled", "oracle"),
    ]
    assert list(rows[0]) == [
        "task", "split", "draft", "policy", "sl_max", "threshold", "latency_ms",
        "modeled_latency_ms", "speedup", "mean_sl", "tau", "alpha", "exact", "vs_static_opt_pct",
    ]  # fmt: skip
    # Other baseline / distilled names change the draft order.
    rows = tables.policy_table(POLICY_RECORDS, baseline="distilled", distilled="x")
    assert [r["draft"] for r in rows if r["task"] == "mbpp"][0] == "distilled"


def test_policy_table_latency_vs_static_opt():
    by_key = {(r["task"], r["draft"], r["policy"]): r for r in tables.policy_table(POLICY_RECORDS)}
    disco = by_key["mbpp", "standard", "disco"]
    assert disco["vs_static_opt_pct"] == pytest.approx(100 * (14.16 - 12.58) / 14.16)  # 11.16%.
    assert disco["latency_ms"] == 12.58 and disco["threshold"] == 0.35
    assert disco["speedup"] == pytest.approx(23.21 / 12.58)
    assert by_key["mbpp", "standard", "static-opt"]["vs_static_opt_pct"] == 0.0
    target = by_key["mbpp", "standard", "target"]["vs_static_opt_pct"]
    assert target == pytest.approx(100 * (14.16 - 23.21) / 14.16)  # Slower: negative.
    # No static-opt record of the same task/split/draft: None (not another draft's static-opt).
    assert by_key["mbpp", "distilled", "disco"]["vs_static_opt_pct"] is None
    assert by_key["alpaca", "standard", "target"]["vs_static_opt_pct"] is None


def test_policy_table_later_records_win_and_grid_records_are_ignored():
    records = RECORDS + POLICY_RECORDS + [_policy("standard", "static-opt", 10.0)]
    rows = tables.policy_table(records)
    assert len(rows) == len(POLICY_RECORDS)  # No rows from the grid records.
    by_key = {(r["task"], r["draft"], r["policy"]): r for r in rows}
    assert by_key["mbpp", "standard", "static-opt"]["latency_ms"] == 10.0
    disco = by_key["mbpp", "standard", "disco"]["vs_static_opt_pct"]
    assert disco == pytest.approx(100 * (10.0 - 12.58) / 10.0)  # Uses the re-run's latency.


def test_policy_table_markdown_and_csv(tmp_path):
    rows = tables.policy_table(POLICY_RECORDS)
    text = tables.to_markdown(rows)
    header, align = text.splitlines()[:2]
    for name in ("Latency (ms/token)", "Speed-up", "Mean SL", "τ", "α", "Exact"):
        assert f"| {name} |" in header
    assert header.endswith("| Latency vs static-opt (%) |")
    assert align.startswith("|---|---|---|---|---:")  # Text columns left, numbers right.
    mean_sl = tables.sl_stats([1, 2, 3, 0, 4])[0]
    assert (
        f"| mbpp | test | standard | disco | 4 | 0.35 | 12.58 | – | 1.84× | {mean_sl:.2f} | 3.10 "
        "| 0.70 | yes | +11.2% |"
    ) in text
    assert "| mbpp | test | distilled | disco | 4 | – | 11.00 | – | 2.11× |" in text
    tables.write_csv(rows, tmp_path / "d.csv")
    with open(tmp_path / "d.csv", newline="") as f:
        parsed = list(csv.DictReader(f))
    assert [back["policy"] for back in parsed] == [row["policy"] for row in rows]
    assert float(parsed[7]["vs_static_opt_pct"]) == pytest.approx(rows[7]["vs_static_opt_pct"])
    assert parsed[-1]["vs_static_opt_pct"] == ""


def test_table_c1_and_tau_plot_ignore_policy_records(tmp_path):
    mixed = POLICY_RECORDS[:3] + RECORDS + POLICY_RECORDS[3:]
    assert tables.records_to_table(mixed) == tables.records_to_table(RECORDS)
    tables.plot_tau_vs_gamma(mixed, tmp_path / "plot.png")  # Policy records have no gamma.
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sl_stats():
    assert tables.sl_stats([0, 2, 0, 2]) == pytest.approx((2.0, 1.0))
    assert tables.sl_stats([1, 0, 0, 0, 1]) == pytest.approx((2.0, 2.0))  # Std, not variance.
    assert tables.sl_stats([3]) == (0.0, 0.0)
    assert all(math.isnan(v) for v in tables.sl_stats([0, 0]))


def test_sl_histogram_plot(tmp_path):
    records = POLICY_RECORDS + [_policy("standard", "oracle", 15.4, task="cnn_dm", split="val")]
    tables.plot_sl_histogram(records, tmp_path / "hist.png")
    assert (tmp_path / "hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tables.plot_sl_histogram(records, tmp_path / "disco.png", policy="disco")
    assert (tmp_path / "disco.png").exists()
    with pytest.raises(ValueError, match="oracle"):
        tables.plot_sl_histogram(RECORDS + POLICY_RECORDS[1:3], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_format_report_mixed_records(tmp_path):
    old_text = tables.format_report(_write_jsonl(tmp_path / "old.jsonl", RECORDS), tmp_path / "a")
    assert not (tmp_path / "a" / "disco_table.md").exists()
    mixed = POLICY_RECORDS[:5] + RECORDS + POLICY_RECORDS[5:]
    records_path = _write_jsonl(tmp_path / "records.jsonl", mixed)
    text = tables.format_report(records_path, tmp_path / "b")
    report = tmp_path / "b"
    assert (report / "table.md").read_text() == old_text  # Unchanged by the policy records.
    assert (report / "table.csv").read_text() == (tmp_path / "a" / "table.csv").read_text()
    for name in ("tau_vs_gamma.png", "disco_table.md", "disco_table.csv", "oracle_sl_hist.png"):
        assert (report / name).stat().st_size > 0
    disco_text = (report / "disco_table.md").read_text()
    assert disco_text == tables.to_markdown(tables.policy_table(POLICY_RECORDS))
    assert text == old_text + "\n" + disco_text  # Table C.1 first, then DISCO's Table 1.
    out = subprocess.run(
        [sys.executable, "-m", "distillspec.tables", str(records_path)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert out.stdout == text
    assert (tmp_path / "disco_table.md").exists()  # Default out_dir: next to the records.


def test_format_report_policy_records_only(tmp_path):
    text = tables.format_report(_write_jsonl(tmp_path / "r.jsonl", POLICY_RECORDS), tmp_path / "a")
    assert text == (tmp_path / "a" / "disco_table.md").read_text()
    assert "| disco |" in text
    assert (tmp_path / "a" / "oracle_sl_hist.png").exists()
    for name in ("table.md", "table.csv", "tau_vs_gamma.png"):
        assert not (tmp_path / "a" / name).exists()
    no_oracle = [r for r in POLICY_RECORDS if r["policy"] != "oracle"]
    tables.format_report(_write_jsonl(tmp_path / "n.jsonl", no_oracle), tmp_path / "n")
    assert (tmp_path / "n" / "disco_table.csv").exists()
    assert not (tmp_path / "n" / "oracle_sl_hist.png").exists()


def _grid(task, split, temperature, tau_factor, latency):
    """Both drafts at gamma 3, 5, 7; the distilled draft's batch-1 latency peaks at gamma 5."""
    out = []
    for gamma in (3, 5, 7):
        for draft, f in (("standard", 1.0), ("distilled", tau_factor)):
            out.append(
                dict(
                    _record(
                        draft, gamma, temperature, 2.0 * f + gamma / 10, 0.6, task=task, split=split
                    ),
                    alpha=0.3 * f,
                    latency_speedup=latency * f - abs(gamma - 5) / 10,
                )
            )
    return out  # fmt: skip


def test_terminal_summary_fits_100_columns_and_reads_the_best_gamma():
    records = []
    for task in ("a_very_long_eval_set_name_that_goes_on_and_on", "humaneval"):
        for temperature in (0.0, 1.0):
            records += _grid(task, "test", temperature, 1.4, 1.1)
    records.append(dict(_record("distilled", 9, 0.0, 9.0, 9.0), policy="oracle"))  # Ignored.
    text = tables.terminal_summary(records, "runs/quickstart/table.md")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= tables.SUMMARY_WIDTH
    assert len(lines) == 2 + 4 + 2  # Title, header, eval set x temperature, the table's path.
    (row,) = [line for line in lines if line.startswith("humaneval/test") and " 1 " in line[24:29]]
    assert row.split()[2] == "5"  # The gamma of the distilled draft's best batch-1 latency.
    assert "0.300 → 0.420" in row and "2.50 → 3.30" in row and "1.10× → 1.54×" in row
    assert lines[-1].strip() == "runs/quickstart/table.md"


def test_terminal_summary_without_latency_or_without_both_drafts():
    no_latency = [dict(r, latency_speedup=None) for r in _grid("t", "s", 0.0, 1.2, 1.0)]
    row = tables.terminal_summary(no_latency, "table.md").splitlines()[2]
    assert row.split()[2] == "7" and row.endswith("– → –")  # Best tau; latency not measured.
    assert tables.terminal_summary([], "table.md") == ""


def test_terminal_summary_of_drafts_of_any_name_and_a_readable_task():
    """Drafts not named standard and distilled each get a line at their own best gamma, and a
    data file's task reads as the file's name (not its registered 'file:NAME#digest')."""
    renamed = {"standard": "fresh-1x64", "distilled": "target-layers-1"}
    records = [dict(r, draft=renamed[r["draft"]], task="file:data.jsonl#92bc8a5c")
               for r in _grid("t", "test", 0.0, 1.4, 1.1)]  # fmt: skip
    lines = tables.terminal_summary(records, "table.md").splitlines()
    assert lines[0].startswith("Summary:") and max(map(len, lines)) <= tables.SUMMARY_WIDTH
    rows = [line.split() for line in lines[2:4]]
    assert [r[0] for r in rows] == ["data.jsonl/test"] * 2
    assert [r[2] for r in rows] == ["fresh-1x64", "target-layers-1"]
    best = lambda name: max((r for r in records if r["draft"] == name),
                            key=lambda r: r["latency_speedup"])  # fmt: skip
    for row, name in zip(rows, ("fresh-1x64", "target-layers-1")):
        assert int(row[3]) == best(name)["gamma"]
        assert row[-1] == f"{best(name)['latency_speedup']:.2f}×"
    table = tables.to_markdown(tables.records_to_table(records))
    assert "| data.jsonl |" in table and "file:" not in table
