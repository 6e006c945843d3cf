"""The python tool: normal runs, and every hostile case an error result within a time bound.

Each case also asserts the call returned within a bound: a hang or a flood must not hold up
the rollout. The bounds are loose (a 2-core CI machine under load) but far below what an
unguarded case would take (forever, or seconds of output).

The escapes (the trainer's environment, memory and files, processes that outlive the call,
signals to the trainer) run in the default OS sandbox (bubblewrap; `.ci/run` installs it):
each gets an error result within the time limit, leaves the trainer (a stand-in process
holding a secret in its environment) and its files as they were, and no process behind.
"""

import functools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxrl.envs import sandbox
from jaxrl.envs.python_tool import GUARD_WARNING, PythonTool
from jaxrl.envs.sandbox import SCRATCH, SandboxUnavailable

LIMIT_S = 1.5  # the time limit of the tests that hit it
# The limit of the calls that must finish: on a loaded 2-core CI host, starting bubblewrap and
# Python took more than LIMIT_S (three tests timed out beside a coverage run, 2026-12-06).
ROOMY_S = 60.0


@functools.cache
def sandboxed(timeout_s: float = ROOMY_S) -> PythonTool:
    """The tool in its OS sandbox, made at first use (not at import: without bubblewrap the
    module is still collected, and each test that needs it fails saying how to install it)."""
    return PythonTool(timeout_s=timeout_s, memory_mb=256, max_output_bytes=4096)


FAST_S = 5.0  # a call that does not hit the time limit returns well within this


def guard_tool(**limits):
    """The tool without its OS sandbox (its warning expected and silenced)."""
    with pytest.warns(UserWarning, match="not a security boundary"):
        return PythonTool(timeout_s=ROOMY_S, memory_mb=256, sandbox="guard", **limits)


def run(code, tool=None):
    tool = tool or sandboxed()
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
        results = list(pool.map(lambda code: sandboxed()({"code": code}), codes))
    assert [r.text for r in results] == ["0\n", "1\n", "4\n", "9\n"]
    assert not any(r.error for r in results)


def test_scratch_folder_is_the_cwd_writable_and_fresh_each_call():
    result, _ = run("import os\nopen('a.txt', 'w').write('hi')\n"
                    "print(open('a.txt').read(), os.getcwd(), os.environ['HOME'])")
    assert not result.error, result.text
    assert result.text.split() == ["hi", SCRATCH, SCRATCH]
    result, _ = run("import os; print(os.listdir('.'))")  # a new tmpfs: a.txt is gone
    assert result.text == "[]\n", result.text


def test_guard_scratch_directory_is_the_cwd_writable_and_removed():
    result, _ = run("import os\nopen('a.txt', 'w').write('hi')\n"
                    "print(open('a.txt').read(), os.getcwd())", guard_tool())
    assert not result.error, result.text
    text, cwd = result.text.split()
    assert text == "hi" and os.path.basename(cwd).startswith("jaxrl-python-")
    assert not os.path.exists(cwd)


HONEST = """import os, shutil
os.mkdir('d')
open('d/a.txt', 'w').write('x')
os.rename('d/a.txt', 'd/b.txt')
os.replace('d/b.txt', 'c.txt')
os.remove('c.txt')
os.rmdir('d')
os.makedirs('e/f')
open('e/f/g.txt', 'w').write('y')
shutil.rmtree('e')
print(sorted(os.listdir('.')))
"""


@pytest.mark.parametrize("kind", ["bwrap", "guard"])
def test_relative_mkdir_rename_remove_inside_the_scratch_folder_work(kind):
    result, _ = run(HONEST, sandboxed() if kind == "bwrap" else guard_tool())
    assert (result.text, result.error) == ("[]\n", False)


def test_scratch_folder_size_is_capped():
    tool = PythonTool(timeout_s=ROOMY_S, max_file_mb=64, max_scratch_mb=8)
    result, elapsed = run("for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))",
                          tool)
    assert result.error and "No space left on device" in result.text, result.text
    assert elapsed < FAST_S


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
    result, elapsed = run(code, sandboxed(LIMIT_S))
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
    result, _ = run("import time\nprint('partial', end='')\ntime.sleep(60)", sandboxed(LIMIT_S))
    assert result.timed_out and result.text == f"partial\nerror: timed out after {LIMIT_S:g} s"


def test_nonzero_exit_and_exceptions():
    result, _ = run("import sys\nprint('partial', end='')\nsys.exit(3)")
    assert (result.text, result.error) == ("partial\nerror: exit status 3", True)
    # bwrap's init reports a signal N as 128 + N; 200 names none, so it is a status
    assert run("import sys; sys.exit(200)")[0].text == "error: exit status 200"
    result, _ = run("1 / 0")
    assert result.error and result.text == (
        'Traceback (most recent call last):\n  File "<code>", line 1, in <module>\n'
        "ZeroDivisionError: division by zero\nerror: exit status 1")


def test_file_size_limit():
    result, elapsed = run("open('big', 'wb').write(b'x' * (2 << 20))",
                          PythonTool(timeout_s=ROOMY_S, max_file_mb=1))
    assert result.error and "File too large" in result.text
    assert elapsed < FAST_S


def test_code_limits_and_bad_arguments():
    assert PythonTool(max_code_chars=10)({"code": "print('a long line')"}).error
    assert "must be a string" in sandboxed()({"code": None}).text
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        PythonTool(timeout_s=0)


# ---------------------------------------------------------------- escapes, in the sandbox


@pytest.fixture
def trainer():
    """A stand-in for the trainer: a process with a secret token in its environment (as the
    trainer's would be, set in its parent at start). Yields (process, secret)."""
    secret = f"jaxrl-secret-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={**os.environ, "JAXRL_TEST_TOKEN": secret})
    try:
        yield proc, secret
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def files(tmp_path):
    """The trainer's files: a folder holding keep.txt (mode 0o600). Yields the folder; checks
    afterwards that it holds exactly that, unchanged."""
    keep = tmp_path / "keep.txt"
    keep.write_text("data")
    keep.chmod(0o600)
    yield tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "data" and keep.stat().st_mode & 0o777 == 0o600


def processes_with(marker: str) -> list[int]:
    """The pids of this machine's processes whose command line holds `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def escape(code: str) -> str:
    """Runs `code` (marked) in the sandbox and checks what every escape must give: an error
    result within the time limit, and no process of the call left; returns the text."""
    marker = f"jaxrl-escape-{uuid.uuid4().hex}"
    result, elapsed = run(f"{code}\n# {marker}", sandboxed(LIMIT_S))
    left = processes_with(marker)
    for pid in left:  # today's guard leaves them: clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert result.error, result.text
    assert elapsed < LIMIT_S + 3.0
    assert not left, f"processes left after the call: {left}"
    return result.text


def test_the_trainers_environment_cannot_be_read(trainer):
    proc, secret = trainer
    text = escape(f"print(open('/proc/{proc.pid}/environ', 'rb').read())")
    assert secret not in text and "No such file" in text, text
    escape(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")  # the tool's parent
    assert proc.poll() is None


def test_the_trainers_memory_cannot_be_opened_read_write(trainer):
    proc, _ = trainer
    text = escape(f"import os\nd = os.open('/proc/{proc.pid}', os.O_RDONLY)\n"
                  f"fd = os.open('mem', os.O_RDWR, dir_fd=d)\nprint('opened')")
    assert "opened" not in text, text
    assert proc.poll() is None


@pytest.mark.parametrize("code", [
    # a new file, through the directory's descriptor
    "fd = os.open('planted.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=target)\n"
    "os.write(fd, b'x')",
    # a rename and a hard link from the scratch folder into the trainer's folder
    "open('mine.txt', 'w').write('x')\nhere = os.open('.', os.O_RDONLY)\n"
    "os.rename('mine.txt', 'planted.txt', src_dir_fd=here, dst_dir_fd=target)",
    "open('mine.txt', 'w').write('x')\nhere = os.open('.', os.O_RDONLY)\n"
    "os.link('mine.txt', 'planted.txt', src_dir_fd=here, dst_dir_fd=target)",
    # a mode change through a descriptor
    "fd = os.open('keep.txt', os.O_RDONLY, dir_fd=target)\nos.fchmod(fd, 0o777)",
], ids=["open-dir_fd", "rename-dst_dir_fd", "link-dst_dir_fd", "fchmod"])
def test_the_trainers_files_stay_untouched_through_descriptor_forms(files, code):
    escape(f"import os\ntarget = os.open({str(files)!r}, os.O_RDONLY)\n{code}\nprint('done')")


FORK_EXEC = """import _posixsubprocess, os
r, w = os.pipe()
args = ([b'/bin/sh', b'-c', b'sleep {seconds}'], [b'/bin/sh'], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, True, -1, -1, None, -1, -1, None)
try:
    pid = _posixsubprocess.fork_exec(*args, False)  # CPython 3.11, 3.12: allow_vfork
except TypeError:
    pid = _posixsubprocess.fork_exec(*args)
print('started', pid)
"""


def test_a_shell_started_in_its_own_session_does_not_outlive_the_call():
    seconds = f"600.{random.randrange(10**8):08d}"  # marks the shell and its sleep
    try:
        text = escape(FORK_EXEC.format(seconds=seconds))
        assert re.search(r"left \d process\(es\) running; they were killed", text), text
    finally:
        left = processes_with(seconds)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the code's shell outlived the call: {left}"


def test_the_trainer_cannot_be_signalled(trainer):
    proc, _ = trainer
    text = escape(f"import os, signal\nfd = os.pidfd_open({proc.pid})\n"
                  f"signal.pidfd_send_signal(fd, signal.SIGKILL)")
    assert "ProcessLookupError" in text, text
    time.sleep(0.2)
    assert proc.poll() is None, "the trainer was killed"


def test_the_code_sees_only_the_sandbox_processes_and_no_network():
    result, _ = run("import os, socket\n"
                    "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),"
                    " os.getuid(), socket.if_nameindex())")
    assert result.text == "[1, 2] 65534 [(1, 'lo')]\n", result.text


# ---------------------------------------------------------------- without the sandbox


def test_without_bwrap_the_tool_refuses_to_start_saying_how_to_install_it(monkeypatch,
                                                                          tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        PythonTool()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tool = PythonTool(sandbox="guard")
    assert [str(w.message) for w in caught] == [GUARD_WARNING]
    assert tool({"code": "print(6 * 7)"}).text == "42\n"


def test_a_bwrap_that_cannot_start_a_sandbox_is_named(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
        PythonTool()
    assert sandbox._probe(str(fake))  # cached per path: the real bwrap's stays


def test_guard_mode_keeps_its_refusals():
    result, _ = run("import os; os.system('true')", guard_tool())
    assert "PermissionError: sandbox: starting or signalling processes" in result.text
    result, _ = run("open('/tmp/x-jaxrl', 'w')", guard_tool())
    assert "PermissionError: sandbox: writing" in result.text
