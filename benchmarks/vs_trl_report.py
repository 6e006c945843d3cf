"""vs_trl.py's report: the tables (one round, or every round with its jaxrl / TRL ratio), the
long-tail workload's completion lengths, and the summary JSON (stdout's last line)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from importlib import metadata

import longtail_policy as longtail


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "torch", "transformers", "trl"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cell(value, fmt):
    return "n/a" if value is None else format(value, fmt)


def _row(name: str, r: dict) -> str:
    mfu = r.get("mfu")
    return (f"| {name} | {_cell(r['tokens_per_s'], ',.0f')} | {_cell(r['step_s'], '.3f')} "
            f"| {_cell(r.get('generate_s'), '.3f')} | {_cell(r.get('train_s'), '.3f')} "
            f"| {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} |")


def table(results: dict) -> str:
    rows = ["| library | completion tokens/s | s/step | generate s/step | train s/step | MFU |",
            "|---|---|---|---|---|---|"]
    rows += [_row(name, r) for name, r in results.items()]
    return "\n".join(rows)


def ratio(results: dict) -> float | None:
    """jaxrl / TRL completion tokens/s of one round (None without both)."""
    if "jaxrl" not in results or "TRL" not in results:
        return None
    return results["jaxrl"]["tokens_per_s"] / results["TRL"]["tokens_per_s"]


def round_table(rounds: list[dict]) -> str:
    """Every round's libraries in the order they ran, then each round's jaxrl / TRL ratio."""
    rows = ["| round | library | completion tokens/s | s/step | generate s/step | train s/step "
            "| MFU |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {i} {_row(name, r)}" for i, results in enumerate(rounds, 1)
             for name, r in results.items()]
    ratios = [ratio(results) for results in rounds]
    if all(x is not None for x in ratios):
        rows += ["", "| round | first | jaxrl / TRL completion tokens/s |", "|---|---|---|"]
        rows += [f"| {i} | {next(iter(results))} | {x:.2f}x |"
                 for i, (results, x) in enumerate(zip(rounds, ratios, strict=True), 1)]
        rows.append(f"| median | | {statistics.median(ratios):.2f}x |")
    before = [r["jaxrl"]["train_s"] / r["jaxrl-before"]["train_s"] for r in rounds
              if "jaxrl-before" in r and "jaxrl" in r]
    if before:
        rows += ["", "| round | jaxrl train s / jaxrl-before train s |", "|---|---|"]
        rows += [f"| {i} | {x:.2f}x |" for i, x in enumerate(before, 1)]
        rows.append(f"| median | {statistics.median(before):.2f}x |")
    return "\n".join(rows)


def lengths_table(rounds: list[dict], expected: dict, rows_per_step: int) -> str:
    """The measured completion lengths of each run, and the chain's own."""
    rows = ["| run | rows | median length | mean length | at the cap | min | max "
            "| tokens/step (median) |", "|---|---|---|---|---|---|---|---|"]
    for i, results in enumerate(rounds, 1):
        for name, r in results.items():
            s = r["lengths"]
            label = name if len(rounds) == 1 else f"{i} {name}"
            rows.append(f"| {label} | {s['rows']} | {s['len_median']:g} | {s['len_mean']:.1f} "
                        f"| {100 * s['cap_frac']:.1f}% | {s['len_min']} | {s['len_max']} "
                        f"| {statistics.median(r['tokens_per_step']):,.0f} |")
    rows.append(f"| the chain (expected) | | {expected['len_median']} "
                f"| {expected['len_mean']:.1f} | {100 * expected['cap_frac']:.1f}% | 2 "
                f"| {longtail.CAP} | {rows_per_step * expected['len_mean']:,.0f} (mean) |")
    return "\n".join(rows)


def summary(rounds: list[dict], workload: dict, **run: object) -> dict:
    """The JSON of the invocation: one round keeps the keys of a single race (`jaxrl`, `trl`,
    `ratio_tokens_per_s`), several go under `rounds`; `run` holds the settings (None and
    empty ones left out)."""
    out = {"date": datetime.date.today().isoformat(), "cpu_count": os.cpu_count(),
           "versions": versions(), **{k: v for k, v in run.items() if v not in (None, [], ())},
           "workload": workload}
    if len(rounds) == 1:
        out.update({name.lower().replace("-", "_"): r for name, r in rounds[0].items()})
        if ratio(rounds[0]) is not None:
            out["ratio_tokens_per_s"] = ratio(rounds[0])
    else:
        out["rounds"] = [{"round": i, "order": list(results),
                          **{name.lower().replace("-", "_"): r for name, r in results.items()},
                          "ratio_tokens_per_s": ratio(results)}
                         for i, results in enumerate(rounds, 1)]
    return out


def print_report(rounds: list[dict], out: dict, rows_per_step: int) -> None:
    """The tables, jaxrl's MFU basis, the ratio, the versions, then `out` as one JSON line."""
    print(table(rounds[0]) if len(rounds) == 1 else round_table(rounds))
    if "expected_lengths" in out["workload"]:
        print("\ncompletion lengths (tokens, EOS counted; the measured steps' rows):")
        print(lengths_table(rounds, out["workload"]["expected_lengths"], rows_per_step))
    for i, results in enumerate(rounds, 1):
        if "jaxrl" in results:
            j = results["jaxrl"]
            print(f"\n{f'round {i}: ' if len(rounds) > 1 else ''}jaxrl MFU {j.get('mfu')} "
                  f"against {j.get('peak_flops_per_device')} FLOP/s ({j.get('peak_source')}, "
                  f"{j.get('device_kind')}, {j.get('num_devices')} device)")
    if "ratio_tokens_per_s" in out:
        print(f"jaxrl / TRL completion tokens/s: {out['ratio_tokens_per_s']:.2f}x")
    v = out["versions"]
    print(f"{out['date']}, os.cpu_count()={out['cpu_count']}, "
          + ", ".join(f"{k} {v[k]}" for k in v))
    print(json.dumps(out))
