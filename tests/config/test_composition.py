"""The composition matrix (`jaxrl.config.composition`): every combination of mode x turns x
advantage x params x arch x processes either trains 3 steps or is refused when it is planned,
and docs/composition.md shows the same table the code computes.

The one-process cells that run train here (fast tier: a tiny model, 3 steps, through
`jaxrl train` in process); the refused ones are refused by `jaxrl train` itself, with its
message and exit status 2.
"""

from pathlib import Path

import pytest

from jaxrl.cli import main
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


@pytest.mark.parametrize("cell", ONE_PROCESS, ids=lambda c: c.name)
def test_a_cell_runs_three_steps_or_is_refused(cell, tmp_path, capsys):
    argv = ["train", str(ROOT / "configs" / config_name(cell)),
            f"train.run_dir={tmp_path / 'run'}", *overrides(cell), *QUIET]
    why = refusal(cell)
    status = main(argv)
    if why is not None:
        assert status == 2 and why in capsys.readouterr().err, cell.name
        return
    assert status == 0, cell.name
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
