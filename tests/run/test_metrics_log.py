"""Metrics log: records (step first, floats, sorted keys), one flushed JSON line per step read
back before close, NaN kept, TensorBoard on or off, the reward plot, the summary table."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from jaxrl.run.metrics_log import (
    METRICS_FILE,
    MetricsLog,
    plot_rewards,
    read_metrics,
    summary_table,
    to_record,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_to_record_puts_step_first_then_sorted_float_values():
    record = to_record(np.int64(3), {"reward/mean": jnp.float32(0.5), "loss/policy": np.float64(2),
                                     "kl": 1, "reward/std": jnp.asarray(0.25)})
    assert list(record) == ["step", "kl", "loss/policy", "reward/mean", "reward/std"]
    assert record == {"step": 3, "kl": 1.0, "loss/policy": 2.0, "reward/mean": 0.5,
                      "reward/std": 0.25}
    assert type(record["step"]) is int
    assert all(type(v) is float for k, v in record.items() if k != "step")
    # No metrics: the record is the step alone.
    assert to_record(0, {}) == {"step": 0}


def test_to_record_rejects_a_non_scalar():
    with pytest.raises(TypeError):
        to_record(1, {"reward/mean": np.ones(2)})


def test_each_write_is_one_flushed_line_readable_before_close(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    assert log.path == tmp_path / METRICS_FILE
    first = to_record(0, {"reward/mean": 0.25, "loss/policy": -1.5})
    log.write(first)
    # Read while the log is still open: what a crash right now would leave on disk.
    assert read_metrics(log.path) == [first]
    second = to_record(1, {"reward/mean": 0.75, "loss/policy": 0.125})
    log.write(second)
    lines = log.path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [first, second]
    assert list(json.loads(lines[1])) == ["step", "loss/policy", "reward/mean"]
    assert log.records == [first, second]
    log.close()
    assert read_metrics(log.path) == [first, second]


def test_a_second_log_in_the_same_run_dir_is_refused(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write(to_record(0, {"reward/mean": 0.0}))
    with pytest.raises(FileExistsError):  # two runs never interleave their metrics
        MetricsLog(tmp_path, tensorboard=False)
    log.close()
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 0, "reward/mean": 0.0}]


def test_nan_and_inf_survive_the_round_trip(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write(to_record(5, {"loss/policy": jnp.float32(jnp.nan), "grad/norm": np.inf,
                            "reward/mean": 0.5}))
    log.close()
    (record,) = read_metrics(tmp_path / METRICS_FILE)
    assert math.isnan(record["loss/policy"])
    assert record["grad/norm"] == math.inf
    assert record["reward/mean"] == 0.5 and record["step"] == 5


def test_without_tensorboard_no_tensorboard_dir(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write(to_record(0, {"reward/mean": 1.0}))
    log.write_scalars(0, {"eval/exact_match": 0.5})  # a no-op without TensorBoard
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]


def test_tensorboard_gets_an_events_file(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True)
    log.write(to_record(0, {"reward/mean": 1.0}))
    log.write_scalars(0, {"eval/exact_match": 0.5})
    log.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 0, "reward/mean": 1.0}]


@pytest.mark.parametrize("target", [None, 0.9])
@pytest.mark.parametrize("steps", [3, 120])  # 120 steps: window 2 draws the moving average
def test_plot_rewards_writes_a_png(tmp_path, target, steps):
    records = [{"step": s, "reward/mean": s / steps} for s in range(steps)]
    path = plot_rewards(records, tmp_path / "reward.png", title="addition", target=target)
    assert path == tmp_path / "reward.png"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_summary_table_renders_every_entry():
    summary = {"steps": 200, "final reward/mean": 0.987654, "loss": math.nan,
               "run dir": "runs/addition", "exact match": 1.0}
    console = Console(record=True, width=100)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "run summary" in text
    for name in summary:
        assert name in text
    # Floats with 4 significant digits; non-finite and non-floats as str().
    for shown in ("200", "0.9877", "nan", "runs/addition", " 1 "):
        assert shown in text
    assert "0.987654" not in text


def test_a_closed_log_refuses_writes(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True)
    log.write(to_record(0, {"reward/mean": 1.0}))
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.write_scalars(5, {"eval/exact_match": 0.5})
    with pytest.raises(ValueError, match="closed"):
        log.write(to_record(1, {"reward/mean": 1.0}))
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents*"))) == 1


def test_a_metric_called_step_is_refused():
    with pytest.raises(ValueError, match="'step'"):
        to_record(3, {"step": 1.0})


def test_a_resumed_log_keeps_the_steps_before_the_checkpoint_and_drops_a_torn_line(tmp_path):
    lines = [json.dumps({"step": i, "reward/mean": i / 10}) for i in range(5)]
    # What a SIGKILL mid-write leaves: five whole records, then half of a sixth.
    (tmp_path / METRICS_FILE).write_text("\n".join(lines) + '\n{"step": 5, "rew')
    log = MetricsLog(tmp_path, tensorboard=True, resume_at=3)
    assert [r["step"] for r in log.records] == [0, 1, 2]
    log.write({"step": 3, "reward/mean": 0.5})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [0, 1, 2, 3]
    assert read_metrics(tmp_path / METRICS_FILE)[3]["reward/mean"] == 0.5
    # Without resume_at an existing metrics file is never appended to.
    with pytest.raises(FileExistsError):
        MetricsLog(tmp_path, tensorboard=False)
