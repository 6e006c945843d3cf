"""Predicted speedup of asynchronous RL over the synchronous fused step, from measured phase times.

    python benchmarks/async_model.py [--devices 1,8,64] [--staleness 0,1,2]
        [--scaling-exponent 1.0] [--phase-times FILE] [--json]

The synchronous step generates, then trains, each phase on all N devices. The asynchronous one
splits the devices: rollout on r of them, training on the other N - r, running concurrently,
with the rollout at most k policy versions behind (bounded staleness k); after each update the
trainer sends its weights to the rollout mesh. This script is a back-of-envelope model, stdlib
only: nothing is run or timed. Its inputs are one measured step:

    T_g, T_t  generate / train phase seconds per step, measured on N0 devices
    W         weight bytes sent per sync (2 x parameters in bf16)

Defaults: the 1.5B Qwen2 GPU check in benchmarks/README.md ("Results (H200)"): 1 x NVIDIA H200,
generate 2,159 ms and train 2,949 ms per step (stamps inside the program), 1,543,714,304
parameters in bf16, so W = 3,087,428,608 bytes. `--phase-times FILE` overrides them with a JSON
object of optional keys generate_s, train_s, devices (N0), weight_bytes.

A phase on n devices, with scaling exponent e (`--scaling-exponent`; 1 = linear scaling,
0 = no speedup from more devices):

    t(n) = T * (N0 / n) ** e

Synchronous, both phases on all N devices:

    T_sync(N) = T_g(N) + T_t(N)

Weight sync per step, with B the per-device link bandwidth and the transfer spread over the
smaller side's devices:

    S = W / (B * min(r, N - r))
    B = 450e9 B/s (NVLink, one node) when N <= 8, else 50e9 B/s (inter-node)

The bandwidths are assumptions, not measurements (`--nvlink-bw`, `--internode-bw`,
`--node-size` override them). Asynchronous, with staleness k:

    k = 0:   T_async = T_g(r) + S + T_t(N - r)         (synchronous on two meshes)
    k >= 1:  T_async = max(T_g(r) + S, T_t(N - r))     (the sync is on the rollout's path)

For each N the split r in 1..N-1 minimising T_async is chosen (ties: the smallest r); N = 1
cannot be split and reports n/a. speedup = T_sync / T_async. The model ignores what changes
with the split beyond the phase time (per-device batch, memory, compile) and any
communication inside a phase; the measured times at N0 already include their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GENERATE_S = 2.159  # benchmarks/README.md, Results (H200): generate per step
TRAIN_S = 2.949  # ... train per step
MEASURED_DEVICES = 1  # 1 x NVIDIA H200
PARAMS = 1_543_714_304
WEIGHT_BYTES = 2 * PARAMS  # bf16
NVLINK_BW = 450e9  # bytes/s per device, assumed
INTERNODE_BW = 50e9  # bytes/s per device, assumed
NODE_SIZE = 8


def phase_time(t_measured: float, n: int, n0: int = 1, exponent: float = 1.0) -> float:
    """A phase measured at t_measured seconds on n0 devices, run on n devices."""
    return t_measured * (n0 / n) ** exponent


def link_bandwidth(n: int, nvlink_bw: float = NVLINK_BW, internode_bw: float = INTERNODE_BW,
                   node_size: int = NODE_SIZE) -> float:
    """Per-device bytes/s for a weight sync among n devices: NVLink in one node, else network."""
    return nvlink_bw if n <= node_size else internode_bw


def weight_sync_time(weight_bytes: float, n: int, r: int, bandwidth: float) -> float:
    """S = W / (B * min(r, n - r))."""
    return weight_bytes / (bandwidth * min(r, n - r))


def sync_time(t_gen: float, t_train: float, n: int, n0: int = 1,
              exponent: float = 1.0) -> float:
    """T_sync(n) = T_g(n) + T_t(n)."""
    return phase_time(t_gen, n, n0, exponent) + phase_time(t_train, n, n0, exponent)


def async_time(t_gen: float, t_train: float, weight_bytes: float, n: int, r: int, k: int,
               n0: int = 1, exponent: float = 1.0, bandwidth: float | None = None
               ) -> tuple[float, float]:
    """(T_async, S) with rollout on r of n devices and staleness k."""
    if not 1 <= r <= n - 1:
        raise ValueError(f"r={r} must be in 1..{n - 1}")
    if bandwidth is None:
        bandwidth = link_bandwidth(n)
    s = weight_sync_time(weight_bytes, n, r, bandwidth)
    gen = phase_time(t_gen, r, n0, exponent)
    train = phase_time(t_train, n - r, n0, exponent)
    return (gen + s + train, s) if k == 0 else (max(gen + s, train), s)


def best_split(t_gen: float, t_train: float, weight_bytes: float, n: int, k: int,
               n0: int = 1, exponent: float = 1.0, bandwidth: float | None = None
               ) -> tuple[int, float, float] | None:
    """(r, T_async, S) for the r in 1..n-1 minimising T_async; None when n < 2."""
    best = None
    for r in range(1, n):
        t, s = async_time(t_gen, t_train, weight_bytes, n, r, k, n0, exponent, bandwidth)
        if best is None or t < best[1]:
            best = (r, t, s)
    return best


def predict(t_gen: float, t_train: float, weight_bytes: float, devices, staleness,
            n0: int = 1, exponent: float = 1.0, nvlink_bw: float = NVLINK_BW,
            internode_bw: float = INTERNODE_BW, node_size: int = NODE_SIZE) -> list[dict]:
    """One row per (N, k): N, k, r, T_sync, T_async, S, speedup (None where N cannot split)."""
    rows = []
    for n in devices:
        t_sync = sync_time(t_gen, t_train, n, n0, exponent)
        bw = link_bandwidth(n, nvlink_bw, internode_bw, node_size)
        for k in staleness:
            split = best_split(t_gen, t_train, weight_bytes, n, k, n0, exponent, bw)
            r, t_async, s = split if split else (None, None, None)
            rows.append({"N": n, "k": k, "r": r, "T_sync": t_sync, "T_async": t_async,
                         "S": s, "speedup": t_sync / t_async if split else None})
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=_ints, default=[1, 8, 64], help="N values, e.g. 1,8,64")
    p.add_argument("--staleness", type=_ints, default=[0, 1, 2], help="k values, e.g. 0,1,2")
    p.add_argument("--scaling-exponent", type=float, default=1.0, help="e in T*(N0/n)**e")
    p.add_argument("--phase-times", type=Path, help="JSON: generate_s, train_s, devices, "
                   "weight_bytes (all optional)")
    p.add_argument("--nvlink-bw", type=float, default=NVLINK_BW, help="bytes/s per device")
    p.add_argument("--internode-bw", type=float, default=INTERNODE_BW, help="bytes/s per device")
    p.add_argument("--node-size", type=int, default=NODE_SIZE, help="devices on NVLink")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)

    measured = {"generate_s": GENERATE_S, "train_s": TRAIN_S, "devices": MEASURED_DEVICES,
                "weight_bytes": WEIGHT_BYTES}
    if args.phase_times:
        given = json.loads(args.phase_times.read_text())
        unknown = set(given) - set(measured)
        if unknown:
            p.error(f"--phase-times: unknown keys {sorted(unknown)}")
        measured.update(given)
    rows = predict(measured["generate_s"], measured["train_s"], measured["weight_bytes"],
                   args.devices, args.staleness, int(measured["devices"]),
                   args.scaling_exponent, args.nvlink_bw, args.internode_bw, args.node_size)

    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"measured on {measured['devices']} device(s): generate {measured['generate_s']} s, "
          f"train {measured['train_s']} s, weights {measured['weight_bytes']:,} bytes; "
          f"scaling exponent {args.scaling_exponent}")
    print(f"{'N':>4} {'k':>2} {'r':>4} {'T_sync s':>10} {'T_async s':>10} {'S s':>10} "
          f"{'speedup':>8}")
    for row in rows:
        print(f"{row['N']:>4} {row['k']:>2} {_fmt(row['r'], 'd'):>4} "
              f"{row['T_sync']:>10.4f} {_fmt(row['T_async'], '.4f'):>10} "
              f"{_fmt(row['S'], '.5f'):>10} {_fmt(row['speedup'], '.3f'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
