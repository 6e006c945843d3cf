"""XLA's memory analysis of real compiled programs, the device's memory, and the fit check."""

import os

import jax
import jax.numpy as jnp
import pytest

from jaxrl.perf.memory import (
    MemoryFitError,
    ProgramMemory,
    check_fit,
    device_memory,
    format_bytes,
    program_memory,
)

N = 512
MATRIX_BYTES = N * N * 4  # one float32 N×N matrix


class FakeDevice:
    def __init__(self, device_kind, platform, stats):
        self.device_kind, self.platform, self._stats = device_kind, platform, stats

    def memory_stats(self):
        return self._stats


def _compiled(fn, donate=()):
    return jax.jit(fn, donate_argnums=donate).lower(jnp.ones((N, N), jnp.float32)).compile()


def test_program_memory_of_a_compiled_program():
    mem = program_memory("step", _compiled(lambda x: (x @ x) @ x))
    assert mem.name == "step"
    assert mem.argument_bytes == MATRIX_BYTES and mem.output_bytes == MATRIX_BYTES
    assert mem.peak_bytes >= mem.argument_bytes
    assert mem.peak_bytes == (mem.argument_bytes + mem.output_bytes - mem.alias_bytes
                              + mem.temp_bytes + mem.generated_code_bytes)


def test_donation_lowers_the_peak_by_the_aliased_bytes():
    kept = program_memory("step", _compiled(lambda x: x * 2 + 1))
    donated = program_memory("step", _compiled(lambda x: x * 2 + 1, donate=(0,)))
    assert donated.alias_bytes == MATRIX_BYTES
    assert donated.peak_bytes == kept.peak_bytes - MATRIX_BYTES


class _NoAnalysis:
    def __init__(self, error):
        self.error = error

    def memory_analysis(self):
        if self.error:
            raise NotImplementedError("no buffer assignment on this backend")


@pytest.mark.parametrize("error", [False, True])
def test_program_memory_is_none_without_analysis(error):
    assert program_memory("step", _NoAnalysis(error)) is None


def _program(name="step", args=2**30, outputs=2**30, alias=2**30, temps=2**31, code=0):
    return ProgramMemory(name, args, outputs, alias, temps, code)


def test_check_fit_under_a_big_limit():
    programs = [_program("generate", temps=2**30), _program("train")]
    report = check_fit(programs, 24 * 2**30, "host memory / 8 CPU devices", ["unused"])
    assert report.fits and report.peak_bytes == 3 * 2**30
    assert report.describe() == (
        "generate program: 2.0 GiB peak per device (arguments 1.0, outputs 1.0, donated -1.0, "
        "temporaries 1.0 GiB) of 24.0 GiB (host memory / 8 CPU devices); "
        "train program: 3.0 GiB peak per device (arguments 1.0, outputs 1.0, donated -1.0, "
        "temporaries 2.0 GiB) of 24.0 GiB (host memory / 8 CPU devices)")


def test_check_fit_raises_with_numbers_and_suggestions():
    programs = [_program("generate", temps=2**30), _program("train", code=2**29)]
    suggestions = ["set train.remat=full", "halve data.batch_size"]
    with pytest.raises(MemoryFitError) as info:
        check_fit(programs, 3 * 2**30, "NVIDIA H200 memory_stats bytes_limit", suggestions)
    message = str(info.value)
    assert "3.5 GiB per device, more than the 3.0 GiB available" in message
    assert "NVIDIA H200 memory_stats bytes_limit" in message
    assert "generate program: 2.0 GiB peak per device" in message
    assert "train program: 3.5 GiB peak per device" in message and "code 0.5 GiB" in message
    assert message.endswith("Try one of:\n  - set train.remat=full\n  - halve data.batch_size")
    assert not info.value.report.fits and info.value.report.peak_bytes == int(3.5 * 2**30)


def test_check_fit_with_a_real_program_and_a_tiny_limit():
    mem = program_memory("step", _compiled(lambda x: (x @ x) @ x))
    with pytest.raises(MemoryFitError) as info:
        check_fit([mem], 1024, "a tiny test limit", ["use a bigger device"])
    message = str(info.value)
    assert message.startswith(f"the step needs {format_bytes(mem.peak_bytes)} per device, more "
                              f"than the 1.0 KiB available (a tiny test limit):\n")
    assert (f"  step program: {format_bytes(mem.peak_bytes)} peak per device (arguments 1.0, "
            f"outputs 1.0, donated 0.0, temporaries ") in message


def test_check_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        check_fit([], 2**30, "limit", [])
    with pytest.raises(ValueError, match="got 0"):
        check_fit([_program()], 0, "limit", [])


def test_device_memory_on_cpu_is_host_memory_shared_by_the_devices():
    limit, source = device_memory(jax.devices()[0])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < limit == host // 8
    assert source == "host memory / 8 CPU devices"


def test_device_memory_of_an_accelerator_is_its_bytes_limit():
    gpu = FakeDevice("NVIDIA H200", "gpu", {"bytes_limit": 140 * 2**30, "bytes_in_use": 0})
    assert device_memory(gpu) == (140 * 2**30, "NVIDIA H200 memory_stats bytes_limit")
    with pytest.raises(ValueError, match="'Mystery X1'"):
        device_memory(FakeDevice("Mystery X1", "gpu", None))


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0.0 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (int(3.2 * 2**30), "3.2 GiB"),
    (2**41, "2.0 TiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text
