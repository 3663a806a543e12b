"""The code's shape: a module is one idea, and the packages are layers (docs/design.md, "Modules").

No import cycles; every import goes down the layers or stays inside its package; only ``mlxspec.pacing``
itself is imported from outside ``pacing/``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folder → the package name it installs as (pyproject.toml's package-dir).
PACKAGES = {"mlxspec": "mlxspec", "app": "mlxspec_app"}
#: Data folders installed as packages (no code): the shipped heads and drafts in models/.
DATA_PACKAGES = {"mlxspec_models"}
#: The layers, lowest first: a module may import from its own package or from a package of a lower layer.
#: ``mlxspec`` is the package's public names (its __init__), for the layers above the engine.
LAYERS = {
    "mlxspec.runtime": 0,  # the process: machine, progress bars, MLXThread, whole files, a job's ranks
    "mlxspec.core": 1,  # the round's parts: tree, cache, sampling, taps, acceptance rules, metrics, stops
    "mlxspec.loading": 2,  # specs → models, GGUF, pickles, assets, identity cards, ShareGPT
    "mlxspec.heads": 3,
    "mlxspec.drafters": 4,
    "mlxspec.pacing": 5,
    "mlxspec.engine": 6,  # the round loop, argument checks, session
    "mlxspec.sharding": 7,  # a job over several ranks: composes the split, the drafter, γ and the engine
    "mlxspec": 8,
    "mlxspec.bench": 9, "mlxspec.train": 9, "mlxspec.serve": 9, "mlxspec_app": 9,
    "mlxspec.commands": 10,
    "mlxspec.__main__": 11,
}
#: The one package whose insides nobody else reads: its __init__ is what the others use.
CLOSED = "mlxspec.pacing"
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
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
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


def package(name: str) -> str:
    """The layer package a module belongs to (the longest ``LAYERS`` key it is inside)."""
    return max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)


def wrong_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer, across to another package of the same layer, or into ``CLOSED``'s
    insides."""
    out = []
    for name, targets in sorted(edges.items()):
        for target in sorted(targets):
            here, there = package(name), package(target)
            if here != there and LAYERS[there] >= LAYERS[here]:
                out.append(f"{name} -> {target} ({'across' if LAYERS[there] == LAYERS[here] else 'up'})")
            if there == CLOSED != here and target != CLOSED:
                out.append(f"{name} -> {target} (inside {CLOSED})")
    return out


def test_the_layer_check_finds_what_it_should():
    edges = {
        "mlxspec.core.cache": {"mlxspec.engine.generate"},
        "mlxspec.serve.server": {"mlxspec.train.loop"},
        "mlxspec.engine.generate": {"mlxspec.pacing.costs", "mlxspec.pacing", "mlxspec.core.cache"},
        "mlxspec.pacing.costs": {"mlxspec.pacing.trees"},
    }
    assert wrong_imports(edges) == ["mlxspec.core.cache -> mlxspec.engine.generate (up)",
                                    "mlxspec.engine.generate -> mlxspec.pacing.costs (inside mlxspec.pacing)",
                                    "mlxspec.serve.server -> mlxspec.train.loop (across)"]


def test_every_module_is_in_a_layer_package():
    """A new top-level module or package must be placed in ``LAYERS`` (and in docs/design.md's drawing)."""
    top = {".".join(name.split(".")[:2]) for name in modules() if name.startswith("mlxspec.")}
    assert top <= set(LAYERS), top - set(LAYERS)


def test_imports_go_down_the_layers():
    assert wrong_imports(graph()) == []


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
    """Every clone carries every tracked file: weights that do not pay (docs/drafters.md, "What ships") stay
    out."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    sizes = {
        name: (ROOT / name).stat().st_size for name in names.split("\0") if name and (ROOT / name).is_file()
    }
    assert sum(sizes.values()) <= MAX_TRACKED_BYTES, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]


def test_the_tree_passes_ruff():
    """pyproject.toml's ruff rules, lines within 110 characters (E501) included, hold for the whole tree."""
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
