"""`jaxrl serve`'s errors found before anything is loaded or allocated: a taken port before
the policy loads; a `train.run_dir` that does not exist or holds no policy, named; an
explicit `serve.max_slots` whose KV cache does not fit, refused by the memory fit before the
engine allocates its pool. Each a ConfigError / MemoryFitError (exit 2)."""

import socket

import pytest
from rich.console import Console

from jaxrl.commands import serve as serve_command
from jaxrl.config import ConfigError, ExperimentConfig, load_config, shipped_config
from jaxrl.perf.memory import MemoryFitError
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
