"""Process-wide XLA settings jaxrl relies on; applied before JAX starts its backends.

XLA may skip the rounding of intermediate bf16 results inside a fusion ("excess
precision"), and which roundings it skips depends on how each program happens to fuse. The
sampler and the trainer are different programs over the same model code, so with bf16
compute their log-probs of the same tokens then differ by up to ~1e-2 (measured on CPU);
with excess precision off both round every bf16 op the same way and agree to fp32 roundoff
(~2e-7). The `jaxrl` command applies this; Python users call `configure_xla()` before
their first JAX computation, or set the flag in XLA_FLAGS themselves.
"""

from __future__ import annotations

import os

STRICT_BF16_FLAG = "--xla_allow_excess_precision=false"


def configure_xla() -> None:
    """Adds jaxrl's XLA flags to XLA_FLAGS unless the user already set them either way."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {STRICT_BF16_FLAG}".strip()
