"""The study's cells and its report's findings, on records made by hand (no JAX, no training):
each finding's rule must say yes when the numbers support it and no when they do not."""

from __future__ import annotations

import pytest

from distillspec.study import pipeline, report


def test_cells_are_the_grid_the_recipes_and_the_spread_seeds_once_each():
    cells = pipeline.make_cells(
        ["fkl", "rkl", "jsd", "tvd"], ["fixed", "teacher", "student", "mixed"],
        list(pipeline.RECIPES), [0], [1], None,
    )  # fmt: skip
    names = [c.name for c in cells]
    assert len(names) == len(set(names)) == 16 + 1 + 7  # grid + ImitKD + second seeds
    assert "fkl-fixed+student-s0" in names  # ImitKD, the one recipe outside the grid
    second = sorted(c.recipe_cell for c in cells if c.seed == 1)
    assert second == sorted([
        "fkl-fixed", "fkl-teacher", "fkl-student", "fkl-mixed", "fkl-fixed+student",
        "tvd-mixed", "jsd-student",
    ])  # fmt: skip
    assert {c.fields()["recipe"] for c in cells} == set(pipeline.RECIPES) | {None}


@pytest.mark.parametrize(
    "args, pattern",
    [
        ((["fkl"], ["fixed"], ["seqkd2"], [0], [], None), r"'seqkd2' is not one of"),
        ((["fkl"], ["fixed"], [], [0], [1], ["rkl-fixed"]), r"spread_cells \['rkl-fixed'\]"),
        ((["fkl"], ["fixed"], [], [], [], None), r"seeds must be a non-empty list"),
    ],
)
def test_cells_reject_bad_names(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        pipeline.make_cells(*args)


def _grid(cell, seed, temperature, tau, tau_theory=None):
    divergence, _, data = cell.partition("-")
    recipe = [r for r, c in pipeline.RECIPES.items() if c == (divergence, data)]
    return {
        "kind": "grid", "cell": cell, "seed": seed, "temperature": temperature, "tau": tau,
        "tau_theory": tau if tau_theory is None else tau_theory, "draft": f"{cell}-s{seed}",
        "divergence": divergence, "data": data, "recipe": recipe[0] if recipe else None,
        "tau_per_prompt": [tau, tau], "in_grid": data in ("fixed", "student", "teacher"),
    }  # fmt: skip


def _records(gain_by_cell, chrf_by_cell=None, lenience=()):
    """Standard tau 2.0 at T = 0 and 1; each cell's tau = 2 * (1 + gain), two seeds."""
    records = [_grid("standard", None, t, 2.0) for t in (0.0, 1.0)]
    records = [dict(r, draft="standard") for r in records]
    for cell, gains in gain_by_cell.items():
        for seed, jitter in ((0, 0.0), (1, 0.001)):
            for t, gain in zip((0.0, 1.0), gains):
                records.append(_grid(cell, seed, t, 2.0 * (1 + gain) + jitter))
    for cell, chrf in (chrf_by_cell or {}).items():
        records.append({"kind": "quality", "model": f"{cell}-s0", "chrf": chrf})
    return records + list(lenience)


def _finding(records, letter):
    rows = report.findings(report.Results(records))
    return next(r for r in rows if r["finding"].startswith(f"({letter})"))


GRID = {  # (gain at T = 0, gain at T = 1): generated data beats fixed, FKL best at T=0, TVD at T=1
    "fkl-fixed": (0.10, 0.05), "fkl-student": (0.30, 0.10), "fkl-teacher": (0.25, 0.08),
    "tvd-fixed": (0.05, 0.10), "tvd-student": (0.15, 0.30), "tvd-teacher": (0.12, 0.25),
    "jsd-student": (0.2, 0.2), "tvd-mixed": (0.1, 0.1), "fkl-fixed+student": (0.1, 0.1),
}  # fmt: skip


def test_findings_a_to_c_reproduce_when_the_numbers_say_so():
    records = _records(GRID)
    assert _finding(records, "a")["reproduced"] == "yes"
    assert _finding(records, "b")["reproduced"] == "yes"
    c = _finding(records, "c")
    assert c["reproduced"] == "yes"
    assert "T=0 FKL (+21.7%), T=1 TVD (+21.7%)" in c["measured here"]


def test_findings_a_to_c_do_not_reproduce_when_the_numbers_say_otherwise():
    worse = dict(GRID, **{"fkl-fixed": (-0.02, 0.05), "tvd-fixed": (0.5, 0.5)})
    records = _records(worse)
    assert _finding(records, "a")["reproduced"] == "no"  # Supervised KD loses at T = 0
    assert _finding(records, "b")["reproduced"] == "partly (2 of 4)"  # TVD: fixed wins
    same = _records(dict(GRID, **{"fkl-student": (0.3, 0.9)}))
    assert _finding(same, "c")["reproduced"] == "no"  # FKL best at both temperatures


def test_finding_d_is_the_rank_correlation_of_theory_and_measurement():
    records = _records(GRID)
    assert _finding(records, "d")["reproduced"] == "yes"  # tau_theory = tau: rho = 1
    inverted = [dict(r, tau_theory=10 - r["tau"]) if r["kind"] == "grid" else r for r in records]
    d = _finding(inverted, "d")
    assert d["reproduced"] == "no" and "T=0 -1.00" in d["measured here"]


def test_finding_e_is_the_correlation_of_quality_and_gain():
    gains = {c: g[0] for c, g in GRID.items()}
    tracking = _records(GRID, {c: 50 + 100 * g for c, g in gains.items()})
    assert _finding(tracking, "e")["reproduced"] == "no"  # chrF follows the gain: r = 1 at T=0
    flat = {c: 50 + (i % 2) for i, c in enumerate(gains)}
    assert _finding(_records(GRID, flat), "e")["reproduced"] in ("yes", "no")


def _lenience(draft, kind, eps, latency, chrf):
    """A lenience record whose target NLL tracks its chrF (higher chrF, lower NLL)."""
    return {"kind": "lenience", "draft": draft, "lenience": kind, "epsilon": eps,
            "latency_ms": latency, "chrf": chrf, "target_nll": 10 - chrf / 10}  # fmt: skip


def test_finding_f_counts_standard_points_dominated_by_the_distilled_curve():
    faster = [
        _lenience("standard", "none", 1.0, 1.0, 30),
        _lenience("standard", "linear", 0.1, 0.8, 28),
        _lenience("distilled", "none", 1.0, 0.9, 30),
        _lenience("distilled", "linear", 0.1, 0.7, 29),
        _lenience("target", None, None, 1.2, 30),
    ]
    f = _finding(_records(GRID, lenience=faster), "f")
    assert f["reproduced"] == "yes by chrF; yes by the target's NLL"
    slower = [dict(r, latency_ms=r["latency_ms"] + 1) if r["draft"] == "distilled" else r
              for r in faster]  # fmt: skip
    f = _finding(_records(GRID, lenience=slower), "f")
    assert f["reproduced"] == "no by chrF; no by the target's NLL"
    assert "0% in (latency, chrF), 0% in (latency, the target's NLL)" in f["measured here"]
    # The two measures can disagree: the distilled draft's outputs worse by chrF, better by NLL.
    distilled = lambda r: r["draft"] == "distilled"
    split = [dict(r, chrf=r["chrf"] - 5 * distilled(r), target_nll=r["target_nll"] - distilled(r))
             for r in faster]  # fmt: skip
    f = _finding(_records(GRID, lenience=split), "f")
    assert f["reproduced"] == "no by chrF; yes by the target's NLL"
