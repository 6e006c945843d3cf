"""The one place jaxrl imports JetStream (google-jetstream 0.2.2, the `jetstream` extra).

JetStream 0.2.2 is the last release (its repository is archived, read-only) and predates
two things this module makes up for, once, on import:

- Its orchestrator calls `jax.tree_map`, which JAX has since removed (the call fails, and
  JetStream's driver threads kill the process on any error): `jax.tree_map` is set to
  `jax.tree.map` (the same function) when it is missing.
- Importing its orchestrator sets the root logger to DEBUG with a handler on stdout, which
  would print JAX's and gRPC's debug logs and a line per decode step: the root logger's
  level and handlers are put back as they were.

Importing it also imports TensorFlow (through seqio, for SentencePiece): seconds of start-up
(benchmarks/README.md, "Host-side setup costs"), and a few start-up lines on stderr from its C++ logging, which TF_CPP_MIN_LOG_LEVEL no
longer silences (checked with TensorFlow 2.21).
"""

from __future__ import annotations

import logging

import jax

INSTALL_HINT = "pip install 'jaxrl[jetstream]'"


class MissingExtraError(ImportError):
    """JetStream is not installed."""


if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map  # see the module docstring

_root = logging.getLogger()
_level, _handlers = _root.level, list(_root.handlers)
try:
    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
    from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
except ImportError as e:
    raise MissingExtraError(f"serving needs JetStream, which is not installed ({e}); install "
                            f"the extra: {INSTALL_HINT}") from None
finally:
    _root.setLevel(_level)
    for _handler in list(_root.handlers):
        if _handler not in _handlers:
            _root.removeHandler(_handler)

__all__ = ["INSTALL_HINT", "MissingExtraError", "engine_api", "jetstream_pb2",
           "jetstream_pb2_grpc", "orchestrator", "tokenizer_api", "tokenizer_pb2"]
