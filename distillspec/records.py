"""records.jsonl and other run outputs: JSONL append/read, atomic writes, canonical names, and
the check of an eval set's timings (`timing_warnings`).

Evaluation appends one JSON object per line (`append_records`); `distillspec.tables` reads them
back (`read_jsonl`) to format tables, as `distillspec.metrics` does for metrics.jsonl. A file
cut short by a kill keeps every complete line: a torn last line is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

RECORDS_FILE = "records.jsonl"

# Lookahead policy names (DISCO Table 1 order); 'static-<k>' stands for static-1, static-2, ...
POLICY_NAMES = (
    "static-<k>", "static-opt", "heuristic", "confidence", "disco", "cumulative", "oracle",
)  # fmt: skip
# Policies whose settings come from a draft's validation tuning (python -m distillspec.disco).
TUNED_POLICIES = ("static-opt", "confidence", "disco", "cumulative")
# The plain target, measured beside every set of policies.
TARGET_POLICY = "target"


def policy_list(static_sl: Iterable[int]) -> list[str]:
    """Every policy of DISCO Table 1: static-<k> for each k, then the named policies."""
    return [f"static-{k}" for k in static_sl] + [p for p in POLICY_NAMES if p != "static-<k>"]


def write_atomic(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Calls write(temporary path) in path's directory, then renames it to path, so a reader
    never sees a half-written file and an interruption leaves the old one."""
    path = os.fspath(path)
    directory, name = os.path.dirname(path) or ".", os.path.basename(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes text to path atomically (`write_atomic`)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomic(path, write)


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Replaces path with one JSON object per line, atomically."""
    write_text_atomic(path, "".join(json.dumps(dict(r)) + "\n" for r in records))


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Replaces path with value as indented JSON, atomically (parent directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, json.dumps(value, indent=1) + "\n")


def append_records(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Appends one JSON object per line to path (parent directories are created)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(dict(record), sort_keys=False) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every JSON object of a JSONL file, in file order, tolerating a torn last line.

    Raises:
      ValueError: naming file and line, for an unparseable line that is not the torn last one.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # A complete file ends with "\n", so a non-empty last piece is a line cut short.
    torn = lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not a JSON object: {line[:200]!r}") from e
    if torn.strip():
        try:  # A complete object without the final newline (a hand-made file) still counts.
            records.append(json.loads(torn))
        except json.JSONDecodeError:
            logging.warning("Ignoring a torn last line in %s: %r", path, torn[:200])
    return records


# The plain target's batch-1 ms per token may differ this much between temperatures (sampling
# at T > 0 costs ~10% more than argmax on a 2-core CPU) before its timings count as disturbed.
PLAIN_LATENCY_SPREAD = 1.3


def timing_warnings(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """What in one eval set's records says the machine's speed changed while they were timed:
    a verify call of gamma + 1 positions measured more than 10% cheaper than one of 1 position
    (r_gamma < 0.9), or the plain target's batch-1 latency (the same program at every
    temperature) differing by more than PLAIN_LATENCY_SPREAD between temperatures. Each
    speed-up is still a ratio of runs interleaved prompt by prompt, but a slow stretch can hit
    the memory-bound plain decoding harder than the speculative one, inflating it."""
    warnings, low = [], {}
    for r in records:
        if r.get("r_gamma") is not None and r["r_gamma"] < 0.9:
            low.setdefault(r["draft"], {})[r["gamma"]] = r["r_gamma"]
    for name, by_gamma in low.items():
        shown = ", ".join(f"{v:.2f} at gamma {g}" for g, v in sorted(by_gamma.items()))
        warnings.append(
            f"draft {name!r}: r_gamma {shown} (a wider target call timed cheaper than one "
            "position): the cost figures c, r_gamma and speedup_ideal are unreliable; rerun on "
            "a quiet machine"
        )
    plain = {
        r["temperature"]: r["target_latency_ms"] for r in records if r.get("target_latency_ms")
    }
    if plain and max(plain.values()) > PLAIN_LATENCY_SPREAD * min(plain.values()):
        shown = ", ".join(f"{ms:.3f} ms at T={t:g}" for t, ms in sorted(plain.items()))
        warnings.append(
            f"the plain target's batch-1 latency per token differs between temperatures ({shown}"
            f"; more than {PLAIN_LATENCY_SPREAD}x): the machine's speed changed while timing, "
            "so the batch-1 latency speed-ups are unreliable; rerun on a quiet machine"
        )
    return warnings


def eval_set(record: Mapping[str, Any]) -> str:
    """A record's eval set, 'task/split' (one `evaluate_drafts` call's records share it), the
    task as `task_label` writes it."""
    return f"{task_label(record.get('task'))}/{record.get('split')}"


def task_label(task: Any) -> str:
    """A task as a reader names it: a data file's registered seqio name
    ('file:data.jsonl#92bc8a5c', its digest keeping two settings of one file apart) as the
    file's name ('data.jsonl'); any other name as it is."""
    text = str(task)
    if text.startswith("file:") and "#" in text:
        return text[len("file:") :].rsplit("#", 1)[0]
    return text
