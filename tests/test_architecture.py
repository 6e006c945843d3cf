"""docs/architecture.md tells the truth: every hop of its step path is a real
`file:function` (or `file:Class.method`) of jaxrl, there are at most 15, and its layer list
is the one `tests/test_imports.py` holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_imports import LAYERS

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "architecture.md").read_text()


def _hops() -> list[str]:
    return re.findall(r"^\| \d+ \| `([^`]+)` \|", DOC, flags=re.MULTILINE)


def _defines(path: Path, name: str) -> bool:
    """Whether the module at `path` defines `name` (`f` or `Class.method`) at its top level."""
    body = ast.parse(path.read_text()).body
    first, *rest = name.split(".")
    for node in body:
        if getattr(node, "name", None) != first:
            continue
        if not rest:
            return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        return any(isinstance(n, ast.FunctionDef) and n.name == rest[0] for n in node.body)
    return False


def test_every_hop_of_the_step_path_is_a_real_function_and_there_are_at_most_15():
    hops = _hops()
    assert 0 < len(hops) <= 15, hops
    missing = [hop for hop in hops
               if not _defines(REPO / hop.split(":")[0], hop.split(":")[1])]
    assert not missing, f"docs/architecture.md names hops that do not exist: {missing}"


def test_the_layer_list_is_the_import_tests():
    listed = re.findall(r"^\d+\. (.+)$", DOC.split("## The layers")[1], flags=re.MULTILINE)
    assert [tuple(re.findall(r"`(\w+)`", line)) for line in listed] == list(LAYERS)
