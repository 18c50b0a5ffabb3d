"""The draft planner (`python -m distillspec.plan`): its arithmetic, the cost profile's round
trip between machines, and the command end to end on a tiny target (pilot, outputs, and the
draft.gin that `python -m distillspec.train` takes as is)."""

from __future__ import annotations

import json

import gin
import jax
import pytest

from distillspec import gin_setup
from distillspec import plan as plan_cli
from distillspec.evaluation import planning
from distillspec.models import DecoderOnlyLM, TransformerConfig, load_checkpoint
from distillspec.models.drafts import num_params
from distillspec.runs.common import export
from distillspec.vocabularies import load_tokenizer

TARGET = TransformerConfig(vocab_size=260, embed_dim=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, mlp_dim=128, init_std=0.5)  # fmt: skip


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama-style target with the byte tokenizer, as a Hugging Face directory."""
    model = DecoderOnlyLM(TARGET)
    path = str(tmp_path_factory.mktemp("plan") / "target")
    export(model, model.init(jax.random.PRNGKey(0)), load_tokenizer("byte", None), path)
    return path


def _flags(target_dir, out, *extra):
    return [
        "--gin_file=runs/plan.gin", f"--gin.TEACHER_CHECKPOINT='{target_dir}'",
        f"--gin.OUTPUT_DIR='{out}'", "--gin.train.vocabulary='byte'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}", "--gin.train.max_examples=64",
        "--gin.BATCH_SIZE=4", "--gin.plan.gammas=[1, 2]", "--gin.plan.num_prompts=4",
        "--gin.plan.timing_repeats=3", *extra,
    ]  # fmt: skip


def result_headline(out) -> str:
    """plan.md's headline (its third line, between the bold marks)."""
    return (out / "plan.md").read_text().splitlines()[2].strip("*")


def _run(argv):
    gin.clear_config()
    try:
        plan_cli.main(argv)
    finally:
        gin.clear_config()


# --------------------------------------------------------------------------------------------
# Arithmetic.
# --------------------------------------------------------------------------------------------


def _profile(draft_ms=0.1, round_ms=None):
    """A synthetic plan profile: target calls 1 ms + 0.1 ms per extra position."""
    target = {w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}
    entry = {"draft_ms": {1: draft_ms, 2: draft_ms}, "round_ms": round_ms or {},
             "outside_ms": {}, "params": 10, "megabytes": 0.1}  # fmt: skip
    return {"target_ms": target, "draft_ms": {1: draft_ms}, "plain_ms": {"step": 1.0,
            "outside": 0.0}, "max_new_tokens": 64, "candidates": {"d": entry}}  # fmt: skip


def test_alpha_needed_reaches_the_speedup_as_the_predictions_price_it():
    """With timed rounds and without (S*): at the alpha needed, tau = 1 + gamma alpha predicts
    the speed-up exactly; None exactly when alpha = 1 falls short (so never_wins agrees)."""
    for profile in (_profile(), _profile(round_ms={1: 1.2, 2: 1.5, 3: 1.8, 8: 3.5}),
                    _profile(draft_ms=1.0), _profile(round_ms={1: 2.5, 8: 9.5})):  # fmt: skip
        for gamma in (1, 3, 8):
            for s in planning.SPEEDUPS:
                alpha = planning.alpha_needed(profile, "d", gamma, s)
                at = {a: planning.predicted_speedup(profile, "d", {gamma: 1 + gamma * a})[gamma]
                      for a in (0.0, 1.0, alpha or 0.0)}  # fmt: skip
                if alpha is None:  # Not even alpha = 1 reaches it.
                    assert at[1.0] < s
                elif alpha == 0:  # Reached with no draft accepted.
                    assert at[0.0] >= s
                else:
                    assert at[alpha] == pytest.approx(s)
        never = planning.never_wins(profile, "d", [1, 3, 8])
        can_win = [planning.alpha_needed(profile, "d", g, 1.0) for g in (1, 3, 8)]
        assert (never is None) == any(a is not None for a in can_win), (never, can_win)
    profile = _profile()
    profile["target_ms"][4] = None  # r_3 untimed: nothing to say at gamma 3.
    assert planning.alpha_needed(profile, "d", 3, 1.0) is None


def test_predicted_speedup_prices_the_decoders_rounds_or_the_ideal_formula():
    ideal = planning.predicted_speedup(_profile(), "d", {3: 2.5})
    assert ideal[3] == pytest.approx(2.5 / (3 * 0.1 + 1.3))  # S*: no timed round.
    timed = planning.predicted_speedup(_profile(round_ms={3: 2.0}), "d", {3: 2.5}, 64)
    assert timed[3] == pytest.approx(64 * 1.0 / (64 / 2.5 * 2.0))
    # Rounds timed at gammas 2 and 4 only: gamma 3's is interpolated, gamma 5's is S*.
    timed = planning.predicted_speedup(_profile(round_ms={2: 1.5, 4: 2.5}), "d",
                                       {3: 2.5, 5: 3.0}, 64)  # fmt: skip
    assert timed[3] == pytest.approx(64 / (64 / 2.5 * 2.0))
    assert timed[5] == pytest.approx(3.0 / (5 * 0.1 + 1.5))
    assert planning.round_gammas(range(1, 9)) == [1, 2, 8]
    assert planning.round_gammas(range(1, 33)) == [1, 2, 16, 32]
    assert planning.round_gammas([4]) == [4]
    assert planning.round_gammas([3, 5, 7]) == [3, 4, 7]


def test_a_draft_that_cannot_win_even_accepting_everything_is_marked_with_the_reason():
    assert planning.never_wins(_profile(draft_ms=0.1), "d", [1, 2, 3]) is None
    reason = planning.never_wins(_profile(draft_ms=1.0), "d", [1, 2, 3])
    assert "c = 1.00" in reason and "even accepting every draft" in reason
    gamma, best = planning.ceiling(_profile(draft_ms=1.0), "d", [1, 2, 3])
    assert best < 1 and best == pytest.approx((gamma + 1) / (gamma * 1.0 + 1 + 0.1 * gamma))


def test_the_learning_curve_extends_a_pilot_to_the_full_run():
    """A proxy whose disagreement follows 0.8 t^-0.25 exactly: the fit recovers the exponent,
    so the ratio from step 100 to 800 is 8^-0.25; a flat or rising curve shrinks nothing."""
    curve = [(t, 1 - 0.8 * t**-0.25) for t in range(1, 101)]
    assert planning.curve_ratio(curve, 800) == pytest.approx(8**-0.25)
    assert planning.curve_ratio(curve, 100) == 1.0  # Not past the pilot.
    assert planning.curve_ratio([(t, 0.5 - 0.001 * t) for t in range(1, 101)], 800) == 1.0
    alphas = planning.pilot_alphas({"held_out": 0.6, "proxy": None, "curve_ratio": 0.5})
    assert alphas == {"held_out": 0.6, "held_out+curve": pytest.approx(0.8)}


def test_default_candidates_and_their_gin():
    target = DecoderOnlyLM(TARGET)
    found = planning.default_candidates(target, ["/ckpt/warm"])
    names = [c.name for c in found]
    assert names == ["fresh-1x32", "fresh-1x16", "target-layers-1", "checkpoint-warm"]
    assert [c.kind for c in found] == ["fresh", "fresh", "target layers", "checkpoint"]
    assert "DraftSpec.num_layers = 1\nDraftSpec.embed_dim = 32" in found[0].gin()
    assert "DraftSpec.from_target_layers = 1" in found[2].gin()
    assert found[3].gin().startswith("STUDENT_CHECKPOINT = '/ckpt/warm'")
    with pytest.raises(ValueError, match="exactly one of spec and checkpoint"):
        planning.Candidate("x")


# --------------------------------------------------------------------------------------------
# The profile between machines.
# --------------------------------------------------------------------------------------------


def test_profile_round_trip_and_its_errors(tmp_path, target_dir):
    """A profile measured by --measure_profile prices the plan elsewhere (--profile) with the
    same c; a profile without candidates, or missing one, is refused by name. At T = 1 (the
    tiny pair's sampled rounds are dear enough for a small draft to win)."""
    flags = lambda out, *extra: _flags(target_dir, out, "--gin.plan.temperature=1.0", *extra)
    path = tmp_path / "profile.json"
    # 9 timings (medians): a tiny pair's round is a difference of milliseconds, which 3 timings
    # left <= 0 three times running beside another job (a refused profile, not a wrong one).
    _run(["--measure_profile", str(path),
          *flags(tmp_path / "m", "--gin.plan.timing_repeats=9")])  # fmt: skip
    raw = json.loads(path.read_text())
    assert set(raw["candidates"]) == {"fresh-1x32", "fresh-1x16", "target-layers-1"}
    assert set(raw["candidates"]["fresh-1x32"]["round_ms"]) == {"1", "2"}  # round_gammas
    assert raw["plain_ms"]["step"] > 0 and set(raw["target_ms"]) == {str(w) for w in range(1, 4)}
    loaded = planning.load_plan_profile(str(path))
    for name, entry in raw["candidates"].items():
        assert loaded["candidates"][name]["draft_ms"][1] == entry["draft_ms"]["1"]
    # Priced elsewhere: inflate one candidate's costs so that it can never win there.
    raw["candidates"]["fresh-1x16"]["draft_ms"] = {"1": 100.0, "2": 100.0}
    raw["candidates"]["fresh-1x16"]["round_ms"] = {g: 1e4 for g in ("1", "2")}
    path.write_text(json.dumps(raw))
    out = tmp_path / "priced"
    _run(["--profile", str(path), *flags(out, "--gin.PILOT_STEPS=0")])
    result = json.loads((out / "plan.json").read_text())
    c = raw["candidates"]["fresh-1x32"]["draft_ms"]["1"] / raw["target_ms"]["1"]
    assert result["candidates"]["fresh-1x32"]["c"] == pytest.approx(c)
    assert "even accepting every draft" in result["candidates"]["fresh-1x16"]["never_wins"]
    assert result["order"][-1] == "fresh-1x16" and result["choice"] != "fresh-1x16"
    # Refused: a profile timed greedy for a plan that samples, one of another pair's
    # candidates, and one without any (disco's format).
    assert raw["temperature"] == 1.0
    path.write_text(json.dumps({**raw, "temperature": 0.0}))
    with pytest.raises(ValueError, match="timed its rounds at temperature 0.0, the plan serves"):
        _run(["--profile", str(path), *flags(out, "--gin.PILOT_STEPS=0")])
    del raw["candidates"]["target-layers-1"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"no costs for candidates \['target-layers-1'\]"):
        _run(["--profile", str(path), *flags(out, "--gin.PILOT_STEPS=0")])
    del raw["candidates"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no 'candidates' section"):
        planning.load_plan_profile(str(path))


# --------------------------------------------------------------------------------------------
# End to end.
# --------------------------------------------------------------------------------------------


def test_plan_end_to_end_and_its_draft_trains_as_is(tmp_path, target_dir, capsys):
    out = tmp_path / "plan"
    _run(_flags(target_dir, out, "--gin.PILOT_STEPS=3"))
    result = json.loads((out / "plan.json").read_text())
    rows = result["candidates"]
    assert sorted(r["rank"] for r in rows.values()) == [1, 2, 3]
    # Whether a candidate of a tiny random pair can ever win at 8 tokens turns on timings of
    # milliseconds: one marked never wins is ranked last, with its reason, and not piloted.
    piloted = [n for n in result["order"] if rows[n]["never_wins"] is None]
    assert piloted and result["choice"] == piloted[0] == result["order"][0]
    assert result["order"][: len(piloted)] == piloted  # Never-wins ones last.
    for name, row in rows.items():
        assert row["params"] > 0 and row["c"] > 0
        if name not in piloted:
            assert "even accepting every draft" in row["never_wins"] and row["pilot"] is None
            continue
        assert set(row["predicted_speedup"]) == {"1", "2"}
        assert 0 <= row["pilot"]["held_out"] <= 1 and 0 <= row["pilot"]["proxy"] <= 1
        assert row["pilot"]["steps"] == 3
    best = lambda n: max(rows[n]["predicted_speedup"].values())
    assert [best(n) for n in piloted] == sorted(map(best, piloted), reverse=True)
    text = (out / "plan.md").read_text()
    assert result["choice"] in text.splitlines()[2] and (out / "plan.png").stat().st_size > 0
    captured = capsys.readouterr()
    printed = captured.out
    assert printed and max(len(line) for line in printed.splitlines()) <= 100
    # Quiet: one line per pilot (its [train] log, c line included, goes to pilot/<name>.log:
    # one c per candidate on the console, the plan's), the headline wrapped between words.
    console = (captured.out + captured.err).splitlines()
    assert len(console) <= 40 and not [line for line in console if "[train]" in line]
    pilots = [line for line in console if line.startswith("[plan] pilot of ")]
    assert len(pilots) == len(piloted) and all("held-out acceptance T = 0" in p for p in pilots)
    for name in piloted:
        assert "[train] done in" in (out / "pilot" / f"{name}.log").read_text()
    head = printed.split("\nrank ")[0].splitlines()
    assert " ".join(head) == result_headline(out)  # Wrapped at spaces only.
    # draft.gin is the chosen draft and the recipe the plan priced, for `train` as is; the
    # recipe's runs/distill.gin settings stay macros (flags still override them).
    draft_gin = (out / "draft.gin").read_text()
    for line in (
        "BATCH_SIZE = 4",
        "DIVERGENCE = 'fkl'",
        "LoopConfig.stop_at = None",
        "train.vocabulary = 'byte'",
        "TASK_FEATURE_LENGTHS = {'inputs': 16, ",
    ):
        assert line in draft_gin  # fmt: skip
    # The serve commands of the trained export take the plan's γ (export/SERVING.md).
    gamma = rows[result["choice"]]["best_gamma"]
    assert gamma is None or f"train.serve_gamma = {gamma}\n" in draft_gin
    # Every candidate has its own, the same but for the draft: train any (here the last).
    body = lambda text: text.split("# The draft.", 1)[1]
    for name, row in rows.items():
        text = (out / row["gin_file"]).read_text()
        assert row["gin_file"] == f"drafts/{name}.gin" and row["gin"] in text
        assert body(text).split("# The recipe")[1] == body(draft_gin).split("# The recipe")[1]
    assert body((out / "drafts" / f"{result['choice']}.gin").read_text()) == body(draft_gin)
    trained = result["order"][-1]
    model_dir = tmp_path / "train"
    gin.clear_config()
    try:
        gin_setup.main("train", [
            "--gin_file=runs/distill.gin", f"--gin_file={out / 'drafts' / (trained + '.gin')}",
            f"--gin.TEACHER_CHECKPOINT='{target_dir}'", f"--gin.MODEL_DIR='{model_dir}'",
            "--gin.train.vocabulary='byte'", "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=2",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
            "--gin.train.max_examples=16",
        ])  # fmt: skip
    finally:
        gin.clear_config()
    draft, _ = load_checkpoint(str(model_dir / "export"))
    assert num_params(draft) == rows[trained]["params"]
    serving_text = (model_dir / "export" / "SERVING.md").read_text()
    gamma = rows[trained]["best_gamma"]
    assert gamma is None or f"num_assistant_tokens={gamma}," in serving_text


def test_bad_plan_settings_are_refused_by_name(tmp_path, target_dir):
    with pytest.raises(ValueError, match="'proxy' is the trainer's acceptance at T = 1"):
        _run(_flags(target_dir, tmp_path, "--gin.plan.estimate='proxy'",
                    "--gin.plan.temperature=0.0"))  # fmt: skip
    with pytest.raises(ValueError, match="plan.pilot_steps must be an integer >= 0"):
        _run(_flags(target_dir, tmp_path, "--gin.PILOT_STEPS=-1"))
    with pytest.raises(ValueError, match="--validate checks the pilot's predictions"):
        _run(["--validate", *_flags(target_dir, tmp_path, "--gin.PILOT_STEPS=0")])


def test_the_plan_serves_at_the_targets_temperature_or_at_several_sharing_costs(
    tmp_path, target_dir
):
    """The temperature comes from the target's generation_config.json (as transformers reads
    it: no do_sample is greedy); --temperatures 0,1 plans both in one run: one timing of the
    model calls, one pilot per candidate, a plan per temperature whose first line says which."""
    from distillspec.runs.plan import target_temperature

    assert target_temperature(str(tmp_path)) == ([0.0], "greedy: the target has no "
                                                  "generation_config.json")  # fmt: skip
    (tmp_path / "generation_config.json").write_text('{"do_sample": false}')
    assert target_temperature(str(tmp_path))[0] == [0.0]
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.7}')
    assert target_temperature(str(tmp_path))[0] == [0.7]
    assert target_temperature(target_dir)[0] == [0.0]  # An export: special ids, greedy.
    out = tmp_path / "both"
    _run(["--temperatures", "0,1", *_flags(target_dir, out, "--gin.PILOT_STEPS=2")])
    first = (out / "plan.md").read_text().splitlines()[0]
    assert first.startswith("# Draft plan at temperature 0 (greedy; set by plan.temperature")
    assert "T = 1 is in temperature-1/plan.md" in first
    other = (out / "temperature-1" / "plan.md").read_text().splitlines()[0]
    assert other.startswith("# Draft plan at temperature 1 (sampling") and "../plan.md" in other
    greedy = json.loads((out / "plan.json").read_text())
    sampled = json.loads((out / "temperature-1" / "plan.json").read_text())
    assert (greedy["context"]["temperature"], sampled["context"]["temperature"]) == (0.0, 1.0)
    assert greedy["profile"]["target_ms"] == sampled["profile"]["target_ms"]  # Shared calls.
    assert greedy["profile"]["temperature"] == 0.0 and sampled["profile"]["temperature"] == 1.0
    for name, row in greedy["candidates"].items():
        if row["pilot"]:  # One pilot serves both temperatures.
            assert row["pilot"]["seconds"] == sampled["candidates"][name]["pilot"]["seconds"]
    assert sorted(p.name for p in (out / "pilot").iterdir() if p.is_dir()) == sorted(
        n for n, r in greedy["candidates"].items() if r["pilot"]
    )
    with pytest.raises(ValueError, match="plan.temperature .* or plan.temperatures"):
        _run(["--temperatures", "0,1", *_flags(target_dir, out, "--gin.plan.temperature=1.0")])
    with pytest.raises(ValueError, match="--validate and --measure_profile take one temperature"):
        _run(["--temperatures", "0,1", "--validate", *_flags(target_dir, out)])
