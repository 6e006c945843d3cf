"""jaxrl's imports run one way, down the layers of DESIGN.md, and never in a circle.

Every `.py` under jaxrl/ is parsed (not imported) and each of its imports of jaxrl is an
edge: module-level ones, those inside functions (lazy) and under `if TYPE_CHECKING:` alike,
since a lazy import is still a dependency of the idea. `from pkg import name` is an edge to
the submodule `pkg.name` when there is one, else to `pkg` (its __init__.py); `import a.b`
is an edge to `a.b`. The test fails on

- a cycle between modules, naming its path;
- an import from a higher layer, or from a package of the same layer (`run` and `serve`
  never import each other), naming the importing file, its line and the module imported;
- an import that DESIGN.md forbids although it goes down: RL math imports nothing of
  jaxrl, the engine (`rollout`) never imports `envs`, and `config` imports only the small
  type modules of lower packages listed in CONFIG_MAY_IMPORT (and the bottom layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jaxrl"

# Top to bottom; a package imports only packages of lower layers. A top-level module
# (jaxrl/cli.py, jaxrl/runtime.py, jaxrl/config_base.py) is its own package; jaxrl/__init__.py
# holds the version, which every module may read, and imports nothing.
LAYERS = (
    ("cli",),
    ("commands",),
    ("run", "serve"),
    ("saved",),  # reading a run directory's policy or checkpoint: below both run and serve
    ("step",),
    ("config",),
    ("rollout", "data", "perf"),
    ("models",),
    ("sharding", "distributed", "rl", "envs"),
    ("runtime", "config_base"),
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}

# Downward imports DESIGN.md forbids all the same: (importer, imported package, why).
FORBIDDEN = (
    ("rl", None, "RL math imports nothing of jaxrl"),
    ("rollout", "envs", "the engine never imports envs (the multi-turn driver above it does)"),
)

# The config sections hold the frozen types of lower packages, never their machinery: these
# modules are all `jaxrl.config` may import outside itself (and the bottom layer's).
CONFIG_MAY_IMPORT = frozenset({
    "jaxrl.data.section",
    "jaxrl.distributed.settings",
    "jaxrl.models.load_settings",
    "jaxrl.models.lora_config",
    "jaxrl.rl.loss_config",
    "jaxrl.rl.settings",
    "jaxrl.rollout.settings",
})

def module_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (its file, whether it is a package's __init__.py)}."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_edges(root: Path = ROOT) -> list[tuple[str, str, Path, int]]:
    """(importer, imported module, file, line) of every import of jaxrl under `root`."""
    modules = module_files(root)
    edges = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, one level up per extra dot
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                submodules = [f"{source}.{a.name}" for a in node.names
                              if f"{source}.{a.name}" in modules]
                targets = submodules + ([source] if len(submodules) < len(node.names) else [])
            else:
                continue
            edges += [(name, target, path, node.lineno) for target in targets
                      if target == "jaxrl" or target.startswith("jaxrl.")]
    return edges


def package_of(module: str) -> str | None:
    """The package (layer member) of a jaxrl module: `jaxrl.rl.losses` -> `rl`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def cycles(edges) -> list[list[str]]:
    """One cycle (a path back to its start) through each strongly connected group."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges:
        if src != dst:
            graph.setdefault(src, set()).add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v roots a group: it and everything above it on the stack
            group = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_within(graph, group) for group in groups]


def _path_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the first module of `group`, inside `group` (breadth first)."""
    start = min(group)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & group):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle within {sorted(group)}")


def layer_violations(edges) -> list[str]:
    """Each import against the layers (module docstring), as `file:line: a imports b (why)`."""
    problems = []
    for src, dst, path, line in edges:
        a, b = package_of(src), package_of(dst)
        where = f"{path.relative_to(ROOT.parent)}:{line}: {src} imports {dst}"
        if a is None:
            problems.append(f"{where} (jaxrl/__init__.py holds the version and imports nothing)")
        elif b is None or a == b:  # `from jaxrl import __version__`, or within a package
            continue
        elif a not in RANK or b not in RANK:
            problems.append(f"{where} ({a if a not in RANK else b} is in no layer of LAYERS)")
        elif RANK[a] > RANK[b]:
            problems.append(f"{where} (upward: {a} is below {b})")
        elif RANK[a] == RANK[b]:
            problems.append(f"{where} (sideways: {a} and {b} share a layer)")
        elif a == "config" and RANK[b] < len(LAYERS) - 1 and dst not in CONFIG_MAY_IMPORT:
            problems.append(f"{where} (config holds lower packages' types only: "
                            f"CONFIG_MAY_IMPORT)")
        else:
            problems += [f"{where} ({why})" for importer, imported, why in FORBIDDEN
                         if a == importer and imported in (None, b)]
    return problems


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """Lazy, TYPE_CHECKING, relative and `from pkg import submodule` imports are all edges."""
    pkg = tmp_path / "jaxrl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from jaxrl.a.x import f\n")
    (pkg / "a" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxrl.a import y\n"
        "def f():\n    import jaxrl.b\n")
    (pkg / "a" / "y.py").write_text("from . import x\nfrom .x import f\n")
    (pkg / "b.py").write_text("import os\n")
    edges = {(s, d, line) for s, d, _, line in import_edges(pkg)}
    assert edges == {("jaxrl.a", "jaxrl.a.x", 1), ("jaxrl.a.x", "jaxrl.a.y", 3),
                     ("jaxrl.a.x", "jaxrl.b", 5), ("jaxrl.a.y", "jaxrl.a.x", 1),
                     ("jaxrl.a.y", "jaxrl.a.x", 2)}
    assert cycles(import_edges(pkg)) == [["jaxrl.a.x", "jaxrl.a.y", "jaxrl.a.x"]]


def test_the_layers_name_every_package():
    """A new package must be given its layer (DESIGN.md) before anything can check it."""
    packages = {package_of(m) for m in module_files()} - {None}
    assert packages <= set(RANK), f"packages in no layer: {sorted(packages - set(RANK))}"


@pytest.fixture(scope="module")
def edges():
    return import_edges()


def test_no_import_cycles(edges):
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_run_down_the_layers(edges):
    problems = layer_violations(edges)
    assert not problems, "imports against DESIGN.md's layers:\n" + "\n".join(problems)
