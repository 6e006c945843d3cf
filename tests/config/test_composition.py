"""The composition matrix (`jaxrl.config.composition`): every combination of mode x turns x
advantage x params x arch x processes either trains 3 steps or is refused when it is planned,
and docs/composition.md shows the same table the code computes.

The one-process cells train 3 steps on a tiny model, each as its own `jaxrl train` process
(process tier): run one after another inside one pytest worker, 32 trainings once aborted
that worker in CI (an XLA abort with no message, in a cell that passes alone), so each gets a
fresh process. The refused ones are refused by `jaxrl train` itself, with its message and
exit status 2.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config.composition import cells, config_name, overrides, refusal, table
from jaxrl.run.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["eval.num_prompts=0", "log.plot=false", "log.tensorboard=false",
         "train.save_final=false", "train.checkpoint_every=0", "perf.count_flops=false",
         "train.max_steps=3"]
ONE_PROCESS = [c for c in cells() if c.processes == 1]


def test_the_docs_table_is_the_computed_one():
    page = (ROOT / "docs" / "composition.md").read_text()
    assert page.endswith(table()), ("docs/composition.md's table differs from jaxrl.config."
                                    "composition.table(): regenerate it (the page says how)")


def test_every_cell_is_covered_and_every_refusal_names_what_to_use():
    assert len(cells()) == 4 * 2 * 2 * 2 * 2 * 2
    for cell in cells():
        why = refusal(cell)
        if why is not None:
            assert "use " in why or "must be" in why, (cell.name, why)


@pytest.mark.process
@pytest.mark.parametrize("cell", ONE_PROCESS, ids=lambda c: c.name)
def test_a_cell_runs_three_steps_or_is_refused(cell, tmp_path):
    argv = [str(Path(sys.executable).parent / "jaxrl"), "train",
            str(ROOT / "configs" / config_name(cell)), f"train.run_dir={tmp_path / 'run'}",
            *overrides(cell), *QUIET]
    env = dict(os.environ, PYTHONPATH=str(ROOT),  # this tree's jaxrl, whatever is installed
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    why = refusal(cell)
    if why is not None:
        assert result.returncode == 2, (cell.name, result.stderr[-2000:])
        assert " ".join(why.split()) in " ".join(result.stderr.split()), cell.name
        return
    assert result.returncode == 0, (cell.name, result.stderr[-3000:])
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
