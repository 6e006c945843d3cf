"""The `jaxrl` command: `jaxrl COMMAND [CONFIG.yaml] [dotted.key=value ...]`.

Thin by design: parse, load the typed config, call the library. What the user sees when
something goes wrong is decided here, once for every command:

    exit 2    bad input: a config key, model or data file, run directory, checkpoint; one
              message naming the thing and what was expected
    exit 1    a fault: training stopped (non-finite updates, failing rewards), disk full, an
              environment that failed or broke its contract during a step, a crash of jaxrl
              or of user code (reward)
    exit 130  Ctrl-C (train: after the step in flight and a checkpoint; a second one at once)

No traceback is printed unless `--debug` or JAXRL_DEBUG=1 asks for it (then it comes before
the same one-line message).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import traceback

# jaxrl uses transformers for tokenizers only: its "PyTorch was not found" advice is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

from jaxrl.config import ConfigError, load_config, shipped_config  # noqa: E402
from jaxrl.models.config import UnsupportedModelError  # noqa: E402
from jaxrl.models.hf_io import CheckpointError  # noqa: E402
from jaxrl.perf.compiler import apply_compiler_flags  # noqa: E402
from jaxrl.perf.memory import MemoryFitError  # noqa: E402
from jaxrl.runtime import configure_xla  # noqa: E402
from jaxrl.sharding.layout import LayoutError  # noqa: E402

EXIT_CONFIG_ERROR = 2
EXIT_TRAINING_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C'd command
DEBUG_ENV = "JAXRL_DEBUG"


def _join(cfg, console: Console, *, preemption: bool = False) -> None:
    """Joins the run's other processes, if it has any (`jaxrl.distributed.setup`), before
    anything touches a JAX backend; every process but 0 then prints nothing but errors.
    `preemption`: SIGTERM stops all processes after one step (train) instead of ending one."""
    from jaxrl.distributed import initialize, is_main

    try:
        initialize(cfg.distributed, preemption=preemption)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not is_main():
        console.quiet = True


def _emit(result: dict) -> None:
    """The command's JSON result line on stdout (process 0 only)."""
    from jaxrl.distributed import is_main

    if is_main():
        print(json.dumps(result))


def _check(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.check import CheckConfig, run_check

    cfg = load_config(CheckConfig, args.config, args.overrides)
    summary = run_check(cfg, console)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _generate(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.generate import GenerateConfig, run_generate

    run_generate(load_config(GenerateConfig, args.config, args.overrides), console)
    return 0


def _experiment(args: argparse.Namespace, console: Console, *, preemption: bool = False):
    """(config path, ExperimentConfig) of train / bench / eval, joined to the run's other
    processes; without a config file, the quickstart (shipped inside the package)."""
    from jaxrl.config import ExperimentConfig

    path = args.config or str(shipped_config("quickstart.yaml"))
    cfg = load_config(ExperimentConfig, path, args.overrides)
    _join(cfg, console, preemption=preemption)
    return path, cfg


def _train(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.train import run_train

    path, cfg = _experiment(args, console, preemption=True)
    summary = run_train(cfg, console, path)
    _emit(summary)
    return EXIT_INTERRUPTED if summary.get("stopped_by") == "SIGINT" else 0


def _bench(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.bench import run_bench

    path, cfg = _experiment(args, console)
    _emit(run_bench(cfg, console, path, steps=args.steps, warmup=args.warmup,
                    profile=args.profile))
    return 0


def _eval(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.eval import run_eval

    _, cfg = _experiment(args, console)
    _emit(run_eval(cfg, console, step=args.step))
    return 0


def _step_option(verb: str):
    """The `--step N` option of a command that reads one checkpoint of a run."""
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--step", type=int, default=None,
                            help=f"{verb} this checkpoint's step (default: the latest)")
    return add


def _serve(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.serve import run_serve

    _, cfg = _experiment(args, console)
    _emit(run_serve(cfg, console, step=args.step))
    return 0


def _export(args: argparse.Namespace, console: Console) -> int:
    from jaxrl.commands.export import run_export

    if args.config is None or args.overrides:
        raise ConfigError(f"export takes one run directory and no overrides: "
                          f"jaxrl export RUN_DIR --out DIR, got {[args.config, *args.overrides]}")
    print(json.dumps(run_export(args.config, args.out, console, step=args.step,
                                adapter=args.adapter)))
    return 0


def _export_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the new HF model directory to write")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT adapter directory "
                             "instead of the merged model")
    _step_option("export")(parser)


def _bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    parser.add_argument("--profile", action="store_true",
                        help="write a jax.profiler trace of the measured steps to the run dir")


COMMANDS = {
    "check": (_check, "build a model on the device mesh, print its layout, run a sharded forward"),
    "generate": (_generate, "sample completions from a model directory for a few prompts"),
    "train": (_train, "run an RL experiment (GRPO family) from a config and overrides"),
    "bench": (_bench, "time the RL step of a config: tokens/s, MFU, HFU, time split, memory"),
    "eval": (_eval, "evaluate a run's policy on held-out prompts: reward, exact match, pass@k"),
    "export": (_export, "write a run's checkpoint as a Hugging Face model directory"),
    "serve": (_serve, "serve a policy over gRPC with JetStream (the jetstream extra)"),
}
OPTIONS = {"bench": _bench_options, "eval": _step_option("evaluate"), "export": _export_options,
           "serve": _step_option("serve")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", nargs="?", help="experiment YAML (optional for check)")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        p.add_argument("--debug", action="store_true",
                       help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")
        if name in OPTIONS:
            OPTIONS[name](p)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_xla()
    apply_compiler_flags()  # before any backend starts; JAXRL_COMPILER_FLAGS=0: off
    parser = build_parser()
    # Overrides may also follow options (`bench cfg.yaml --steps 3 a.b=1`): argparse leaves
    # positionals after an option unparsed, so they are taken back here.
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    # A first positional with '=' is an override, not a config path.
    if args.config is not None and "=" in args.config:
        args.overrides = [args.config, *args.overrides]
        args.config = None
    # Logs and CI capture stderr: do not fold the layout table to 80 columns there.
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    args.debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        status = _run(args, console)
    except BaseException:
        if _several_processes():
            traceback.print_exc()
            _exit_now(EXIT_TRAINING_FAILED)
        raise
    if status and _several_processes():
        _exit_now(status)
    return status


def _several_processes() -> bool:
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def _exit_now(status: int) -> None:
    """Ends a failed process of a multi-process run at once. A normal exit would wait (up to
    JAX's shutdown timeout) for the others, which may be waiting for this one in a
    collective; gone, it is seen as dead by the coordinator's health check, which ends them
    too within `distributed.heartbeat_timeout_s`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(args: argparse.Namespace, console: Console) -> int:
    """Runs the command; a failure prints one line (module docstring) and returns its exit
    status."""
    errors = _ErrorConsole(console)
    try:
        return COMMANDS[args.command][0](args, console)
    except BaseException as e:
        status, text = _describe(e)
        if status is None:
            raise  # SystemExit and the like: not a failure of the command
        if args.debug:
            traceback.print_exc()
        errors.print(text)
        return status


OUR_NOTES = ("async:",)  # how the notes jaxrl adds to an exception begin


def _describe(e: BaseException) -> tuple[int | None, str]:
    """(exit status, console message) of a command's failure; (None, "") for an exception
    that is not one (SystemExit)."""
    # Imported here: the training loop and orbax are heavy, and most commands need neither.
    from jaxrl.distributed import is_lost_peer
    from jaxrl.envs.base import EnvFailure
    from jaxrl.run.loop import TrainingStopped
    from jaxrl.saved.checkpoint import RestoreError

    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "[bold yellow]interrupted[/] (Ctrl-C)"
    if not isinstance(e, Exception):
        return None, ""
    # jaxrl's notes say where the error arose (the asynchronous step's side): part of the
    # message; others (JAX's on its filtered traceback) are not.
    notes = [n for n in getattr(e, "__notes__", []) if n.startswith(OUR_NOTES)]
    text = "; ".join([str(e).strip(), *notes])
    message = escape(text)
    if isinstance(e, ConfigError):
        return EXIT_CONFIG_ERROR, f"[bold red]config error[/]: {message}"
    if isinstance(e, FileNotFoundError | LayoutError | UnsupportedModelError | CheckpointError
                  | MemoryFitError | RestoreError):
        return EXIT_CONFIG_ERROR, f"[bold red]error[/]: {message}"
    if isinstance(e, TrainingStopped):
        return EXIT_TRAINING_FAILED, f"[bold red]training stopped[/]: {message}"
    if isinstance(e, EnvFailure):
        return EXIT_TRAINING_FAILED, f"[bold red]environment failed[/]: {message}"
    if isinstance(e, PermissionError):
        return EXIT_CONFIG_ERROR, (f"[bold red]error[/]: permission denied: "
                                   f"{escape(str(e.filename))} cannot be written or read "
                                   f"({escape(e.strerror or str(e))})")
    if is_lost_peer(e):
        return EXIT_TRAINING_FAILED, (
            f"[bold red]error[/]: lost contact with another process of this run: a collective "
            f"between the processes failed ({type(e).__name__}: "
            f"{escape(str(e).splitlines()[0][:300])}); another process has probably died: see "
            f"its output")
    if (full := _disk_full(e)) is not None:
        what, why = full
        return EXIT_TRAINING_FAILED, (f"[bold red]error[/]: the disk is full: writing "
                                      f"{escape(what)} failed ({escape(why)}); free space and "
                                      f"run the same command again (a run resumes from its "
                                      f"last checkpoint)")
    return EXIT_TRAINING_FAILED, (f"[bold red]error[/]: {type(e).__name__}: "
                                  f"{escape(text[:2000])} (rerun with --debug or "
                                  f"{DEBUG_ENV}=1 for the traceback)")


_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (?:28|122)\]"
                        r"|OS error (?:28|122)\b")


def _disk_full(e: BaseException) -> tuple[str, str] | None:
    """(what was written, why) when `e` or an exception it came from is a full disk: an
    OSError with ENOSPC / EDQUOT, or (orbax's asynchronous saves, tensorstore) an error whose
    text says so; None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return str(e.filename or "?"), e.strerror or str(e)
        if _DISK_FULL.search(str(e)):
            return "a checkpoint or a log", str(e).strip().splitlines()[0][:300]
        e = e.__cause__ or e.__context__
    return None


class _ErrorConsole:
    """Prints errors on every process (the main console is quiet on all but process 0),
    naming the process when the run has several."""

    def __init__(self, console: Console):
        self.console = console

    def print(self, text: str) -> None:
        import jax

        prefix = ""
        if jax.distributed.is_initialized() and jax.process_count() > 1:
            prefix = f"process {jax.process_index()}/{jax.process_count()}: "
        quiet, self.console.quiet = self.console.quiet, False
        try:
            self.console.print(prefix + text, soft_wrap=True)  # one line, for grep and logs
        finally:
            self.console.quiet = quiet


if __name__ == "__main__":
    sys.exit(main())
