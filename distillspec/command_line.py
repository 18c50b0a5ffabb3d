"""The entry points' command line, read before the heavy imports (JAX, TensorFlow, seqio).

`python -m distillspec.<run>` parses its flags here first (`preflight`): --help lists every flag
of the run (T5X's, the entry point's own) at once, and the mistakes a user makes on the command
line are reported in well under a second instead of after 8-18 s of imports, before any
directory is made: a macro that nothing reads (a misspelled flag), a checkpoint directory that
does not exist, a truncated safetensors file, a data file that does not exist, a JSONL line
without the prompt key, and prompts-only data where the recipe needs completions (LAMBDA1 > 0).
The gin files are read as text for their literal macros (`NAME = value`) and references
(`%NAME`); whatever this cannot read (a value that is not a literal, an include it cannot find)
is left to the full checks after the imports. Nothing here imports gin or JAX.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import glob
import json
import os
import pathlib
import re
import struct
from collections.abc import Sequence
from typing import Any

from distillspec import console

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
CHECKPOINT_MACROS = ("TEACHER_CHECKPOINT", "TARGET_CHECKPOINT", "STUDENT_CHECKPOINT",
                     "DRAFT_CHECKPOINT")  # fmt: skip
DATA_MACROS = ("MIXTURE_OR_TASK_NAME", "STREAM")
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "spiece.model")  # vocabularies.TOKENIZER_FILES
DATA_SUFFIXES = (".jsonl", ".txt")
UNKNOWN = object()  # A macro whose value is not a Python literal (a reference, @Config()).
_REFERENCE = re.compile(r"%((?:\w+/)*)([A-Za-z_]\w*)(?![\w.])")
_MACRO = re.compile(r"^([A-Za-z_][\w./]*)\s*=\s*(.*)$", re.DOTALL)  # Macros, parameters.
_INCLUDE = re.compile(r"^include\s+['\"]([^'\"]+)['\"]")


def parser(run_name: str, parents: Sequence[argparse.ArgumentParser] = ()):
    """T5X-style flags of `python -m distillspec.<run_name>` (and `parents`: the entry
    point's own): --gin_file, --gin.NAME=VALUE, --gin_search_paths, --tfds_data_dir, --verbose
    and the multi-process flags."""
    out = argparse.ArgumentParser(
        prog=f"python -m distillspec.{run_name}", parents=list(parents),
        epilog="--gin.NAME=VALUE (repeatable) binds a gin macro or parameter after the files, "
        "e.g. --gin.TRAIN_STEPS=100 or --gin.MODEL_DIR=\\\"/runs/x\\\"",
    )  # fmt: skip
    out.add_argument("--gin_file", action="append", default=[], help="gin config file(s)")
    out.add_argument("--gin_search_paths", default="", help="comma-separated directories")
    out.add_argument("--tfds_data_dir", default=None, help="prepared TFDS data sets")
    out.add_argument(
        console.VERBOSE_FLAG, action="store_true",
        help="keep TensorFlow's, absl's and SentencePiece's start-up logs",
    )  # fmt: skip
    group = out.add_argument_group("multi-process runs (T5X's flags)")
    group.add_argument(
        "--multiprocess", action="store_true",
        help="join a multi-process run (jax.distributed); addresses not given are detected "
        "from the cluster (Cloud TPU VM metadata, SLURM, Open MPI)",
    )  # fmt: skip
    group.add_argument("--coordinator_address", help="host:port of process 0")
    group.add_argument("--process_count", type=int, help="number of processes")
    group.add_argument("--process_index", type=int, help="this process, in [0, process_count)")
    group.add_argument(
        "--initialization_timeout", type=int, default=300,
        help="seconds to wait for the coordinator and every process (default 300)",
    )  # fmt: skip
    return out


def binding(flag: str) -> str:
    """'--gin.NAME=VALUE' -> 'NAME = VALUE'; a bare path or word VALUE is quoted for the user."""
    name, _, value = flag[len("--gin.") :].partition("=")
    if not value:
        raise ValueError(f"gin flag {flag!r} needs a value: --gin.NAME=VALUE")
    bare = value[0] not in "'\"@%[({-.0123456789" and value not in ("True", "False", "None")
    return f"{name} = {value!r}" if bare else f"{name} = {value}"


def unused_macros_message(unused: Sequence[str], referenced: set[str]) -> str:
    """The error for macros bound on the command line that no binding reads, each with the
    closest macro that is read."""
    hints = []
    for name in unused:
        close = difflib.get_close_matches(name, sorted(referenced), n=1, cutoff=0.6)
        hints.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return (
        f"gin macro(s) bound but never used by the configuration: {', '.join(hints)}; "
        f"the macros this configuration reads: {', '.join(sorted(referenced))}"
    )


def preflight(run_name: str, argv: list[str], parents=()) -> None:
    """Parses argv (--help exits here, listing every flag) and exits with status 2 and one line
    naming the mistake when `problems` finds one; returns when it finds none."""
    command = parser(run_name, parents)
    args, rest = command.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--gin.")]
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        found = problems(run_name, args.gin_file, rest, args.gin_search_paths.split(","))
    except ValueError as e:
        found = [str(e)]
    if found:
        command.exit(2, f"{command.prog}: error: {found[0]}\n")


def problems(run_name: str, files: list[str], flags: list[str], search_paths=()) -> list[str]:
    """The mistakes found in the configuration's literal macros and the files they name."""
    read = read_macros(files, [binding(f) for f in flags], search_paths)
    if read is None:  # An include or a file this cannot find: gin will say which.
        return []
    values, referenced = read
    named = [f[len("--gin.") :].partition("=")[0] for f in flags]
    unused = sorted({n for n in named if "." not in n and "/" not in n} - referenced)
    if unused:
        return [unused_macros_message(unused, referenced)]
    found = []
    # The target's tokenizer is the run's unless some `vocabulary` is bound.
    own_vocabulary = not any(k.endswith(".vocabulary") and v is not None for k, v in values.items())
    for macro in CHECKPOINT_MACROS:
        tokenizer = own_vocabulary and macro in ("TEACHER_CHECKPOINT", "TARGET_CHECKPOINT")
        found += _checkpoint_problems(macro, values.get(macro), tokenizer)
    drafts = values.get("DRAFTS")
    for name, path in drafts.items() if isinstance(drafts, dict) else ():
        found += _checkpoint_problems(f"DRAFTS[{name!r}]", path)
    data = [(m, values.get(m)) for m in DATA_MACROS]
    eval_sets = values.get("EVAL_SETS")
    if isinstance(eval_sets, (list, tuple)):
        data += [("EVAL_SETS", s[0]) for s in eval_sets if isinstance(s, (list, tuple)) and s]
    lambda1 = values.get("LAMBDA1") if run_name == "train" else None
    keys = [values.get(f"FileTask.{k}_key", k) for k in ("prompt", "completion")]
    if not all(isinstance(k, str) for k in keys):
        return found
    for macro, path in data:
        needs = macro == "MIXTURE_OR_TASK_NAME" and isinstance(lambda1, (int, float)) and lambda1
        found += _data_problems(macro, path, bool(needs), *keys)
    return found


def read_macros(files, bindings, search_paths=()) -> tuple[dict[str, Any], set[str]] | None:
    """({macro or parameter: its literal value, or UNKNOWN}, {macros referenced}) of gin files and
    'NAME = VALUE' bindings (later ones win, as in gin); None if a file cannot be found."""
    values: dict[str, Any] = {}
    referenced: set[str] = set()

    def take(statement: str) -> bool:
        if match := _INCLUDE.match(statement):
            return read(match.group(1))
        referenced.update(m.group(2) for m in _REFERENCE.finditer(statement))
        if match := _MACRO.match(statement):
            values[match.group(1)] = _literal(match.group(2))
        return True

    def read(name: str) -> bool:
        path = find_gin_file(name, search_paths)
        if path is None:
            return False
        return all(take(s) for s in _statements(path.read_text(encoding="utf-8")))

    if not all(read(f) for f in files):
        return None
    for statement in bindings:
        take(statement)
    return values, referenced


def find_gin_file(name: str, search_paths=()) -> pathlib.Path | None:
    """Where gin finds `name`: as given, then each search path, configs/, the repository."""
    for base in ("", *[p for p in search_paths if p], CONFIGS_DIR, CONFIGS_DIR.parent):
        path = pathlib.Path(base, name)
        if path.is_file():
            return path
    return None


def _statements(text: str) -> list[str]:
    """A gin file's statements: comments dropped, lines joined while a bracket is open."""
    out, current, depth = [], "", 0
    for line in text.splitlines():
        line = _uncommented(line)
        current = f"{current} {line.strip()}" if current else line.strip()
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth <= 0 and current:
            out.append(current)
            current, depth = "", 0
    return out + ([current] if current else [])


def _uncommented(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return UNKNOWN


def _checkpoint_problems(macro: str, path: Any, needs_tokenizer: bool = False) -> list[str]:
    if not isinstance(path, str) or not path:
        return []
    if not os.path.exists(path):
        return [f"{macro} = {path!r} does not exist: give a Hugging Face checkpoint directory "
                "(config.json, model.safetensors) or a T5X one"]  # fmt: skip
    if not os.path.isdir(path):
        return [f"{macro} = {path!r} is a file: give the checkpoint's directory"]
    if needs_tokenizer and not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZERS):
        return [f"the checkpoint {path!r} ({macro}) holds no tokenizer file {TOKENIZERS}; pass its "
                "tokenizer as vocabulary = <path of tokenizer.json or the SentencePiece model> "
                "(e.g. --gin.train.vocabulary=...), or 'sentencepiece' / 'byte' for the built-in "
                "ones"]  # fmt: skip
    return [p for f in sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if (p := safetensors_problem(f, macro))]  # fmt: skip


def safetensors_problem(path: str, macro: str = "checkpoint") -> str | None:
    """What is wrong with a safetensors file's framing (its header and the bytes it promises:
    a copy cut short), read without loading a tensor; None when whole."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if header_size is None or 8 + header_size > size:
            return f"{macro}: {path} is truncated ({size} bytes; its header is cut off)"
        try:
            header = json.loads(f.read(header_size))
        except ValueError:
            return f"{macro}: {path} is not a safetensors file (its header is not JSON)"
    ends = [t["data_offsets"][1] for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t]  # fmt: skip
    needed = 8 + header_size + max(ends, default=0)
    if size < needed:
        return (f"{macro}: {path} is truncated: {size} bytes of the {needed} its header "
                "describes (an interrupted copy or download?): copy it again")  # fmt: skip
    return None


def _data_problems(macro: str, path: Any, needs_completions: bool, prompt_key: str = "prompt",
                   completion_key: str = "completion") -> list[str]:  # fmt: skip
    if not isinstance(path, str) or not (os.sep in path or path.endswith(DATA_SUFFIXES)):
        return []  # A built-in task's name: the registry checks it.
    if not os.path.exists(path):
        return [f"{macro}: data path {path!r} does not exist"]
    if not (os.path.isfile(path) and path.endswith(".jsonl")):
        return []
    try:
        rows = jsonl_rows(path, prompt_key)
    except ValueError as e:
        return [str(e)]
    has_completion = any(completion_key in row for _, row in rows)
    if needs_completions and not has_completion:
        return [f"{path!r} holds prompts only (no {completion_key!r} key), so it cannot give the "
                "fixed data set's completions: LAMBDA1 (DataMixture.fixed_data_fraction) must "
                "be 0 (teacher- or student-generated data)"]  # fmt: skip
    return []


def jsonl_rows(path: str, prompt_key: str = "prompt") -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file; ValueError naming the
    first line that is not a JSON object or has no string under `prompt_key`."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not a JSON object: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{number} is not a JSON object")
            if not isinstance(obj.get(prompt_key), str):
                raise ValueError(
                    f"{path}:{number} has no string under the prompt key {prompt_key!r} "
                    f"(FileTask.prompt_key); keys: {sorted(obj)[:10]}"
                )
            rows.append((number, obj))
    return rows
