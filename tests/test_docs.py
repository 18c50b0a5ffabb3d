"""The docs cannot rot: every command, gin file, flag, Python snippet and relative link that
README.md and docs/ name is checked here, parsed and never run (GUIDE.md §7).

- `python -m distillspec.X ...`: the module exists and runs with -m (a package needs __main__).
  A gin run's flags go through `gin_setup.parse_command_line` (unknown flags fail), its
  --gin_file files must exist (working directory, --gin_search_paths, configs/) and parse, and
  each --gin.NAME must name a macro those files define or a parameter of a configurable (bound
  to None while parsing, never called). Other commands' flags go through their `build_parser()`.
  A bare mention (no arguments) only needs the module.
- Every gin path named anywhere (`dir/name.gin`) exists and parses.
- Every ```python snippet compiles, and its import statements run.
- Every relative link or image resolves to a file (anchors are not checked).
The last tests plant each kind of fault in a temporary page and assert it is reported.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re
import shlex

import gin
import pytest

from distillspec import gin_setup

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PAGES = (
    "getting-started", "your-own-model", "training", "evaluation", "decoding",
    "dynamic-lookahead", "study", "t5x-checkpoints", "benchmarks", "design", "serving",
)  # fmt: skip
GIN_RUNS = {"train", "evaluate", "quickstart", "disco", "study", "plan", "online"}
# Parsed before gin's flags.
OWN_FLAGS = {"quickstart": ("--output_dir",), "study": ("--output_dir", "--json"),
             "online": ("--json",)}  # fmt: skip
IMPLICIT_GIN = {"quickstart": "experiments/quickstart.gin"}
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
SEPARATORS = {"&&", "||", ";", "|", "do", "done", "then", "(", ")"}

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`(python3? -m distillspec[^`]*)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_GIN_PATH = re.compile(r"[\w./-]+\.gin\b")


def _blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) in languages]


def _prose(text: str) -> str:
    """The page without its fenced blocks."""
    return _FENCE.sub("", text)


def _tokens(line: str) -> list[str]:
    """Shell words of a line, separators apart; a line shlex cannot read (a quote opened in a
    comment or in prose) is split on whitespace."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        return list(lexer)
    except ValueError:
        return line.split("#")[0].split()


def commands(text: str) -> list[list[str]]:
    """Every `python -m distillspec...` invocation as [module, arg, ...] (shell blocks and
    inline code); backslash continuations joined, comments and '...' placeholders dropped."""
    lines = []
    for block in _blocks(text, SHELL_BLOCKS):
        lines += block.replace("\\\n", " ").splitlines()
    lines += _INLINE.findall(_prose(text))
    found = []
    for line in lines:
        tokens = [t for t in _tokens(line) if t != "..."]
        for i, token in enumerate(tokens[:-2]):
            if token in ("python", "python3") and tokens[i + 1] == "-m":
                if tokens[i + 2].startswith("distillspec"):
                    rest = tokens[i + 3 :]
                    end = next((j for j, t in enumerate(rest) if t in SEPARATORS), len(rest))
                    found.append([tokens[i + 2], *rest[:end]])
    return found


def _split_gin_flags(args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(gin files, binding names, the other flags) of a gin run's arguments."""
    files, names, others = [], [], []
    it = iter(args)
    for arg in it:
        if arg.startswith("--gin_file"):
            files.append(arg.partition("=")[2] or next(it, ""))
        elif arg.startswith("--gin."):
            names.append(arg[len("--gin.") :].partition("=")[0])
        else:
            others.append(arg)
    return files, names, others


def _drop_own_flag(run: str, args: list[str]) -> list[str]:
    """Removes the flag (and its value) that `run`'s entry point parses before gin's (the
    plan's own flags: its `build_parser`, which fails on a bad one)."""
    if run == "plan":
        from distillspec import plan

        return plan.build_parser().parse_known_args(args)[1]
    flags, out, skip = OWN_FLAGS.get(run, ()), [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not any(arg.startswith(flag + "=") for flag in flags):
            out.append(arg)
    return out


def find_gin_file(name: str, search_paths: list[str] = ()) -> pathlib.Path | None:
    for base in (pathlib.Path.cwd(), *map(pathlib.Path, search_paths), gin_setup.CONFIGS_DIR, REPO):
        if (base / name).is_file():
            return base / name
    return None


def _load(files: list[str], bindings: list[str] = ()) -> str | None:
    """Parses gin files and bindings; the error's first line, or None."""
    gin_setup.clear()
    try:
        gin_setup.load_config(files, list(bindings))
    except Exception as e:  # gin raises ValueError, IOError, SyntaxError, ...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        gin_setup.clear()
    return None


def _is_macro_defined(files: list[str], name: str) -> bool:
    gin_setup.clear()
    try:
        gin_setup.load_config(files, [])
        gin.query_parameter(f"%{name}")
        return True
    except ValueError:
        return False
    finally:
        gin_setup.clear()


def _gin_run_problems(run: str, args: list[str]) -> list[str]:
    files, names, others = _split_gin_flags(_drop_own_flag(run, args))
    search = [a.partition("=")[2] for a in others if a.startswith("--gin_search_paths=")]
    problems = []
    try:
        gin_setup.parse_command_line(others, run)
    except SystemExit:
        problems.append(f"python -m distillspec.{run}: unknown flag in {' '.join(others)}")
    finally:
        gin_setup.clear()
    missing = [f for f in files if find_gin_file(f, search) is None]
    problems += [f"gin file not found: {f}" for f in missing]
    files = [f for f in files if f not in missing] or (
        [IMPLICIT_GIN[run]] if run in IMPLICIT_GIN else []
    )
    if (error := _load(files)) is not None:
        return problems + [f"gin files {files} do not parse: {error}"]
    for name in names:
        is_macro = "." not in name.rsplit("/", 1)[-1]
        if is_macro and not _is_macro_defined(files, name):
            problems.append(f"--gin.{name}: no such macro in {files}")
        elif not is_macro and (error := _load(files, [f"{name} = None"])) is not None:
            problems.append(f"--gin.{name}: {error}")
    return problems


def command_problems(module: str, args: list[str]) -> list[str]:
    """What is wrong with `python -m module args` (empty when it would parse)."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return [f"no module {module}"]
    if spec.submodule_search_locations is not None and not importlib.util.find_spec(
        f"{module}.__main__"
    ):
        return [f"{module} is a package without __main__: python -m cannot run it"]
    run = module.removeprefix("distillspec.")
    if run in GIN_RUNS:
        return _gin_run_problems(run, args)
    if not args:
        return []
    build_parser = getattr(importlib.import_module(module), "build_parser", None)
    if build_parser is None:
        return [f"{module} has no build_parser() to check the flags {args}"]
    try:
        build_parser().parse_args(args)
    except SystemExit:
        return [f"python -m {module}: unknown or invalid flags in {' '.join(args)}"]
    return []


def gin_path_problems(text: str) -> list[str]:
    """Every gin path the page names (dir/name.gin, outside --gin_file flags too) exists and
    parses; a bare name (a run's own config.gin) is not a path into configs/."""
    problems = []
    for name in sorted(n for n in set(_GIN_PATH.findall(text)) if "/" in n):
        path = find_gin_file(name.removeprefix("configs/"))
        if path is None:
            problems.append(f"gin file not found: {name}")
        elif (error := _load([str(path)])) is not None:
            problems.append(f"gin file {name} does not parse: {error}")
    return problems


def snippet_problems(text: str) -> list[str]:
    problems = []
    for i, snippet in enumerate(_blocks(text, ("python",))):
        try:
            tree = ast.parse(snippet)
        except SyntaxError as e:
            problems.append(f"python snippet {i + 1} does not compile: {e}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                code = compile(ast.Module(body=[node], type_ignores=[]), "<docs>", "exec")
                try:
                    exec(code, {})
                except Exception as e:
                    problems.append(f"python snippet {i + 1}: {ast.unparse(node)}: {e!r}")
    return problems


def link_problems(text: str, page: pathlib.Path) -> list[str]:
    problems = []
    for target in _LINK.findall(_prose(text)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # A URL or an anchor on this page.
        if not (page.parent / target.partition("#")[0]).exists():
            problems.append(f"broken link: {target}")
    return problems


def page_problems(page: pathlib.Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    problems = [p for cmd in commands(text) for p in command_problems(cmd[0], cmd[1:])]
    return problems + gin_path_problems(text) + snippet_problems(text) + link_problems(text, page)


@pytest.fixture(autouse=True)
def clean_gin():
    gin_setup.clear()
    yield
    gin_setup.clear()


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_what_the_docs_name_exists_and_parses(page):
    assert page_problems(page) == []


def test_readme_is_short_and_docs_has_a_page_per_task():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    for name in PAGES:
        assert (REPO / "docs" / f"{name}.md").is_file(), name
        assert f"docs/{name}.md" in (REPO / "README.md").read_text(), f"README links {name}"


def test_no_commit_hash_outside_the_generated_results():
    hashes = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    for page in DOCS:
        if "results" not in page.relative_to(REPO).parts:
            assert not hashes.findall(page.read_text()), page


def test_the_docs_name_every_command():
    text = "\n".join(p.read_text() for p in DOCS)
    named = {cmd[0] for cmd in commands(text)}
    every = {f"distillspec.{n}" for n in (*GIN_RUNS, "convert", "report")} | {
        f"distillspec.benchmarks.{n}" for n in ("speculative", "disco", "train_step")
    }
    assert every <= named, every - named


def test_commands_are_found_in_blocks_and_inline():
    text = (
        "Run `python -m distillspec.report --out_dir x`.\n\n```bash\n"
        "for s in 1 2; do python -m distillspec.quickstart --output_dir runs/s$s \\\n"
        "    --gin.SEED=$s; done  # seeds\npython3 -m distillspec.disco ...\n```\n"
    )
    assert commands(text) == [
        ["distillspec.quickstart", "--output_dir", "runs/s$s", "--gin.SEED=$s"],
        ["distillspec.disco"],
        ["distillspec.report", "--out_dir", "x"],
    ]


PLANTED = """# A planted page

See [the guide](no-such-page.md) and [the design](design.md).

```bash
python -m distillspec.quickstart --no_such_flag
python -m distillspec.train --gin_file=experiments/no_such_config.gin
python -m distillspec.evaluate --gin_file=runs/evaluate.gin --gin.evaluate.no_such_param=1
python -m distillspec.evaluate --gin_file=runs/evaluate.gin --gin.NO_SUCH_MACRO=1
python -m distillspec.benchmarks.speculative --no_such_flag 3
python -m distillspec.no_such_module
```

```python
from distillspec.no_such_module import thing
```
"""


def test_the_checker_reports_each_planted_fault(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    (tmp_path / "design.md").write_text("# exists\n")
    problems = "\n".join(page_problems(page))
    assert "broken link: no-such-page.md" in problems and "design.md" not in problems
    assert "python -m distillspec.quickstart: unknown flag" in problems
    assert "gin file not found: experiments/no_such_config.gin" in problems
    assert "--gin.evaluate.no_such_param" in problems
    assert "--gin.NO_SUCH_MACRO: no such macro" in problems
    assert "python -m distillspec.benchmarks.speculative: unknown or invalid flags" in problems
    assert "no module distillspec.no_such_module" in problems
    assert "from distillspec.no_such_module import thing" in problems


def test_a_correct_page_has_no_problems(tmp_path):
    page = tmp_path / "fine.md"
    page.write_text(
        "```bash\npython -m distillspec.quickstart --output_dir runs/q --gin.SEED=1 "
        "--gin.distill/LoopConfig.train_steps=400\n"
        'python -m distillspec.evaluate --gin_file=runs/evaluate.gin --gin.OUTPUT_DIR=\\"x\\"\n'
        "python -m distillspec.benchmarks.disco --json out.json\n```\n\n"
        "```python\nimport distillspec.decoding.acceptance\n```\n"
    )
    assert page_problems(page) == []


HELP_RUNS = ("plan", "train", "evaluate", "online", "disco")


def docs_flags(texts) -> dict[str, set[str]]:
    """{run: every --flag (not --gin.NAME) its `python -m distillspec.<run>` commands use}."""
    found = {run: set() for run in HELP_RUNS}
    for text in texts:
        for module, *args in commands(text):
            run = module.removeprefix("distillspec.")
            if run in found:
                found[run] |= {a.partition("=")[0] for a in args
                               if a.startswith("--") and not a.startswith("--gin.")}  # fmt: skip
    return found


def test_every_flag_the_docs_use_is_listed_by_its_entry_points_help():
    """`python -m distillspec.<run> --help` (run as a user runs it, in a fresh process) lists
    every flag README.md and docs/ give that run; the docs' own commands are the reference."""
    import subprocess
    import sys

    used = docs_flags(page.read_text() for page in DOCS)
    assert {"--validate", "--measure_profile", "--profile", "--temperatures"} <= used["plan"]
    assert "--gin_file" in used["train"]  # The parse finds the flags it compares.
    missing = {}
    for run in HELP_RUNS:
        done = subprocess.run([sys.executable, "-m", f"distillspec.{run}", "--help"],
                              capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        listed = set(re.findall(r"--\w+", done.stdout))
        if used[run] - listed:
            missing[run] = sorted(used[run] - listed)
    assert not missing, f"flags the docs use that --help does not list: {missing}"
