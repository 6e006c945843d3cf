"""The asynchronous mode's phase times on 8 CPU devices, staleness 0/1/2 beside the fused step.

    python benchmarks/async_phases.py [--steps 60] [--staleness 0 1 2] [--rollout-devices 4]
        [--inflight] [--rounds 1] [--json]

Runs `jaxrl train configs/quickstart.yaml` for `--steps` steps with phase stamps on
(perf.phase_times=true), one run after the other on this machine: the fused step over all 8
devices, then algo.mode=async with `--rollout-devices` rollout devices (the rest train) for
each staleness k; and the fused step on as many devices as the async train side has (the
fused step's collectives over 8 host devices sharing 2 cores cost more than over 4, so this
is the fairer baseline here). Prints, per run, the median over the steps after the first two (compiles
and queue fill) of:

    step_s          time/step_s: between the ends of two consecutive updates
    generate_s      time/generate_s: one batch's generation on the rollout devices
    train_s         time/train_s: score + advantages + updates on the train devices
    weight_sync_s   time/weight_sync_s: the weights' reshard train mesh -> rollout mesh
    rollout_wait_s  time/rollout_wait_s: rollout devices idle between two batches
    train_wait_s    time/train_wait_s: train devices idle between two updates

and the 8-device fused step's median over each run's (speedup), and the mean staleness of
the tokens trained (`async/staleness_mean`). `--inflight` adds, for each k >= 2, the run with
in-flight weight updates (rollout.inflight_updates=true). `--rounds R` runs the whole
sequence R times, interleaved, and reports the median over the rounds (and the range of
step_s): on a shared machine one run's median moves by 2x between sittings. `--json` prints one JSON object
per run. The 8 devices are XLA's host-platform devices sharing this machine's cores: the two
sides compete for the same 2 CPUs, so the overlap the mode buys on separate accelerators
shows here only as far as the cores are idle (a lower bound on what it gives).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxrl.run.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RUN = ["perf.phase_times=true", "perf.count_flops=false", "eval.num_prompts=0",
       "log.plot=false", "log.tensorboard=false", "train.checkpoint_every=0",
       "train.save_final=false", "log.print_every=1000"]
NAMES = ("step_s", "generate_s", "train_s", "weight_sync_s", "rollout_wait_s", "train_wait_s")
SKIP = 2  # the first steps compile, and fill the queue


def run(name: str, overrides: list[str], steps: int, run_dir: Path, devices: int = 8) -> dict:
    """One training run's medians of NAMES (None where the run has no such metric)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, "-m", "jaxrl.cli", "train", "configs/quickstart.yaml",
               f"train.max_steps={steps}", f"train.run_dir={run_dir}", *RUN, *overrides]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")[SKIP:]
    out: dict = {"run": name}
    for key in NAMES:
        values = [r[f"time/{key}"] for r in records if f"time/{key}" in r]
        out[key] = float(np.median(values)) if values else None
    stale = [r["async/staleness_mean"] for r in records if "async/staleness_mean" in r]
    out["staleness"] = float(np.mean(stale)) if stale else None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rollout-devices", type=int, default=4)
    parser.add_argument("--inflight", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps <= SKIP:
        parser.error(f"--steps must be more than {SKIP}")
    train = 8 - args.rollout_devices
    runs = [("fused (8 devices)", [], 8), (f"fused ({train} devices)", [], train)] + [
        (f"async k={k} ({args.rollout_devices}+{train})",
         ["algo.mode=async", f"sharding.rollout_devices={args.rollout_devices}",
          f"algo.max_staleness={k}"], 8) for k in args.staleness]
    if args.inflight:
        runs += [(f"async k={k} in-flight",
                  ["algo.mode=async", f"sharding.rollout_devices={args.rollout_devices}",
                   f"algo.max_staleness={k}", "rollout.inflight_updates=true"], 8)
                 for k in args.staleness if k >= 2]
    rounds: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # interleaved: machine noise hits every run alike
            rounds.append([run(name, overrides, args.steps, Path(tmp) / f"{i}-{j}", devices)
                           for j, (name, overrides, devices) in enumerate(runs)])
    results = []
    for j, (name, _, _) in enumerate(runs):
        per_round = [r[j] for r in rounds]
        merged = {"run": name, "rounds": args.rounds,
                  "step_s_range": [min(r["step_s"] for r in per_round),
                                   max(r["step_s"] for r in per_round)]}
        for key in (*NAMES, "staleness"):
            values = [r[key] for r in per_round if r[key] is not None]
            merged[key] = float(np.median(values)) if values else None
        results.append(merged)
    fused = results[0]["step_s"]
    for r in results:
        r["speedup"] = fused / r["step_s"]
    if args.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"{'run':<22}" + "".join(f"{n:>16}" for n in (*NAMES, "speedup", "staleness"))
          + "  step_s range")
    for r in results:
        cells = [("-" if r[n] is None else f"{r[n] * 1e3:.1f} ms") for n in NAMES]
        stale = "-" if r["staleness"] is None else f"{r['staleness']:.2f}"
        low, high = r["step_s_range"]
        print(f"{r['run']:<22}" + "".join(f"{c:>16}" for c in cells) + f"{r['speedup']:>16.2f}"
              f"{stale:>16}  {low * 1e3:.0f}-{high * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
