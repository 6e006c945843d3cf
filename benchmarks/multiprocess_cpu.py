"""The quickstart over 8 CPU devices as one process and as several, side by side.

    python benchmarks/multiprocess_cpu.py [--steps 10] [--processes 2]

Runs `jaxrl train configs/quickstart.yaml sharding.layout=fsdp` for `--steps` steps three
ways, one after the other on this machine:

    in-process   1 process x 8 devices, XLA's in-process CPU collectives (no jax.distributed)
    gloo 1x8     `launch/local_multiprocess.sh 1`: 1 process x 8 devices, jax.distributed,
                 collectives over gloo (TCP)
    gloo Nx(8/N) `launch/local_multiprocess.sh N`: N processes, collectives over gloo

and prints each one's median step time (steps after the first), setup time, and whether its
metrics (wall-clock times aside) and final parameters equal the gloo 1x8 run's: the runs
over gloo must agree bit for bit; the in-process one adds partial sums in another order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxrl.saved.files import FINAL_MODEL_DIR, METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("time/", "perf/")
RUN = ["sharding.layout=fsdp", "perf.count_flops=false", "eval.num_prompts=0",
       "log.plot=false", "log.tensorboard=false", "train.checkpoint_every=0"]


def _run(name: str, command: list[str], env: dict[str, str], run_dir: Path) -> dict:
    out = subprocess.run(command + [f"train.run_dir={run_dir}"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return {
        "name": name,
        "median_step_s": float(np.median([r["time/step_s"] for r in records[1:]])),
        "setup_s": summary["setup_s"],
        "metrics": [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records],
        "params": hashlib.sha256(
            (run_dir / FINAL_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    base_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    base_env["JAXRL_BIN"] = str(bin_dir / "jaxrl")
    overrides = [f"train.max_steps={args.steps}", *RUN]
    launcher = str(ROOT / "launch" / "local_multiprocess.sh")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = [
            _run("in-process 1x8", [str(bin_dir / "jaxrl"), "train", "configs/quickstart.yaml",
                                    *overrides],
                 {**base_env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                 tmp / "a"),
            _run("gloo 1x8", [launcher, "1", "configs/quickstart.yaml", *overrides], base_env,
                 tmp / "b"),
            _run(f"gloo {args.processes}x{8 // args.processes}",
                 [launcher, str(args.processes), "configs/quickstart.yaml", *overrides],
                 {**base_env, "JAXRL_LOG_DIR": str(tmp / "logs")}, tmp / "c"),
        ]
    reference = runs[1]
    print(f"quickstart, fsdp over 8 CPU devices, {args.steps} steps")
    print("| run | median step | setup | metrics = gloo 1x8 | parameters = gloo 1x8 |")
    print("|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['name']} | {r['median_step_s'] * 1e3:.0f} ms | {r['setup_s']:.1f} s | "
              f"{r['metrics'] == reference['metrics']} | {r['params'] == reference['params']} |")


if __name__ == "__main__":
    main()
