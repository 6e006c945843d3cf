"""What runs around the compiled step: building a run, the loop, its directory, checkpoints,
preemption, metrics, progress, evaluation and the preflight. `jaxrl.run.loop.train` is what
`jaxrl train` calls."""
