"""The python tool: runs the policy's code in a separate, limited Python process.

    {"code": "print(sum(range(10)))"}  ->  "45\\n"

Each call starts `sys.executable -I -B -u -c BOOTSTRAP OPTIONS CODE` (isolated mode: no
PYTHON* variables, no user site, no cwd on sys.path; no .pyc writes; unbuffered, so what was
printed before a hang still comes back) in an OS sandbox (`sandbox="bwrap"`, the default:
`jaxrl/envs/sandbox.py`: its own user, PID, network and mount namespaces, the system and the
interpreter read-only, a fresh size-capped tmpfs as the only writable folder) with

    cwd      the scratch folder (tmpfs, `max_scratch_mb`), gone after the call; HOME, TMPDIR too
    env      built from nothing (PATH, locale, one BLAS/OpenMP thread): no proxies, tokens or
             credentials of the trainer's environment reach the code
    session  its own session; at the end of every call the sandbox's first process is killed
             and the call waits until it is gone, so the kernel has ended every process the
             code started (its PID namespace); a call that returns left nothing running
    stdin    /dev/null; stdout and stderr merged into one pipe, read up to max_output_bytes

The bootstrap, in the child before the code runs, sets rlimits (RLIMIT_AS: memory_mb,
RLIMIT_CPU: the time limit + 1 s, RLIMIT_FSIZE: max_file_mb, RLIMIT_NPROC: 0 (no new processes
or threads for a non-root trainer; root is exempt), RLIMIT_CORE: 0) and installs an audit hook
(`sys.addaudithook`, which the audited code cannot remove) as a second layer that refuses,
with a PermissionError the code sees:

    open for writing, os.remove/rename/mkdir/rmdir/chmod/link/...   outside the scratch dir
    socket.*                                                       (no network)
    subprocess.Popen, os.system, os.exec*, os.spawn*, os.posix_spawn, os.fork, os.kill, ...

In the sandbox, code that leaves processes running when it ends gets an error result (they
are killed with the sandbox either way). The rlimits are set in the child rather than in
`preexec_fn`: preexec_fn is unsafe when the parent has threads (environments run in worker
threads, next to JAX's), and without it CPython starts the child with vfork, cheap even from
a trainer with a large address space.

`sandbox="guard"` runs the same child without the OS sandbox (a host temp folder as scratch,
killed by process group): the audit hook alone is no security boundary (ctypes, C extensions,
`dir_fd` forms, `_posixsubprocess` and reads of /proc get past it), so it warns; use it only
where bubblewrap cannot run and the policy's code is trusted.

Every failure is an error result with a short message, never an exception or a stuck call:

    wall time over timeout_s (sleep, a loop)   timed_out=True   "error: timed out after 2 s"
    CPU time over the limit (SIGXCPU)          timed_out=True
    output over max_output_bytes               the first bytes + "[output truncated ...]"
    exception, MemoryError, non-zero exit      the traceback / output
    killed by a signal (os.abort, segfault)    "error: the process was killed by SIGABRT"
                                               (in the sandbox an exit status 128 + N is
                                               read as signal N, as shells do)

Overhead: a call costs an interpreter's start-up (tens of ms, mostly site-packages) plus
the sandbox's few ms (benchmarks/README.md; tests/envs/test_python_tool.py prints it): the
tool suits tens of calls per second per core, not thousands. Calls from several threads run
concurrently (one child each).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

from jaxrl.envs.sandbox import SCRATCH, bwrap_argv, find_bwrap
from jaxrl.envs.tools import ToolResult, string_argument
from jaxrl.envs.tools_config import SandboxKind

# Runs in the child (module docstring). Its names are not in the code's globals.
_BOOTSTRAP = r"""
import json, os, resource, signal, sys, traceback
_options = json.loads(sys.argv[1])
_code = sys.argv[2]
sys.argv = ["<code>"]
for _name, _value in _options["rlimits"].items():
    try:
        resource.setrlimit(getattr(resource, _name), (_value, _value))
    except (ValueError, OSError):
        pass
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises OSError instead


def _install_guard():
    scratch = os.path.realpath(os.getcwd())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    # path-changing events: (position of a path argument, position of its dir_fd) pairs.
    path_events = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
                   "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
                   "os.symlink": ((1, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
                   "os.truncate": ((0, None),), "os.utime": ((0, 3),),
                   "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),), "shutil.rmtree": ((0, 1),)}
    no_processes = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn",
                    "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
                    "signal.pthread_kill", "os.startfile")

    def where(fd):
        return os.readlink(f"/proc/self/fd/{fd}")

    def inside(path, dir_fd=None):
        if isinstance(path, int):  # a descriptor (fchmod, ftruncate...): the file it opened
            try:
                path = where(path)
            except OSError:
                return True  # not a file descriptor: the call itself fails
        path = os.fsdecode(path)
        # dir_fd None or -1 (what os.mkdir & co. pass by default): relative to the cwd.
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
            path = os.path.join(where(dir_fd), path)
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
            for at, dir_fd_at in path_events[event]:
                dir_fd = args[dir_fd_at] if dir_fd_at is not None and len(args) > dir_fd_at \
                    else None
                if not inside(args[at], dir_fd):
                    what = args[at] if isinstance(args[at], int) else os.fsdecode(args[at])
                    refuse(f"{event} of {what!r} outside the scratch directory")

    sys.addaudithook(hook)


def _leftover():
    # In the sandbox /proc is its own: any process but its init (1) and this one that is
    # not a zombie was started by the code and would outlive it but for the sandbox.
    alive = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, os.getpid()):
            try:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] != "Z":
                        alive.append(int(name))
            except OSError:
                pass
    return alive


_install_guard()
_sandboxed = _options["sandboxed"]
del _install_guard, _options, _name, _value
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
if _sandboxed and _leftover():
    sys.stdout.flush()
    print(f"error: the code left {len(_leftover())} process(es) running; they were killed",
          file=sys.stderr)
    sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class PythonTool:
    """Runs Python code in a limited child process in an OS sandbox (module docstring); one
    argument, "code". Constructing it finds `bwrap` (SandboxUnavailable saying how to install
    it); `sandbox="guard"` runs without it, with a warning."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_output_bytes: int = 4096
    max_file_mb: int = 16
    max_code_chars: int = 20_000
    max_scratch_mb: int = 64  # the sandbox's scratch tmpfs (every file the code writes)
    sandbox: SandboxKind = "bwrap"
    name: str = "python"
    description: str = ("Runs a Python 3 program and returns what it prints (stdout and "
                        "stderr). No network; files only in the current directory.")
    argument: str = "code"
    _bwrap: str = dataclasses.field(default="", init=False, repr=False, compare=False)

    def __post_init__(self):
        for field in ("timeout_s", "memory_mb", "max_output_bytes", "max_file_mb",
                      "max_code_chars", "max_scratch_mb"):
            if not getattr(self, field) > 0:
                raise ValueError(f"PythonTool.{field} must be > 0, got {getattr(self, field)}")
        if self.sandbox == "bwrap":
            object.__setattr__(self, "_bwrap", find_bwrap())
        elif self.sandbox == "guard":
            warnings.warn(GUARD_WARNING, stacklevel=3)  # the caller of PythonTool(...)
        else:
            raise ValueError(f"PythonTool.sandbox must be 'bwrap' or 'guard', got "
                             f"{self.sandbox!r}")

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
        scratch = tempfile.mkdtemp(prefix="jaxrl-python-") if self.sandbox == "guard" else None
        try:
            result = self._run(code, scratch)
        except OSError as e:  # the child could not start (out of memory or processes)
            result = ToolResult(f"error: could not start Python: {e}", error=True)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return dataclasses.replace(result, latency_s=time.perf_counter() - start)

    def _rlimits(self) -> dict[str, int]:
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": math.ceil(self.timeout_s) + 1,
                "RLIMIT_FSIZE": self.max_file_mb << 20, "RLIMIT_NPROC": 0, "RLIMIT_CORE": 0}

    def _start(self, code: str, scratch: str | None) -> tuple[subprocess.Popen, int | None]:
        """The child, and a pidfd of the sandbox's first process (None: no sandbox, or it is
        gone already)."""
        home = scratch or SCRATCH
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        options = json.dumps({"rlimits": self._rlimits(), "sandboxed": scratch is None})
        python = [sys.executable, "-I", "-B", "-u", "-c", _BOOTSTRAP, options, code]
        pipes = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     start_new_session=True)
        if scratch is not None:
            return subprocess.Popen(python, cwd=scratch, env=env, **pipes), None
        info_r, info_w = os.pipe()
        try:
            argv = bwrap_argv(self._bwrap, scratch_bytes=self.max_scratch_mb << 20, env=env,
                              info_fd=info_w)
            proc = subprocess.Popen([*argv, *python], cwd="/", env={"PATH": env["PATH"]},
                                    pass_fds=(info_w,), **pipes)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
        with open(info_r, "rb") as info:  # bwrap writes it and closes it as the sandbox starts
            text = info.read()
        try:
            return proc, os.pidfd_open(json.loads(text)["child-pid"])
        except (ValueError, KeyError, ProcessLookupError):  # bwrap failed, or all is over
            return proc, None

    def _run(self, code: str, scratch: str | None) -> ToolResult:
        proc, sandbox = self._start(code, scratch)
        try:
            output, stopped = _collect(proc, time.monotonic() + self.timeout_s,
                                       self.max_output_bytes)
        finally:
            _stop(proc, sandbox)
        text = output.decode("utf-8", errors="replace")
        if stopped == "timeout":
            return ToolResult(_then(text, f"error: timed out after {self.timeout_s:g} s"),
                              error=True, timed_out=True)
        if stopped == "output":
            return ToolResult(f"{text}\n[output truncated at {self.max_output_bytes} bytes; the "
                              f"process was stopped]", error=True)
        sig = _signal(-proc.returncode if proc.returncode < 0 else
                      proc.returncode - 128 if scratch is None and proc.returncode > 128 else 0)
        if sig is not None:  # in the sandbox, bwrap's init exits with 128 + the signal
            if sig == signal.SIGXCPU:
                return ToolResult(_then(text, "error: CPU time limit exceeded"), error=True,
                                  timed_out=True)
            return ToolResult(_then(text, f"error: the process was killed by {sig.name}"),
                              error=True)
        if proc.returncode != 0:
            return ToolResult(_then(text, f"error: exit status {proc.returncode}"), error=True)
        return ToolResult(text)


GUARD_WARNING = ("the python tool runs without its OS sandbox (sandbox='guard', "
                 "data.tools.python_sandbox=guard): its in-process audit hook is not a "
                 "security boundary; code a policy writes can read the trainer's environment, "
                 "write outside its folder and leave processes running")


def _stop(proc: subprocess.Popen, sandbox: int | None) -> None:
    """Kills the child and everything it started, and returns once they are gone: the
    sandbox's first process (its PID namespace dies with it: the kernel kills the rest
    before the process counts as exited), else the child's process group."""
    if sandbox is not None:
        try:
            signal.pidfd_send_signal(sandbox, signal.SIGKILL)
            select.select([sandbox], [], [], 10.0)  # readable once it has exited
        except ProcessLookupError:
            pass  # exited already
        finally:
            os.close(sandbox)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone: it exited
    proc.wait()
    proc.stdout.close()


def _signal(number: int) -> signal.Signals | None:
    """The signal numbered `number`; None for 0 or a number that names none."""
    try:
        return signal.Signals(number) if number else None
    except ValueError:
        return None


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
