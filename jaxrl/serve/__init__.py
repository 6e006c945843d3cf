"""Serving a policy with JetStream (the optional extra: `pip install 'jaxrl[jetstream]'`).

    jaxrl.serve.jetstream   the one place JetStream is imported (and its one shim)
    jaxrl.serve.tokenizer   the model directory's HF tokenizer as JetStream's Tokenizer
    jaxrl.serve.engine      jaxrl's engine (`jaxrl.rollout.serving`) as JetStream's Engine
    jaxrl.serve.server      JetStream's orchestrator and gRPC service, checked requests,
                            a drain on SIGTERM

The rest of jaxrl never imports this package; `jaxrl serve` does, and says how to install
the extra when it is missing.
"""
