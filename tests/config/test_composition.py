"""The composition matrix (`jaxrl.config.composition`): every combination of mode x turns x
advantage x params x arch x processes either trains 3 steps or is refused when it is planned,
and docs/composition.md shows the same table the code computes.

Here (fast tier): the docs' table is the computed one, every refusal names what to use, and
every refused one-process cell is refused by `jaxrl train` itself (in process: it stops at
planning, before the policy's weights load and the prompts are tokenized), with exit status 2
and its message. The cells that run,
and the two-process cells, run as `jaxrl` processes in tests/config/test_composition_runs.py
(process tier), one run per distinct program: its grouping is checked here.
"""

from pathlib import Path

import pytest

from jaxrl.cli import main
from jaxrl.config.composition import cells, config_name, overrides, refusal, table

ROOT = Path(__file__).resolve().parents[2]
REFUSED_ONE_PROCESS = [c for c in cells() if c.processes == 1 and refusal(c) is not None]


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


@pytest.mark.parametrize("cell", REFUSED_ONE_PROCESS, ids=lambda c: c.name)
def test_a_refused_one_process_cell_is_refused_by_jaxrl_train(cell, tmp_path, capsys):
    status = main(["train", str(ROOT / "configs" / config_name(cell)),
                   f"train.run_dir={tmp_path / 'run'}", "train.max_steps=3", *overrides(cell)])
    err = capsys.readouterr().err  # the run's console is stderr
    assert status == 2, (cell.name, err[-2000:])
    assert " ".join(refusal(cell).split()) in " ".join(err.split()), (cell.name, err[-2000:])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # refused when planned, before the run loads the weights ("policy: <type>, N parameters")
    # or tokenizes the prompts ("data: task ..."): a config error costs seconds, not a load
    assert " parameters (" not in err and "data: task" not in err, (cell.name, err[-2000:])


def test_the_runs_stand_for_every_cell_that_runs_once_two_processes_where_they_can():
    from tests.config.test_composition_runs import RUNS, program, programs

    groups = programs()
    stood_for = sorted(c.name for group in groups.values() for c in group)
    assert stood_for == sorted(c.name for c in cells() if refusal(c) is None)
    assert len(stood_for) == 56 and len(RUNS) == len(groups) == 28
    for key, group in groups.items():
        assert all(program(c) == key for c in group)
        # the one run has two processes wherever a cell of its program runs on two
        assert group[0].processes == max(c.processes for c in group), key
