"""What runs around the compiled step: building a run, the loop, claiming its directory,
preemption, metrics, progress, evaluation and the preflight (its checkpoints and the names of
what it saves: `jaxrl.saved`). `jaxrl.run.loop.train` is what `jaxrl train` calls."""
