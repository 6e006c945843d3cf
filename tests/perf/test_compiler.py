"""The compiler-flag tables: a flag the user set wins, the off switch works, nothing is added
twice, each platform's flags go to its variable, and the CPU and GPU tables are accepted by
the installed jaxlib (an unknown flag in XLA_FLAGS aborts the process)."""

import json
import os
import subprocess
import sys

import pytest

import jaxrl.cli
from jaxrl.perf import compiler
from jaxrl.perf.compiler import (
    CPU_FLAGS,
    GPU_FLAGS,
    TPU_FLAGS,
    apply_compiler_flags,
    flag_name,
    platforms,
)

LHS = "xla_gpu_enable_latency_hiding_scheduler"


@pytest.fixture
def env(monkeypatch):
    """A clean slate: no flags set, on a CUDA + TPU process (so every table applies)."""
    for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", compiler.OFF_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,tpu,cpu")
    return monkeypatch


def test_platforms_from_jax_platforms(monkeypatch):
    for value, expected in [("cpu", ("cpu",)), ("cuda,cpu", ("gpu", "cpu")), ("TPU", ("tpu",)),
                            ("rocm,cuda", ("gpu",)), ("cpu,metal", ("cpu",))]:
        monkeypatch.setenv("JAX_PLATFORMS", value)
        assert platforms() == expected, value


def test_platforms_without_jax_platforms_include_cpu(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    found = platforms()
    assert found[0] == "cpu" and set(found) <= {"cpu", "gpu", "tpu"}


@pytest.mark.parametrize("plugin", ["xla_cuda12", "xla_cuda13", "xla_rocm7"])
def test_an_installed_gpu_plugin_adds_gpu(monkeypatch, tmp_path, plugin):
    (tmp_path / "jax_plugins" / plugin).mkdir(parents=True)
    (tmp_path / "jax_plugins" / plugin / "__init__.py").write_text("raise ImportError\n")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "gpu" in platforms()  # found without importing it


def test_each_table_goes_to_its_variable(env):
    added = apply_compiler_flags()
    assert added == {"XLA_FLAGS": [*CPU_FLAGS, *GPU_FLAGS], "LIBTPU_INIT_ARGS": list(TPU_FLAGS)}
    assert os.environ["XLA_FLAGS"].split() == [*CPU_FLAGS, *GPU_FLAGS]
    assert os.environ["LIBTPU_INIT_ARGS"].split() == list(TPU_FLAGS)


def test_only_this_platforms_flags(env):
    env.setenv("JAX_PLATFORMS", "cpu")
    apply_compiler_flags()
    assert os.environ.get("XLA_FLAGS", "").split() == list(CPU_FLAGS)
    assert "LIBTPU_INIT_ARGS" not in os.environ


def test_the_users_flag_wins(env):
    assert any(flag_name(f) == LHS for f in GPU_FLAGS)
    user = f"--xla_force_host_platform_device_count=8 --{LHS}=false"
    env.setenv("XLA_FLAGS", user)
    env.setenv("LIBTPU_INIT_ARGS", "-xla_tpu_enable_async_collective_fusion")  # bare boolean
    apply_compiler_flags()
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[:2] == user.split()  # kept, first
    assert [f for f in flags if flag_name(f) == LHS] == [f"--{LHS}=false"]
    tpu = os.environ["LIBTPU_INIT_ARGS"].split()
    assert tpu[0] == "-xla_tpu_enable_async_collective_fusion"
    assert [flag_name(f) for f in tpu].count("xla_tpu_enable_async_collective_fusion") == 1


def test_nothing_is_added_twice(env):
    first = apply_compiler_flags()
    after_first = {v: os.environ[v] for v in first}
    assert apply_compiler_flags() == {}
    assert {v: os.environ[v] for v in first} == after_first


@pytest.mark.parametrize("off", ["0", "false", "OFF", "no"])
def test_off_switch(env, off):
    env.setenv(compiler.OFF_ENV, off)
    env.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert apply_compiler_flags() == {}
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert "LIBTPU_INIT_ARGS" not in os.environ


def test_the_cli_applies_them_before_parsing(monkeypatch):
    calls = []
    monkeypatch.setattr(jaxrl.cli, "apply_compiler_flags", lambda: calls.append(1))
    with pytest.raises(SystemExit):
        jaxrl.cli.main(["bench", "--help"])
    assert calls == [1]


def _jit_with(xla_flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: (x @ x).sum())(jnp.eye(4))))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.process
def test_this_jaxlib_accepts_the_cpu_and_gpu_tables():
    """XLA_FLAGS is parsed into one DebugOptions for every backend, so the CPU jaxlib checks
    the GPU table's names too; a made-up flag shows that the check would fail."""
    result = _jit_with(" ".join([*CPU_FLAGS, *GPU_FLAGS]))
    assert result.returncode == 0 and result.stdout.strip() == "4.0", result.stderr[-2000:]
    bogus = _jit_with("--xla_jaxrl_no_such_flag=true")
    assert bogus.returncode != 0 and "Unknown flag in XLA_FLAGS" in bogus.stderr


_THREEFRY = """
import json, jax, jax.numpy as jnp
from jaxrl.perf.compiler import unroll_cpu_threefry
def draw():
    f = jax.jit(lambda k: (jax.random.bits(k, (64, 1000)), jax.random.gumbel(k, (3, 7))))
    bits, gumbel = f(jax.random.key(7))
    return bits.tolist(), gumbel.tolist(), " while(" in f.lower(jax.random.key(7)).compile().as_text()
rolled = draw()
ok = unroll_cpu_threefry()
jax.clear_caches()
print(json.dumps({"ok": ok, "rolled": rolled, "unrolled": draw()}))
"""


@pytest.mark.process
def test_unrolled_cpu_threefry_draws_the_same_bits_without_a_loop():
    out = subprocess.run([sys.executable, "-c", _THREEFRY], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"]
    (bits, gumbel, loop), (bits_u, gumbel_u, loop_u) = result["rolled"], result["unrolled"]
    assert loop and not loop_u  # JAX's CPU lowering is a loop; the unrolled one is not
    assert bits_u == bits and gumbel_u == gumbel
