"""Online distillation (`python -m distillspec.online`) end to end on a tiny pair: it serves the
stream with recording, adapts the draft without a teacher pass, resumes, and reports."""

from __future__ import annotations

import json

import gin
import jax
import numpy as np
import pytest

from distillspec import online as online_cli
from distillspec import report, served
from distillspec.models import DecoderOnlyLM, TransformerConfig, load_checkpoint
from distillspec.runs.common import export
from distillspec.vocabularies import load_tokenizer

TARGET = TransformerConfig(vocab_size=260, embed_dim=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, mlp_dim=128, init_std=0.5)  # fmt: skip
DRAFT = TransformerConfig(vocab_size=260, embed_dim=32, num_layers=1, num_heads=2,
                          num_kv_heads=2, head_dim=16, mlp_dim=64, init_std=0.5)  # fmt: skip


@pytest.fixture(scope="module")
def pair_and_stream(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    byte = load_tokenizer("byte", None)
    for name, config, seed in (("target", TARGET, 0), ("draft", DRAFT, 1)):
        model = DecoderOnlyLM(config)
        export(model, model.init(jax.random.PRNGKey(seed)), byte, str(root / name))
    stream = root / "stream"
    stream.mkdir()
    words = "the of a to in is it that for on with as was he she they we you this are".split()
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("test", 8)):
        lines = [json.dumps({"prompt": " ".join(rng.choice(words, 6))}) for _ in range(n)]
        (stream / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _run(root, out, *extra):
    gin.clear_config()
    try:
        return online_cli.main([
            "--gin_file=runs/online.gin", f"--gin.TARGET_CHECKPOINT='{root / 'target'}'",
            f"--gin.DRAFT_CHECKPOINT='{root / 'draft'}'", f"--gin.STREAM='{root / 'stream'}'",
            f"--gin.ORIGINAL=('{root / 'stream'}', 'test')", f"--gin.OUTPUT_DIR='{out}'",
            "--gin.online.vocabulary='byte'",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
            "--gin.online.chunk_prompts=12", "--gin.online.serve_batch=6",
            "--gin.online.steps_per_chunk=2", "--gin.online.batch_size=4",
            "--gin.online.eval_prompts=8", "--gin.online.latency_prompts=2",
            "--gin.online.timing_repeats=1", "--gin.online.seeds=(0,)", "--gin.online.gammas=(2,)",
            "--gin.online.record_top_k=8", *extra,
        ])  # fmt: skip
    finally:
        gin.clear_config()


def test_online_serves_records_adapts_without_the_teacher_and_resumes(pair_and_stream, tmp_path,
                                                                       capsys):  # fmt: skip
    root, out = pair_and_stream, tmp_path / "online"
    result = _run(root, out, f"--json={tmp_path / 'copy.json'}")
    assert json.loads((tmp_path / "copy.json").read_text()) == json.loads(
        (out / "online.json").read_text()
    )
    chunks = result["chunks"]
    assert [c["chunk"] for c in chunks] == [0, 1] and chunks[-1]["prompts_served"] == 24
    assert result["teacher_forward_passes"] == 0 and all(
        c["teacher_forward_passes"] == 0 for c in chunks
    )
    for c in chunks:
        assert 0 <= c["alpha"] <= 1 and c["tau"] >= 1 and c["latency_ms"] > 0
    # The buffer: every served prompt, with the target's top 8 at each generated token.
    data = served.read(str(out / "seed_0" / "buffer"), vocab_size=260)
    assert len(data) == 24 and data.top_k.log_probs.shape[2] == 8
    # The comparison: held-out and original, at T 0 and 1, with intervals; the summary's
    # figures are the worst of them.
    rows = result["comparisons"]
    assert {(r["set"], r["temperature"]) for r in rows} == {
        (s, t) for s in ("held_out", "original") for t in (0.0, 1.0)
    }
    held = [r for r in rows if r["set"] == "held_out"]
    assert result["alpha_gain"] == min(r["alpha_gain"] for r in held)
    assert result["tau_gain_pct"] == min(r["tau_gain_pct"] for r in held)
    low, high = result["alpha_gain_interval"]
    assert low <= high and set(result["goals"]) == {
        "alpha_gain", "tau_gain_pct", "forgetting_alpha_drop", "recording_cost_pct",
        "teacher_forward_passes",
    }  # fmt: skip
    original = [r for r in rows if r["set"] == "original"]
    assert result["forgetting_alpha_drop"] == pytest.approx(
        max(r["alpha_frozen"] - r["alpha_adapted"] for r in original)
    )
    # The adapted draft is exported and differs from the frozen one.
    adapted, adapted_params = load_checkpoint(str(out / "seed_0" / "adapted" / "export"))
    _, frozen_params = load_checkpoint(str(root / "draft"))
    assert not all(
        np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(adapted_params), jax.tree.leaves(frozen_params))
    )
    printed = capsys.readouterr().out
    assert printed and max(len(line) for line in printed.splitlines()) <= 100
    # A rerun resumes: no chunk is served or trained again.
    again = _run(root, out)
    assert len((out / "seed_0" / "chunks.jsonl").read_text().splitlines()) == 2
    assert again["chunks"] == chunks
    # The results page.
    missing = str(tmp_path / "missing")
    written = report.main([
        "--out_dir", str(tmp_path / "results"), "--quickstart", missing, "--disco", missing,
        "--study", missing, "--plan", missing, "--online", str(out),
    ])  # fmt: skip
    assert written["online.md"]
    page = (tmp_path / "results" / "online.md").read_text()
    assert "teacher forward passes of the adaptation | 0 | 0 | met" in page


def test_bad_online_settings_are_refused_by_name(pair_and_stream, tmp_path):
    with pytest.raises(ValueError, match=r"online.chunk_prompts must be an integer >= 1, got 0"):
        _run(pair_and_stream, tmp_path / "o", "--gin.online.chunk_prompts=0")
    with pytest.raises(FileNotFoundError, match="online.draft_checkpoint = .* does not exist"):
        _run(pair_and_stream, tmp_path / "o", f"--gin.DRAFT_CHECKPOINT='{tmp_path / 'none'}'")
