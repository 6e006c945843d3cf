"""The end-of-run summary: what the run did, for the table and the final JSON line.

Medians leave out step 0, which also pays first-run costs (allocation, caches). With
`train.target_reward` set, the summary says when the moving average of reward/mean over
TARGET_WINDOW steps first reached it (its step and the seconds since the first dispatch).
`reward_errors`, the failed reward calls of the run (reward/errors summed), is there only when
some call failed. A median MFU or HFU above 1 is shown as null with a `*_note` saying why
(`jaxrl.perf.mfu`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl.perf import IMPLAUSIBLE, plausible
from jaxrl.run.metrics_log import moving_average

if TYPE_CHECKING:
    from jaxrl.run.start import Started

TARGET_WINDOW = 20  # steps averaged when checking train.target_reward


def run_summary(started: Started, records: list[dict[str, float]], train_s: float
                ) -> dict[str, Any]:
    """The summary of a run's `records` (snake_case keys)."""
    run, pre = started.run, started.pre
    rewards_N = np.array([r["reward/mean"] for r in records])
    later = records[1:] or records
    window = max(1, len(records) // 20)
    reward_errors = int(sum(r.get("reward/errors", 0) for r in records))
    return {
        "run_dir": str(run.run_dir),
        "steps": len(records),
        "setup_s": started.setup_s,
        "train_s": train_s,
        "first_step_s": records[0]["time/step_s"],
        "median_step_s": float(np.median([r["time/step_s"] for r in later])),
        "tokens_per_s": float(np.median([r["perf/tokens_per_s"] for r in later])),
        **{f"{key}_median": float(np.median(values)) for key, values in (
            (key, [r[name] for r in later if name in r])
            for key, name in (("generate_s", "time/generate_s"), ("train_s", "time/train_s")))
           if values},
        **_utilization(later),
        "peak_memory_bytes": pre.memory.peak_bytes if pre.memory.programs else None,
        "device_memory_bytes": pre.memory.limit_bytes or None,
        "step_compilations": run.step.num_compilations(),
        "reward_first": float(rewards_N[0]),
        "reward_last": float(rewards_N[-window:].mean()),
        "reward_last_window": window,
        "reward_best": float(rewards_N.max()),
        "prompts_dropped": run.batches.stats.num_dropped,
        **({"reward_errors": reward_errors} if reward_errors else {}),
        **target_reached(run.cfg.train.target_reward, records),
    }


def _utilization(records: list[dict[str, float]]) -> dict[str, Any]:
    """mfu_median and hfu_median where counted; an impossible one (> 1) is None, with a note."""
    out: dict[str, Any] = {}
    for key in ("mfu", "hfu"):
        values = [r[f"perf/{key}"] for r in records if f"perf/{key}" in r]
        if values:
            median = float(np.median(values))
            out[f"{key}_median"] = plausible(median)
            if out[f"{key}_median"] is None:
                out[f"{key}_note"] = f"median {key.upper()} {median:.3f} is {IMPLAUSIBLE}"
    return out


def target_reached(target: float | None, records: list[dict[str, float]]) -> dict[str, Any]:
    """When the moving average of reward/mean over TARGET_WINDOW steps first reached `target`."""
    if target is None:
        return {}
    average_N = moving_average([r["reward/mean"] for r in records], TARGET_WINDOW)
    hits = np.flatnonzero((average_N >= target) & (np.arange(len(records)) >= TARGET_WINDOW - 1))
    if not len(hits):
        return {"target_reward": target, "target_reached": False}
    first = records[int(hits[0])]
    return {"target_reward": target, "target_reached": True, "target_step": first["step"],
            "target_elapsed_s": first["time/elapsed_s"]}
