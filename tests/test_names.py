"""One name per idea: no public top-level name is defined in two modules of jaxrl/.

Every `.py` under jaxrl/ is parsed (not imported). A module defines the names of its
top-level classes, functions and assignments (type aliases and TypeVars included), also
those under a module-level `if` or `try`, except under `if TYPE_CHECKING:`. Imports are not
definitions (a package's `__init__.py` re-exporting a name defines nothing), and private
(`_name`) and dunder names are the module's own business. The test fails on a name that two
modules define, naming both.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "jaxrl"

# One interface that several modules each implement by name, read off the module by the
# code that picks one (jaxrl/data/tasks/registry.py: a math task module's gold answer and
# correctness reward). Same idea in each, so the same name.
ONE_INTERFACE = frozenset({"gold_answer", "math_reward"})


def _targets(node: ast.expr):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def defined_names(body: list[ast.stmt]):
    """The names a module body binds at its top level, other than by importing."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                yield from _targets(target)
        elif isinstance(node, ast.AnnAssign):
            yield from _targets(node.target)
        elif type(node).__name__ == "TypeAlias":  # `type X = ...` (Python 3.12+)
            yield node.name.id
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            yield from defined_names(node.body)
            yield from defined_names(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse,
                          node.finalbody):
                yield from defined_names(block)


def definitions() -> dict[str, list[str]]:
    """{public name: the modules that define it}."""
    by_name = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for name in set(defined_names(ast.parse(path.read_text(encoding="utf-8")).body)):
            if not name.startswith("_"):
                by_name[name].append(module)
    return by_name


def test_no_name_is_defined_in_two_modules():
    twice = {name: modules for name, modules in definitions().items()
             if len(modules) > 1 and name not in ONE_INTERFACE}
    assert not twice, "names defined in more than one module of jaxrl/ (one name per idea):\n" + (
        "\n".join(f"  {name}: {', '.join(modules)}" for name, modules in sorted(twice.items())))


def test_a_module_defines_what_it_binds_not_what_it_imports():
    body = ast.parse("import x\nfrom y import z\nA = 1\nif TYPE_CHECKING:\n    B = 2\n"
                     "try:\n    import c\nexcept ImportError:\n    C = None\n"
                     "def f(): pass\nclass K: pass\n_private = 3\n").body
    assert sorted(defined_names(body)) == ["A", "C", "K", "_private", "f"]
