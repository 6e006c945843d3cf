"""Progress lines: means over the steps since the previous line, by hand and on the steps of a
recorded quickstart run (`data/quickstart_steps.jsonl`, see `make_recorded` below)."""

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from jaxrl.run import progress

RECORDED = Path(__file__).parent / "data" / "quickstart_steps.jsonl"
KEYS = ("step", "time/step_s", "perf/tokens_per_s", "perf/mfu", "reward/mean")


def make_recorded(metrics_jsonl: Path, steps: int = 500) -> None:
    """Writes RECORDED from a quickstart run's metrics.jsonl (its first `steps` steps; how it
    was made: `jaxrl train configs/quickstart.yaml train.max_steps=500 train.run_dir=R` on
    one CPU device, then make_recorded(R / "metrics.jsonl"))."""
    lines = metrics_jsonl.read_text().splitlines()[:steps]
    RECORDED.write_text("".join(
        json.dumps({k: json.loads(line)[k] for k in KEYS}) + "\n" for line in lines))


def test_means_by_hand():
    records = [{"time/step_s": 0.1, "perf/tokens_per_s": 1000.0, "perf/mfu": 0.2,
                "reward/mean": 0.0},
               {"time/step_s": 0.3, "perf/tokens_per_s": 100.0, "perf/mfu": 0.1,
                "reward/mean": 1.0}]
    mean = progress.means(records)
    # 100 + 30 tokens in 0.4 s; FLOPs 0.02 + 0.03 (in units of peak x 1 s) in 0.4 s.
    assert mean == pytest.approx({"time/step_s": 0.2, "perf/tokens_per_s": 325.0,
                                  "perf/mfu": 0.125, "reward/mean": 0.5})
    assert progress.status(records) == "reward 0.500  200 ms/step  325 tok/s  MFU 12.5%"
    without_mfu = [{k: v for k, v in r.items() if k != "perf/mfu"} for r in records]
    assert "MFU" not in progress.status(without_mfu)


def test_an_mfu_above_one_is_not_shown_as_a_number():
    record = {"time/step_s": 0.1, "perf/tokens_per_s": 10.0, "perf/mfu": 1.3,
              "reward/mean": 0.5}
    assert progress.status([record]).endswith("MFU ? (peak too low)")


def _lines(records, print_every):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with progress.ProgressBar(console, len(records), 0, print_every) as bar:
        for record in records:
            bar.add(record)
    return out.getvalue().splitlines()


def test_lines_come_after_step_1_then_every_n_steps_and_at_the_end():
    records = [{"step": i, "time/step_s": 0.1, "perf/tokens_per_s": 1.0,
                "reward/mean": 0.0} for i in range(25)]
    lines = _lines(records, 10)
    assert lines[0].startswith(progress.HEADER)
    assert [line.split()[1] for line in lines[1:]] == ["1/25", "10/25", "20/25", "25/25"]


def test_on_a_recorded_quickstart_the_line_is_within_25_percent_of_the_median_step():
    records = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    assert len(records) == 500
    lines = _lines(records, 100)[1:]
    bounds = [0, 1, 100, 200, 300, 400, 500]  # the steps each line covers
    assert len(lines) == len(bounds) - 1
    for line, start, end in zip(lines, bounds[:-1], bounds[1:], strict=True):
        shown_ms = float(re.search(r"(\d+) ms/step", line).group(1))
        median_ms = 1e3 * np.median([r["time/step_s"] for r in records[start:end]])
        assert abs(shown_ms - median_ms) <= 0.25 * median_ms, (line, median_ms)
