"""What a run leaves on disk, read back: the run directory's names (`files`), its
checkpoints (`checkpoint`) and the policy at one of them (`policy`). It sits below both the
trainer (`jaxrl.run`, which writes them) and serving (`jaxrl.serve`, which reads them), so
neither imports the other."""
