"""python -m distillspec.report on tiny synthetic records made here (no run, no JAX work)."""

from __future__ import annotations

import json
import re

import pytest

from distillspec import report


def _grid_record(draft, gamma, temperature, tau, latency, task="stdlib_code"):
    return {
        "draft": draft, "gamma": gamma, "temperature": temperature, "alpha": tau / 10,
        "alpha_ci95": 0.01, "tau": tau, "tau_ci95": 0.1, "tau_theory": tau + 0.05,
        "speedup": 0.6, "latency_speedup": latency, "task": task, "split": "test",
        "num_prompts": 4, "max_new_tokens": 8,
    }  # fmt: skip


def _quickstart(run_dir, gain=1.3):
    run_dir.mkdir(parents=True)
    records = [
        _grid_record(draft, gamma, temperature, (2.0 + gamma / 10) * f, 1.1 * f)
        for draft, f in (("standard", 1.0), ("distilled", gain))
        for gamma in (3, 5)
        for temperature in (0.0, 1.0)
    ]
    policy = {"draft": "distilled", "policy": "oracle", "task": "stdlib_code", "split": "test",
              "latency_ms": 2.0, "speedup": 1.4, "mean_sl": 3.0, "tau": 3.5, "alpha": 0.6,
              "exact": True, "sl_histogram": [0, 2, 3, 1]}  # fmt: skip
    lines = [json.dumps(r) for r in records + [policy]]
    (run_dir / "records.jsonl").write_text("\n".join(lines) + "\n")
    quality = [
        {"task": "stdlib_code", "split": "test", "model": m, "nll": 3.0 + i, "distinct_4": 0.1,
         "repeating_share": 0.5}
        for i, m in enumerate(("target", "d"))
    ]  # fmt: skip
    (run_dir / "quality.jsonl").write_text("".join(json.dumps(q) + "\n" for q in quality))
    (run_dir / "disco_f1.md").write_text("| draft | F1 |\n|---|---:|\n| distilled | 0.71 |\n")
    return str(run_dir)


def _argv(tmp_path, *extra):
    missing = str(tmp_path / "missing")
    return [
        "--out_dir", str(tmp_path / "results"), "--quickstart", missing, "--disco", missing,
        "--study", missing, "--speculative_json", f"{missing}.json",
        "--disco_json", f"{missing}.json", "--disco_trained_json", f"{missing}.json",
        "--train_step_json", f"{missing}.json", "--versus_trl_json", f"{missing}.json",
        "--memory_json", f"{missing}.json", "--plan", missing, "--online", missing,
        "--recipes_json", f"{missing}.json", *extra,
    ]  # fmt: skip


def test_pages_only_for_inputs_that_exist_and_an_index_of_all(tmp_path):
    run = _quickstart(tmp_path / "qs")
    written = report.main(_argv(tmp_path, "--quickstart", run, "--disco", run))
    assert written == {
        "quickstart.md": True, "seeds.md": False, "disco.md": True, "study.md": False,
        "speculative.md": False, "disco_benchmark.md": False, "disco_trained.md": False,
        "train_step.md": False, "versus_trl.md": False, "memory.md": False, "plan.md": False,
        "online.md": False, "recipes.md": False,
    }  # fmt: skip
    out = tmp_path / "results"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "disco.md", "disco_oracle_sl_hist.png", "quickstart.md",
        "quickstart_tau_vs_gamma.png",
    ]  # fmt: skip
    index = (out / "README.md").read_text()
    for page in report.PAGES:  # Every page, the command behind its input, and its state.
        assert page.title in index and page.producer in index
    assert "[The main job: Table C.1 and quality](quickstart.md)" in index
    assert "| Benchmark: where a distillation step's time goes |" in index  # Not linked.
    assert index.count("no: input not found") == 11


def test_a_page_is_stamped_and_shows_the_records_figures(tmp_path):
    run = _quickstart(tmp_path / "qs")
    report.main(_argv(tmp_path, "--quickstart", run))
    page = (tmp_path / "results" / "quickstart.md").read_text()
    stamp = page.splitlines()[2]
    assert "python -m distillspec.report --out_dir" in stamp
    assert re.search(r"at commit [0-9a-f]{7,}|at commit unknown", stamp)
    assert re.search(r"on \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", stamp)
    assert re.search(r"machine: .+, \d+ cores, JAX backend \w+", stamp)
    assert "| 3.25 ± 0.10 |" in page  # Distilled tau at gamma 5: 2.5 * 1.3, from the records.
    assert "1.10× → 1.43×" in page  # The terminal summary's batch-1 latency speed-ups.
    assert "![quickstart_tau_vs_gamma.png](quickstart_tau_vs_gamma.png)" in page
    assert "| target |" in page  # Quality.


def test_the_main_job_page_names_timings_that_disagree_with_themselves(tmp_path):
    run = _quickstart(tmp_path / "qs")
    report.main(_argv(tmp_path, "--quickstart", run))
    assert "Timing warnings" not in (tmp_path / "results" / "quickstart.md").read_text()
    path = tmp_path / "qs" / "records.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:  # A slow stretch while T=0 was timed: the plain target 3x slower.
        if "policy" not in r:
            r["target_latency_ms"] = 1.2 if r["temperature"] == 0.0 else 0.4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.main(_argv(tmp_path, "--quickstart", run))
    page = (tmp_path / "results" / "quickstart.md").read_text()
    assert "**Timing warnings**" in page
    assert "- stdlib_code/test: the plain target's batch-1 latency" in page
    assert "1.200 ms at T=0, 0.400 ms at T=1" in page


def test_seed_spread_needs_two_runs_and_gives_mean_and_sd(tmp_path):
    runs = [_quickstart(tmp_path / f"s{i}", gain) for i, gain in enumerate((1.2, 1.4))]
    assert not report.main(_argv(tmp_path, "--seeds", runs[0]))["seeds.md"]
    assert report.main(_argv(tmp_path, "--seeds", *runs))["seeds.md"]
    page = (tmp_path / "results" / "seeds.md").read_text()
    assert "| 1.30 ± 0.14 |" in page  # tau ratio distilled / standard over the two seeds.
    assert "| 4.000 ± 0.000 |" in page  # The quality spread: model d's NLL.


def test_benchmark_pages_from_their_json(tmp_path):
    spec = [{"dtype": "float32", "batch": 1, "gamma": 4, "alpha": 0.7, "tau": 3.1, "c": 0.1,
             "r_gamma": 1.2, "speedup_ideal": 1.9, "speedup": 1.5, "efficiency": 0.79,
             "exact_greedy": True, "pair": "reference"}]  # fmt: skip
    disco = {"disco_vs_static_opt_pct": 4.5, "all_exact": True, "pair": "reference",
             "policies": {"disco": {"latency_ms": 3.2, "speedup": 1.6}}}  # fmt: skip
    train = {"kd_step_fixed_over_sum": 1.07, "backend": "cpu", "shapes": {"batch": 16},
             "pretrain_step_products": [{"lhs": [32, 4, 128, 64], "rhs": [32, 4, 64, 128],
                                         "dimension_numbers": [[[3], [2]], [[0, 1], [0, 1]]],
                                         "count": 4, "ms": 2.47, "gflops": 108.7}]}  # fmt: skip
    trl = {"speedup": 2.31, "speedup_interval": [2.1, 2.5], "trl_version": "1.16.0",
           "student_logits_max_abs_diff": 4.77e-06}  # fmt: skip
    paths = {}
    for name, value in (("spec", spec), ("disco", disco), ("train", train), ("trl", trl)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(value))
    written = report.main(_argv(
        tmp_path, "--speculative_json", str(paths["spec"]), "--disco_json", str(paths["disco"]),
        "--train_step_json", str(paths["train"]), "--versus_trl_json", str(paths["trl"]),
    ))  # fmt: skip
    assert written["speculative.md"] and written["disco_benchmark.md"] and written["train_step.md"]
    assert written["versus_trl.md"]
    out = tmp_path / "results"
    assert "| 0.79 |" in (out / "speculative.md").read_text()
    assert "| disco_vs_static_opt_pct | 4.50 |" in (out / "disco_benchmark.md").read_text()
    page = (out / "train_step.md").read_text()
    assert "| kd_step_fixed_over_sum | 1.07 |" in page
    assert "| 32x4x128x64 | 32x4x64x128 | [3]; [2] | [0, 1]; [0, 1] | 4 | 2.47 | 108.70 |" in page
    page = (out / "versus_trl.md").read_text()
    assert "| speedup | 2.31 |" in page and "| trl_version | 1.16.0 |" in page
    assert "| speedup_interval | [2.10, 2.50] |" in page  # Intervals and small figures kept.
    assert "| student_logits_max_abs_diff | 4.77e-06 |" in page


def test_the_trained_pair_page_shows_table_1_intervals_and_the_modeled_sweep(tmp_path):
    policies = {name: {"latency_ms": ms, "modeled_latency_ms": ms, "speedup": 2.0 / ms,
                       "mean_sl": 3.0, "tau": 2.5, "exact": True}
                for name, ms in (("target", 2.0), ("static-opt", 1.0), ("disco", 0.9),
                                 ("cumulative", 0.85), ("oracle", 0.7))}  # fmt: skip
    sweep = [{"c": c, "r_gamma": r, "static_opt": 3, **{
        f"{p}_vs_static_opt_pct": 10.0 * c for p in report.SWEEP_POLICIES}}
        for c in (0.05, 0.4) for r in (1.0, 2.0)]  # fmt: skip
    result = {"policies": policies, "disco_vs_static_opt_pct_interval": [4.0, 16.0],
              "c": 0.08, "r_gamma": 1.1, "pair": "padded", "sweep": sweep}  # fmt: skip
    path = tmp_path / "trained.json"
    path.write_text(json.dumps(result))
    assert report.main(_argv(tmp_path, "--disco_trained_json", str(path)))["disco_trained.md"]
    out = tmp_path / "results"
    page = (out / "disco_trained.md").read_text()
    assert "| disco | 0.90 | 0.90 | 2.22× | 3.00 | 2.50 | yes | +10.0% | [+4.0, +16.0] |" in page
    assert "| cumulative | 0.85 |" in page and "c = 0.08, r_gamma = 1.1" in page
    assert "**Modeled, not measured**" in page and "![disco_trained_sweep.png]" in page
    assert (out / "disco_trained_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_page_of_an_earlier_run_is_kept_and_said_so(tmp_path):
    run = _quickstart(tmp_path / "qs")
    report.main(_argv(tmp_path, "--quickstart", run))
    report.main(_argv(tmp_path))
    index = (tmp_path / "results" / "README.md").read_text()
    assert "[The main job: Table C.1 and quality](quickstart.md)" in index
    assert "from an earlier run" in index


def test_the_parser_rejects_an_unknown_flag():
    with pytest.raises(SystemExit):
        report.build_parser().parse_args(["--no_such_flag"])
    assert report.cpu_model("/nonexistent")  # Falls back to platform's name.


def test_the_plan_page_puts_predicted_against_measured(tmp_path):
    """The plan's check (`plan_report.validation`) from a plan and measured records: each
    candidate's best speed-up both ways, Spearman, the choice against the best measured, each
    error; the page shows them."""
    from distillspec.records import write_json_atomic
    from distillspec.runs import plan_report

    context = {"teacher_checkpoint": "T", "task": "data", "temperature": 1.0, "pilot_steps": 10,
               "train_steps": 100, "estimate": "held_out", "gammas": [2, 3]}  # fmt: skip
    predicted = {"a": {2: 1.4, 3: 1.5}, "b": {2: 1.2, 3: 1.1}, "c": {2: 1.1, 3: 1.0}}
    rows = {
        n: {"predicted_speedup": s, "pilot": {"held_out": 0.6, "proxy": 0.7, "curve_ratio": 1.0},
            "predicted_by_estimate": {"held_out": s, "proxy": {g: x * 1.1 for g, x in s.items()}}}
        for n, s in predicted.items()
    }  # fmt: skip
    record = lambda speedup: {"latency_speedup": speedup, "tau": 2.0, "tau_ci95": 0.1, "alpha": 0.5}
    measured = {n: {2: record(m2), 3: record(m3)}
                for n, m2, m3 in (("a", 1.1, 1.2), ("b", 1.25, 1.0), ("c", 1.0, 0.9))}  # fmt: skip
    check = plan_report.validation({"candidates": rows, "choice": "a", "context": context},
                                   measured)  # fmt: skip
    a = check["candidates"]["a"]
    assert (a["predicted_gamma"], a["measured_gamma"], a["measured_at_predicted_gamma"]) == (
        3,
        3,
        1.2,
    )
    assert check["spearman"] == pytest.approx(0.5)  # Ranks (1, 2, 3) against (2, 1, 3).
    assert check["top_choice_vs_best_measured_pct"] == pytest.approx(100 * (1.2 / 1.25 - 1))
    assert check["max_abs_error_pct"] == pytest.approx(25.0)  # a: 1.5 / 1.2.
    assert check["by_estimate"]["proxy"]["spearman"] == pytest.approx(0.5)
    assert a["predicted_tau"]["held_out"] == pytest.approx((1 - 0.6**4) / 0.4)
    plan_dir = tmp_path / "plan"
    write_json_atomic(plan_dir / "validation.json", check)
    written = report.main(_argv(tmp_path, "--plan", str(plan_dir)))
    assert written["plan.md"]
    page = (tmp_path / "results" / "plan.md").read_text()
    assert "Spearman (predicted against measured ranking): **0.50**" in page
    assert "| a | 1.50x (3) | 1.20x (3) | +25.0% | 1.20x | 2.00 ± 0.10 |" in page


def test_the_memory_page_shows_each_recipe_and_mesh_with_its_settings(tmp_path):
    figures = {"peak_bytes_per_device": 14.2e9, "temp_bytes": 8.1e9, "param_bytes": 0.6e9,
               "optimizer_bytes": 1.2e9, "teacher_bytes": 2.0e9, "mfu": 0.4,
               "projected_step_s": {"h100-80gb": 0.5}}  # fmt: skip
    row = {"recipe": "Llama", "mesh": "8 x H100", "role": "most tokens", "chips": 8,
           "accelerator": "h100-80gb", "teacher_dtype": "bfloat16", "fsdp": True,
           "remat": "full", "fits": True, "tokens_per_device": 16384, "result": figures,
           "recipe_seconds": 66.0}  # fmt: skip
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"divergence": "jsd", "rows": [row]}))
    assert report.main(_argv(tmp_path, "--memory_json", str(path)))["memory.md"]
    page = (tmp_path / "results" / "memory.md").read_text()
    want = "| Llama | 8 x H100 | most tokens | yes | 16384 | bfloat16 | yes | full | 14.2 | 8.1 |"
    assert want in page and "0.6 + 1.2 + 2.0 | 0.50 | 66 |" in page and "divergence jsd" in page
