"""The `distributed` section: how this process joins a multi-process run, checked when it is
made; `jaxrl.distributed.setup` acts on it and the experiment config holds it."""

from __future__ import annotations

import dataclasses

from jaxrl.config_base import fail, require_at_least


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """`distributed`: how this process joins a multi-process run (`jaxrl.distributed.setup`)."""

    coordinator_address: str | None = None  # host:port of process 0; env JAX_COORDINATOR_ADDRESS
    num_processes: int | None = None  # env JAX_NUM_PROCESSES
    process_id: int | None = None  # env JAX_PROCESS_ID
    auto: bool = True  # detect SLURM jobs of several tasks and Cloud TPU VMs
    initialization_timeout_s: int = 300  # how long to wait for every process to join
    heartbeat_timeout_s: int = 100  # a process silent this long counts as dead: all exit

    def __post_init__(self):
        if self.coordinator_address is not None and not is_address(self.coordinator_address):
            fail("distributed", self, "coordinator_address", "host:port")
        require_at_least("distributed", self, ("num_processes", "initialization_timeout_s",
                                               "heartbeat_timeout_s"))
        require_at_least("distributed", self, ("process_id",), 0)

def is_address(text: str) -> bool:
    """Whether `text` is host:port."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
