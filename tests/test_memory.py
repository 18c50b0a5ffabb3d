"""The memory dry run (`distillspec.benchmarks.memory`) on tiny shapes: its figures, its checks."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from distillspec.benchmarks import flops, memory
from distillspec.models import TransformerConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGET = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "tie_word_embeddings": False}  # fmt: skip
DRAFT = {**TARGET, "hidden_size": 16, "num_hidden_layers": 1, "tie_word_embeddings": True}


def _configs(tmp_path):
    paths = []
    for name, config in (("target", TARGET), ("draft", DRAFT)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        paths.append(str(tmp_path / name))
    return paths


def test_the_dry_run_reports_the_compiled_step_per_device(tmp_path):
    target, draft = _configs(tmp_path)
    out = tmp_path / "memory.json"
    args = ["--target_config", target, "--draft_config", f"{draft}/config.json",
            "--divergence", "jsd", "--tokens_per_device", "64", "--sequence_length", "16",
            "--mesh", "2", "--fsdp", "--teacher_dtype", "bfloat16", "--run_steps", "1",
            "--remat", "full", "--time_pairs", "1", "--baseline", "no_remat",
            "--json", str(out)]  # fmt: skip
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "distillspec.benchmarks.memory", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    keys = {"temp_bytes", "peak_bytes_per_device", "param_bytes", "optimizer_bytes",
            "teacher_bytes", "flops_per_step", "fits", "projected_step_s",
            "measured_peak_rss_bytes", "step_s", "no_remat_step_s", "over_no_remat"}  # fmt: skip
    assert keys <= set(result)
    # The draft: 512 x 16 tied embedding + 1 block; float32, split over 2 devices (FSDP).
    student = memory.load_model(draft)
    params = sum(
        x.size for x in __import__("jax").tree.leaves(memory._abstract(student, "float32"))
    )
    assert result["param_bytes"] == params * 4 // 2
    # AdamW: two moments per parameter and a step count.
    assert result["optimizer_bytes"] == pytest.approx(2 * result["param_bytes"], abs=64)
    teacher = memory.load_model(target)
    count = sum(x.size for x in __import__("jax").tree.leaves(memory._abstract(teacher, "float32")))
    assert result["teacher_bytes"] == count * 2 // 2  # bfloat16, split over 2 devices.
    # Matmul FLOPs: the teacher's forward and the student's forward and backward (3x), over the
    # 2 devices' 2 x 64 tokens (rows of 16), per device; full remat adds at most the student's
    # blocks' forward (not its head) again, what the backward pass needs of it.
    rows = 2 * 64 // 16
    teacher_flops = flops.forward_flops(teacher.config, rows, 16, 16)
    student_flops = flops.forward_flops(student.config, rows, 16, 16)
    blocks = flops.forward_flops(student.config, rows, 16, 16, head_tokens=0)
    plain = (teacher_flops + 3 * student_flops) / 2
    assert plain < result["flops_per_step"] <= plain + blocks / 2
    assert result["peak_bytes_per_device"] >= result["temp_bytes"] > 0
    assert all(result["fits"].values()) and set(result["fits"]) == set(memory.ACCELERATORS)
    assert result["measured_peak_rss_bytes"] > 0


def test_the_dry_run_reads_gemma_and_t5_shapes_and_names_a_bad_model():
    gemma = memory.load_model(str(REPO / "configs" / "shapes" / "gemma-2-2b.json"))
    assert isinstance(gemma.config, TransformerConfig)
    assert (gemma.config.vocab_size, gemma.config.num_layers) == (256_000, 26)
    assert gemma.config.tie_embeddings and gemma.config.activation == "gelu_new"
    assert memory.load_model("t5_1_1_small").config.vocab_size == 32_128
    with pytest.raises(SystemExit, match="'no_such_model' is neither a config.json"):
        memory.load_model("no_such_model")
