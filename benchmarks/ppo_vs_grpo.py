"""PPO (with a critic) against GRPO: step time on the quickstart, side by side.

    python benchmarks/ppo_vs_grpo.py [--rounds 3] [--steps 30] [dotted.key=value ...]

Runs `jaxrl bench configs/quickstart.yaml` for GRPO (the shipped config), PPO with a separate
critic and PPO with a value head on the policy's trunk (`algo.advantage=gae`,
`algo.critic.kind=...`), interleaved round by round so that each round's three measurements
share the machine's load, each in its own process on one device; then prints, per variant,
the medians over the rounds of the median step, generate and train seconds and the MFU, and
the train time relative to GRPO's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "grpo": [],
    "ppo, separate critic": ["algo.advantage=gae", "algo.critic.kind=separate",
                             "algo.mask_zero_std_groups=false"],
    "ppo, value head": ["algo.advantage=gae", "algo.critic.kind=value_head",
                        "algo.mask_zero_std_groups=false"],
}


def bench(overrides: list[str], steps: int, run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    jaxrl = Path(sys.executable).parent / "jaxrl"
    out = subprocess.run(
        [str(jaxrl), "bench", str(ROOT / "configs" / "quickstart.yaml"), *overrides,
         f"train.run_dir={run_dir}", "--steps", str(steps), "--warmup", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every variant")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, overrides) in enumerate(VARIANTS.items()):
                out = bench([*overrides, *args.overrides], args.steps,
                            Path(tmp) / f"{r}-{i}")
                results[name].append(out)
                print(f"round {r} {name}: step {out['step_s'] * 1e3:.1f} ms", file=sys.stderr)

    def median(name, key):
        values = [o[key] for o in results[name] if o[key] is not None]
        return statistics.median(values) if values else float("nan")

    base = median("grpo", "train_s")
    print("| variant | median step | generate | train | train / GRPO's | MFU |")
    print("|---|---|---|---|---|---|")
    for name in VARIANTS:
        print(f"| {name} | {median(name, 'step_s') * 1e3:.1f} ms "
              f"| {median(name, 'generate_s') * 1e3:.1f} ms "
              f"| {median(name, 'train_s') * 1e3:.1f} ms "
              f"| {median(name, 'train_s') / base:.2f}x | {median(name, 'mfu'):.3f} |")


if __name__ == "__main__":
    main()
