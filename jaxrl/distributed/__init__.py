"""Runs that span several processes (hosts): joining them (`setup`) and the host-side data
helpers every process uses on its own rows (`host`)."""

from jaxrl.distributed.host import (
    broadcast,
    from_local_rows,
    is_lost_peer,
    is_main,
    local_rows,
    process_rows,
    sync,
)
from jaxrl.distributed.setup import detect, initialize

__all__ = ["broadcast", "detect", "from_local_rows", "initialize",
           "is_lost_peer", "is_main", "local_rows", "process_rows", "sync"]
