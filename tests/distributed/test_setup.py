"""When jaxrl joins a multi-process run, from the config, the environment, SLURM or a TPU VM;
and bad settings named before anything starts."""

import pytest

from jaxrl.config import ConfigError, DistributedSection, ExperimentConfig, load_config
from jaxrl.distributed import setup
from jaxrl.distributed.setup import detect, explicit_settings

REAL_TPU_PROCESSES = setup._tpu_processes
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
       "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
       "SLURM_STEP_NUM_TASKS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(setup, "_tpu_processes", lambda: 0)


def test_nothing_set_is_a_single_process_run():
    assert explicit_settings(DistributedSection()) is None
    assert detect(DistributedSection()) == "none"


def test_environment_gives_the_explicit_settings_and_config_wins(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    s = explicit_settings(DistributedSection())
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:1234", 4, 3)
    s = explicit_settings(DistributedSection(process_id=1, coordinator_address="h:9"))
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("h:9", 4, 1)
    assert detect(DistributedSection()) == "explicit"


def test_partial_settings_name_what_is_missing(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    with pytest.raises(ValueError, match=r"missing: distributed.num_processes "
                                         r"\(JAX_NUM_PROCESSES\), distributed.process_id"):
        explicit_settings(DistributedSection())
    with pytest.raises(ValueError, match="process_id=2 must be in 0..num_processes-1"):
        explicit_settings(DistributedSection(num_processes=2, process_id=2))
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer, got 'two'"):
        explicit_settings(DistributedSection())


@pytest.mark.parametrize("override, message", [
    ("distributed.coordinator_address=nohost", "must be host:port, got 'nohost'"),
    ("distributed.num_processes=0", "num_processes must be >= 1, got 0"),
    ("distributed.heartbeat_timeout_s=0", "heartbeat_timeout_s must be >= 1"),
])
def test_bad_config_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, None, [override])


def test_slurm_with_several_tasks_is_detected_and_auto_false_turns_it_off(monkeypatch):
    for name, value in (("SLURM_JOB_ID", "42"), ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0"),
                        ("SLURM_NTASKS", "1")):
        monkeypatch.setenv(name, value)
    assert detect(DistributedSection()) == "none"  # a batch script, not an srun step
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-02]")
    assert detect(DistributedSection()) == "none"  # one task: nothing to join
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert detect(DistributedSection()) == "slurm"
    assert detect(DistributedSection(auto=False)) == "none"


def test_a_tpu_slice_of_several_workers_is_detected_a_single_host_is_not(monkeypatch):
    monkeypatch.setattr(setup, "_tpu_processes", lambda: 1)
    assert detect(DistributedSection()) == "none"
    monkeypatch.setattr(setup, "_tpu_processes", lambda: 4)
    assert detect(DistributedSection()) == "tpu"
    assert detect(DistributedSection(auto=False)) == "none"


def test_off_a_tpu_vm_jax_counts_no_tpu_workers():
    assert REAL_TPU_PROCESSES() == 0
