"""The test tiers as pyproject.toml configures them: `pytest` alone collects the fast tier
(no tier marker), `-m TIER` that tier, `-m ""` all; a misspelt marker is an error. Checked on
a throwaway test file under the project's own pytest settings (a plain Python, no jaxrl)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIERED = """
import pytest

def test_fast():
    pass

@pytest.mark.process
def test_process():
    pass

@pytest.mark.learning
def test_learning():
    pass

@pytest.mark.packaging
def test_packaging():
    pass
"""


def _collect(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(folder), "-p", "no:cacheprovider", "-p", "no:xdist", "--collect-only", "-q",
         *args, str(folder)], capture_output=True, text=True, timeout=120)


def _names(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split("::")[1] for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize(("args", "names"), [
    ((), ["test_fast"]),
    (("-m", "process"), ["test_process"]),
    (("-m", "learning"), ["test_learning"]),
    (("-m", "packaging"), ["test_packaging"]),
    (("-m", ""), ["test_fast", "test_process", "test_learning", "test_packaging"]),
])
def test_the_default_run_is_the_fast_tier_and_m_picks_another(tmp_path, args, names):
    (tmp_path / "test_tiered.py").write_text(TIERED)
    assert _names(_collect(tmp_path, *args)) == names


def test_a_misspelt_marker_is_an_error(tmp_path):
    (tmp_path / "test_typo.py").write_text(
        "import pytest\n\n@pytest.mark.proces\ndef test_x():\n    pass\n")
    result = _collect(tmp_path)
    assert result.returncode != 0
    assert "'proces' not found in `markers` configuration option" in result.stdout
