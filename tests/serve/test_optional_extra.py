"""The optional `jetstream` extra stays optional: no module of jaxrl outside `jaxrl.serve`
imports JetStream (or the TensorFlow it pulls in), and `jaxrl serve` without it exits 2 saying
how to install it. Runs in the serving environment, which has the extra: there the check that
no core module imports it can fail, and the message is checked with JetStream hidden."""

import pkgutil
import subprocess
import sys

import pytest

import jaxrl

pytestmark = pytest.mark.process  # each test starts a Python that imports jaxrl

HIDE_JETSTREAM = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jetstream" or name.startswith("jetstream."):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Hide())
"""


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_no_core_module_imports_jetstream():
    modules = sorted(m.name for m in pkgutil.walk_packages(jaxrl.__path__, "jaxrl.")
                     if not m.name.startswith("jaxrl.serve"))
    assert "jaxrl.commands.serve" in modules and "jaxrl.rollout.serving" in modules
    code = "\n".join([*(f"import {m}" for m in modules), "import sys",
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('jetstream', 'tensorflow', 'seqio')))"])
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_serve_without_the_extra_exits_2_with_the_install_command():
    result = _run(HIDE_JETSTREAM + "import jaxrl.cli\nsys.exit(jaxrl.cli.main(['serve']))")
    assert result.returncode == 2, result.stderr
    assert "pip install 'jaxrl[jetstream]'" in result.stderr
    assert "Traceback" not in result.stderr
