#!/usr/bin/env bash
# The GPU check: `jaxrl bench` of a random Qwen2.5-1.5B-shaped policy (bf16) on one GPU, and
# the rollout engine on the same shape over every local GPU, with the headline numbers written
# to OUT_DIR. Run from anywhere; nothing is installed from the network.
#
#   bash benchmarks/gpu_check.sh OUT_DIR                 # GPU: benchmarks/gpu_qwen2_1.5b.yaml
#   bash benchmarks/gpu_check.sh OUT_DIR --tiny          # CPU: the same config, quickstart-sized
#   ... [--steps N] [--warmup W] [dotted.key=value ...]  # bench options / config overrides
#   ... --compiler-ab    # then the same bench without jaxrl's XLA flags (JAXRL_COMPILER_FLAGS=0)
#   ... --attention      # first: attention_impl cudnn vs xla, training fwd+bwd (gpu_attention.py)
#   ... --no-engine      # without the engine line (benchmarks/decode.py) before the bench
#
# Steps: (1) an installed jaxrl is used only if it is this tree, else the source tree goes on
# PYTHONPATH; wheels in $GPU_CHECK_WHEELS (default <repo>/.whl) are installed offline into a
# temporary folder first. (2) jaxrl's runtime dependencies (pyproject.toml) are checked: a
# missing or too old one stops the check at once, by name (exit 3), as does a GPU run that
# sees no GPU. (2c) The engine line, under its own `timeout` (below). (3) `python -m jaxrl.cli
# bench` runs under `timeout`, so the whole script ends within $GPU_CHECK_BUDGET_S seconds
# (default 570; 330 with --tiny; 90 less with --no-engine). (4) OUT_DIR gets, flat:
#
#   bench.json     the bench's JSON line          metrics.jsonl  one record per step
#   log.txt        everything printed             config.yaml    the resolved config
#   engine.json    the engine line's JSON object (benchmarks/decode.py --json, + "command")
#   summary.md     headline numbers: train-step MFU, decode tokens/s against the HBM bound,
#                  step MFU and HFU, peak memory; date, device_kind, jax version; the engine's
#                  tokens/s and KV pool bytes per device
#
# Exit status: 0 ok, 2 usage, 3 environment (dependency missing, no GPU), 124 timed out,
# else the bench's own status. $PYTHON picks the interpreter (default python3).
#
# --compiler-ab: the A/B of jaxrl/perf/compiler.py's flags for this platform (A: the bench
# above, flags on) against none (B: a second bench, JAXRL_COMPILER_FLAGS=0, no FLOP count).
# B gets $GPU_CHECK_AB_BUDGET_S seconds (default 200; 120 with --tiny) of the budget, which
# grows to 570 s by default (300 with --tiny); OUT_DIR also gets bench_no_compiler_flags.json
# and summary.md a table of both.
#
# --attention: before the bench, benchmarks/gpu_attention.py checks the model's training
# forward + backward with attention_impl cudnn against xla on left-padded bf16 rows (closeness
# asserted, both timed; with --tiny: on CPU, the cuDNN arm's rotation through XLA's attention).
# It gets $GPU_CHECK_ATTENTION_BUDGET_S seconds (default 150; 180 with --tiny: it compiles four
# programs, slow on a busy CPU), added to the default budget; OUT_DIR also gets attention.json
# and summary.md its line. A failed check makes the exit status 1 when the bench succeeded.
#
# The engine line (on unless --no-engine): before the bench, benchmarks/decode.py runs jaxrl's
# rollout engine (continuous batching, `--layout fsdp`) on the Qwen2.5-1.5B shape in bf16 over
# every device JAX sees (no --devices: that fakes CPU devices), rows, slots and KV pages split
# over them: 256 rows of 128 random prompt tokens + 256 new tokens each, all slots at once (the
# bench's rows and lengths, one sample per prompt), 1 checked warm-up + 3 timed rollouts. Sized
# for ~1 minute on one H100, not yet measured there (3.1 GB of weights + 2-3 GB of KV read per
# decode step, 255 steps a rollout; compilation most of it); with --tiny the quickstart's
# model, 8 rows, 8 + 8 tokens, ~20 s on 2 busy vCPUs. It gets $GPU_CHECK_ENGINE_BUDGET_S
# seconds (default 90), part of the default budget; OUT_DIR gets engine.json and summary.md
# its table (tokens_per_s, decode_step_s, kv_bytes_per_device: the KV pool one device
# allocates, read off the partitioned program). A failed line makes the exit status 1 when
# the bench succeeded. With --compiler-ab the default budget (660 s) exceeds one 10-minute
# device call: add --no-engine there.
set -uo pipefail

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

OUT="" TINY=0 AB=0 ATTN=0 ENGINE=1 STEPS="" WARMUP="" EXTRA=()
while (($#)); do
  case "$1" in
    --tiny) TINY=1 ;;
    --compiler-ab) AB=1 ;;
    --attention) ATTN=1 ;;
    --no-engine) ENGINE=0 ;;
    --steps) STEPS="${2:?--steps needs a number}"; shift ;;
    --warmup) WARMUP="${2:?--warmup needs a number}"; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *=*) EXTRA+=("$1") ;;
    *) if [[ -n "$OUT" ]]; then echo "gpu_check.sh: one OUT_DIR, got '$OUT' and '$1'" >&2; exit 2; fi
       OUT="$1" ;;
  esac
  shift
done
[[ -n "$OUT" ]] || { usage >&2; exit 2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
CONFIG=benchmarks/gpu_qwen2_1.5b.yaml
if ((TINY)); then
  MODE="tiny (CPU)"
  export JAX_PLATFORMS=cpu
  ATTN_BUDGET="${GPU_CHECK_ATTENTION_BUDGET_S:-180}"
  ENGINE_BUDGET="${GPU_CHECK_ENGINE_BUDGET_S:-90}"
  BUDGET="${GPU_CHECK_BUDGET_S:-$(((AB ? 300 : 240) + (ATTN ? ATTN_BUDGET : 0) + (ENGINE ? ENGINE_BUDGET : 0)))}"
  AB_BUDGET="${GPU_CHECK_AB_BUDGET_S:-120}"
  STEPS="${STEPS:-2}" WARMUP="${WARMUP:-1}"
  # The quickstart's model size and a few rows. float32, no remat and whole-vocabulary
  # log-probs: the FLOP accounting then compiles one set of phase programs, not two, and the
  # check stays well under a minute on 2 cores (bf16 on CPU is also slow to compile).
  OVERRIDES=(model.init.hidden_size=64 model.init.intermediate_size=256 model.init.num_layers=2
             model.init.num_heads=4 model.init.num_kv_heads=2 model.init.rope_theta=10000
             model.init.vocab_size=512 model.dtype=float32 model.compute_dtype=float32
             model.remat=none algo.logprob_chunk_size=null data.batch_size=8
             rollout.num_generations=4 data.max_prompt_len=8 rollout.max_new_tokens=8
             algo.microbatch_size=8 data.num_prompts=256)
  ENGINE_ARGS=(--hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 256 --vocab 512
               --batch 8 --prompt-len 8 --max-new-tokens 8 --page-size 4 --repeats 2)
else
  MODE="GPU"
  ATTN_BUDGET="${GPU_CHECK_ATTENTION_BUDGET_S:-150}"
  ENGINE_BUDGET="${GPU_CHECK_ENGINE_BUDGET_S:-90}"
  BUDGET="${GPU_CHECK_BUDGET_S:-$(((AB ? 570 : 480) + (ATTN ? ATTN_BUDGET : 0) + (ENGINE ? ENGINE_BUDGET : 0)))}"
  AB_BUDGET="${GPU_CHECK_AB_BUDGET_S:-200}"
  STEPS="${STEPS:-4}" WARMUP="${WARMUP:-1}"
  OVERRIDES=()
  ENGINE_ARGS=(--hidden 1536 --layers 28 --heads 12 --kv-heads 2 --intermediate 8960
               --vocab 151936 --dtype bfloat16 --batch 256 --prompt-len 128
               --max-new-tokens 256 --repeats 3)
fi
ENGINE_ARGS+=(--layout fsdp --batching continuous --no-micro --json)
OVERRIDES+=("${EXTRA[@]}")

mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/{attention.json,engine.json,bench.json,bench_no_compiler_flags.json,log.txt,summary.md,metrics.jsonl,config.yaml}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
START=$SECONDS

# Everything printed from here on also goes to log.txt.
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!
finish() {
  local rc=$?
  rm -rf "$WORK"  # the run directory: a 1.5B random policy is 3 GB of safetensors
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit "$rc"
}
trap finish EXIT

say() { printf '[gpu_check %3ds] %s\n' "$((SECONDS - START))" "$*"; }
# A program's progress (stderr) gets the seconds since the start, so a timed-out log still
# shows where the time went.
stamp() { while IFS= read -r line; do printf '[%4ds] %s\n' "$((SECONDS - START))" "$line"; done; }
env_failed() {  # stop before the bench: say why, and write a summary.md that says so
  say "FAILED: $*"
  printf '# jaxrl GPU check: %s\n\nFAILED before the bench (%s):\n\n%s\n\nSee log.txt.\n' \
    "$MODE" "$(date -u '+%Y-%m-%d %H:%M UTC')" "$*" >"$OUT/summary.md"
  exit "${FAIL_RC:-3}"
}

PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if [[ -z "$PYTHON" ]] || ! command -v "$PYTHON" >/dev/null; then
  env_failed "no Python interpreter (${PYTHON:-python3 or python} not found; set \$PYTHON)."
fi
say "mode: $MODE; out: $OUT; budget ${BUDGET}s; $(date -u '+%Y-%m-%d %H:%M:%S UTC'); host $(hostname 2>/dev/null || cat /etc/hostname 2>/dev/null)"
say "python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
if git -C "$ROOT" rev-parse --short HEAD >/dev/null 2>&1; then
  say "tree: $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || echo ' + uncommitted changes')"
fi
if ((!TINY)) && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
fi

# (1) Offline wheels, then which jaxrl runs.
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS (offline) into $WORK/site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$WORK/site" "$WHEELS"/*.whl || env_failed "could not install the wheels in $WHEELS."
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Asked from another folder: `python -c` would find ./jaxrl in the current one.
FOUND="$(cd "$WORK" && "$PYTHON" -c 'import importlib.util as u; s = u.find_spec("jaxrl"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null)"
if [[ "$FOUND" == "$ROOT/jaxrl" ]]; then
  say "jaxrl: installed from this tree ($FOUND)"
else
  say "jaxrl: ${FOUND:-not installed}${FOUND:+ is not this tree}: using the source tree (PYTHONPATH=$ROOT)"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

# (2) Dependencies, imports and the device, before anything slow.
say "checking jaxrl's runtime dependencies (pyproject.toml)"
"$PYTHON" - "$ROOT" "$TINY" "$WORK/env.json" <<'EOF'
import importlib.metadata as md
import json
import platform
import re
import sys
import tomllib

root, tiny, env_path = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
# Declared for features this check turns off (log.tensorboard, log.plot): reported, not needed.
UNUSED = {"tensorboardx": "log.tensorboard is off", "matplotlib": "log.plot is off"}
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
with open(f"{root}/pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]

missing, old, rows = [], [], []
for dep in deps:
    if Requirement is not None:
        req = Requirement(dep)
        name, spec = req.name, req.specifier
    else:
        name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0)
        spec = dep[len(name):]
    key = name.lower().replace("_", "-")
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = None
    unused = UNUSED.get(key)
    if version is None:
        state = f"MISSING ({unused}: not needed here)" if unused else "MISSING"
        if not unused:
            missing.append(dep)
    elif Requirement is not None and not spec.contains(version, prereleases=True):
        state = f"too old/new, needs {spec}" + (f" ({unused}: not needed here)" if unused else "")
        if not unused:
            old.append(f"{dep} (found {version})")
    else:
        state = "ok" if Requirement is not None else "found (version unchecked: no packaging)"
    rows.append(f"  {name:<18} {version or '-':<14} {state}")
print("\n".join(rows))

# Their own requirements, transitively (what a wheel carried with --no-deps may still lack):
# a missing one fails, a version outside its range is only reported (upper bounds are often
# stricter than needed).
if Requirement is not None:
    from packaging.markers import default_environment
    marker_env = {**default_environment(), "extra": ""}
    seen = {Requirement(d).name.lower().replace("_", "-") for d in deps}
    queue = [Requirement(d).name for d in deps
             if Requirement(d).name.lower().replace("_", "-") not in UNUSED]
    while queue:
        parent = queue.pop()
        try:
            requires = md.requires(parent) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(marker_env):
                continue
            key = req.name.lower().replace("_", "-")
            if key in seen:
                continue
            seen.add(key)
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                missing.append(f"{req} (needed by {parent})")
                continue
            if not req.specifier.contains(version, prereleases=True):
                print(f"  note: {parent} asks for {req}, found {version}")
            queue.append(req.name)


def fail(lines):
    print("\nFAILED: " + "\n".join(lines), flush=True)
    with open(env_path + ".failed", "w") as f:  # for summary.md
        f.write("\n".join(lines) + "\n")
    sys.exit(3)

if missing or old:
    lines = ["jaxrl's runtime dependencies are not all here:"]
    if missing:
        lines.append("  missing:  " + ", ".join(missing))
    if old:
        lines.append("  wrong version:  " + ", ".join(old))
    lines.append("This check installs nothing from the network. Carry the wheels in <repo>/.whl "
                 "(benchmarks/README.md, 'GPU check') and run it again.")
    fail(lines)

try:  # what `jaxrl bench` imports, so a missing transitive dependency shows here, by name
    import jax
    import jaxrl.cli  # noqa: F401
    import jaxrl.commands.bench  # noqa: F401
    import jaxrl.run.build  # noqa: F401
except ModuleNotFoundError as e:
    fail([f"importing jaxrl's bench needs the module {e.name!r}, which is not installed "
          f"({e}). Carry its wheel in <repo>/.whl (benchmarks/README.md, 'GPU check')."])
except Exception as e:
    import traceback
    traceback.print_exc()
    fail([f"importing jaxrl's bench failed: {type(e).__name__}: {e}"])

backend = jax.default_backend()
devices = jax.devices()
print(f"  jax {jax.__version__} (jaxlib {md.version('jaxlib')}), backend {backend}: "
      f"{len(devices)} x {devices[0].device_kind}")
if not tiny and backend != "gpu":
    fail([f"no GPU visible to JAX (backend {backend!r}, devices {devices}); on a CPU "
          f"machine run `bash benchmarks/gpu_check.sh OUT_DIR --tiny`."])
versions = {n: md.version(n) for n in ("jax", "jaxlib", "flax", "optax")}
with open(env_path, "w") as f:
    json.dump({"python": platform.python_version(), "backend": backend, **versions}, f)
EOF
status=$?
((status == 0)) || env_failed "$(cat "$WORK/env.json.failed" 2>/dev/null || echo "the dependency check crashed (exit $status).")"

# (2b) --attention: cuDNN vs XLA attention in the training forward + backward.
ATTN_RC=0
if ((ATTN)); then
  ATTN_CMD=("$PYTHON" "$ROOT/benchmarks/gpu_attention.py" "$OUT")
  ((TINY)) && ATTN_CMD+=(--tiny --steps 2)
  say "attention check (timeout ${ATTN_BUDGET}s): ${ATTN_CMD[*]}"
  (cd "$WORK" && PYTHONUNBUFFERED=1 timeout --kill-after=15 "$ATTN_BUDGET" "${ATTN_CMD[@]}") \
    2>&1 | tee "$WORK/attention.txt"
  ATTN_RC=${PIPESTATUS[0]}
  say "attention check exited with status $ATTN_RC"
fi

# (2c) The engine line: benchmarks/decode.py over every device JAX sees; engine.json at once.
ENGINE_RC=0
if ((ENGINE)); then
  ENGINE_CMD=("$PYTHON" "$ROOT/benchmarks/decode.py" "${ENGINE_ARGS[@]}")
  say "engine line (timeout ${ENGINE_BUDGET}s): ${ENGINE_CMD[*]}"
  (cd "$WORK" && PYTHONUNBUFFERED=1 timeout --kill-after=15 "$ENGINE_BUDGET" \
    "${ENGINE_CMD[@]}" 2>&1 >"$WORK/engine.txt") | stamp
  ENGINE_RC=${PIPESTATUS[0]}
  cat "$WORK/engine.txt"
  if ((ENGINE_RC == 0)); then
    "$PYTHON" -c 'import json, sys; r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); r["command"] = sys.argv[3]; open(sys.argv[2], "w").write(json.dumps(r, indent=1) + "\n")' \
      "$WORK/engine.txt" "$OUT/engine.json" "${ENGINE_CMD[*]}" || ENGINE_RC=1
  fi
  ((ENGINE_RC == 137)) && ENGINE_RC=124
  say "engine line exited with status $ENGINE_RC$( ((ENGINE_RC == 124)) && echo " (TIMED OUT after ${ENGINE_BUDGET}s)")"
fi

# (3) The bench, within what is left of the budget (20 s kept for the report, and B's share
# with --compiler-ab).
LEFT=$((BUDGET - (SECONDS - START) - 20 - (AB ? AB_BUDGET : 0)))
say "compiler flags (jaxrl/perf/compiler.py) the bench adds: $(cd "$WORK" && "$PYTHON" -c 'from jaxrl.perf.compiler import compiler_flags_enabled, planned_flags; print(planned_flags() if compiler_flags_enabled() else "none: JAXRL_COMPILER_FLAGS is off")' 2>&1)"
((LEFT > 30)) || FAIL_RC=124 env_failed "only ${LEFT}s of the ${BUDGET}s budget left for the bench."
CMD=("$PYTHON" -m jaxrl.cli bench "$CONFIG" "train.run_dir=$WORK/run" "${OVERRIDES[@]}"
     --steps "$STEPS" --warmup "$WARMUP")
say "running (timeout ${LEFT}s): ${CMD[*]}"
# Its progress (stderr) is stamped (the memory line ends compilation, the flops line the
# FLOP count).
PYTHONUNBUFFERED=1 timeout --kill-after=15 "$LEFT" "${CMD[@]}" 2>&1 >"$WORK/stdout.txt" | stamp
BENCH_RC=${PIPESTATUS[0]}
cat "$WORK/stdout.txt"
if ((BENCH_RC == 124 || BENCH_RC == 137)); then
  say "bench TIMED OUT after ${LEFT}s (budget ${BUDGET}s)"
  BENCH_RC=124
else
  say "bench exited with status $BENCH_RC"
fi
for f in metrics.jsonl config.yaml; do
  [[ -f "$WORK/run/$f" ]] && cp "$WORK/run/$f" "$OUT/$f"
done

# (4) bench.json and summary.md (also after a failure: the summary then says so).
"$PYTHON" - "$OUT" "$WORK" "$BENCH_RC" "$MODE" "${CMD[*]}" <<'EOF'
import json
import re
import sys
import time
from pathlib import Path

out, work, rc, mode, cmd = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
env = json.loads((work / "env.json").read_text())
lines = (work / "stdout.txt").read_text().strip().splitlines()
bench = None
if rc == 0 and lines:
    try:
        bench = json.loads(lines[-1])
    except ValueError:
        rc = 1
if bench is not None:
    (out / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
log = (out / "log.txt").read_text(errors="replace")
params = re.search(r"policy: \w+, ([\d,]+) parameters \(([^)]*)\)", log)


def pct(x):
    return "n/a" if x is None else f"{x:.1%}"


def rate(x):
    return "n/a" if x is None else f"{x:,.0f}"


def ms(x):
    return "n/a" if x is None else f"{x * 1e3:,.1f} ms"


def size(x):
    if x is None:
        return "n/a"
    scale, unit = next((2**p, u) for p, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                       if x >= 2**p or p == 0)
    return f"{x / scale:.2f} {unit}"


def flops(x):
    if x is None:
        return "n/a"
    scale, unit = next((10**p, u) for p, u in ((15, "PFLOP"), (12, "TFLOP"), (9, "GFLOP"),
                                               (6, "MFLOP"), (0, "FLOP")) if x >= 10**p or p == 0)
    return f"{x / scale:.3g} {unit}"


try:
    import yaml

    cfg = yaml.safe_load((out / "config.yaml").read_text())
except Exception:  # no config.yaml (the bench failed early) or no yaml: left out
    cfg = None


def workload():
    if cfg is None:
        return "n/a"
    m, r, a, d = cfg["model"], cfg["rollout"], cfg["algo"], cfg["data"]
    return (f"{d['batch_size']} prompts x {r['num_generations']} generations, "
            f"{d['max_prompt_len']} prompt + {r['max_new_tokens']} new tokens "
            f"(ignore_eos {r['ignore_eos']}), microbatch {a['microbatch_size']}, "
            f"{m['dtype']}/{m['compute_dtype']}, scan_layers {m['scan_layers']}, remat "
            f"{m['remat']}, logprob_chunk_size {a['logprob_chunk_size']}, {a['mode']} step")


def analytic_decode_bound(b):
    """(tokens/s, bytes per step, bandwidth): every weight and the whole preallocated KV cache
    read once per decode step (the sampler attends over every slot, masked) at the HBM
    bandwidth of jaxrl's table; a cross-check of the bench's bound from XLA's bytes accessed."""
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}
    try:
        from types import SimpleNamespace

        from jaxrl.perf import memory_bandwidth

        bandwidth = memory_bandwidth(SimpleNamespace(device_kind=b["device_kind"]))
        m, i, r, d = cfg["model"], cfg["model"]["init"], cfg["rollout"], cfg["data"]
        weights = int(params.group(1).replace(",", ""))
        if not i["tie_word_embeddings"]:  # an input table is gathered (B rows), not read whole
            weights -= i["vocab_size"] * i["hidden_size"]
        rows = d["batch_size"] * r["num_generations"]
        slots = d["max_prompt_len"] + r["max_new_tokens"] - 1
        head_dim = i["hidden_size"] // i["num_heads"]
        cache = 2 * i["num_layers"] * rows * slots * i["num_kv_heads"] * head_dim
        step_bytes = weights * itemsize[m["dtype"]] + cache * itemsize[m["compute_dtype"]]
    except Exception:  # CPU (no bandwidth), a failed run, a config this does not model
        return None, None, None
    if bandwidth is None:
        return None, step_bytes, None
    return rows / (step_bytes / bandwidth), step_bytes, bandwidth


result = ("ok" if bench else "TIMED OUT" if rc == 124 else f"FAILED (exit {rc})")
head = [f"# jaxrl GPU check: {mode}", "",
        "| | |", "|---|---|",
        f"| date | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} |",
        f"| device_kind | {bench['device_kind'] if bench else 'n/a'}"
        f"{' x %d' % bench['num_devices'] if bench else ''} |",
        f"| jax | {env['jax']} (jaxlib {env['jaxlib']}, flax {env['flax']}, optax {env['optax']}, "
        f"Python {env['python']}) |",
        f"| policy | {params.group(1) + ' parameters (' + params.group(2) + ')' if params else 'n/a'} |",
        f"| workload | {workload()} |",
        f"| command | `{cmd}` |",
        f"| result | {result} |", ""]
if bench is None:
    body = [f"No numbers: the bench did not finish ({result}). See log.txt."]
else:
    b = bench
    share = (None if not (b["decode_tokens_per_s"] and b["decode_bound_tokens_per_s"])
             else b["decode_tokens_per_s"] / b["decode_bound_tokens_per_s"])
    bound, step_bytes, bandwidth = analytic_decode_bound(b)
    analytic_share = (None if not (b["decode_tokens_per_s"] and bound)
                      else b["decode_tokens_per_s"] / bound)
    memory = (f"{size(b['peak_memory_bytes'])} of {size(b['device_memory_bytes'])}"
              if b["peak_memory_bytes"] is not None else "n/a")
    rows = [
        ("train-step MFU", "train_mfu", pct(b["train_mfu"]),
         "model FLOPs of the train phase / (train_s x devices x peak)"),
        ("decode tokens/s", "decode_tokens_per_s", rate(b["decode_tokens_per_s"]),
         f"rows x {b['decode_steps'] + 1} tokens / generate_s (prefill included)"),
        ("decode bound tokens/s", "decode_bound_tokens_per_s",
         rate(b["decode_bound_tokens_per_s"]),
         "HBM roofline: XLA bytes accessed of one decode step / memory bandwidth"),
        ("decode share of the bound", "decode_tokens_per_s / decode_bound_tokens_per_s",
         pct(share), ""),
        ("decode bound tokens/s, analytic", "", rate(bound),
         f"rows / ({size(step_bytes)} of weights + whole KV cache per step / "
         f"{'n/a' if bandwidth is None else f'{bandwidth / 1e12:.2g} TB/s'})"),
        ("decode share of the analytic bound", "", pct(analytic_share),
         "not in bench.json: computed here from the config"),
        ("step MFU", "mfu", pct(b["mfu"]), "model FLOPs (no remat) / (step_s x devices x peak)"),
        ("step HFU", "hfu", pct(b["hfu"]), "XLA FLOPs as compiled (remat included)"),
        ("generate MFU", "generate_mfu", pct(b["generate_mfu"]), ""),
        ("peak memory", "peak_memory_bytes", memory,
         f"XLA memory analysis of the step program, per device, of device_memory_bytes "
         f"({b['memory_source']})"),
        ("completion tokens/s", "tokens_per_s", rate(b["tokens_per_s"]),
         f"{b['completion_tokens_per_step']:,.0f} tokens per step"),
        ("step time", "step_s", ms(b["step_s"]), f"median of {b['steps']} after "
         f"{b['warmup']} warm-up; min {ms(b['step_s_min'])}"),
        ("generate / train time", "generate_s / train_s",
         f"{ms(b['generate_s'])} / {ms(b['train_s'])}", "stamps inside the program"),
        ("FLOPs per step", "model / xla / analytic_flops_per_step",
         " / ".join(flops(b[k]) for k in ("model_flops_per_step", "xla_flops_per_step",
                                          "analytic_flops_per_step")), ""),
        ("peak FLOP/s per device", "peak_flops_per_device",
         "n/a" if b["peak_flops_per_device"] is None else f"{b['peak_flops_per_device'] / 1e12:.4g} TFLOP/s", b["peak_source"]),
        ("compile / FLOP count", "compile_s / count_flops_s",
         f"{b['compile_s']:.1f} s / {b['count_flops_s']:.1f} s", ""),
    ]
    body = ["| metric | key | value | how |", "|---|---|---|---|"]
    body += [f"| {a} | {f'`{k}`' if k else '-'} | {v} | {n} |" for a, k, v, n in rows]
    body += ["", "The bench's decode bound takes XLA's bytes accessed of one decode step (the "
             "KV cache updated in place, counted on the host CPU's cost model); the analytic "
             "bound counts every weight and cache byte once."]
    if b.get("flops_unknown"):
        body += ["", "FLOPs unknown to cost analysis: " + "; ".join(b["flops_unknown"])]
(out / "summary.md").write_text("\n".join(head + body) + "\n")
print("\n".join(head + body))
sys.exit(0 if bench is not None else 1)
EOF
REPORT_RC=$?
((BENCH_RC == 0 && REPORT_RC != 0)) && BENCH_RC=$REPORT_RC
if ((ATTN)); then
  { printf '\n## Attention kernels (benchmarks/gpu_attention.py, exit %s)\n\n' "$ATTN_RC"
    grep '^attention check' "$WORK/attention.txt" || echo "No result line; see log.txt."
  } >>"$OUT/summary.md"
  ((BENCH_RC == 0 && ATTN_RC != 0)) && BENCH_RC=1
fi
if ((ENGINE)); then
  "$PYTHON" - "$OUT" "$ENGINE_RC" >>"$OUT/summary.md" <<'EOF'
import json
import sys
from pathlib import Path

out, rc = Path(sys.argv[1]), int(sys.argv[2])
print(f"\n## Rollout engine (benchmarks/decode.py, exit {rc})\n")
if not (out / "engine.json").exists():
    print("No numbers: the engine line did not finish" + (" (TIMED OUT)" if rc == 124 else "")
          + ". See log.txt.")
    sys.exit()
r = json.loads((out / "engine.json").read_text())


def mib(x):
    return "n/a" if x is None else f"{x:,} B ({x / 2**20:,.1f} MiB)"


mesh = ", ".join(f"{a} {n}" for a, n in r["mesh"].items())
rows = [
    ("devices", "`device`, `mesh`", f"{r['device']}; mesh {mesh}"),
    ("workload", "-", f"{r['batch']} rows, {r['prompt_len']} prompt + {r['max_new_tokens']} new "
     f"tokens ({r['lengths']}), {r['batching']} batching, {r['slots']} slots in all, pages of "
     f"{r['page_size']}, {r['dtype']}, {r['params']:,} parameters"),
    ("generated tokens/s", "`tokens_per_s`", f"{r['tokens_per_s']:,.0f} ({r['generated_tokens']:,} "
     f"tokens in {r['rollout_s'] * 1e3:,.1f} ms, median, prefill included)"),
    ("decode step", "`decode_step_s`", "n/a" if r["decode_step_s"] is None else
     f"{r['decode_step_s'] * 1e3:.2f} ms over {r['decode_iterations']} iterations"),
    ("share of the HBM roofline", "`roofline_frac`", "n/a" if r["roofline_frac"] is None else
     f"{r['roofline_frac']:.1%} of {r['bandwidth_gbs']:,.0f} GB/s (measured copy)"),
    ("KV pool per device", "`kv_bytes_per_device`", mib(r["kv_bytes_per_device"])),
    ("peak memory per device", "`peak_memory_bytes`", mib(r["peak_memory_bytes"])),
]
print("| metric | key | value |\n|---|---|---|")
print("\n".join(f"| {a} | {k} | {v} |" for a, k, v in rows))
print(f"\nCommand: `{r['command']}`")
EOF
  ((BENCH_RC == 0 && ENGINE_RC != 0)) && BENCH_RC=1
fi

# (5) --compiler-ab: B, the same bench without jaxrl's compiler flags (the user's own
# XLA_FLAGS stay), after A; the step times are compared, so B skips the FLOP count.
if ((AB && BENCH_RC == 0)); then
  LEFT=$((BUDGET - (SECONDS - START) - 10))
  CMD_B=("$PYTHON" -m jaxrl.cli bench "$CONFIG" "train.run_dir=$WORK/run_b" "${OVERRIDES[@]}"
         perf.count_flops=false --steps "$STEPS" --warmup "$WARMUP")
  say "compiler A/B: B without jaxrl's flags (timeout ${LEFT}s): JAXRL_COMPILER_FLAGS=0 ${CMD_B[*]}"
  JAXRL_COMPILER_FLAGS=0 PYTHONUNBUFFERED=1 timeout --kill-after=15 "$LEFT" "${CMD_B[@]}" \
    2>&1 >"$WORK/stdout_b.txt" | stamp
  B_RC=${PIPESTATUS[0]}
  say "compiler A/B: B exited with status $B_RC"
  "$PYTHON" - "$OUT" "$WORK/stdout_b.txt" "$B_RC" <<'EOF'
import json
import sys
from pathlib import Path

out, stdout_b, rc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
a = json.loads((out / "bench.json").read_text())
try:
    b = json.loads(stdout_b.read_text().strip().splitlines()[-1]) if rc == 0 else None
except (IndexError, ValueError):
    b = None
lines = ["", "## XLA compiler flags: A (jaxrl/perf/compiler.py's set) vs B (none)", ""]
if b is None:
    lines.append(f"B did not finish (exit {rc}); see log.txt.")
else:
    (out / "bench_no_compiler_flags.json").write_text(json.dumps(b, indent=1) + "\n")
    lines += ["| metric | A: flags | B: none | B / A |", "|---|---|---|---|"]
    for key in ("step_s", "step_s_min", "generate_s", "train_s", "decode_tokens_per_s",
                "tokens_per_s", "peak_memory_bytes", "compile_s"):
        va, vb = a.get(key), b.get(key)
        ratio = f"{vb / va:.3f}" if va and vb is not None else "n/a"
        lines.append(f"| `{key}` | {'n/a' if va is None else f'{va:.6g}'} | "
                     f"{'n/a' if vb is None else f'{vb:.6g}'} | {ratio} |")
    lines += ["", "A ran first, then B, in one sitting; B skipped the FLOP count (step times "
              "do not include it). A's flags: the `compiler flags` line of log.txt."]
with open(out / "summary.md", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
fi
say "done in $((SECONDS - START))s: $OUT ($(cd "$OUT" && ls | tr '\n' ' '))"
exit "$BENCH_RC"
