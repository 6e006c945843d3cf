"""The memory fit before the first step: the engine's KV pool is sized to what fits."""

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from jaxrl.config import ExperimentConfig, load_config
from jaxrl.perf import MemoryFitError
from jaxrl.rollout.pages import worst_row_pages
from jaxrl.run.preflight import _print_flops
from jaxrl.run.start import start_run
from tests.commands.test_failures import QUICKSTART

# Long completions, small training microbatches: the KV pool is most of the step's memory
# when the rollout does not split its rows over the devices (measured per device, fsdp over
# the 8 test devices with the rollout's rows unsplit: 28.0 MiB peak with every slot's worst
# case; 13.1 MiB with 355 row pages); split (fsdp as shipped), 9.3 MiB.
POOL_HEAVY = ["rollout.max_new_tokens=128", "algo.microbatch_size=4", "eval.num_prompts=0",
              "log.tensorboard=false", "log.plot=false", "perf.count_flops=false"]
LIMIT_GIB = 0.015  # 15.4 MiB: between the two


def _unsplit_layout(tmp_path):
    """fsdp, but the rollout keeps every row on every device (its pool replicated)."""
    text = (Path(__file__).parents[2] / "sharding" / "fsdp.yaml").read_text()
    train, rollout = text.split("  rollout:")
    path = tmp_path / "unsplit.yaml"
    path.write_text(train + "  rollout:" + rollout.replace("batch: [data, fsdp]", "batch: null", 1))
    return f"sharding.layout={path}"


def _start(tmp_path, *overrides):
    cfg = load_config(ExperimentConfig, QUICKSTART, [f"train.run_dir={tmp_path / 'run'}",
                                                    *POOL_HEAVY, *overrides])
    out = io.StringIO()
    started = start_run(cfg, "fit", Console(file=out, width=200))
    return started, out.getvalue()


def test_the_kv_pool_shrinks_to_what_fits(tmp_path):
    started, out = _start(tmp_path, f"perf.memory_limit_gib={LIMIT_GIB}",
                          _unsplit_layout(tmp_path))
    memory, engine = started.pre.memory, started.run.step.sampler.config.engine
    worst = worst_row_pages(6, 128, 16)
    assert memory.fits and memory.peak_bytes <= LIMIT_GIB * 2**30
    # Fewer pages than 256 slots' worst case, more than one row's; the step runs with them.
    assert worst < engine.row_pages < 256 * worst, engine
    assert f"KV pool: {engine.row_pages:,} row pages" in out, out
    assert started.run.step.num_compilations() == 1
    started.checkpoints.close()


def test_a_set_kv_pages_is_not_resized(tmp_path):
    """rollout.engine.row_pages is the user's: too big is an error naming the step's numbers."""
    with pytest.raises(MemoryFitError, match="per device, more than the"):
        _start(tmp_path, f"perf.memory_limit_gib={LIMIT_GIB}", _unsplit_layout(tmp_path),
               f"rollout.engine.row_pages={256 * worst_row_pages(6, 128, 16)}")


def test_rows_split_over_the_devices_fit_with_every_slots_worst_case(tmp_path):
    """The same step with the rollout's rows split over the 8 devices (fsdp as shipped):
    each device holds an eighth of the pool, and every slot's worst case fits."""
    started, _ = _start(tmp_path, f"perf.memory_limit_gib={LIMIT_GIB}")
    memory, engine = started.pre.memory, started.run.step.sampler.config.engine
    assert memory.fits and memory.peak_bytes <= LIMIT_GIB * 2**30
    assert engine.row_pages is None  # not shrunk
    started.checkpoints.close()


@pytest.mark.parametrize("packs", [False, True])
def test_the_flops_line_says_how_a_packed_steps_train_flops_count(packs):
    """Preflight's FLOPs line counts all decode steps; a packed run's adds that its train
    FLOPs follow its real tokens. A stand-in accounting: the line, not the count, is tested."""
    counted = {"perf/model_flops": 2e9, "perf/xla_flops": 3e9, "perf/analytic_flops": 4e9}
    none = SimpleNamespace(unknown=list)
    accounting = SimpleNamespace(metrics=lambda decode_steps: counted, model=none,
                                 hardware=none)
    out = io.StringIO()
    _print_flops(accounting, 64, Console(file=out, width=200), packs=packs)
    text = out.getvalue()
    assert "per step (all 64 tokens decoded): model 2" in text and "XLA 3" in text, text
    assert ("train FLOPs of a packed step" in text) == packs, text
