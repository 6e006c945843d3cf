"""`benchmarks/async_model.py`: its predictions match ones worked out by hand, N = 1 has no
split, and the CLI prints a table or parseable JSON lines."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "async_model.py"

_spec = importlib.util.spec_from_file_location("async_model", SCRIPT)
am = importlib.util.module_from_spec(_spec)
sys.modules["async_model"] = am
_spec.loader.exec_module(am)

KEYS = {"N", "k", "r", "T_sync", "T_async", "S", "speedup"}


def test_defaults_are_the_readme_h200_numbers():
    assert (am.GENERATE_S, am.TRAIN_S, am.MEASURED_DEVICES) == (2.159, 2.949, 1)
    assert am.WEIGHT_BYTES == 2 * 1_543_714_304 == 3_087_428_608
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert "2,159 ms / 2,949 ms" in readme and "1,543,714,304 parameters" in readme


def test_phase_time_scaling():
    assert am.phase_time(8.0, 4, n0=2, exponent=1.0) == pytest.approx(4.0)
    assert am.phase_time(8.0, 4, n0=1, exponent=0.5) == pytest.approx(4.0)
    assert am.phase_time(8.0, 64, n0=1, exponent=0.0) == pytest.approx(8.0)


def test_no_scaling_balanced_two_devices():
    # e = 0: each phase takes 1 s on any device count; W = 0. sync = 1 + 1 = 2.
    assert am.sync_time(1.0, 1.0, 2, exponent=0.0) == pytest.approx(2.0)
    # k >= 1: max(1 + 0, 1) = 1 -> speedup 2; k = 0: 1 + 0 + 1 = 2 -> speedup 1.
    rows = am.predict(1.0, 1.0, 0, [2], [0, 1, 2], exponent=0.0)
    assert [(r["k"], r["r"]) for r in rows] == [(0, 1), (1, 1), (2, 1)]
    assert [r["T_async"] for r in rows] == pytest.approx([2.0, 1.0, 1.0])
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 2.0, 2.0])
    assert all(r["S"] == 0 for r in rows)


def test_linear_scaling_balanced_two_devices_gains_nothing():
    # e = 1, N0 = 1: sync = 1/2 + 1/2 = 1; async r = 1: max(1, 1) = 1 -> speedup 1.
    (row,) = am.predict(1.0, 1.0, 0, [2], [1], exponent=1.0)
    assert (row["r"], row["T_sync"], row["T_async"]) == (1, pytest.approx(1.0),
                                                         pytest.approx(1.0))
    assert row["speedup"] == pytest.approx(1.0)


def test_weight_sync_by_hand():
    # N = 4 (one node, 450e9 B/s), W = 9e9: r = 2 -> 9e9 / (450e9 * 2) = 0.01 s,
    # r = 1 or 3 -> 9e9 / 450e9 = 0.02 s.
    assert am.link_bandwidth(4) == 450e9 and am.link_bandwidth(8) == 450e9
    assert am.link_bandwidth(16) == 50e9
    assert am.weight_sync_time(9e9, 4, 2, 450e9) == pytest.approx(0.01)
    assert am.weight_sync_time(9e9, 4, 3, 450e9) == pytest.approx(0.02)
    # N = 16 (inter-node, 50e9 B/s), W = 10e9, r = 4: 10e9 / (50e9 * 4) = 0.05 s.
    assert am.async_time(1.0, 1.0, 10e9, 16, 4, 1, exponent=0.0) == (
        pytest.approx(1.05), pytest.approx(0.05))

    # T_g = 3, T_t = 1 on one device, e = 1, N = 4, W = 9e9; sync = 3/4 + 1/4 = 1.
    # k = 1: r=1 max(3.02, 1/3) = 3.02, r=2 max(1.51, 0.5) = 1.51, r=3 max(1.02, 1) = 1.02.
    assert am.best_split(3.0, 1.0, 9e9, 4, 1) == (3, pytest.approx(1.02), pytest.approx(0.02))
    # k = 0: r=1 3 + .02 + 1/3, r=2 1.5 + .01 + .5 = 2.01, r=3 1 + .02 + 1 = 2.02.
    assert am.best_split(3.0, 1.0, 9e9, 4, 0) == (2, pytest.approx(2.01), pytest.approx(0.01))
    k1, k0 = am.predict(3.0, 1.0, 9e9, [4], [1, 0])
    assert k1["T_sync"] == pytest.approx(1.0) and k1["speedup"] == pytest.approx(1 / 1.02)
    assert k0["speedup"] == pytest.approx(1 / 2.01)


def test_one_device_cannot_split(capsys):
    assert am.best_split(1.0, 1.0, 0, 1, 1) is None
    with pytest.raises(ValueError):
        am.async_time(1.0, 1.0, 0, 1, 1, 1)
    (row,) = am.predict(2.0, 3.0, 0, [1], [1])
    assert row["T_sync"] == pytest.approx(5.0)
    assert row["r"] is row["T_async"] is row["S"] is row["speedup"] is None

    assert am.main(["--devices", "1", "--staleness", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last[:3] == ["1", "1", "n/a"] and last[4:] == ["n/a"] * 3


def test_cli_json_defaults(capsys):
    assert am.main(["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["N"], r["k"]) for r in rows] == [(n, k) for n in (1, 8, 64) for k in (0, 1, 2)]
    assert all(set(r) == KEYS for r in rows)
    assert rows[0]["speedup"] is None and all(r["speedup"] > 0 for r in rows[3:])


def test_cli_phase_times_file(tmp_path, capsys):
    path = tmp_path / "phases.json"
    path.write_text(json.dumps({"generate_s": 1.0, "train_s": 1.0, "devices": 1,
                                "weight_bytes": 0}))
    argv = ["--phase-times", str(path), "--scaling-exponent", "0", "--devices", "2",
            "--staleness", "0,1"]
    assert am.main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(set(r) == KEYS for r in rows)
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 2.0])

    assert am.main(argv) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "2.000" in out and "1.000" in out
