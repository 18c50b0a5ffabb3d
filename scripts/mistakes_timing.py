"""How long a new user's documented mistakes take to be reported, and what they leave behind.

    python scripts/mistakes_timing.py [--repeats 3]

Builds each mistake in a temporary directory (a missing completion key where LAMBDA1 > 0, a
missing checkpoint, a JSONL line without the prompt key, a truncated safetensors file, a
checkpoint without a tokenizer, a misspelled macro), runs `python -m distillspec.train` on it
as a user would, `repeats` times after one untimed run (a warm page cache), and prints JSON:
per mistake the median wall seconds, the exit status, the error line and whether a MODEL_DIR
was left. A benchmark script, not a test (GUIDE.md section 4: no timed unit tests).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _safetensors(path: pathlib.Path, cut: int) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    data = len(header).to_bytes(8, "little") + header + bytes(16)
    path.write_bytes(data[: len(data) - cut])


def mistakes(root: pathlib.Path) -> dict[str, list[str]]:
    """{mistake: the train command's flags that make it}."""
    target, truncated, untokenized = root / "target", root / "truncated", root / "untokenized"
    for directory, cut, tokenizer in ((target, 0, True), (truncated, 5, True),
                                      (untokenized, 0, False)):  # fmt: skip
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        if tokenizer:
            (directory / "tokenizer.json").write_text("{}")
        _safetensors(directory / "model.safetensors", cut)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}():"}) + "\n" for i in range(2000)))
    no_prompt = root / "no_prompt.jsonl"
    no_prompt.write_text('{"prompt": "a", "completion": "b"}\n{"promt": "c", "completion": "d"}\n')
    data = lambda path: f"--gin.MIXTURE_OR_TASK_NAME='{path}'"
    teacher = lambda path: f"--gin.TEACHER_CHECKPOINT='{path}'"
    return {
        "completion key missing, LAMBDA1 = 1": [teacher(target), data(prompts), "--gin.LAMBDA1=1"],
        "missing checkpoint": [teacher(root / "nowhere"), data(prompts)],
        "JSONL line without the prompt key": [teacher(target), data(no_prompt)],
        "truncated safetensors": [teacher(truncated), data(prompts)],
        "checkpoint without a tokenizer": [teacher(untokenized), data(prompts)],
        "misspelled macro": [teacher(target), data(prompts), "--gin.TRAIN_STEP=2"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python scripts/mistakes_timing.py")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mistake")
    args = parser.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for name, flags in mistakes(root).items():
            model_dir = root / "run"
            command = [sys.executable, "-m", "distillspec.train", "--gin_file=runs/distill.gin",
                       f"--gin.MODEL_DIR='{model_dir}'", *flags]  # fmt: skip
            seconds = []
            for i in range(args.repeats + 1):  # The first warms the page cache.
                start = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                                      env=dict(os.environ))  # fmt: skip
                if i:
                    seconds.append(time.perf_counter() - start)
            out[name] = {
                "median_s": round(statistics.median(seconds), 3),
                "max_s": round(max(seconds), 3),
                "returncode": done.returncode,
                "error": (done.stderr.strip().splitlines() or [""])[-1][:160],
                "left_a_directory": model_dir.exists(),
            }
    print(json.dumps({"python": sys.version.split()[0], "cpus": os.cpu_count(),
                      "mistakes": out}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
