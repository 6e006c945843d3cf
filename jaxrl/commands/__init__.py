"""What each `jaxrl` subcommand does, one module per command; `jaxrl/cli.py` only dispatches."""
