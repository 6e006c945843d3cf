"""`jaxrl serve CONFIG [overrides] [--step N]`: serve a policy with JetStream over gRPC.

    port     serve.host:serve.port bound first: a taken one is refused before anything loads
    policy   with train.run_dir: its checkpoint N (newest without --step), else its
             final_model/ (a run_dir missing or holding neither is refused, naming it); else
             model.path; on the mesh of sharding.layout
    slots    serve.max_slots, or as many as fit in serve.memory_fraction of a device times the
             devices of the rollout layout's batch axes (the slots split over them,
             `jaxrl.rollout.slots_on_mesh`); an explicit count whose share of one device
             does not fit is refused before the pool is allocated
    server   JetStream's orchestrator and gRPC service on that port (`jaxrl.serve.server`),
             every program compiled first (serve.warmup)
    prints   "serving on HOST:PORT" (stderr) once it answers, then serves until SIGTERM or
             SIGINT: new requests are refused, those in flight finish (serve.drain_timeout_s),
             the command returns its JSON line with exit 0; a second Ctrl-C cuts the drain
             (exit 130)

Needs the extra: `pip install 'jaxrl[jetstream]'`; without it, exit 2 saying so.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from rich.console import Console

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.tokenizer import load_tokenizer, rollout_end_ids
from jaxrl.models import load_policy
from jaxrl.perf.memory import MemoryFitError, format_bytes, memory_limit
from jaxrl.rollout import serving
from jaxrl.rollout.slots_on_mesh import SlotSplit, batch_devices
from jaxrl.saved.checkpoint import Checkpoints
from jaxrl.saved.files import FINAL_MODEL_DIR
from jaxrl.saved.policy import load_run_policy
from jaxrl.sharding import make_mesh, resolve_layout


def run_serve(cfg: ExperimentConfig, console: Console, *, step: int | None = None,
              stop: threading.Event | None = None) -> dict[str, Any]:
    """Serves until SIGTERM / SIGINT (or `stop` is set); returns the JSON summary."""
    try:
        from jaxrl.serve.server import Server
    except ImportError as e:  # jaxrl.serve.jetstream's message says how to install it
        raise ConfigError(str(e)) from None
    if jax.process_count() > 1:
        raise ConfigError(f"jaxrl serve runs in one process (one host's devices), got "
                          f"{jax.process_count()} processes; start it without "
                          f"distributed.* settings")
    serve = cfg.serve
    # The port first: a taken one is found before the policy loads and compiles.
    server = Server(serve.host, serve.port, threads=serve.max_slots or serving.MAX_FIT_SLOTS)
    try:
        return _serve(cfg, console, step, stop or threading.Event(), server)
    finally:
        server.close()  # after an error or a second signal: requests in flight are cut


def _serve(cfg: ExperimentConfig, console: Console, step: int | None, stop: threading.Event,
           server: Any) -> dict[str, Any]:
    """`run_serve` once the port is bound: load, size, compile, serve until a signal."""
    from jaxrl.serve.engine import EngineSpec, JetStreamEngine, place

    serve = cfg.serve
    layout = resolve_layout(cfg.sharding.layout)
    mesh = make_mesh(layout)
    model, model_dir, source = _policy(cfg, step, mesh, layout.rollout_rules)
    tokenizer = load_tokenizer(model_dir)
    model_config, (graphdef, params) = model.config, nnx.split(model)
    # Only the copy the engine serves stays: the model as loaded (another dtype, or a
    # checkpoint restored onto one device) is dropped before the slots are sized.
    params = place(params, model_config.compute_dtype, mesh, layout.rollout_rules)
    del model
    slots = _slots(cfg, model_config, params, mesh, layout.rollout_rules)
    spec = EngineSpec.of(cfg, model_config, num_slots=slots,
                         end_token_ids=rollout_end_ids(tokenizer, model_config, cfg.rollout),
                         tokenizer_dir=str(model_dir))
    engine = JetStreamEngine(graphdef, params, spec, mesh=mesh, rules=layout.rollout_rules)
    del params
    console.print(f"[bold]serve[/]: {source} on mesh {dict(mesh.shape)}, {slots} slots "
                  f"({engine.split.describe()}), prompts up to {serve.max_prefill_length} tokens, up to "
                  f"{serve.max_new_tokens} new tokens, stop ids {list(spec.end_token_ids)}",
                  soft_wrap=True)  # one line, for grep and logs
    if serve.warmup:
        start = time.perf_counter()
        engine.warmup()
        console.print(f"compiled {len(spec.buckets)} prefill buckets {list(spec.buckets)}, "
                      f"insert and generate in {time.perf_counter() - start:.1f}s")
    server.serve(engine, engine.load_params(), max_new_tokens=serve.max_new_tokens)
    signals = _Signals()
    try:
        server.start()
        address = f"{serve.host}:{server.port}"
        console.print(f"[bold green]serving on {address}[/] (JetStream gRPC; SIGTERM or "
                      f"Ctrl-C drains and stops)")
        started = time.perf_counter()
        while signals.name is None and not stop.is_set():  # polled (`_Signals`)
            time.sleep(0.2)
        received = signals.name or "stop"
        server.drain(serve.drain_timeout_s, on_refusing=lambda: console.print(
            f"[bold]serve[/]: {received} received: draining (up to {serve.drain_timeout_s:g}s; "
            f"new requests are refused; a second Ctrl-C stops at once)"))
    finally:
        signals.restore()
    console.print("[bold]serve[/]: stopped")
    return {"address": address, "port": server.port, "slots": slots, "policy": source,
            "served_s": round(time.perf_counter() - started, 3)}


def _policy(cfg: ExperimentConfig, step: int | None, mesh, rules):
    """(model, its tokenizer's directory, a description) by the module docstring's order."""
    run_dir = Path(cfg.train.run_dir) if cfg.train.run_dir else None
    if run_dir is not None and not run_dir.is_dir():
        raise ConfigError(f"train.run_dir={str(run_dir)!r} "
                          f"{'is a file' if run_dir.exists() else 'does not exist'}; expected a "
                          f"run directory holding checkpoints/ or final_model/ (or leave "
                          f"train.run_dir unset and give model.path)")
    if run_dir is not None and (run_dir / "checkpoints").is_dir():
        checkpoints = Checkpoints(run_dir, async_save=False)
        try:
            has_steps = bool(checkpoints.steps())
        finally:
            checkpoints.close()
        if has_steps:
            restored, model, model_dir = load_run_policy(run_dir, step)
            return model, model_dir, f"checkpoint of step {restored} of {run_dir}"
    if step is not None:
        raise ConfigError(f"--step {step} needs train.run_dir to hold checkpoints, got "
                          f"train.run_dir={cfg.train.run_dir}")
    if run_dir is not None and (run_dir / FINAL_MODEL_DIR / "config.json").is_file():
        path = run_dir / FINAL_MODEL_DIR
    elif run_dir is not None:
        raise ConfigError(f"train.run_dir={str(run_dir)!r} holds no policy: no checkpoint in "
                          f"checkpoints/ and no {FINAL_MODEL_DIR}/config.json (a run saves them "
                          f"as it trains and at its end); give a run directory that has one, or "
                          f"leave train.run_dir unset and give model.path")
    elif cfg.model.path:
        path = Path(cfg.model.path)
    else:
        raise ConfigError("jaxrl serve needs a policy: model.path=an HF model directory, or "
                          "train.run_dir=a run directory with checkpoints or final_model/")
    # The served policy is whole weights (final_model/ holds LoRA merged): no new adapters.
    load = dataclasses.replace(cfg.model.load_settings(), lora=None)
    model = load_policy(path, load, mesh=mesh, rules=rules)
    return model, path, str(path)


def _slots(cfg: ExperimentConfig, model_config, params: nnx.State, mesh, rules) -> int:
    """serve.max_slots (refused when one device's share of their KV pages does not fit), or
    what fits on one device beside the weights (`params`: as served, one device's share of
    them) times the devices the slots split over (`rules`: the rollout rules)."""
    serve = cfg.serve
    devices = batch_devices(mesh, rules)
    memory, where = memory_limit(cfg.perf.memory_limit_gib)
    device = jax.local_devices()[0]
    weights = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
                  if s.device == device)
    kw = dict(max_prefill_length=serve.max_prefill_length,
              max_new_tokens=serve.max_new_tokens, page_size=cfg.rollout.engine.page_size)
    per_slot = serving.slot_bytes(model_config, **kw)
    if serve.max_slots is not None:  # checked before the engine allocates the pool
        fit = serving.slots_that_fit(model_config, memory_bytes=memory, weight_bytes=weights,
                                     fraction=serve.memory_fraction, cap=None, **kw)
        split = SlotSplit.over(mesh, rules, serve.max_slots)
        if split.local_slots > fit:
            raise MemoryFitError(
                f"serve.max_slots={serve.max_slots:,} needs "
                f"{format_bytes(split.local_slots * per_slot)} of KV cache per device "
                f"(slots: {split.describe()}; {format_bytes(per_slot)} per slot) beside {format_bytes(weights)} of "
                f"weights, more than fits in serve.memory_fraction="
                f"{serve.memory_fraction:g} of {format_bytes(memory)} ({where}): at most "
                f"{fit * devices:,} slots fit ({fit:,} per device over {devices} devices); set "
                f"serve.max_slots={fit * devices} or null (as many as fit), or lower "
                f"serve.max_prefill_length / serve.max_new_tokens", None)
        return serve.max_slots
    slots = serving.slots_that_fit(model_config, memory_bytes=memory, weight_bytes=weights,
                                   fraction=serve.memory_fraction, **kw) * devices
    if slots < 1:
        raise MemoryFitError(
            f"no decode slot fits: {format_bytes(weights)} of weights and "
            f"{format_bytes(per_slot)} of KV cache per slot against "
            f"{serve.memory_fraction:g} x {format_bytes(memory)} ({where}); lower "
            f"serve.max_prefill_length or serve.max_new_tokens, or use more devices", None)
    return slots


class _Signals:
    """SIGTERM and SIGINT (main thread only): the first sets `name`, which the serving loop
    polls (a handler that took a lock, as `Event.set` does, could wait forever on the main
    thread it interrupted); a second Ctrl-C (SIGINT) raises KeyboardInterrupt, which cuts
    the drain (exit 130)."""

    def __init__(self):
        self.name, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.name is None:
            self.name = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        # A repeated SIGTERM changes nothing: wrappers (timeout, srun, shells) often pass
        # one on to a process that already got its own.

    def restore(self) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
