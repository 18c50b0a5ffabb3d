"""Every run type end to end through its command line, on the tiny configs in configs/tests/.

The tiny quickstart trains a byte-vocabulary target and draft and distils the draft (seconds);
its exports then feed `python -m distillspec.evaluate` and the study. (`python -m
distillspec.disco` runs end to end in tests/test_disco.py, on models of its own.)
"""

from __future__ import annotations

import json
import math
import os

import gin
import pytest

from distillspec import gin_setup, quickstart, records, vocabularies
from tests.test_utils import TEST_CONFIGS as CONFIGS


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """A model cache of this module's own ($DISTILLSPEC_CACHE, restored afterwards)."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get(vocabularies.CACHE_ENV_VAR)
    os.environ[vocabularies.CACHE_ENV_VAR] = str(cache)
    yield cache
    if old is None:
        del os.environ[vocabularies.CACHE_ENV_VAR]
    else:
        os.environ[vocabularies.CACHE_ENV_VAR] = old


def _quickstart(out, *flags):
    gin.clear_config()
    made = quickstart.main(
        [f"--output_dir={out}", f"--gin_file={CONFIGS / 'tiny_quickstart.gin'}", *flags]
    )
    gin.clear_config()
    return made


@pytest.fixture(scope="module")
def tiny_quickstart(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("quickstart")
    return out, _quickstart(out)


def _flags(out, quickstart_dir) -> list[str]:
    drafts = {"standard": str(quickstart_dir / "draft" / "export")}
    return [
        f"--gin.OUTPUT_DIR={out}",
        f"--gin.TARGET_CHECKPOINT={quickstart_dir / 'target' / 'export'}",
        f"--gin.DRAFTS={json.dumps(drafts)}",
    ]


def test_tiny_quickstart(tiny_quickstart):
    out, made = tiny_quickstart
    # 2 drafts x 1 gamma x 2 temperatures on one eval set, all appended to records.jsonl.
    assert {(r["draft"], r["temperature"]) for r in made} == {
        (d, t) for d in ("standard", "distilled") for t in (0.0, 1.0)
    }
    assert records.read_jsonl(out / "records.jsonl") == made
    assert all((r["dtype"], r["cache_dtype"]) == ("float32", "float32") for r in made)
    for stage in ("target", "draft", "distilled"):
        assert (out / stage / "export" / "config.json").is_file()
        assert "TransformerConfig.embed_dim" in (out / stage / "config.gin").read_text()
    assert "τ with distillation" in (out / "table.md").read_text()
    quality = records.read_jsonl(out / "quality.jsonl")
    assert [q["model"] for q in quality] == ["target", "standard", "distilled"]
    assert all(q["nll"] > 0 and q["num_prompts"] == 4 for q in quality)
    assert "NLL (nats/token)" in (out / "quality.md").read_text()


def test_pretrained_models_are_cached_by_their_config(tiny_quickstart, model_cache, tmp_path):
    first = tiny_quickstart[0]
    for stage in ("target", "draft"):  # Linked into the cache, complete.
        assert (first / stage).is_symlink()
        assert (first / stage).resolve().parent == model_cache / "models"
        assert (first / stage / "CACHED").is_file()
    weights = first / "target" / "export" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    # Another run that changes only the draft's training: the target is reused as it is, the
    # draft is trained anew under another key.
    _quickstart(tmp_path, "--gin.draft/LoopConfig.train_steps=3")
    assert (tmp_path / "target").resolve() == (first / "target").resolve()
    assert weights.stat().st_mtime_ns == before
    assert (tmp_path / "draft").resolve() != (first / "draft").resolve()
    assert records.read_jsonl(tmp_path / "draft" / "metrics.jsonl")[-1]["step"] == 3


def test_tiny_evaluate_cli(tiny_quickstart, tmp_path):
    made = gin_setup.main(
        "evaluate",
        [f"--gin_file={CONFIGS / 'tiny_evaluate.gin'}", *_flags(tmp_path, tiny_quickstart[0])],
    )
    grid = [r for r in made if "gamma" in r]
    policies = [r["policy"] for r in made if "policy" in r]
    assert sorted(r["gamma"] for r in grid) == [1, 3] and all(r["num_prompts"] == 4 for r in grid)
    assert policies == ["target", "heuristic"]
    assert all(r["exact"] for r in made if "policy" in r)
    assert all(r["dtype"] == "float32" for r in made)  # Every record names its dtype.
    assert records.read_jsonl(tmp_path / "records.jsonl") == made
    assert (tmp_path / "disco_table.md").is_file() and (tmp_path / "table.md").is_file()


def _study(out, *flags):
    from distillspec.study.__main__ import main

    gin.clear_config()
    made = main([
        f"--output_dir={out}", "--gin_file=experiments/study_quickstart.gin",
        f"--gin_file={CONFIGS / 'tiny_study.gin'}", *flags,
    ])  # fmt: skip
    gin.clear_config()
    return made


def test_tiny_study_runs_every_cell_writes_the_report_and_resumes(tiny_quickstart, tmp_path):
    """The whole study pipeline on the tiny quickstart's models (served by its model cache):
    every cell trained and evaluated, the report written; a rerun skips finished cells and
    redoes an unfinished one identically."""
    out = tmp_path / "study"
    made = _study(out)
    cells = sorted(os.listdir(out / "cells"))
    # 2 divergences x 2 sources + GKD (jsd-student) at seed 0, fkl-fixed again at seed 1.
    assert cells == sorted([
        "standard", "fkl-fixed-s0", "fkl-student-s0", "tvd-fixed-s0", "tvd-student-s0",
        "jsd-student-s0", "fkl-fixed-s1",
    ])  # fmt: skip
    for cell in cells:
        assert (out / "cells" / cell / "study_eval.jsonl").exists()
    grid = [r for r in made if r["kind"] == "grid"]
    assert {(r["cell"], r["seed"], r["temperature"]) for r in grid} == {
        (c.rsplit("-s", 1)[0], int(c.rsplit("-s", 1)[1]), t)
        for c in cells if c != "standard" for t in (0.0, 1.0)
    } | {("standard", None, 0.0), ("standard", None, 1.0)}  # fmt: skip
    assert all(len(r["tau_per_prompt"]) == r["num_prompts"] == 4 for r in grid)
    curves = [r for r in made if r["kind"] == "curve" and r["cell"] == "fkl-student"]
    assert sorted(r["step"] for r in curves) == [0, 2, 4]
    quality = [r for r in made if r["kind"] == "quality"]
    assert len(quality) == len(cells) and all(0 <= r["chrf"] <= 100 for r in quality)
    lenience = [r for r in made if r["kind"] == "lenience"]
    # 2 drafts x (lossless + linear 0.5) + the plain target.
    assert len(lenience) == 5 and lenience[-1]["draft"] == "target"
    for name in ("recipes.md", "grid_T0.md", "grid_T1.md", "findings.md", "fig2_recipes.png",
                 "fig3a_training.png", "fig3b_per_prompt.png", "fig3c_tau_theory.png",
                 "fig4_grid.png", "fig5a_quality.png", "fig5b_lenience.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    assert [json.loads(line) for line in open(out / "records.jsonl")] == made
    # A rerun skips the finished cells; a cell whose evaluation is missing is redone.
    finished = out / "cells" / "tvd-fixed-s0" / "study_eval.jsonl"
    mtime = finished.stat().st_mtime_ns
    redone = out / "cells" / "fkl-student-s0" / "study_eval.jsonl"
    before = [json.loads(line) for line in open(redone)]
    redone.unlink()
    again = _study(out)
    assert finished.stat().st_mtime_ns == mtime
    after = [json.loads(line) for line in open(redone)]
    assert [r["tau"] for r in after if r["kind"] == "grid"] == [
        r["tau"] for r in before if r["kind"] == "grid"
    ]
    assert len(again) == len(made)


def test_tiny_recipes_grid_writes_the_summary_and_the_page(tiny_quickstart, tmp_path):
    """The recipes comparison on the tiny pair (served by the model cache): LK^lambda on-policy,
    AdaSPEC's reference stage and its two selective runs, the --json OUT and the page."""
    import argparse

    from distillspec import metrics, report
    from distillspec.study.__main__ import main

    out, path = tmp_path / "recipes", tmp_path / "out.json"
    gin.clear_config()
    summary = main([
        f"--output_dir={out}", "--gin_file=experiments/recipes_quickstart.gin",
        f"--gin_file={CONFIGS / 'tiny_recipes.gin'}", "--json", str(path),
    ])  # fmt: skip
    gin.clear_config()
    names = ["adaspec-fkl-fixed", "adaspec-lk_lambda-student", "fkl-fixed", "lk_lambda-student"]
    assert sorted(os.listdir(out / "runs")) == [f"{n}-s0" for n in names]
    assert json.loads(path.read_text()) == summary
    assert sorted(summary["recipes"]) == sorted(summary["ranking"]) == names
    keys = {f"stdlib_code/{t}/{g}" for t in (0, 1) for g in (2, 5)}
    for recipe in summary["recipes"].values():
        for metric, top in (("alpha", 1.0), ("tau", 6.0)):
            assert set(recipe[metric]) == keys
            for f in recipe[metric].values():
                low, high = f["interval_90"]
                assert 0 <= low <= high <= top and f["seeds"] == 1 and f["seed_sd"] is None
    # AdaSPEC's budget counts its reference's training; only its runs select tokens.
    ada, ref = summary["recipes"]["adaspec-fkl-fixed"], summary["recipes"]["fkl-fixed"]
    assert ada["train_seconds"] > ref["train_seconds"] > 0
    for name in names:
        rows = [r for r in metrics.read_metrics(out / "runs" / f"{name}-s0") if "loss" in r]
        fractions = [r["selected_fraction"] for r in rows if "selected_fraction" in r]
        if name.startswith("adaspec"):  # ceil(0.4 n) of a step's n tokens (n <= 32), or ties.
            assert len(fractions) == len(rows) > 0
            assert all(0.4 <= f < 0.6 for f in fractions), fractions
        else:
            assert not fractions
    assert summary["adaspec_vs_distillspec_pct"]["adaspec"].startswith("adaspec-")
    assert set(summary["lk_vs_fkl_pct"]) == set()  # No on-policy FKL in the tiny grid.
    page = report.recipes_page(argparse.Namespace(recipes_json=str(path)), str(tmp_path))
    assert "AdaSPEC's +15% over DistillSpec" in page and "| 1 |" in page


def test_study_rejects_unknown_cells_naming_the_valid_ones(tiny_quickstart, tmp_path):
    valid = r"\('fkl', 'rkl', 'jsd', 'tvd', 'lk_alpha', 'lk_lambda', 'lk_lambda_mean'\)"
    with pytest.raises(ValueError, match=rf"'kl' is not one of {valid}"):
        _study(tmp_path / "s", "--gin.study.divergences=['kl']")
    with pytest.raises(ValueError, match=r"study.data_sources: 'on-policy' is not one of"):
        _study(tmp_path / "s", "--gin.study.data_sources=['on-policy']")


def test_study_on_your_own_prompts_only_data_names_the_cells_it_cannot_run(
    tiny_quickstart, tmp_path
):
    """Your target and draft and a prompts-only JSONL: the fixed-data cells are refused before
    anything trains, naming them and the settings that drop them."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(40)))
    exports = tiny_quickstart[0]
    with pytest.raises(ValueError, match=r"holds prompts only, so the cells \['fkl-fixed-s0'"):
        _study(
            tmp_path / "s", f"--gin.study.target_checkpoint='{exports / 'target' / 'export'}'",
            f"--gin.study.draft_checkpoint='{exports / 'draft' / 'export'}'",
            f"--gin.train.task='{data}'", f"--gin.study.eval_set=('{data}', 'test')",
        )  # fmt: skip
    assert not (tmp_path / "s" / "cells").exists()


def test_speculative_benchmark_on_your_own_checkpoints(tiny_quickstart, tmp_path):
    from distillspec.benchmarks import speculative

    exports = tiny_quickstart[0]
    (record,) = speculative.main([
        "--target", str(exports / "target" / "export"), "--draft",
        str(exports / "distilled" / "export"), "--vocabulary", "byte", "--batch", "2",
        "--gamma", "2", "--max_new_tokens", "8", "--prompt_length", "16", "--repeats", "5",
        "--json", str(tmp_path / "out.json"),
    ])  # fmt: skip
    assert record["batch"] == 2 and record["exact_greedy"] and record["efficiency"] > 0
    assert "target " in record["pair"] and record["prompt_length"] == 16


def test_round_profile_on_your_own_checkpoints(tiny_quickstart):
    from distillspec.benchmarks import profile_round

    exports = tiny_quickstart[0]
    records = profile_round.main([
        "--target", str(exports / "target" / "export"), "--draft",
        str(exports / "distilled" / "export"), "--vocabulary", "byte", "--gamma", "2",
        "--max_new_tokens", "32", "--prompt_length", "16", "--repeats", "3",
    ])  # fmt: skip
    assert [r["temperature"] for r in records] == [0.0, 1.0]
    for r in records:
        # Per-call figures are differences of two timed runs: on a model this small they are
        # within timer noise of 0 and may come out negative (CI saw -0.04 ms), so only their
        # presence and the script's arithmetic are asserted, never a sign.
        assert r["rounds"] >= 32 // 3 and math.isfinite(r["target_call_ms"] + r["round_calls_ms"])
        assert r["plain_outside_ms"] == pytest.approx(r["plain_step_ms"] - r["target_call_ms"],
                                                      abs=1e-3)  # fmt: skip
        assert r["spec_outside_ms"] == pytest.approx(r["spec_round_ms"] - r["round_calls_ms"],
                                                     abs=1e-3)  # fmt: skip


def test_policy_latency_on_your_own_checkpoints(tiny_quickstart):
    from distillspec.benchmarks import policy_latency

    exports = tiny_quickstart[0]
    out = policy_latency.main([
        "--target", str(exports / "target" / "export"), "--draft",
        str(exports / "distilled" / "export"), "--vocabulary", "byte", "--prompts", "2",
        "--max_new_tokens", "8", "--prompt_length", "16", "--repeats", "1",
    ])  # fmt: skip
    assert out["exact"]  # Every policy's output is the target's.
    for name in ("target", "static", "heuristic", "confidence", "oracle"):
        assert out[name] > 0
    assert out["oracle_vs_static"] == pytest.approx(out["oracle"] / out["static"], rel=1e-2)
