"""`jaxrl serve`'s errors found before anything is loaded or allocated: a taken port before
the policy loads; a `train.run_dir` that does not exist or holds no policy, named; an
explicit `serve.max_slots` whose KV cache does not fit, refused by the memory fit before the
engine allocates its pool. Each a ConfigError / MemoryFitError (exit 2). And the slot count
the memory fit gives, one device's share times the devices the slots split over."""

import socket

import jax
import pytest
from flax import nnx
from rich.console import Console

from jaxrl.commands import serve as serve_command
from jaxrl.config import ConfigError, ExperimentConfig, load_config, shipped_config
from jaxrl.models import from_pretrained
from jaxrl.perf.memory import MemoryFitError
from jaxrl.rollout import serving
from jaxrl.serve import engine as serve_engine


def _config(*overrides):
    """The config `jaxrl serve OVERRIDES` runs with (the quickstart's, as without a file)."""
    return load_config(ExperimentConfig, shipped_config("quickstart.yaml"), [
        "serve.host=127.0.0.1", "serve.port=0", "serve.warmup=false", *overrides])


def _serve(cfg):
    return serve_command.run_serve(cfg, Console(quiet=True))


@pytest.fixture
def nothing_loaded(monkeypatch):
    """The policy and the engine must not be made."""
    def refuse(*args, **kwargs):
        raise AssertionError("loaded or allocated before the error")

    monkeypatch.setattr(serve_command, "_policy", refuse)
    monkeypatch.setattr(serve_engine, "JetStreamEngine", refuse)


def test_a_taken_port_is_refused_before_the_policy_loads(model_dir, nothing_loaded):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port} \(serve.host, "
                                              r"serve.port\): the port is taken"):
            _serve(_config(f"model.path={model_dir}", f"serve.port={port}"))


def test_a_run_dir_that_does_not_exist_or_holds_no_policy_is_named(model_dir, tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(ConfigError, match=rf"train.run_dir='{missing}' does not exist; "
                                          r"expected a run directory"):
        _serve(_config(f"train.run_dir={missing}", f"model.path={model_dir}"))
    empty = tmp_path / "run"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "init_model").mkdir()
    with pytest.raises(ConfigError, match=rf"train.run_dir='{empty}' holds no policy: no "
                                          r"checkpoint in checkpoints/ and no final_model/"):
        _serve(_config(f"train.run_dir={empty}"))


def test_max_slots_that_do_not_fit_are_refused_before_the_pool_is_allocated(model_dir,
                                                                            monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine allocated its pool")

    monkeypatch.setattr(serve_engine, "JetStreamEngine", refuse)
    cfg = _config(f"model.path={model_dir}", "serve.max_slots=10000000",
                  "perf.memory_limit_gib=1", "serve.max_prefill_length=16")
    with pytest.raises(MemoryFitError) as e:
        _serve(cfg)
    text = str(e.value)
    assert text.startswith("serve.max_slots=10,000,000 needs "), text
    fit = int(text.split("at most ")[1].split(" slots fit")[0].replace(",", ""))
    assert 1 <= fit < 10_000_000 and f"set serve.max_slots={fit} or null" in text
    assert "perf.memory_limit_gib" in text


class _Sized(Exception):
    """Raised instead of making the engine: the slot count it was given."""


def test_the_slots_that_fit_are_what_fits_on_one_device_times_the_devices(model_dir,
                                                                          monkeypatch):
    """The slots split over the batch axes' devices (8 with fsdp), so one device holds its
    share: null sizes that share by the memory fit and multiplies it by the devices, and an
    explicit count is checked by its share of one device."""
    def sized(graphdef, params, spec, **kwargs):
        raise _Sized(spec.num_slots)

    monkeypatch.setattr(serve_engine, "JetStreamEngine", sized)

    def config(*overrides):
        return _config(f"model.path={model_dir}", "perf.memory_limit_gib=0.001",
                       "serve.max_prefill_length=16", *overrides)

    def slots(*overrides):
        with pytest.raises(_Sized) as e:
            _serve(config(*overrides))
        return e.value.args[0]

    cfg = config()
    model = from_pretrained(model_dir)  # fsdp's rollout rules replicate the weights
    one = serving.slots_that_fit(
        model.config, memory_bytes=int(0.001 * 2**30),
        weight_bytes=sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))),
        max_prefill_length=16, max_new_tokens=cfg.serve.max_new_tokens,
        page_size=cfg.rollout.engine.page_size, fraction=cfg.serve.memory_fraction)
    assert 1 < one < 64  # the memory limit, not the cap, decides
    assert slots("sharding.layout=fsdp") == 8 * one
    assert slots("sharding.layout=fsdp", f"serve.max_slots={8 * one}") == 8 * one
    with pytest.raises(MemoryFitError, match=rf"at most {8 * one} slots fit \({one} per "
                                             rf"device over 8 devices\); set "
                                             rf"serve.max_slots={8 * one} or null"):
        _serve(config("sharding.layout=fsdp", f"serve.max_slots={8 * one + 8}"))
