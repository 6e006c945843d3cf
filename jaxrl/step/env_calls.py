"""The environment calls of a multi-turn rollout: `env.step` on daemon worker threads, each
call timed against a limit.

    calls = EnvCalls(workers=8)
    calls.submit(slot, env, text)          env.step(text) on a worker thread
    for slot, future in calls.done(): ...  (Observation, seconds) or the exception it raised
    calls.overdue(limit_s)                 a slot whose call has run longer than limit_s
    calls.wait(timeout_s)                  until a call ends (or the timeout)
    calls.close()                          workers told to stop; never waits for one

Why not `concurrent.futures.ThreadPoolExecutor`: its workers are joined when it shuts down
and again at interpreter exit, so one `env.step` that never returns kept a run alive through
the rollout's error, two Ctrl-C and SIGTERM, until it was killed. Here a call past its limit
is abandoned on its daemon thread (Python cannot stop a thread): the rollout raises and the
process can still exit.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time

from jaxrl.envs.base import Environment, Observation


def timed_step(env: Environment, text: str) -> tuple[Observation, float]:
    """(env.step(text), the seconds it took)."""
    start = time.perf_counter()
    obs = env.step(text)
    return obs, time.perf_counter() - start


class EnvCalls:
    """`env.step` calls by slot on up to `workers` daemon threads (module docstring)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.waiting: dict[int, tuple[cf.Future, float]] = {}  # slot -> (future, its start)

    def submit(self, slot: int, env: Environment, text: str) -> None:
        """Starts `timed_step(env, text)` for `slot` (one call per slot at a time)."""
        future: cf.Future = cf.Future()
        self.waiting[slot] = (future, time.monotonic())
        self._queue.put((future, env, text))
        if len(self._threads) < min(self.workers, len(self.waiting)):
            thread = threading.Thread(target=_work, args=(self._queue,), daemon=True,
                                      name=f"jaxrl-env-{len(self._threads)}")
            thread.start()
            self._threads.append(thread)

    def done(self) -> list[tuple[int, cf.Future]]:
        """The calls that ended since the last look, by slot (no longer waiting)."""
        ended = [slot for slot, (future, _) in self.waiting.items() if future.done()]
        return [(slot, self.waiting.pop(slot)[0]) for slot in ended]

    def overdue(self, limit_s: float | None) -> tuple[int, float] | None:
        """(slot, seconds) of the longest-running call if it ran past `limit_s`, else None."""
        if limit_s is None or not self.waiting:
            return None
        slot, (_, start) = min(self.waiting.items(), key=lambda item: item[1][1])
        seconds = time.monotonic() - start
        return (slot, seconds) if seconds > limit_s else None

    def wait(self, limit_s: float | None) -> None:
        """Until some call ends, or the oldest one reaches `limit_s` (None: no limit)."""
        timeout = None
        if limit_s is not None and self.waiting:
            oldest = min(start for _, start in self.waiting.values())
            timeout = max(oldest + limit_s - time.monotonic(), 0.0) + 0.01
        cf.wait([future for future, _ in self.waiting.values()], timeout=timeout,
                return_when=cf.FIRST_COMPLETED)

    def close(self) -> None:
        """Tells every worker to stop once its call returns; waits for none."""
        for _ in self._threads:
            self._queue.put(None)
        self._threads.clear()


def _work(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not None:
        future, env, text = task
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(timed_step(env, text))
            except BaseException as e:  # handed to the rollout, which names the environment
                future.set_exception(e)
