"""Joining a multi-process run: when and how `jax.distributed.initialize` is called.

JAX's multi-controller runtime runs the same program in every process over one global mesh;
`jax.distributed.initialize` connects the processes (a coordinator on process 0, health
checks, the key-value store orbax uses for multi-host checkpoints). It must run before
anything touches a JAX backend, so the `jaxrl` command calls `initialize(cfg.distributed)`
right after reading the config. Which processes form the run:

    explicit   distributed.coordinator_address / num_processes / process_id, or the
               environment JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (a
               config value wins over the environment); all three are needed. Used by
               `launch/local_multiprocess.sh`; joins even when num_processes is 1.
    SLURM      SLURM_NTASKS > 1 (an `srun` of several tasks): JAX reads the job's
               environment (coordinator: the first node; one GPU per task unless
               JAX_LOCAL_DEVICE_IDS says otherwise, `launch/slurm_gpu.sbatch`).
    TPU VM     a Cloud TPU VM whose slice has several workers (or a multislice): JAX finds
               them from the VM's metadata and environment. A single-host TPU VM runs alone.
    none       otherwise: one process over the local devices, no initialize.

`distributed.auto: false` turns the SLURM and TPU detection off (an `srun` that starts one
independent jaxrl per task on purpose, say). On CPU the processes' collectives go over gloo (TCP),
and each process keeps its own programs in JAX's persistent compilation cache (`cpu_cache`).

When a process dies, the others learn it from the coordinator's health checks within
`distributed.heartbeat_timeout_s` and exit with JAX's "another task died" error instead of
waiting forever in a collective.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import jax

from jaxrl.distributed.cpu_cache import write_every_cpu_process
from jaxrl.distributed.settings import DistributedSection, is_address

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

How = Literal["explicit", "slurm", "tpu", "none", "already"]


@dataclasses.dataclass(frozen=True)
class Explicit:
    coordinator_address: str
    num_processes: int
    process_id: int


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def explicit_settings(section: DistributedSection) -> Explicit | None:
    """The coordinator, process count and id from the config or the environment; None when
    none of them is set. Raises ValueError naming what is missing when only some are."""
    env_address = os.environ.get(ENV_ADDRESS) or None
    if env_address is not None and not is_address(env_address):
        raise ValueError(f"environment variable {ENV_ADDRESS} must be host:port, got "
                         f"{env_address!r}")
    values = {
        "coordinator_address": section.coordinator_address or env_address,
        "num_processes": (section.num_processes if section.num_processes is not None
                          else _env_int(ENV_NUM_PROCESSES)),
        "process_id": (section.process_id if section.process_id is not None
                       else _env_int(ENV_PROCESS_ID)),
    }
    missing = [k for k, v in values.items() if v is None]
    if len(missing) == 3:
        return None
    if missing:
        env = {"coordinator_address": ENV_ADDRESS, "num_processes": ENV_NUM_PROCESSES,
               "process_id": ENV_PROCESS_ID}
        raise ValueError(
            "a multi-process run needs all of distributed.coordinator_address, num_processes "
            "and process_id (or the environment " + ", ".join(env.values()) + "); missing: "
            + ", ".join(f"distributed.{k} ({env[k]})" for k in missing))
    settings = Explicit(**values)
    if settings.num_processes < 1 or not 0 <= settings.process_id < settings.num_processes:
        raise ValueError(f"distributed.process_id={settings.process_id} must be in "
                         f"0..num_processes-1 with num_processes={settings.num_processes}")
    return settings


_SLURM_STEP = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")  # what JAX's SLURM detection reads: set inside an srun step


def _slurm_tasks() -> int:
    """The tasks of this SLURM job step (0: not inside an srun step)."""
    if not all(name in os.environ for name in _SLURM_STEP):
        return 0
    return _env_int("SLURM_STEP_NUM_TASKS") or _env_int("SLURM_NTASKS") or 0


def _tpu_processes() -> int:
    """The workers of the TPU slice(s) this Cloud TPU VM belongs to (0: not a TPU VM, or
    unknown), as JAX's own cluster detection counts them (the VM's metadata, or the
    TPU_WORKER_HOSTNAMES / MEGASCALE_* environment of GKE and multislice). Those classes are
    JAX internals, hence the guard: without them a pod slice needs explicit settings."""
    try:
        from jax._src.clusters import cloud_tpu_cluster as tpu

        for cluster in (tpu.GkeTpuCluster, tpu.GceTpuCluster):
            if cluster.is_env_present():
                return int(cluster.get_process_count())
    except Exception:
        pass
    return 0


def detect(section: DistributedSection) -> How:
    """Which kind of multi-process run this process belongs to (module docstring)."""
    if jax.distributed.is_initialized():
        return "already"
    if explicit_settings(section) is not None:
        return "explicit"
    if section.auto and _slurm_tasks() > 1:
        return "slurm"
    if section.auto and _tpu_processes() > 1:
        return "tpu"
    return "none"


def initialize(section: DistributedSection, *, preemption: bool = True) -> How:
    """Joins the multi-process run this process belongs to, if any; returns how it was
    detected. Call before any JAX computation (and before `jax.devices()`).

    `preemption`: run JAX's preemption service, which takes over SIGTERM for the life of the
    process so that all processes stop after the same step (`jaxrl.run.preemption`); off,
    SIGTERM ends the process as usual (commands that do not checkpoint).
    """
    how = detect(section)
    if how in ("none", "already"):
        return how
    jax.config.update("jax_enable_preemption_service", preemption)
    # CPU processes exchange collectives over TCP; without this a CPU run of several
    # processes cannot run a program that spans them. Other backends ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(initialization_timeout=section.initialization_timeout_s,
                    heartbeat_timeout_seconds=section.heartbeat_timeout_s)
    if how == "explicit":
        s = explicit_settings(section)
        jax.distributed.initialize(s.coordinator_address, s.num_processes, s.process_id,
                                   **timeouts)
    else:
        jax.distributed.initialize(**timeouts)  # JAX reads the SLURM / TPU environment
    write_every_cpu_process()  # on CPU each process caches its own programs (`cpu_cache`)
    return how
