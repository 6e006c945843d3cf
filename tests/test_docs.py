"""The docs are true: every code block of docs/*.md (and README.md) marked runnable (info
string `bash runnable` or `python runnable`, docs/README.md "Runnable blocks") runs as
written and exits 0; every docs page is linked from README.md or docs/README.md; README.md
stays a newcomer's length."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_env import TEST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 200
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
RUNNERS = {"bash": ["bash", "-e", "-o", "pipefail"], "python": [sys.executable]}


def _pages():
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _blocks():
    """(id, language, code) of every runnable block, in page order."""
    found = []
    for page in _pages():
        text = page.read_text()
        n = 0
        for match in FENCE.finditer(text):
            words = match.group(1).split()
            if len(words) >= 2 and words[1] == "runnable" and words[0] in RUNNERS:
                n += 1
                line = text[:match.start()].count("\n") + 1
                name = f"{page.relative_to(ROOT).as_posix()}:{line}"
                found.append(pytest.param(words[0], match.group(2), id=name))
    return found


BLOCKS = _blocks()


def test_there_are_runnable_blocks():
    assert len(BLOCKS) >= 10, len(BLOCKS)


@pytest.mark.process
@pytest.mark.parametrize(("language", "code"), BLOCKS)
def test_runnable_block(language, code, tmp_path):
    """The block, run as a reader runs it: from a folder that looks like the repository root
    (links to its top-level entries; `runs/` is the block's own), one CPU device, `jaxrl` on
    PATH, this tree importable."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != "runs" and not entry.name.startswith("."):  # not .git, .venv, caches
            (repo / entry.name).symlink_to(entry)
    script = tmp_path / f"block.{'sh' if language == 'bash' else 'py'}"
    script.write_text(code)
    # Not the tests' XLA_FLAGS (the README's commands run on one device unless they say
    # otherwise), and not JAXRL_TESTS_RAN or JAXRL_TEST_TIMES: a block that runs pytest must
    # not count in CI's exactly-once check.
    # XLA_FLAGS: only the tests' cheap compiler settings (tests/launch_env.py), which change
    # how long a block's programs take to compile, not what it runs or prints; a block that
    # sets XLA_FLAGS itself compiles as XLA does by default.
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", "JAXRL_TESTS_RAN", "JAXRL_TEST_TIMES")}
    env["XLA_FLAGS"] = TEST_COMPILE
    env["PYTHONPATH"] = str(ROOT)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run([*RUNNERS[language], str(script)], cwd=repo, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=600)
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"exit {result.returncode}:\n{output}"


def test_readme_is_a_newcomers_length():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_every_docs_page_is_linked():
    linked = set()
    for index, base in ((ROOT / "README.md", ROOT), (DOCS / "README.md", DOCS)):
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", index.read_text()):
            linked.add((base / target).resolve())
    pages = {p.resolve() for p in DOCS.glob("*.md")} - {(DOCS / "README.md").resolve()}
    assert (DOCS / "README.md").resolve() in {(ROOT / t).resolve() for t in re.findall(
        r"\]\(([^)#\s]+)\)", (ROOT / "README.md").read_text())}, "README.md must link docs/"
    missing = sorted(p.name for p in pages - linked)
    assert not missing, f"docs pages linked from neither README.md nor docs/README.md: {missing}"


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
