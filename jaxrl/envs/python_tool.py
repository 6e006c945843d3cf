"""The python tool: runs the policy's code in a separate, limited Python process.

    {"code": "print(sum(range(10)))"}  ->  "45\\n"

Each call starts `sys.executable -I -B -u -c BOOTSTRAP LIMITS CODE` (isolated mode: no
PYTHON* variables, no user site, no cwd on sys.path; no .pyc writes; unbuffered, so what was
printed before a hang still comes back) with

    cwd      a fresh scratch directory (tempfile), removed after the call; HOME and TMPDIR too
    env      built from nothing (PATH, locale, one BLAS/OpenMP thread): no proxies, tokens or
             credentials of the trainer's environment reach the code
    session  its own process group, killed as a whole at the end of every call
    stdin    /dev/null; stdout and stderr merged into one pipe, read up to max_output_bytes

The bootstrap, in the child before the code runs, sets rlimits (RLIMIT_AS: memory_mb,
RLIMIT_CPU: the time limit + 1 s, RLIMIT_FSIZE: max_file_mb, RLIMIT_NPROC: 0 (no new processes
or threads; root is exempt), RLIMIT_CORE: 0) and installs an audit hook (`sys.addaudithook`,
which the audited code cannot remove) that refuses, with a PermissionError the code sees:

    open for writing, os.remove/rename/mkdir/rmdir/chmod/link/...   outside the scratch dir
    socket.*                                                       (no network)
    subprocess.Popen, os.system, os.exec*, os.spawn*, os.posix_spawn, os.fork, os.kill, ...

The rlimits are set in the child rather than in `preexec_fn`: preexec_fn is unsafe when the
parent has threads (environments run in worker threads, next to JAX's), and without it
CPython starts the child with vfork, cheap even from a trainer with a large address space.

This is a guard against a policy's *mistakes* (a runaway loop, a huge allocation, writing over
files, a stray network call), not a security boundary against an adversary: audit hooks are
bypassed by ctypes or a C extension, and reads are not restricted. Process isolation, the
rlimits and the killed process group bound the damage of what gets past; run untrusted code in
a container or VM.

Every failure is an error result with a short message, never an exception or a stuck call:

    wall time over timeout_s (sleep, a loop)   timed_out=True   "error: timed out after 2 s"
    CPU time over the limit (SIGXCPU)          timed_out=True
    output over max_output_bytes               the first bytes + "[output truncated ...]"
    exception, MemoryError, non-zero exit      the traceback / output
    killed by a signal (os.abort, segfault)    "error: the process was killed by SIGABRT"

Overhead: one call of `print(1+1)` took 36 ms at best and 50-90 ms typically (median of 30)
on the shared 2-core VM it was measured on, almost all of it interpreter start-up with
site-packages (`python -I -c pass` alone: 26 ms there); tests/envs/test_python_tool.py prints
it. The tool suits tens of calls per second per core, not thousands. Calls from several
threads run concurrently (one child each).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from jaxrl.envs.tools import ToolResult, string_argument

# Runs in the child (module docstring). Its names are not in the code's globals.
_BOOTSTRAP = r"""
import json, os, resource, signal, sys, traceback
_limits = json.loads(sys.argv[1])
_code = sys.argv[2]
sys.argv = ["<code>"]
for _name, _value in _limits.items():
    try:
        resource.setrlimit(getattr(resource, _name), (_value, _value))
    except (ValueError, OSError):
        pass
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises OSError instead


def _install_guard():
    scratch = os.path.realpath(os.getcwd())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    # path-changing events: the positions of their path arguments and of their dir_fd.
    path_events = {"os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2),
                   "os.rename": ((0, 1), 2), "os.link": ((0, 1), 2), "os.symlink": ((1,), 2),
                   "os.chmod": ((0,), 2), "os.chown": ((0,), 3), "os.truncate": ((0,), None),
                   "os.utime": ((0,), 3), "os.mkfifo": ((0,), 2), "os.mknod": ((0,), 3),
                   "shutil.rmtree": ((0,), 1)}
    no_processes = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn",
                    "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
                    "signal.pthread_kill", "os.startfile")

    def inside(path, dir_fd=None):
        if isinstance(path, int):  # an open file descriptor: its file was opened under the hook
            return True
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = os.path.realpath(path)
        return path == scratch or path.startswith(scratch + os.sep)

    def refuse(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                bool((flags or 0) & write_flags)
            if writing and path is not None and not inside(path):
                refuse(f"writing {os.fsdecode(path)!r} outside the scratch directory")
        elif event.startswith("socket."):
            refuse(f"network access ({event})")
        elif event.startswith(no_processes):
            refuse(f"starting or signalling processes ({event})")
        elif event in path_events:
            positions, dir_fd_at = path_events[event]
            dir_fd = args[dir_fd_at] if dir_fd_at is not None and len(args) > dir_fd_at else None
            for i in positions:
                if not inside(args[i], dir_fd):
                    refuse(f"{event} of {os.fsdecode(args[i])!r} outside the scratch directory")

    sys.addaudithook(hook)


_install_guard()
del _install_guard, _limits, _name, _value
try:
    exec(compile(_code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _e:
    # The traceback without the frames of this bootstrap and its hook (file "<string>").
    _report = traceback.TracebackException(type(_e), _e, _e.__traceback__)
    _report.stack = traceback.StackSummary.from_list(
        [f for f in _report.stack if f.filename != "<string>"])
    print("".join(_report.format()), end="", file=sys.stderr)
    sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class PythonTool:
    """Runs Python code in a limited child process (module docstring); one argument, "code"."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_output_bytes: int = 4096
    max_file_mb: int = 16
    max_code_chars: int = 20_000
    name: str = "python"
    description: str = ("Runs a Python 3 program and returns what it prints (stdout and "
                        "stderr). No network; files only in the current directory.")
    argument: str = "code"

    def __post_init__(self):
        for field in ("timeout_s", "memory_mb", "max_output_bytes", "max_file_mb",
                      "max_code_chars"):
            if not getattr(self, field) > 0:
                raise ValueError(f"PythonTool.{field} must be > 0, got {getattr(self, field)}")

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        start = time.perf_counter()
        code = string_argument(arguments, self.argument)
        if isinstance(code, ToolResult):
            return code
        if len(code) > self.max_code_chars:
            return ToolResult(f"error: the code is longer than {self.max_code_chars} characters",
                              error=True)
        if "\0" in code:
            return ToolResult("error: the code contains a NUL character", error=True)
        scratch = tempfile.mkdtemp(prefix="jaxrl-python-")
        try:
            result = self._run(code, scratch)
        except OSError as e:  # the child could not start (out of memory or processes)
            result = ToolResult(f"error: could not start Python: {e}", error=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return dataclasses.replace(result, latency_s=time.perf_counter() - start)

    def _rlimits(self) -> dict[str, int]:
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": math.ceil(self.timeout_s) + 1,
                "RLIMIT_FSIZE": self.max_file_mb << 20, "RLIMIT_NPROC": 0, "RLIMIT_CORE": 0}

    def _run(self, code: str, scratch: str) -> ToolResult:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-u", "-c", _BOOTSTRAP, json.dumps(self._rlimits()),
             code],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=scratch, env=env, start_new_session=True)
        try:
            output, stopped = _collect(proc, time.monotonic() + self.timeout_s,
                                       self.max_output_bytes)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone: it exited
            proc.wait()
            proc.stdout.close()
        text = output.decode("utf-8", errors="replace")
        if stopped == "timeout":
            return ToolResult(_then(text, f"error: timed out after {self.timeout_s:g} s"),
                              error=True, timed_out=True)
        if stopped == "output":
            return ToolResult(f"{text}\n[output truncated at {self.max_output_bytes} bytes; the "
                              f"process was stopped]", error=True)
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode)
            if sig == signal.SIGXCPU:
                return ToolResult(_then(text, "error: CPU time limit exceeded"), error=True,
                                  timed_out=True)
            return ToolResult(_then(text, f"error: the process was killed by {sig.name}"),
                              error=True)
        if proc.returncode > 0:
            return ToolResult(_then(text, f"error: exit status {proc.returncode}"), error=True)
        return ToolResult(text)


def _then(output: str, message: str) -> str:
    """The output, then the message on a line of its own."""
    return f"{output}\n{message}" if output and not output.endswith("\n") else output + message


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, str | None]:
    """Reads the child's output until it exits, `deadline` passes ("timeout") or more than
    `cap` bytes came ("output"); returns at most `cap` bytes and why it stopped early."""
    fd = proc.stdout.fileno()
    output = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(output), "timeout"
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            output += chunk
            if len(output) > cap:
                return bytes(output[:cap]), "output"
    try:  # the output closed: the process is exiting (or closed its stdout and went on)
        proc.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return bytes(output), "timeout"
    return bytes(output), None
