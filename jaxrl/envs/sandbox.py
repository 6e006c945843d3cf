"""The python tool's OS sandbox: bubblewrap (`bwrap`), one fresh sandbox per call.

    argv = bwrap_argv(bwrap, scratch_bytes=64 << 20, info_fd=w) + [sys.executable, ...]

Why an OS sandbox: the code a policy writes is optimised for reward, and an in-process guard
(a Python audit hook in the trainer's own user and PID namespace) has holes a policy finds:
reading `/proc/<trainer>/environ`, writing through `dir_fd` forms, `_posixsubprocess` and
`pidfd_send_signal` have no audit event. Peers run such code in containers or sandbox
services (verl, SkyRL); bubblewrap gives the same kernel isolation per call, in a few ms
(benchmarks/README.md, the python tool in its OS sandbox):

    namespaces   new user, PID, network, IPC, UTS, cgroup and mount namespaces
                 (`--unshare-all --unshare-user`); no network but loopback; the code sees
                 only its own processes (`/proc` is the sandbox's), so no trainer pid to read,
                 trace or signal; no further user namespaces (`--disable-userns`)
    filesystem   an empty root with, read-only, the system's /usr (and /lib*, /bin, /sbin as
                 the host has them), the interpreter's prefixes (its standard library, the
                 environment's site-packages) and /etc/ld.so.cache; a new tmpfs of
                 `scratch_bytes` at SCRATCH as the only writable path (the code's cwd, HOME
                 and TMPDIR), gone with the sandbox; the trainer's files are not there at all
    user         uid/gid 65534 (nobody) inside, every capability dropped: no remounting the
                 read-only binds writable. (The kernel maps that user to the trainer's own
                 outside; as root that is root, which reads what is bound, never writes it.)
    processes    the code runs in a new session (`--new-session`); the sandbox's first
                 process is its PID 1, so when it dies the kernel kills everything the code
                 started; it dies with the trainer (`--die-with-parent`) and is killed by the
                 tool at the end of every call (`python_tool.py`)
    environment  cleared (`--clearenv`), then only the variables the tool sets

`bwrap` is a declared system dependency (Debian/Ubuntu: `apt-get install bubblewrap`; found
on PATH). Without a working one the tool refuses to start (`SandboxUnavailable`, saying how
to install it) unless asked for the in-process guard alone (`sandbox="guard"`), which is not a
security boundary.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

SCRATCH = "/scratch"  # the code's writable directory inside the sandbox
NOBODY = "65534"
INSTALL = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
           "bubblewrap) so that `bwrap` is on PATH")
# The system directories the interpreter's shared libraries live in, as the host has them
# (merged-/usr systems have /lib -> usr/lib links, others directories).
_SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")


class SandboxUnavailable(ValueError):
    """No working `bwrap`: the python tool cannot run code in its sandbox."""


def find_bwrap() -> str:
    """The path of `bwrap` on PATH, checked to start a sandbox on this machine (once per
    process); SandboxUnavailable saying how to install it, or why it does not work here."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"the python tool runs code in a bubblewrap sandbox, and "
                                 f"`bwrap` is not on PATH: {INSTALL}")
    problem = _probe(bwrap)
    if problem:
        raise SandboxUnavailable(f"the python tool's sandbox does not start here ({bwrap}: "
                                 f"{problem}); bubblewrap needs user namespaces (allowed "
                                 f"for root, or with kernel.unprivileged_userns_clone=1)")
    return bwrap


@functools.cache
def _probe(bwrap: str) -> str:
    """'' when `bwrap` starts this interpreter in the sandbox, else bwrap's complaint."""
    try:
        result = subprocess.run([*bwrap_argv(bwrap, scratch_bytes=1 << 20), sys.executable,
                                 "-I", "-S", "-c", "pass"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if result.returncode == 0:
        return ""
    return (result.stderr.strip() or f"exit status {result.returncode}").splitlines()[-1]


def bwrap_argv(bwrap: str, *, scratch_bytes: int, env: dict[str, str] | None = None,
               info_fd: int | None = None) -> list[str]:
    """bwrap and its options up to the command (module docstring): `env` is the whole
    environment inside; `info_fd` gets bwrap's JSON with the sandbox's first pid."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL"]
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        argv += ["--ro-bind-try", path, path]
    for path in _interpreter_dirs():
        argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(scratch_bytes), "--tmpfs",
             SCRATCH, "--chdir", SCRATCH, "--clearenv"]
    for name, value in (env or {}).items():
        argv += ["--setenv", name, value]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return [*argv, "--"]


def _interpreter_dirs() -> list[str]:
    """The interpreter's prefixes (its environment's, its base installation's) and its
    executable's directory, less those inside /usr or inside each other."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                          sys.base_exec_prefix)}
    dirs |= {os.path.dirname(os.path.abspath(sys.executable)),
             os.path.dirname(os.path.realpath(sys.executable))}
    # A venv's own path too (sys.prefix as given, when it sits behind a link).
    dirs.add(os.path.abspath(sys.prefix))
    kept: list[str] = []
    for path in sorted(dirs, key=len):
        if not any(path == k or path.startswith(k.rstrip("/") + "/")
                   for k in ("/usr", *kept)):
            kept.append(path)
    return kept
