"""The code's shape: no import cycles, the app on the public library only, small modules."""

from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folder → the package name it installs as (pyproject.toml's package-dir).
PACKAGES = {"mlxspec": "mlxspec", "app": "mlxspec_app"}
#: Data folders installed as packages (no code): the shipped heads and drafts in models/.
DATA_PACKAGES = {"mlxspec_models"}
#: Files allowed past the size limit, and why.
LONG_FILES = {"mlxspec/loading/gguf.py": "one reader for a binary format with many block types"}
MAX_LINES = 500
#: What a clone's tracked files may weigh: code, docs, bench records and the shipped heads that pay.
MAX_TRACKED_BYTES = 40 * 2**20


def modules() -> dict[str, Path]:
    """Dotted module name → file, for every module of the project's packages."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package] + list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, anywhere in the file (function bodies included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_reader_finds_a_cycle_it_is_shown():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert graph()["mlxspec.engine.generate"] >= {"mlxspec.pacing", "mlxspec.drafters", "mlxspec.core.verify"}


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(graph()) == []


def test_the_app_uses_the_library_not_the_cli():
    edges = graph()
    for name, targets in edges.items():
        if name.startswith("mlxspec_app"):
            assert not {t for t in targets if t.startswith("mlxspec.commands")}, name
        elif name != "mlxspec.commands.chat":
            assert not {t for t in targets if t.startswith("mlxspec_app")}, name


def test_no_source_file_is_long():
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in modules().values()}
    assert {path: n for path, n in long.items() if n > MAX_LINES and path not in LONG_FILES} == {}


def test_every_package_is_installed():
    """pyproject.toml lists packages by hand (app/ installs as mlxspec_app): a new one must be listed."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert folders | DATA_PACKAGES == listed


def test_every_kind_of_shipped_asset_is_in_the_wheel():
    """A head or drafter kind that can ship in models/<kind>/ must be package data, or a wheel lacks it."""
    from mlxspec.loading.assets import SHIPPED_MARKERS

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {f"{kind}/*/*" for kind in SHIPPED_MARKERS} <= set(data["mlxspec_models"])


def test_the_tracked_files_stay_small():
    """Every clone carries every tracked file: weights that do not pay (docs/drafters.md, "What ships") stay out."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    sizes = {name: (ROOT / name).stat().st_size for name in names.split("\0") if name and (ROOT / name).is_file()}
    assert sum(sizes.values()) <= MAX_TRACKED_BYTES, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
