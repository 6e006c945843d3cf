"""How much XLA compiled during a test session, and how much its persistent cache saved.

Every process running tests (the pytest process, or each xdist worker) listens to JAX's
monitoring events: a backend compile (with its seconds), a compile request that may use the
persistent cache, a hit, and a miss written to the cache. A request that neither hit nor was
written compiled without being stored: JAX does not store programs with host callbacks
(`jax.pure_callback` rewards, the phase clock's `io_callback`) nor ones that compiled in less
than JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS. Workers hand their counts to the controller
(xdist's `workeroutput`), which prints one line at the end of the run. The `jaxrl` processes
that tests start use the same cache folder but are not counted here; the folder's entry
count before and after the run shows what they and the tests added.
"""

from __future__ import annotations

import collections
import os
import threading

FIELDS = ("compiles", "compile_s", "cache_requests", "cache_hits", "cache_writes", "saved_s")
_COMPILE = "/jax/core/compile/backend_compile_duration"

_counts: collections.Counter = collections.Counter()
_seconds_by_program: collections.Counter = collections.Counter()  # compile + cache reads
_lock = threading.Lock()


def _on_event(event: str, **_) -> None:
    name = {"/jax/compilation_cache/compile_requests_use_cache": "cache_requests",
            "/jax/compilation_cache/cache_hits": "cache_hits",
            "/jax/compilation_cache/cache_misses": "cache_writes"}.get(event)
    if name:
        with _lock:
            _counts[name] += 1


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    with _lock:
        if event == _COMPILE:
            _counts["compiles"] += 1
            _counts["compile_s"] += seconds
            _seconds_by_program[kwargs.get("fun_name", "?")] += seconds
        elif event == "/jax/compilation_cache/compile_time_saved_sec":
            _counts["saved_s"] += seconds


def listen() -> None:
    """Starts counting this process's compilations (call once per process)."""
    from jax import monitoring

    monitoring.register_event_listener(_on_event)
    monitoring.register_event_duration_secs_listener(_on_duration)


def counts() -> dict:
    """This process's counts so far, and its compile seconds by program name."""
    with _lock:
        return {**{field: _counts[field] for field in FIELDS},
                "by_program": dict(_seconds_by_program)}


def add(total: dict, more: dict) -> None:
    for field in FIELDS:
        total[field] = total.get(field, 0) + more.get(field, 0)
    by_program = total.setdefault("by_program", collections.Counter())
    by_program.update(more.get("by_program", {}))


def cache_entries(folder: str) -> int:
    """Executables stored in the persistent cache folder (0 when it does not exist yet)."""
    if not os.path.isdir(folder):
        return 0
    return sum(1 for name in os.listdir(folder) if name.endswith("-cache"))


def summary(total: dict, folder: str, entries_before: int) -> str:
    """One line for the end of the run."""
    unstored = total["cache_requests"] - total["cache_hits"] - total["cache_writes"]
    return (f"XLA compilations: {total['compiles']:.0f} ({total['compile_s']:.0f} s); "
            f"persistent cache: {total['cache_hits']:.0f} hits (saved "
            f"{max(total['saved_s'], 0):.0f} s), {total['cache_writes']:.0f} written, {unstored:.0f} "
            f"compiled and not stored (host callbacks or under the minimum compile time); "
            f"{folder}: {entries_before} -> {cache_entries(folder)} entries")


def top_programs(total: dict, n: int) -> list[str]:
    """The n program names that took the most compile seconds (JAXRL_COMPILE_REPORT=n)."""
    return [f"{seconds:8.1f} s  {name}"
            for name, seconds in total.get("by_program", collections.Counter()).most_common(n)]
