"""setup.py's install_requires covers every third-party module the package imports.

The suite runs in an environment with the test extra, which brings in transformers (and
through it `tokenizers`), so a module the package needs but only the extra installs passes
every other test while `pip install -e .` alone fails on a user's path. This test reads the
import graph instead: every `import x` / `from x import` in distillspec/ (at module level or
inside a function, where optional paths import lazily) and every `importlib.util.find_spec("x")`,
mapped to the distribution that provides it, must be named in install_requires.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imported_modules(package_dir: pathlib.Path) -> dict[str, str]:
    """{top-level module imported: a file that imports it} over every .py under package_dir."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "find_spec"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(package_dir.parent)))
    return found


def _install_requires(setup_py: pathlib.Path) -> set[str]:
    """Normalised distribution names of setup(install_requires=[...]), read with ast."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return {_normalise(re.split(r"[<>=!~\[; ]", ast.literal_eval(e))[0])
                    for e in node.value.elts}  # fmt: skip
    raise AssertionError(f"{setup_py} has no install_requires")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_requirements(package_dir: pathlib.Path, setup_py: pathlib.Path) -> dict[str, str]:
    """{module: 'file (distribution)'} of third-party imports whose distribution is not in
    install_requires; modules no installed distribution provides are reported too."""
    required = _install_requires(setup_py)
    providers = importlib.metadata.packages_distributions()
    own = package_dir.name
    missing = {}
    for module, where in _imported_modules(package_dir).items():
        if module in sys.stdlib_module_names or module == own or module == "__future__":
            continue
        dists = {_normalise(d) for d in providers.get(module, [])}
        if not dists & required:
            missing[module] = f"{where} ({', '.join(sorted(dists)) or 'no installed distribution'})"
    return missing


def test_every_imported_module_is_installed_by_install_requires():
    missing = missing_requirements(ROOT / "distillspec", ROOT / "setup.py")
    assert not missing, f"imported but not in setup.py's install_requires: {missing}"


def test_the_check_finds_a_module_install_requires_lacks(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "import numpy\n\ndef f():\n    import tokenizers\n    return tokenizers\n"
    )
    (tmp_path / "setup.py").write_text("setup(install_requires=['numpy>=1'])\n")
    missing = missing_requirements(package, tmp_path / "setup.py")
    assert list(missing) == ["tokenizers"] and "pkg/a.py" in missing["tokenizers"]
