"""The package's layering (GUIDE.md §1), checked on the source with `ast`.

library < evaluation/ < disco/ < runs/ < study/ < gin glue and entry points (and benchmarks):
a module imports only from its own layer or those below; only the top imports gin; nothing imports a
benchmark; the import graph has no cycle (imports inside functions count too). Also the size
budgets: no module over ~600 lines, no function over ~100.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distillspec"
TOP_MODULES = {
    "gin_setup", "train", "evaluate", "quickstart", "disco.__main__", "study.__main__", "convert",
    "report", "plan", "online", "serve_check",
}  # fmt: skip
LAYERS = ("library", "evaluation", "disco", "runs", "study", "top")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, pathlib.Path]:
    """{dotted name below distillspec ('runs.train', 'models' for models/__init__): path}."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(name: str) -> str:
    if name in TOP_MODULES or name.startswith("benchmarks"):
        return "top"
    head = name.split(".")[0]
    return head if head in ("evaluation", "disco", "runs", "study") else "library"


def _imports(path: pathlib.Path) -> set[str]:
    """Names imported anywhere in the file: 'gin', 'numpy', and our modules as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from distillspec.disco import storage` imports the module distillspec.disco.storage.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _own(imported: set[str]) -> set[str]:
    """Our modules among imported names (dropping names that are not modules)."""
    prefix = "distillspec."
    return {n[len(prefix) :] for n in imported if n.startswith(prefix)} & set(MODULES)


GRAPH = {name: _own(_imports(path)) - {name} for name, path in MODULES.items()}


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module from a layer above its own."""
    return [
        f"{name} ({_layer(name)}) imports {dep} ({_layer(dep)})"
        for name, deps in graph.items()
        for dep in sorted(deps)
        if LAYERS.index(_layer(dep)) > LAYERS.index(_layer(name))
    ]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the import graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done.

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_layers_import_only_downwards():
    assert not upward_edges(GRAPH), "\n".join(upward_edges(GRAPH))


def test_only_the_top_imports_gin_and_nobody_imports_a_benchmark():
    uses_gin = lambda p: any(i.split(".")[0] == "gin" for i in _imports(p))
    assert {n for n, p in MODULES.items() if uses_gin(p)} == {"gin_setup"}
    importers = {n for n, deps in GRAPH.items() for d in deps if d.startswith("benchmarks")}
    assert importers <= {n for n in MODULES if n.startswith("benchmarks")}


def test_no_import_cycle():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_the_checks_catch_a_planted_cycle_and_upward_import():
    planted = {**GRAPH, "records": GRAPH["records"] | {"tables"}}  # tables imports records.
    assert find_cycle(planted) in (
        ["records", "tables", "records"],
        ["tables", "records", "tables"],
    )
    upward = {**GRAPH, "tasks": GRAPH["tasks"] | {"runs.train"}}
    assert upward_edges(upward) == ["tasks (library) imports runs.train (runs)"]
    assert "runs.train" in GRAPH["gin_setup"] and "feature_converters" in GRAPH["runs.train"]
    assert _layer("disco.__main__") == "top" and _layer("evaluation.timing") == "evaluation"


def test_the_decoder_is_one_package():
    """The loop, acceptance, lookahead policies and sampling live in distillspec/decoding/ (the
    package re-exports the public API); no top-level module holds or re-exports a part."""
    parts = ("loop", "acceptance", "lookahead", "sampling", "fixed_rounds", "result")
    assert {f"decoding.{part}" for part in parts} <= set(MODULES)
    assert not {"speculative", *parts} & set(MODULES), "a decoder part outside decoding/"
    within = lambda n: n.startswith("decoding")
    # Inside the package, parts import each other, never the package's re-exports.
    assert not any("decoding" in GRAPH[n] for n in MODULES if within(n)), GRAPH["decoding"]


def test_size_budgets():
    long_modules = [
        f"{n}: {len(p.read_text().splitlines())} lines"
        for n, p in MODULES.items()
        if len(p.read_text().splitlines()) > MAX_MODULE_LINES
    ]
    long_functions = [
        f"{n}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for n, p in MODULES.items()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long_modules and not long_functions, long_modules + long_functions
