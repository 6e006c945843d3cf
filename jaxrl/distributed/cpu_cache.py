"""On CPU, every process of a multi-process run keeps its own programs in JAX's persistent
compilation cache (when one is configured: JAX_COMPILATION_CACHE_DIR).

JAX stores compiled programs from process 0 only: on a TPU or GPU cluster every process
computes the same cache key, so the others read what process 0 wrote, and one writer spares a
shared filesystem. On CPU the key hashes the host's device topology, whose fingerprint
differs per process (jax 0.10.2), so a process other than process 0 never finds its
programs and compiles every one of them on every run, while process 0, reading its own from
the cache, waits for it in the first collective. `launch/local_multiprocess.sh` runs and
SLURM jobs on CPU are such runs (the time saved: benchmarks/README.md, "Host-side setup
costs").

So each non-zero CPU process writes its entries too, under the conditions JAX applies to
process 0 (no host callbacks, at least the minimum compile time; a failed write only warns).
This wraps a private JAX function (`jax._src.compiler._cache_write`): where a JAX version
lacks it, nothing changes. Other platforms keep JAX's behaviour.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any


def write_every_cpu_process() -> bool:
    """Lets every CPU process write its own cache entries; returns whether it could (this
    JAX has the functions it wraps). Idempotent."""
    try:
        from jax._src import compilation_cache, compiler, distributed
        from jax._src import config as jax_config
        original = compiler._cache_write
        put = compilation_cache.put_executable_and_time
        min_compile_s = jax_config.persistent_cache_min_compile_time_secs
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_jaxrl_every_cpu_process", False):
        return True

    @functools.wraps(original)
    def cache_write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any,
                    executable: Any, host_callbacks: Any) -> None:
        process_id = distributed.global_state.process_id
        if process_id == 0 or getattr(backend, "platform", None) != "cpu":
            return original(cache_key, compile_time_secs, module_name, backend, executable,
                            host_callbacks)
        if host_callbacks or compile_time_secs < min_compile_s.value:
            return None
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # as JAX does: a cache that cannot be written is not an error
            warnings.warn(f"process {process_id}: cannot write the persistent compilation "
                          f"cache entry of {module_name!r}: {type(e).__name__}: {e}",
                          stacklevel=2)
        return None

    cache_write._jaxrl_every_cpu_process = True  # type: ignore[attr-defined]
    compiler._cache_write = cache_write
    return True
