"""A new user's mistakes end in a clear error (or notice) before any work, and a run says what it
did: start and end lines, resume, preemption status, quiet start-up, progress in a file.

Everything runs on configs/tests/tiny_distill.gin (a tiny random teacher and student on the
byte vocabulary) and on files the tests write.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
import sys

import gin
import pytest

from distillspec import (
    checkpoints,
    command_line,
    console,
    gin_setup,
    metrics,
    tasks,
    trainer,
    vocabularies,
)
from distillspec.evaluation import costs

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tests" / "tiny_distill.gin")
NOISE = ("oneDNN", "cuInit", "absl::InitializeLog", "cuda drivers", "precompiled_charsmap")


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _train(model_dir, *flags):
    return gin_setup.main("train", [f"--gin_file={TINY}", f"--gin.MODEL_DIR={model_dir}", *flags])


# --- Mistakes that used to pass silently --------------------------------------------------


def test_misspelled_macro_is_an_error_naming_the_closest(tmp_path):
    with pytest.raises(ValueError, match=r"TRAIN_STEP \(did you mean TRAIN_STEPS\?\)"):
        _train(tmp_path / "run", "--gin.TRAIN_STEP=2")
    assert not (tmp_path / "run").exists()  # Nothing started.


def _jsonl(path: pathlib.Path, key: str) -> str:
    rows = [{"prompt": f"def f{i}(x):", key: f"    return x + {i}\n"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_misspelled_completion_key_is_a_notice_naming_the_key(tmp_path, capsys):
    data = tasks.FileTask(_jsonl(tmp_path / "data.jsonl", "completoin"))
    assert not tasks.has_completions(data)
    err = capsys.readouterr().err
    assert "no line has the completion key 'completion'" in err
    assert "did you mean FileTask.completion_key = 'completoin'?" in err


def test_prompts_only_data_is_an_error_when_completions_are_needed(tmp_path):
    data = _jsonl(tmp_path / "data.jsonl", "completoin")
    with pytest.raises(ValueError, match="holds prompts only"):  # Fixed data (lambda1 > 0).
        _train(tmp_path / "run", f"--gin.train.task={data!r}",
               "--gin.DataMixture.fixed_data_fraction=1.0")  # fmt: skip
    assert not (tmp_path / "run").exists()  # Failed before a checkpoint: the MODEL_DIR it made.


def _safetensors(path: pathlib.Path, cut: int = 0) -> None:
    """A safetensors file of one [4] float32 tensor, its last `cut` bytes missing."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    data = len(header).to_bytes(8, "little") + header + bytes(16)
    path.write_bytes(data[: len(data) - cut])


def _mistakes(tmp_path: pathlib.Path) -> dict[str, tuple[list[str], str]]:
    """The documented mistakes of a new user's first `train`: {name: (flags, the error)}."""
    target, truncated = tmp_path / "target", tmp_path / "truncated"
    for directory, cut in ((target, 0), (truncated, 5)):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        (directory / "tokenizer.json").write_text("{}")
        _safetensors(directory / "model.safetensors", cut)
    untokenized = tmp_path / "untokenized"
    untokenized.mkdir()
    (untokenized / "config.json").write_text("{}")
    prompts_only = _jsonl(tmp_path / "prompts.jsonl", "completoin")
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"prompt": "a", "completion": "b"}\n{"promt": "c", "completion": "d"}\n')
    data = lambda path: f"--gin.MIXTURE_OR_TASK_NAME='{path}'"
    return {
        "completion key missing (lambda1 > 0)": (
            [f"--gin.TEACHER_CHECKPOINT='{target}'", data(prompts_only), "--gin.LAMBDA1=1.0"],
            "holds prompts only (no 'completion' key)",
        ),
        "missing checkpoint": (
            [f"--gin.TEACHER_CHECKPOINT='{tmp_path / 'nowhere'}'", data(prompts_only)],
            "TEACHER_CHECKPOINT = '" + str(tmp_path / "nowhere") + "' does not exist",
        ),
        "prompt key missing": (
            [f"--gin.TEACHER_CHECKPOINT='{target}'", data(no_prompt)],
            "no_prompt.jsonl:2 has no string under the prompt key 'prompt'",
        ),
        "truncated safetensors": (
            [f"--gin.TEACHER_CHECKPOINT='{truncated}'", data(prompts_only)],
            "model.safetensors is truncated: 81 bytes of the 86 its header describes",
        ),
        "no tokenizer file": (
            [f"--gin.TEACHER_CHECKPOINT='{untokenized}'", data(prompts_only)],
            "untokenized' (TEACHER_CHECKPOINT) holds no tokenizer file",
        ),
        "misspelled macro": (
            [f"--gin.TEACHER_CHECKPOINT='{target}'", data(prompts_only), "--gin.TRAIN_STEP=2"],
            "TRAIN_STEP (did you mean TRAIN_STEPS?)",
        ),
    }


def test_a_new_users_mistakes_stop_the_command_before_its_imports_and_leave_no_directory(
    tmp_path,
):
    """`python -m distillspec.train` as a user runs it: each documented mistake ends in one
    line naming it (no traceback), before JAX or TensorFlow is imported (so in well under the
    imports' 8-18 s; scripts/mistakes_timing.py measures it), and no MODEL_DIR is made."""
    for name, (flags, error) in _mistakes(tmp_path).items():
        model_dir = tmp_path / "run"
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "distillspec.train",
             "--gin_file=runs/distill.gin", f"--gin.MODEL_DIR='{model_dir}'", *flags],
            capture_output=True, text=True, cwd=REPO, timeout=300,
            env=dict(os.environ, DISTILLSPEC_HUGE_PAGES="0"),
        )  # fmt: skip
        assert done.returncode == 2, (name, done.stderr[-2000:])
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("python -m distillspec.train: error: ") and error in last, name
        assert "Traceback" not in done.stderr, name
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                    if line.startswith("import time:")}  # fmt: skip
        assert not imported & {"jax", "tensorflow", "seqio", "gin"}, name
        assert not model_dir.exists(), name
    assert command_line.TOKENIZERS == vocabularies.TOKENIZER_FILES  # Read without seqio there.


def _bpe(directory: pathlib.Path, texts: list[str]) -> str:
    """A 300-id BPE tokenizer.json trained on `texts` (ids 0-2 special, as a Llama's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))  # fmt: skip
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return str(directory)


def test_draft_with_another_tokenizer_of_the_same_size_is_an_error(tmp_path):
    code = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    prose = ["The quick brown fox jumps over the lazy dog.", "Pack my box with jugs."] * 20
    target, draft = _bpe(tmp_path / "target", code), _bpe(tmp_path / "draft", prose)
    same = _bpe(tmp_path / "same", code)
    vocabularies.check_same_vocabulary({"target": target, "draft": same})  # Same: passes.
    with pytest.raises(ValueError, match=r"the tokenizers differ: draft has .*draft/tokenizer.json "
                       r"\(300 ids\) and target has .*target/tokenizer.json"):  # fmt: skip
        vocabularies.check_same_vocabulary({"target": target, "draft": draft})


def test_second_run_into_a_model_dir_in_use_stops_naming_the_holder(tmp_path, capsys):
    with checkpoints.model_dir_lock(str(tmp_path)):
        with pytest.raises(RuntimeError, match=rf"in use by another run \(process {os.getpid()}"):
            with checkpoints.model_dir_lock(str(tmp_path)):
                pass
        with pytest.raises(RuntimeError, match="in use by another run"):
            _train(tmp_path)  # The CLI stops before any work.
    assert not (tmp_path / "checkpoints").exists()
    # Released on exit: the next run takes it; a lock file whose holder died is stale.
    (tmp_path / checkpoints.LOCK_FILE).write_text("process 999999 on elsewhere")
    with checkpoints.model_dir_lock(str(tmp_path)):
        fd = os.open(tmp_path / checkpoints.LOCK_FILE, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    assert "taking over a stale lock of process 999999" in capsys.readouterr().out


# --- A run that says what it did ------------------------------------------------------------


def test_start_end_and_resume_lines(tmp_path, capsys):
    _train(tmp_path, "--gin.TRAIN_STEPS=2")
    err = capsys.readouterr().err
    assert "[train] distilling a draft of 0.01 M parameters toward a target of" in err
    assert f"starting fresh: 2 steps into {tmp_path}" in err
    assert f"student exported to {tmp_path}/export" in err and "final loss" in err
    # The draft's call cost, or that it could not be timed: tiny models' costs are differences
    # of timings, which the other worker's load can bring to <= 0 (it did once in CI).
    timed = "[train] c = " in err and "(a draft call / a target call, batch 1" in err
    assert timed or "[train] the draft's call cost could not be timed on this machine" in err
    gin.clear_config()
    _train(tmp_path, "--gin.TRAIN_STEPS=4")  # TRAIN_STEPS raised: trains on from step 2.
    assert "resuming from step 2 of 4" in capsys.readouterr().err
    gin.clear_config()
    with pytest.raises(ValueError, match="holds step 4, past TRAIN_STEPS = 3"):
        _train(tmp_path, "--gin.TRAIN_STEPS=3")


def test_preempted_run_exits_with_the_documented_status():
    assert trainer.PREEMPTED_EXIT_CODE == 75  # docs/training.md and the SLURM script say 75.


def test_command_line_output_to_a_file_is_quiet_and_each_progress_line_appears_once(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-m", "distillspec.train", f"--gin_file={TINY}",
             f"--gin.MODEL_DIR={tmp_path / 'run'}"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=600, check=True,
        )  # fmt: skip
    lines = log.read_text().splitlines()
    assert not [x for x in lines if any(n in x for n in NOISE)], lines[:10]
    progress = [x for x in lines if x.startswith("[train] step ")]
    assert progress and len(progress) == len(set(progress))
    assert progress[-1].startswith("[train] step 8/8 (100%)")
    assert not [x for x in lines if "\r" in x]


@pytest.mark.parametrize("argv", [[], [console.VERBOSE_FLAG]])
def test_loading_the_sentencepiece_vocabulary_is_quiet_unless_verbose(tmp_path, argv):
    script = (
        f"from distillspec import console, vocabularies; console.quiet_startup({argv!r}); "
        f"v = vocabularies.get_vocabulary(cache_dir={str(tmp_path)!r}, max_files=60, "
        "vocab_size=512); import tensorflow as tf\n"
        "for _ in range(2):  # Pipelines as training builds them, one per stage.\n"
        "    list(tf.data.Dataset.from_tensor_slices(['a b', 'c']).map(v.encode_tf))"
    )  # A process of its own: TF Text logs on loading a model, once per process.
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=True)  # fmt: skip
    assert ("precompiled_charsmap" in out.stderr) == bool(argv), out.stderr[-2000:]


@pytest.mark.parametrize(
    "environ, glibc, mode, tunables",
    [
        ({}, (2, 36), "madvise", console.HUGE_PAGES_TUNABLE),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 35), "madvise",
         "glibc.malloc.arena_max=2:" + console.HUGE_PAGES_TUNABLE),
        ({}, (2, 34), "madvise", None),  # The tunable is new in glibc 2.35.
        ({}, None, "madvise", None),  # Not glibc.
        ({}, (2, 36), "always", None),  # Huge pages already; 'never': none to ask for.
        ({}, (2, 36), "never", None),
        ({}, (2, 36), None, None),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise", None),  # The user's.
        ({console.HUGE_PAGES_ENV: "0"}, (2, 36), "madvise", None),
    ],
)  # fmt: skip
def test_huge_pages_are_asked_for_only_where_they_change_something(environ, glibc, mode, tunables):
    out = console.huge_pages_environment(environ, glibc, mode)
    assert (out and out["GLIBC_TUNABLES"]) == tunables
    if out:
        assert {k: v for k, v in out.items() if k != "GLIBC_TUNABLES"} == {
            k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"
        }


@pytest.mark.parametrize(
    "argv, entry",
    [
        (["python", "-m", "distillspec.quickstart", "--output_dir", "x"], True),
        (["python", "-X", "dev", "-m", "distillspec.benchmarks.disco"], True),
        (["python", "-m", "pytest", "-m", "distillspec.slow"], False),  # pytest's -m: a marker.
        (["python", "-c", "import distillspec"], False),
        (["python", str(REPO / "scripts" / "versus_trl.py")], True),
        (["python", str(REPO / "tests" / "test_new_user.py")], False),
        (["python", "other/versus_trl.py"], False),
    ],
)
def test_only_the_packages_entry_points_restart(argv, entry):
    assert console._launched_as_entry_point(argv) == entry


def test_an_entry_point_restarts_once_with_huge_pages_and_its_arguments(tmp_path):
    # `python -m distillspec.train --help` runs in a process whose environment says it restarted
    # (or, where huge pages change nothing here, in the process as launched).
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES",
                                                           console.HUGE_PAGES_ENV)}  # fmt: skip
    probe = (
        "import os, sys; from distillspec import console; "
        "console.restart_with_huge_pages([sys.executable, '-c', "
        "'import os, sys; print(os.environ.get(\"GLIBC_TUNABLES\"), sys.argv[1:])', 'a', '--b'])"
        "; print('not restarted')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120, check=True).stdout.split("\n")  # fmt: skip
    expected = console.huge_pages_environment(env, console.glibc_version(), console.thp_mode())
    if expected is None:
        assert out[0] == "not restarted"
    else:
        assert out[0] == f"{console.HUGE_PAGES_TUNABLE} ['a', '--b']"
    help_run = subprocess.run(
        [sys.executable, "-m", "distillspec.train", "--help"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    assert help_run.returncode == 0 and "--gin_file" in help_run.stdout, help_run.stderr[-2000:]


@pytest.mark.parametrize("name", ["speculative", "disco", "train_step"])
def test_benchmark_entry_points_start_quietly(name):
    command = [sys.executable, "-m", f"distillspec.benchmarks.{name}", "--help"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300, check=True)
    assert "usage:" in out.stdout  # --help comes after the benchmark's imports (TensorFlow's).
    assert not [n for n in NOISE if n in out.stderr], out.stderr[-2000:]


def test_line_progress_writes_each_update_once(capsys):
    bar = metrics.LineProgress(total=10, initial=0, lines=5)
    for step in range(1, 11):
        bar.set_postfix(loss=f"{1 / step:.3g}")
        bar.update(1)
    err = capsys.readouterr().err.splitlines()
    assert [x.split(":")[0] for x in err] == [f"[train] step {s}/10 (" + f"{10 * s}%)"
                                              for s in (2, 4, 6, 8, 10)]  # fmt: skip
    assert "loss 0.1," in err[-1]


# --- A draft that can win, and the line when it cannot ---------------------------------------


def test_break_even_and_verdict_lines_name_the_cause():
    cheap = {"c": 0.05, "r_gamma": {3: 1.0, 5: 1.05}}
    # alpha as evaluate reports it (accepted / proposed): tau = 1 + 3 a = 3 * 0.05 + 1.0, a = 0.05.
    assert costs.break_even_alpha(3, 0.05, 1.0) == pytest.approx(0.05)
    a = costs.break_even_alpha(5, 0.05, 1.05)  # = 0.06; at it, S* (of tau = 1 + 5 a) is 1.
    assert costs.ideal_speedup(1 + 5 * a, 5, 0.05, 1.05) == pytest.approx(1.0)
    assert "speeds decoding up only if alpha > 0." in costs.break_even_line(cheap)
    dear = {"c": 1.2, "r_gamma": {3: 1.3, 5: 1.6}}
    assert costs.break_even_alpha(3, 1.2, 1.3) is None  # 4.9 > the 4 tokens a round can give.
    assert "cannot win with this draft at any acceptance rate" in costs.break_even_line(dear)
    untimed = costs.break_even_line({"c": None, "r_gamma": {}})
    assert untimed == "the draft's call cost could not be timed on this machine"
    line = costs.verdict("fresh", {"c": 0.7, "r_gamma": {3: 1.2}}, {3: 2.5})
    assert "S* = 0.76 at gamma = 3" in line and "S* < 1 at every gamma: at c = 0.70" in line
    assert "--gin.DraftSpec.max_param_fraction" in line
    assert "S* < 1" not in costs.verdict("fresh", cheap, {3: 2.5, 5: 3.0})
    low = costs.verdict("fresh", {"c": 0.02, "r_gamma": {3: 1.5}}, {3: 1.1})
    assert "the drafts are cheap (c = 0.02) but too few are accepted" in low
    assert "could not be timed" in costs.verdict("x", {"c": None, "r_gamma": {3: 1}}, {3: 2})
