"""The suite's crash reports (tests/crash_report.py): a dead worker's fault-handler dump in its
test's report, and one rerun after an abort only."""

import os
import sys

from tests import crash_report


def test_the_newest_dump_of_the_worker_is_described(tmp_path, monkeypatch):
    monkeypatch.setenv(crash_report.ENV, str(tmp_path))
    assert "no fault-handler output from gw3" in crash_report.describe("gw3")
    (tmp_path / "gw3-10.txt").write_text("Fatal Python error: Segmentation fault\nold\n")
    (tmp_path / "gw3-11.txt").write_text("")  # its replacement, alive: nothing written
    (tmp_path / "gw4-12.txt").write_text("another worker's\n")
    os.utime(tmp_path / "gw3-10.txt", (1, 1))
    (tmp_path / "gw3-13.txt").write_text("Fatal Python error: Aborted\n" + "line\n" * 200)
    text = crash_report.describe("gw3", max_lines=5)
    assert text.splitlines()[0].endswith("gw3-13.txt):") and len(text.splitlines()) == 6
    assert "another" not in text and "old" not in text


def test_a_worker_enables_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv(crash_report.ENV, str(tmp_path))
    import faulthandler
    before = list(crash_report._open_files)  # this worker's own file, under xdist
    try:
        path = crash_report.enable("gw9")
        assert path == tmp_path / f"gw9-{os.getpid()}.txt" and path.exists()
        faulthandler.dump_traceback(file=crash_report._open_files[-1])
        crash_report._open_files[-1].flush()
        assert "test_a_worker_enables_its_own_file" in crash_report.describe("gw9")
    finally:  # the process's fault handler as it was
        crash_report._open_files[len(before):] = []
        if before:
            faulthandler.enable(file=before[-1], all_threads=True)
        else:
            faulthandler.enable(file=sys.stderr, all_threads=True)


def test_only_an_abort_reruns_and_only_once():
    abort = "gw1's fault handler:\nFatal Python error: Aborted\n\nThread 0x1 ..."
    segfault = "gw1's fault handler:\nFatal Python error: Segmentation fault\n"
    assert not crash_report.rerun_once("t.py::segv", segfault)
    assert crash_report.rerun_once("t.py::abort", abort)
    assert not crash_report.rerun_once("t.py::abort", abort)
