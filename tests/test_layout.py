"""How the code is laid out, checked from its source: shared test models come from the package,
command lines share their helpers without importing each other, nothing outside a module uses
its private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) for every import in ``path``, at any depth:
    relative imports resolved against the file's package, function-level imports included."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((module, [a.name for a in node.names], node.lineno))
    return found


def project_modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "dflash_core").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_scripts_and_tests_get_shared_models_from_the_package():
    """Tiny models and reference drafters come from ``dflash_core.testing``: no script imports
    ``tests/`` (a lent GPU machine runs scripts/gpu_check.py with only the package on the path),
    no test imports ``conftest`` (pytest injects its fixtures) or another test module."""
    offenders = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        offenders += [f"{path.name}:{line}: {module}" for module, _, line in imports(path)
                      if module == "conftest" or module.split(".")[0].startswith("test")]
    for path in sorted((ROOT / "tests").glob("*.py")):
        offenders += [f"{path.name}:{line}: {module}" for module, _, line in imports(path)
                      if module == "conftest" or module.split(".")[0].startswith("test_")]
    assert offenders == []


def test_command_lines_do_not_import_each_other_back():
    """``cli`` imports ``bench.cli`` and ``training.cli`` to build its parser; what they share
    (stderr progress, quiet libraries) is in ``console``, which imports nothing of the project's."""
    modules = project_modules()
    graph = {name: {m for m, names, _ in imports(path) for m in [m, *(f"{m}.{n}" for n in names)] if m in modules and m != name}
             for name, path in modules.items()}
    assert not graph["dflash_core.console"]
    for name in ("dflash_core.bench.cli", "dflash_core.training.cli"):
        assert "dflash_core.cli" not in graph[name], name
    # No cycle through any command line: walk everything each one reaches.
    for start in ("dflash_core.cli", "dflash_core.bench.cli", "dflash_core.training.cli"):
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph[module]
        assert start not in seen, f"{start} imports itself back"


def test_nothing_imports_a_private_name_from_another_top_level_package():
    """The app and the scripts use the engine's public names only (``app/__main__`` once
    imported ``dflash_core.cli._quiet_libraries``)."""
    offenders = []
    for path in sorted((ROOT / "app").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        for module, names, line in imports(path):
            if module.startswith("dflash_core"):
                offenders += [f"{path.relative_to(ROOT)}:{line}: {module}.{n}" for n in names if n.startswith("_")]
    assert offenders == []
