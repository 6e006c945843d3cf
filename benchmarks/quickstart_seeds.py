"""How fast the quickstart learns, seed by seed: steps and seconds to the 0.8 target.

    python benchmarks/quickstart_seeds.py [dotted.key=value ...] --seeds 0 1 2 3

Runs `jaxrl train configs/quickstart.yaml train.seed=S` in process for each seed (TensorBoard
and the plot off, run directories under a temporary folder) and prints one table row per
seed: the step at which the 20-step mean reward first reached `train.target_reward`, the
summed step time (`time/step_s`) up to it and the seconds after the first dispatch, the final
reward and the greedy exact match. Run it on an otherwise idle machine: the seconds depend on
the load, the steps do not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from jaxrl.runtime import configure_xla

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args()
    configure_xla()
    from rich.console import Console

    from jaxrl.config import ExperimentConfig, load_config
    from jaxrl.run.loop import train
    from jaxrl.run.metrics_log import read_metrics
    from jaxrl.saved.files import METRICS_FILE

    quiet = Console(stderr=True, quiet=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            cfg = load_config(ExperimentConfig, ROOT / "configs" / "quickstart.yaml",
                              [f"train.seed={seed}", f"train.run_dir={tmp}/seed{seed}",
                               "log.tensorboard=false", "log.plot=false", *args.overrides])
            summary = train(cfg, quiet, name=f"seed{seed}")
            if summary.get("stopped_by"):  # SIGTERM/SIGINT: train() stopped after a step
                sys.exit(f"seed {seed} was stopped by {summary['stopped_by']} at step "
                         f"{summary.get('checkpoint_step')}; seeds after it not run")
            records = read_metrics(Path(tmp) / f"seed{seed}" / METRICS_FILE)
            target = summary.get("target_step")
            row = {"seed": seed, "target_step": target,
                   "target_step_s_sum": None if target is None else sum(
                       r["time/step_s"] for r in records[:target + 1]),
                   "target_elapsed_s": summary.get("target_elapsed_s"),
                   "median_step_s": summary["median_step_s"],
                   "reward_last": summary["reward_last"],
                   "eval_exact_match": summary.get("eval/exact_match")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| seed | step reaching 0.8 | summed step time to it | seconds since first dispatch "
          "| median step | final reward | greedy exact match |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        reached = r["target_step"] is not None
        summed = f"{r['target_step_s_sum']:.0f} s" if reached else "—"
        elapsed = f"{r['target_elapsed_s']:.0f} s" if reached else "—"
        exact = "—" if r["eval_exact_match"] is None else f"{r['eval_exact_match']:.3f}"
        print(f"| {r['seed']} | {r['target_step'] if reached else 'not reached'} "
              f"| {summed} | {elapsed} "
              f"| {r['median_step_s'] * 1e3:.0f} ms | {r['reward_last']:.3f} "
              f"| {exact} |")


if __name__ == "__main__":
    main()
