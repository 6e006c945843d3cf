#!/usr/bin/env bash
# The rollout engine on one GPU (issue 16): `benchmarks/decode.py` on the Qwen2.5-1.5B shape
# (bf16, random weights), dense sampler vs the engine's static and continuous batching, fixed
# and long-tailed lengths. Nothing is installed; run it after gpu_check.sh has shown that the
# environment imports jaxrl; wheels in .whl/ are installed offline first, and the source tree
# goes on PYTHONPATH unless this tree's jaxrl is installed (both as gpu_check.sh).
#
#   bash benchmarks/gpu_decode.sh OUT_DIR            # GPU
#   bash benchmarks/gpu_decode.sh OUT_DIR --tiny     # CPU: a 2-layer d=128 model, few rows
#
# OUT_DIR gets decode.jsonl (one decode.py JSON object per run, with "command") and decode.md
# (a table: tokens/s, decode step, share of the weights + live-KV HBM roofline, peak memory).
# Each run has its own timeout; the whole script stays within $GPU_DECODE_BUDGET_S seconds
# (default 420; 300 with --tiny). Exit 0 when every run finished, 1 otherwise.
set -uo pipefail

OUT="" TINY=0
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY=1 ;;
    -*) echo "gpu_decode.sh: unknown option $arg" >&2; exit 2 ;;
    *) OUT="$arg" ;;
  esac
done
[[ -n "$OUT" ]] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || exit 2
: >"$OUT/decode.jsonl"
PYTHON="${PYTHON:-python3}"
# Wheels the device image lacks (benchmarks/README.md, 'GPU check'), offline, as gpu_check.sh.
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_decode.XXXXXX")" || exit 2
  trap 'rm -rf "$SITE"' EXIT
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$WHEELS"/*.whl || { echo "gpu_decode: cannot install $WHEELS" >&2; exit 3; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
FOUND="$(cd /tmp && "$PYTHON" -c 'import importlib.util as u; s = u.find_spec("jaxrl"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null)"
[[ "$FOUND" == "$ROOT/jaxrl" ]] || export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ((TINY)); then
  export JAX_PLATFORMS=cpu
  BUDGET="${GPU_DECODE_BUDGET_S:-300}"
  MODEL=(--hidden 128 --layers 2 --heads 4 --kv-heads 2 --intermediate 256 --vocab 1024
         --no-micro)
  FIXED=(--batch 8 --max-new-tokens 16) TAIL=(--batch 16 --max-new-tokens 64)
  SLOTS=8
else
  BUDGET="${GPU_DECODE_BUDGET_S:-420}"
  MODEL=(--hidden 1536 --layers 28 --heads 12 --kv-heads 2 --intermediate 8960
         --vocab 151936 --dtype bfloat16)
  FIXED=(--batch 64 --max-new-tokens 256) TAIL=(--batch 64 --max-new-tokens 256)
  SLOTS=32
fi
TAIL+=(--lengths longtail --length-median 32 --length-sigma 1.0)
RUNS=(
  "--batching dense ${FIXED[*]}"
  "--batching continuous ${FIXED[*]}"
  "--batching static ${TAIL[*]}"
  "--batching continuous --slots $SLOTS --min-slots 2 ${TAIL[*]}"
  "--batching continuous ${TAIL[*]}"
)
START=$SECONDS FAILED=0
for run in "${RUNS[@]}"; do
  LEFT=$((BUDGET - (SECONDS - START)))
  if ((LEFT < 30)); then echo "gpu_decode: out of budget before: $run"; FAILED=1; break; fi
  # shellcheck disable=SC2086  # each run is a list of flags
  CMD=("$PYTHON" benchmarks/decode.py "${MODEL[@]}" $run --repeats 3 --json)
  echo "[gpu_decode $((SECONDS - START))s] ${CMD[*]} (timeout ${LEFT}s)"
  if timeout --kill-after=10 "$LEFT" "${CMD[@]}" >"$OUT/last.txt" 2>&1; then
    tail -n 1 "$OUT/last.txt" | "$PYTHON" -c 'import json, sys; r = json.loads(sys.stdin.read()); r["command"] = sys.argv[1]; print(json.dumps(r))' "${CMD[*]}" >>"$OUT/decode.jsonl"
    grep -v '^{' "$OUT/last.txt"
  else
    echo "gpu_decode: FAILED or timed out: ${CMD[*]}"; tail -n 20 "$OUT/last.txt"; FAILED=1
  fi
done
rm -f "$OUT/last.txt"
"$PYTHON" - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines() if line]
lines = ["| batching (slots, min) | lengths | device | tok/s | decode step | roofline | "
         "peak memory | command |", "|---|---|---|---|---|---|---|---|"]
for r in rows:
    slots = f"{r['slots']}" + (f", min {r['min_slots']}" if r.get("min_slots") else "")
    frac = "n/a" if r["roofline_frac"] is None else f"{r['roofline_frac']:.1%}"
    peak = r["peak_memory_bytes"]
    memory = ("n/a" if peak is None else f"{peak / 2**30:.2f} GiB" if peak >= 2**30
              else f"{peak / 2**20:.1f} MiB")
    lines.append(f"| {r['batching']} ({slots}) | {r['lengths']} | {r['device']} | "
                 f"{r['tokens_per_s']:,.0f} | {r['decode_step_s'] * 1e3:.2f} ms | {frac} | "
                 f"{memory} | `{r['command']}` |")
(out / "decode.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit "$FAILED"
