"""Reward functions by import path: resolved from a module on sys.path, and every way it can
fail named with the path."""

import uuid

import pytest

from jaxrl.data.tasks.custom import load_reward_fn, render_custom_prompt

REWARDS = '''
def score(prompt, completion, fields):
    return float(completion.strip() == fields["target"])

class Scorer:
    @staticmethod
    def score(prompt, completion, fields, scale=1.0):
        return scale * len(completion) / 100

def one_arg(completion):
    return 1.0

threshold = 0.5
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    """Writes a module with `source` on sys.path; returns its (fresh, unique) name."""
    def write(source=REWARDS):
        name = f"jaxrl_test_rewards_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        return name
    return write


def test_a_function_resolves_named_after_its_attribute(module):
    name = module()
    reward_name, fn = load_reward_fn(f"{name}:score")
    assert reward_name == "score"
    assert fn("p", " 42 ", {"target": "42"}) == 1.0 and fn("p", "41", {"target": "42"}) == 0.0
    reward_name, fn = load_reward_fn(f" {name}:Scorer.score ")
    assert reward_name == "score" and fn("p", "x" * 50, {}) == 0.5


@pytest.mark.parametrize("path", ["my_pkg.rewards", "my_pkg.rewards:", ":score", "a b:c",
                                  "pkg..x:f", "pkg:f.", "pkg:f:g", ""])
def test_a_path_that_does_not_parse_is_named(path):
    with pytest.raises(ValueError, match="is not an import path 'module:attribute'") as info:
        load_reward_fn(path)
    assert repr(path) in str(info.value)


def test_each_failure_names_the_path_and_what_failed(module):
    name = module()
    cases = {
        "jaxrl_no_such_module:score":
            "module 'jaxrl_no_such_module' does not import: ModuleNotFoundError",
        f"{name}:scor": f"{name!r} has no attribute 'scor'",
        f"{name}:Scorer.rate": f"{name!r} has no attribute 'Scorer.rate' \\('rate' is missing",
        f"{name}:threshold": "is a float, not callable",
        f"{name}:one_arg": r"cannot be called as fn\(prompt, completion, fields\)",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            load_reward_fn(path)
        assert f"data.reward_fn={path!r}" in str(info.value)


def test_a_module_that_fails_on_import_is_named(module):
    name = module("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ValueError, match=f"module '{name}' does not import: RuntimeError: no GPU "
                                         f"here"):
        load_reward_fn(f"{name}:score")


def test_custom_prompts_are_verbatim():
    assert render_custom_prompt("  Say hi.\n") == "  Say hi.\n"
