"""Before the first step: compile the step, check that it fits in memory, count its FLOPs.

    pre = preflight(run, state, args, console)     args: the first step's arguments
        1. run.step.compile(state, *args)   the step program(s), ahead of time; later steps
                                            run these executables
        2. memory fit                       XLA's memory analysis of those programs against
                                            the device's memory (or perf.memory_limit_gib);
                                            too big -> MemoryFitError with what to change;
                                            async: the batches made ahead count too
        3. FLOP accounting                  the phase programs (`jaxrl.step.accounting`)
        4. peak FLOP/s                      table / CPU calibration / perf.peak_tflops
    pre.step_metrics(metrics, step_s)       perf/* and time/* of one fetched step

MFU = perf/model_flops / (step_s x devices x peak); HFU the same with perf/xla_flops
(DESIGN.md). A FLOP count that cost analysis could not give is left out of the metrics and
the reason printed, never replaced by a guess.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console

from jaxrl.distributed.host import wait_for_all
from jaxrl.perf import (
    MemoryFitError,
    MemoryReport,
    Peak,
    ProgramMemory,
    check_fit,
    format_bytes,
    format_flops,
    memory_limit,
    peak_flops,
    program_memory,
    utilization,
)
from jaxrl.rollout import Sampler
from jaxrl.rollout.decode_loop import row_shards
from jaxrl.rollout.pages import PoolLayout, worst_row_pages
from jaxrl.rollout.slot_count import max_concurrent_decodes
from jaxrl.run.build import Run
from jaxrl.step.accounting import StepAccounting, StepShapes, account_step
from jaxrl.step.clock import phase_times
from jaxrl.step.packing import MIN_COMPLETION


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What is known before the first step runs (module docstring)."""

    memory: MemoryReport
    accounting: StepAccounting | None  # None: perf.count_flops is off
    peak: Peak | None  # None: unknown device kind and no perf.peak_tflops
    num_devices: int
    device_kind: str
    compile_s: float
    count_s: float

    def step_metrics(self, metrics: dict[str, Any], step_s: float,
                     stamps: dict[str, float]) -> dict[str, float]:
        """time/generate_s, time/train_s and perf/* of a step from its fetched metrics."""
        out: dict[str, float] = dict(phase_times(stamps))
        if self.accounting is None:
            return out
        decode_steps = self.accounting.decode_steps(
            float(np.asarray(metrics["rollout/decode_slot_steps"])))
        for name, flops in self.accounting.metrics(decode_steps, metrics).items():
            if flops is not None:
                out[name] = flops
        for ratio, flops_name in (("perf/mfu", "perf/model_flops"),
                                  ("perf/hfu", "perf/xla_flops")):
            if flops_name in out and step_s > 0 and self.peak is not None:
                out[ratio] = utilization(out[flops_name], step_s, self.num_devices,
                                         self.peak.flops_per_s)
        return out


def preflight(run: Run, state: nnx.State, args: tuple[Any, ...], console: Console, *,
              refresh_peak: bool = False) -> Preflight:
    """Compiles, checks the memory fit and counts FLOPs of `run`'s step (module docstring);
    `refresh_peak` measures a CPU's matmul rate again instead of reading the cache."""
    cfg = run.cfg
    device = run.mesh.local_devices[0]  # this process's (a multi-process mesh spans others)
    try:
        limit, source = memory_limit(cfg.perf.memory_limit_gib, device)
    except ValueError as e:  # an accelerator that reports no limit
        limit, source = 0, str(e)
    if limit > 0:
        _check_kv_cache(run, limit, source)
    start = time.perf_counter()
    with console.status("compiling the step program..."):
        programs = _compile(run, (state, *args, run.ref_params))
    compile_s = time.perf_counter() - start
    if programs and limit > 0:
        _check_queue(run, state, args, programs, limit, source)
        try:
            memory = check_fit(programs, limit, source, memory_suggestions(run))
        except MemoryFitError as e:
            programs = _fit_kv_pool(run, (state, *args, run.ref_params), e, console)
            memory = check_fit(programs, limit, source, memory_suggestions(run))
        console.print(f"[bold]memory[/]: {memory.describe()}")
        console.print(f"[bold]train state[/]: {_train_state_bytes(run, state)}")
    else:
        memory = MemoryReport(tuple(programs), limit, source)
        why = source if limit <= 0 else "XLA gave no memory analysis on this backend"
        console.print(f"[yellow]memory[/]: the fit was not checked: {why}")

    accounting, count_s = None, 0.0
    if cfg.perf.count_flops and run.plan.multiturn:
        console.print("[yellow]flops[/]: not counted for multi-turn rollouts (the host drives "
                      "the decode steps): no perf/mfu")
    elif cfg.perf.count_flops:
        start = time.perf_counter()
        with console.status("counting FLOPs of the phase programs..."):
            accounting = account_step(
                run.step.cfg, run.model_config, run.step.sampler.config,
                StepShapes(cfg.data.batch_size, cfg.data.max_prompt_len,
                           cfg.rollout.num_generations, cfg.rollout.max_new_tokens),
                run.step.graphdef, state,
                run.step.rules.size("batch", run.mesh) if run.step.rules is not None else 1)
        count_s = time.perf_counter() - start
        _print_flops(accounting, cfg.rollout.max_new_tokens, console,
                     packs=cfg.algo.packing and cfg.rollout.max_new_tokens >= MIN_COMPLETION)
    try:
        peak = peak_flops(device, override_tflops=cfg.perf.peak_tflops, refresh=refresh_peak)
        console.print(f"[bold]peak[/]: {peak.flops_per_s / 1e12:.3g} TFLOP/s per device "
                      f"({peak.source}); {run.num_devices} x {device.device_kind}")
    except ValueError as e:  # an accelerator missing from the table: no MFU, still train
        peak = None
        console.print(f"[yellow]peak[/]: unknown, no MFU/HFU: {e}")
    # The first step's collectives wait for a process still compiling only 30 s (gloo):
    # every process has its programs before any goes on.
    wait_for_all("jaxrl: step programs compiled")
    return Preflight(memory, accounting, peak, run.num_devices, device.device_kind, compile_s,
                     count_s)


def _compile(run: Run, args: tuple[Any, ...]) -> list[ProgramMemory]:
    """Compiles the step program(s) for `args`; their memory analysis (where XLA gives it),
    an async step's rollout programs holding its queue too (`_queue_bytes`)."""
    compiled = run.step.compile(*args)
    programs = [m for name, c in compiled.items()
                if (m := program_memory(name, c)) is not None]
    queue = _queue_bytes(run, args[0], args[1:5])
    programs = [dataclasses.replace(m, argument_bytes=m.argument_bytes + queue)
                if m.name in ROLLOUT_PROGRAMS else m for m in programs]
    if run.ref_params is not None and "generate" in compiled:
        # Split mode: the reference copy is live through the generate program too, though
        # not one of its arguments.
        programs = [dataclasses.replace(m, argument_bytes=m.argument_bytes + _device_bytes(
            run.ref_params)) if m.name == "generate" else m for m in programs]
    return programs


ROLLOUT_PROGRAMS = ("generate", "start", "resume", "finish")  # an async step's rollout side


def _batch_bytes(run: Run, state: nnx.State, args: tuple[Any, ...]) -> int:
    """Per rollout device: the bytes one queued batch of an async step holds (a made rollout
    with its reward inputs, or one in flight with its KV cache, whichever is larger)."""
    entries = run.queue.abstract_entries(run.step.policy_params(state), *args)
    return max(sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree)) for tree in entries.values())


def _queue_bytes(run: Run, state: nnx.State, args: tuple[Any, ...]) -> int:
    """Per rollout device: the max_staleness batches an async step keeps made ahead beside
    the one its rollout program makes (0 for other steps)."""
    if not run.plan.max_staleness:
        return 0
    return run.plan.max_staleness * _batch_bytes(run, state, args)


def _check_queue(run: Run, state: nnx.State, args: tuple[Any, ...],
                 programs: list[ProgramMemory], limit: int, source: str) -> None:
    """Refuses an algo.max_staleness whose queue of batches made ahead cannot fit beside the
    rollout program on a rollout device, naming it and the most that fits: a value of 10^6
    made the rollout side generate batches ahead for ever instead of an error."""
    queue = _queue_bytes(run, state, args)
    rollout = [p for p in programs if p.name in ROLLOUT_PROGRAMS]
    if not queue or not rollout or max(p.peak_bytes for p in rollout) <= limit:
        return
    k = run.plan.max_staleness
    per_batch = queue // k
    peak = max(p.peak_bytes for p in rollout) - queue
    fit = max(0, (limit - peak) // per_batch)
    raise MemoryFitError(
        f"algo.max_staleness={k:,} keeps up to {k:,} batches made ahead on each rollout "
        f"device ({format_bytes(per_batch)} each, {format_bytes(queue)} in all) beside the "
        f"rollout program's {format_bytes(peak)}, more than the {format_bytes(limit)} "
        f"available ({source}); at most algo.max_staleness={fit:,} fits (1-4 is usual: "
        f"every step of staleness trains on older rollouts)", MemoryReport(tuple(programs),
                                                                           limit, source))


def _fit_kv_pool(run: Run, args: tuple[Any, ...], error: MemoryFitError,
                 console: Console) -> list[ProgramMemory]:
    """The step recompiled with the largest KV pool that fits, when the engine's default
    pool (every slot's worst case at once) does not and `rollout.engine.row_pages` is unset; else
    the error stands. A pool of R row pages makes the peak a convex, piecewise linear
    function of R (a constant part, and the generate phase's part growing with R), so the
    line through the peaks at one worst-case row (R_min) and at the default (R_max) bounds it
    from above:  R = R_min + (limit - peak(R_min)) / ((peak(R_max) - peak(R_min)) /
    (R_max - R_min)). Fewer pages than slots' worst cases: rows wait for pages to come back.
    If even R_min does not fit, its MemoryFitError is raised."""
    sampler, cfg, report = run.step.sampler, run.cfg, error.report
    engine = sampler.config.engine
    if engine is None or engine.row_pages is not None:
        raise error
    prompt_len, new = args[1].ids_BxP.shape[1], cfg.rollout.max_new_tokens
    layout = PoolLayout.plan(page_size=engine.page_size, num_prompts=cfg.data.batch_size,
                             prompt_len=prompt_len, max_new_tokens=new,
                             num_slots=max_concurrent_decodes(engine, run.rows))
    # Rows split over d devices (`rollout_on_mesh`): each holds R / d pages, at least one
    # worst-case row's.
    shards = row_shards(sampler.mesh, sampler.rules, run.rows)
    worst = shards * worst_row_pages(prompt_len, new, layout.page_size)
    most = layout.row_pages
    if most <= worst:
        raise error

    def compile_with(row_pages: int) -> list[ProgramMemory]:
        config = dataclasses.replace(sampler.config, engine=dataclasses.replace(
            engine, row_pages=row_pages))
        run.step.use_sampler(Sampler(sampler.graphdef, config, mesh=sampler.mesh,
                                     rules=sampler.rules))
        with console.status(f"compiling the step with a KV pool of {row_pages:,} row "
                            f"pages..."):
            return _compile(run, args)

    least = check_fit(compile_with(worst), report.limit_bytes, report.limit_source,
                      memory_suggestions(run))
    per_page = (report.peak_bytes - least.peak_bytes) / (most - worst)
    pages = min(most - 1, worst + int((report.limit_bytes - least.peak_bytes) // per_page))
    programs = compile_with(pages)  # per_page > 0: the least pool fits, the default did not
    console.print(f"[bold]KV pool[/]: {pages:,} row pages of {layout.page_size} tokens "
                  f"(~{format_bytes(int(per_page))} of peak each) fit beside the rest of the "
                  f"step; every slot's worst "
                  f"case at once needs {most:,}, so rows may wait for pages "
                  f"(rollout.engine.row_pages sets the pool)")
    return programs


def _check_kv_cache(run: Run, limit: int, source: str) -> None:
    """Refuses, before compiling, a rollout whose KV cache alone cannot fit: per device at
    least  layers * 2 * rows * kv_heads * head_dim * (prompt + new tokens) * bytes / devices.
    (XLA itself aborts the process on shapes whose element count overflows, which a
    max_new_tokens of 10^9 reaches, so the compiled program's analysis comes too late.)"""
    cfg, config = run.cfg, run.model_config
    tokens = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    per_token = config.num_layers * 2 * run.rows * config.num_kv_heads * config.head_dim * itemsize
    devices = (run.rollout_mesh or run.mesh).size  # the devices that generate
    kv_bytes = per_token * tokens // devices
    if kv_bytes > limit:
        fit = limit * devices // per_token - cfg.data.max_prompt_len
        raise MemoryFitError(
            f"the rollout's KV cache alone needs {format_bytes(kv_bytes)} per device "
            f"({run.rows} rows x {tokens:,} tokens = data.max_prompt_len "
            f"{cfg.data.max_prompt_len} + rollout.max_new_tokens {cfg.rollout.max_new_tokens:,}, "
            f"over {devices} devices), more than the {format_bytes(limit)} available "
            f"({source}); rollout.max_new_tokens must be well under {max(fit, 0):,} (where the "
            f"cache alone fills the memory), or data.batch_size / rollout.num_generations "
            f"smaller", MemoryReport((), limit, source))


def _print_flops(accounting: StepAccounting, max_new_tokens: int, console: Console, *,
                 packs: bool = False) -> None:
    full = max_new_tokens - 1  # decode steps when no completion stops early
    model, xla, analytic = (accounting.metrics(full)[k] for k in
                            ("perf/model_flops", "perf/xla_flops", "perf/analytic_flops"))
    console.print(f"[bold]flops[/] per step (all {max_new_tokens} tokens decoded): model "
                  f"{format_flops(model)}, XLA {format_flops(xla)}, analytic "
                  f"{format_flops(analytic)}")
    if packs:
        console.print("  train FLOPs of a packed step (algo.packing) count its real tokens: "
                      "the padded programs' x train/real_token_frac (XLA: x train/run_row_frac)")
    for line in accounting.model.unknown() + accounting.hardware.unknown():
        console.print(f"[yellow]flops unknown[/]: {line}")


def memory_suggestions(run: Run) -> list[str]:
    """Concrete changes that shrink the step's peak memory, for this config."""
    cfg, out = run.cfg, []
    rows = cfg.data.batch_size * cfg.rollout.num_generations
    minibatch, num_micro = cfg.algo.batch_split(rows)
    micro = minibatch // num_micro
    if micro > 1:
        smaller = next(m for m in range(micro // 2, 0, -1) if minibatch % m == 0)
        out.append(f"algo.microbatch_size={smaller} (now {micro} rows per gradient pass: "
                   f"training activations scale with it)")
    if cfg.model.remat == "none":
        out.append("model.remat=block (keep only each block's input; recompute the rest in "
                   "the backward pass)")
    if run.step.cfg.logprob_chunk_size is None and run.model_config.vocab_size > 8192:
        out.append(f"algo.logprob_chunk_size=8192 (never hold [rows, completion, "
                   f"{run.model_config.vocab_size}] logits at once)")
    if run.mesh.size > 1 and run.mesh.shape.get("fsdp", 1) < run.mesh.size:
        out.append(f"a layout with more fsdp (sharding.layout=fsdp: parameters and optimizer "
                   f"state split over all {run.mesh.size} devices; now {dict(run.mesh.shape)})")
    elif run.mesh.size == 1 and jax.device_count() > 1:
        out.append(f"sharding.layout=fsdp (use all {jax.device_count()} devices, not one)")
    if cfg.rollout.max_new_tokens > 1:
        out.append(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens // 2} (the KV cache "
                   f"and training sequences shrink with it)")
    if run.model_config.param_dtype == "float32":
        out.append("model.dtype=bfloat16 (half the parameter and optimizer memory)")
    out.append(f"data.batch_size={max(1, cfg.data.batch_size // 2)} (fewer prompts per step)")
    return out


def _train_state_bytes(run: Run, state: nnx.State) -> str:
    """Per device: the policy, what of it is trained, and the optimizer state (with LoRA
    the adapters and their moments only: what the report shows LoRA saving)."""
    model, optimizer = _device_bytes(state["model"]), _device_bytes(state["optimizer"])
    if run.cfg.model.lora is None:
        return (f"policy {format_bytes(model)} (all trained), optimizer state "
                f"{format_bytes(optimizer)} per device")
    lora = run.cfg.model.lora
    adapters = _device_bytes(nnx.filter_state(state["model"], nnx.LoRAParam))
    return (f"policy {format_bytes(model)} of which LoRA adapters {format_bytes(adapters)} "
            f"(rank {lora.rank}; the base is frozen), optimizer state "
            f"{format_bytes(optimizer)} per device (a full fine-tune's would be about "
            f"{format_bytes(2 * (model - adapters))})")


def _device_bytes(tree: Any) -> int:
    """Bytes of `tree`'s arrays held by one device (the first shard of each)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
