"""The python tool: normal runs, and every hostile case an error result within a time bound.

Each case also asserts the call returned within a bound: a hang or a flood must not hold up
the rollout. The bounds are loose (a 2-core CI machine under load) but far below what an
unguarded case would take (forever, or seconds of output).
"""

import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxrl.envs.python_tool import PythonTool

LIMIT_S = 1.5
TOOL = PythonTool(timeout_s=LIMIT_S, memory_mb=256, max_output_bytes=4096)
FAST_S = 5.0  # a call that does not hit the time limit returns well within this


def run(code, tool=TOOL):
    start = time.monotonic()
    result = tool({"code": code})
    return result, time.monotonic() - start


def test_normal_output_and_latency():
    result, _ = run("print(1 + 1)")
    assert (result.text, result.error, result.timed_out) == ("2\n", False, False)
    latencies = [run("print(1 + 1)")[0].latency_s for _ in range(5)]
    print(f"python tool print(1+1): median {statistics.median(latencies) * 1e3:.0f} ms")
    assert statistics.median(latencies) < 1.0


def test_concurrent_calls_from_threads():
    codes = [f"print({i} * {i})" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda code: TOOL({"code": code}), codes))
    assert [r.text for r in results] == ["0\n", "1\n", "4\n", "9\n"]
    assert not any(r.error for r in results)


def test_scratch_directory_is_the_cwd_writable_and_removed():
    result, _ = run("import os\nopen('a.txt', 'w').write('hi')\n"
                    "print(open('a.txt').read(), os.getcwd())")
    assert not result.error, result.text
    text, cwd = result.text.split()
    assert text == "hi" and os.path.basename(cwd).startswith("jaxrl-python-")
    assert not os.path.exists(cwd)


def test_environment_has_no_proxies_or_credentials(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    monkeypatch.setenv("HF_TOKEN", "secret")
    result, _ = run("import os; print(sorted(os.environ))")
    assert "PROXY" not in result.text and "TOKEN" not in result.text
    assert "'PATH'" in result.text


@pytest.mark.parametrize("code", ["import time\nprint('started')\ntime.sleep(60)",
                                  "while True:\n    pass",
                                  "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)"])
def test_hang_times_out_within_the_limit(code):
    result, elapsed = run(code)
    assert result.error and result.timed_out
    assert result.text.endswith(f"error: timed out after {LIMIT_S:g} s")
    assert LIMIT_S <= elapsed < LIMIT_S + 3.0
    if "started" in code:  # printed before the hang: unbuffered, so it comes back
        assert result.text == f"started\nerror: timed out after {LIMIT_S:g} s"


@pytest.mark.parametrize("code, signal_name", [("import os; os.abort()", "SIGABRT"),
                                               ("import ctypes; ctypes.string_at(0)", "SIGSEGV")])
def test_crash_is_an_error(code, signal_name):
    result, elapsed = run(code)
    assert result.error and not result.timed_out
    assert result.text == f"error: the process was killed by {signal_name}"
    assert elapsed < FAST_S


@pytest.mark.parametrize("code", ["x = bytearray(1 << 30)", "x = [0] * (1 << 28)"])
def test_memory_error_under_the_memory_limit(code):
    result, elapsed = run(code)
    assert result.error and not result.timed_out
    assert "MemoryError" in result.text and result.text.endswith("error: exit status 1")
    assert elapsed < FAST_S


def test_megabytes_of_prints_are_truncated():
    result, elapsed = run("for _ in range(100_000):\n    print('x' * 50)")  # 5.1 MB
    assert result.error and not result.timed_out
    assert result.text.startswith("x" * 50 + "\n")
    assert result.text.endswith("\n[output truncated at 4096 bytes; the process was stopped]")
    assert len(result.text) < 4096 + 100
    assert elapsed < FAST_S


def test_writing_outside_the_scratch_directory_is_refused(tmp_path):
    absolute = tmp_path / "x"
    relative = f"jaxrl-test-{uuid.uuid4().hex}"  # ../NAME: next to the scratch directory
    for path in (str(absolute), f"../{relative}"):
        result, elapsed = run(f"open({path!r}, 'w').write('hi')")
        assert result.error and "PermissionError: sandbox: writing" in result.text
        assert elapsed < FAST_S
    assert not absolute.exists()
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), relative))


def test_removing_and_renaming_outside_the_scratch_directory_are_refused(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("data")
    for code in (f"import os; os.remove({str(keep)!r})",
                 f"import os; os.rename({str(keep)!r}, 'stolen.txt')",
                 f"import shutil; shutil.rmtree({str(tmp_path)!r})"):
        result, elapsed = run(code)
        assert result.error and "PermissionError: sandbox:" in result.text, result.text
        assert elapsed < FAST_S
    assert keep.read_text() == "data"


@pytest.mark.parametrize("code, event", [
    ("import socket; socket.socket()", "socket.__new__"),
    ("import socket; socket.create_connection(('localhost', 80))", "socket.getaddrinfo"),
])
def test_socket_is_refused(code, event):
    result, elapsed = run(code)
    assert result.error
    assert f"PermissionError: sandbox: network access ({event}) is not allowed" in result.text
    assert elapsed < FAST_S


@pytest.mark.parametrize("code, event", [
    ("import subprocess; subprocess.run(['true'])", "subprocess.Popen"),
    ("import os; os.system('true')", "os.system"),
    ("import os; os.fork()", "os.fork"),
    ("import os; os.execv('/bin/true', ['true'])", "os.exec"),
    ("import os; os.kill(os.getppid(), 9)", "os.kill"),
])
def test_processes_are_refused(code, event):
    result, elapsed = run(code)
    assert result.error
    assert f"PermissionError: sandbox: starting or signalling processes ({event}" in result.text
    assert elapsed < FAST_S


def test_output_without_a_final_newline_before_the_error():
    result, _ = run("import time\nprint('partial', end='')\ntime.sleep(60)")
    assert result.timed_out and result.text == f"partial\nerror: timed out after {LIMIT_S:g} s"


def test_nonzero_exit_and_exceptions():
    result, _ = run("import sys\nprint('partial', end='')\nsys.exit(3)")
    assert (result.text, result.error) == ("partial\nerror: exit status 3", True)
    result, _ = run("1 / 0")
    assert result.error and result.text == (
        'Traceback (most recent call last):\n  File "<code>", line 1, in <module>\n'
        "ZeroDivisionError: division by zero\nerror: exit status 1")


def test_file_size_limit():
    result, elapsed = run("open('big', 'wb').write(b'x' * (2 << 20))",
                          PythonTool(timeout_s=LIMIT_S, max_file_mb=1))
    assert result.error and "File too large" in result.text
    assert elapsed < FAST_S


def test_code_limits_and_bad_arguments():
    assert PythonTool(max_code_chars=10)({"code": "print('a long line')"}).error
    assert "must be a string" in TOOL({"code": None}).text
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        PythonTool(timeout_s=0)
