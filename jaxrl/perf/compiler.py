"""XLA compiler settings per platform: one table each for CPU, GPU and TPU, every flag with
what it does and the gain measured (where, with what command), or why it is set unmeasured.

XLA reads XLA_FLAGS (CPU, GPU) and libtpu reads LIBTPU_INIT_ARGS (TPU) once, when JAX starts
a backend, so `apply_compiler_flags()` runs before that: the `jaxrl` command calls it first
thing; Python users call it before their first JAX computation. It only adds: a flag already
in the variable (either value) is the user's and is kept, so calling it twice adds nothing.
`JAXRL_COMPILER_FLAGS=0` turns it off (an environment variable, not a config key: the flags
must be in place before any config is read, for every command alike).

Only the tables of platforms this process can run on are applied, decided without starting
a backend (`platforms()`): JAX_PLATFORMS when set, else CPU, plus GPU when a CUDA/ROCm plugin
is installed, plus TPU when libtpu is. The reason not to apply all three at once: an unknown
flag in XLA_FLAGS aborts the process ("Unknown flag in XLA_FLAGS", checked with jaxlib
0.10.2), so a GPU flag that a later jaxlib drops must not take CPU runs down with it.
tests/perf/test_compiler.py runs the CPU and GPU tables through this machine's jaxlib.

Besides flags, one lowering: JAX's threefry random bits on CPU unrolled as on GPU/TPU
(`unroll_cpu_threefry`, applied with the flags; the same bits, fewer copies).

The one flag jaxrl needs for correctness, not speed (XLA's bf16 excess precision off, so the
sampler's and the trainer's log-probs agree), is `jaxrl.runtime.configure_xla`: always on.
Nothing here may change numerics (no fast-math, no NaN-dropping min/max).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil

OFF_ENV = "JAXRL_COMPILER_FLAGS"
FLAGS_ENV = {"cpu": "XLA_FLAGS", "gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}

# XLA:CPU. Empty: nothing tried won clearly and repeatably (benchmarks/README.md, "XLA
# compiler flags on CPU", has the flags, the commands and the numbers). This jaxlib already
# sends dots to YNNPACK fusions, so the XNNPACK, oneDNN and FAST_RUNTIME options left the
# compiled code byte-identical; YNNPACK's eltwise/reduce fusions change the results (by fp32
# roundoff), and jaxrl's results must not depend on this table.
CPU_FLAGS: tuple[str, ...] = ()

# XLA:GPU. Not measured yet (benchmarks/README.md keeps what was);
# `bash benchmarks/gpu_check.sh OUT --compiler-ab` measures the set against none.
GPU_FLAGS: tuple[str, ...] = (
    # Schedules each program so asynchronous collectives (the FSDP all-gathers and
    # reduce-scatters, the train -> rollout reshard) overlap with compute; off by default in
    # XLA (jaxlib 0.10-0.11), on in NVIDIA's JAX containers, and the first flag of JAX's "GPU
    # performance tips". One GPU has no collectives to hide: expect ~no change there.
    # Command buffers (CUDA graphs) need no flag: XLA records fusions, cuBLAS(Lt), cuDNN,
    # custom calls and conditionals by default since jaxlib 0.10 (while loops, the decode
    # loop, are not; no published recommendation to add them, so not set unmeasured).
    "--xla_gpu_enable_latency_hiding_scheduler=true",
)

# libtpu. Not measured yet (benchmarks/README.md keeps what was). The asynchronous
# collective fusion set that MaxText's TPU recipes pass (benchmarks/xla_flags_library.py
# there: "enabled by default but let's make sure"): an all-gather runs as an asynchronous
# fusion, over several steps, overlapped with the TensorCore's compute: the FSDP layouts'
# weight all-gathers. Collective matmul (windowed einsum) is left out: no published flag
# recommendation for libtpu found, MaxText implements it in model code.
TPU_FLAGS: tuple[str, ...] = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)

TABLES = {"cpu": CPU_FLAGS, "gpu": GPU_FLAGS, "tpu": TPU_FLAGS}
# JAX_PLATFORMS names -> the table that serves them.
_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}
_GPU_PLUGINS = ("xla_cuda", "xla_rocm")  # jax_plugins.xla_cuda12, ..._cuda13, ..._rocm7


def platforms() -> tuple[str, ...]:
    """The platforms ("cpu", "gpu", "tpu") this process may run on, known without starting
    a JAX backend: JAX_PLATFORMS when set, else CPU and what the installed plugins add."""
    requested = os.environ.get("JAX_PLATFORMS", "").strip()
    if requested:
        names = (_PLATFORM_NAMES.get(p.strip().lower()) for p in requested.split(","))
        return tuple(dict.fromkeys(n for n in names if n))
    found = ["cpu"]
    # The PJRT plugins JAX would load live in the `jax_plugins` namespace package (listed
    # without importing them, as JAX's own discovery does first).
    plugins = importlib.util.find_spec("jax_plugins")
    if plugins is not None and any(
            m.name.startswith(_GPU_PLUGINS)
            for m in pkgutil.iter_modules(plugins.submodule_search_locations or [])):
        found.append("gpu")
    if importlib.util.find_spec("libtpu") is not None:
        found.append("tpu")
    return tuple(found)


def flag_name(flag: str) -> str:
    """`--xla_foo=1` -> `xla_foo` (XLA also takes `-xla_foo` and a bare boolean `--xla_foo`)."""
    return flag.lstrip("-").split("=", 1)[0]


def planned_flags(on: tuple[str, ...] | None = None) -> dict[str, list[str]]:
    """{environment variable: flags `apply_compiler_flags` would add}, for the platforms
    `on` (default: `platforms()`); a flag the variable already names is left out."""
    planned: dict[str, list[str]] = {}
    for platform in on if on is not None else platforms():
        var = FLAGS_ENV[platform]
        present = {flag_name(f) for f in os.environ.get(var, "").split()}
        present |= {flag_name(f) for f in planned.get(var, [])}
        new = [f for f in TABLES[platform] if flag_name(f) not in present]
        if new:
            planned.setdefault(var, []).extend(new)
    return planned


def compiler_flags_enabled() -> bool:
    """False when JAXRL_COMPILER_FLAGS is 0 / false / no / off."""
    return os.environ.get(OFF_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def apply_compiler_flags() -> dict[str, list[str]]:
    """Adds this platform's table to XLA_FLAGS / LIBTPU_INIT_ARGS, after what the user set;
    returns what was added. Call before JAX starts a backend; a no-op when turned off."""
    if not compiler_flags_enabled():
        return {}
    unroll_cpu_threefry()
    planned = planned_flags()
    for var, flags in planned.items():
        os.environ[var] = " ".join([os.environ.get(var, ""), *flags]).strip()
    return planned


def unroll_cpu_threefry() -> bool:
    """Lowers JAX's threefry2x32 on CPU as on GPU/TPU, its 5 rounds unrolled; returns whether
    it could (False: this jax has not the private names, and nothing changes).

    JAX lowers it on CPU as a 5-trip loop (jax/_src/random/threefry2x32.py: less to compile),
    whose two carries XLA:CPU copies every trip: in the sampler's Gumbel noise, [rows, vocab]
    u32 each, per decode step; unrolled, those copies go (benchmarks/README.md has the
    measurement). The same integer operations in the same order: the random bits are
    identical (tests/perf/test_compiler.py).
    """
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32
        mlir.register_lowering(threefry2x32.threefry2x32_p,
                               threefry2x32._threefry2x32_lowering_rule, platform="cpu")
    except (ImportError, AttributeError):
        return False
    return True
