"""Test setup: 8 fake CPU devices (before jax is imported), one XLA compilation cache for
every test process of the machine, the tiers, and tiny model configs.

Tiers (markers registered in pyproject.toml; `pytest` alone runs the fast tier, README's
"Tests" lists the commands): `process` starts `jaxrl` or a Python that imports jaxrl (signals
and resume, several processes, launchers, the console script, failures seen from outside),
`learning` trains until a reward or an accuracy threshold, `packaging` builds a wheel or an
environment. A test carries one of them at most, so the tiers split the suite; `.ci/run`
checks that its tier runs ran every collected test exactly once (each run appends the node
ids it ran to the file named by JAXRL_TESTS_RAN).
"""

import json
import os
import subprocess
import sys
import tempfile

from tests.launch_env import TEST_COMPILE

# Cheap compiler settings (tests/launch_env.py TEST_COMPILE): two thirds of a cold fast tier
# is XLA compiling thousands of tiny programs. Measured on an empty cache (tests/models/
# test_transformer.py, tests/rollout/test_golden.py, tests/rl/test_losses_vs_trl.py, the
# parity and recorded-number tests among them): 198 s of compiling with XLA's defaults, 116 s
# with LLVM's cheap settings, 63 s with the older fusion emitters too; every tolerance of the
# suite still met. The `jaxrl` processes that tests start inherit them, and the docs' blocks
# get them; those that run a command on one device as README does (the learning tier, the
# process goldens, resume) drop XLA_FLAGS and compile as users do.
# A test marked `default_compiler` checks a property of XLA's default compilation (a buffer
# updated in place, FLOPs XLA counts, two programs bitwise equal): it runs in a pytest process
# of its own (`pytest_pyfunc_call` below) with this variable set, which compiles as users do.
DEFAULT_COMPILER = os.environ.get("JAXRL_TESTS_DEFAULT_COMPILER") == "1"
_inherited = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
              if not (DEFAULT_COMPILER and flag in TEST_COMPILE.split())]
_cheap = [] if DEFAULT_COMPILER else [TEST_COMPILE]
os.environ["XLA_FLAGS"] = " ".join([*_inherited, *_cheap,
                                    "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests (and the `jaxrl` processes some of them start, which inherit the environment)
# compile the same small programs: XLA's persistent cache compiles each once per machine,
# shared by the xdist workers, the tiers, and every clone (tests/compile_stats.py counts).
# Every program is stored, however quickly it compiled: the suite compiles thousands of
# programs of 20-200 ms each (tiny models), and reading one back costs a few milliseconds
# (measured: tests/models/test_transformer.py + tests/rollout/test_sampler.py, 30 s of
# compiling with a 0.2 s minimum, 6 s from a cache that stores everything).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jaxrl-tests-xla-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

from jaxrl.perf.compiler import unroll_cpu_threefry  # noqa: E402
from jaxrl.runtime import SERIAL_CPU_COLLECTIVES_FLAG, configure_xla  # noqa: E402

# This process's own backend keeps XLA:CPU's concurrency-optimized scheduler, which the
# `jaxrl` command turns off (jaxrl/runtime.py): neither order is safe from XLA:CPU's
# collective deadlock on 8 fake devices, and which one aborts depends on the program. Measured
# (jax 0.10.2): the shipped recipes' in-process trainings (tests/test_shipped_configs.py), 5 in
# a row per process: with the scheduler off 3 of 4 processes aborted (and 3 fresh-clone fast
# tiers), with it on 0 of 4 (20 trainings); the split-mode quickstart as `jaxrl train`: with it
# on 11 of 15 aborted, off 0 of 5 (and the process tier's 56 runs). So the in-process tests run
# with it on, and the `jaxrl` processes tests start get the command's flags (below).
_scheduler = SERIAL_CPU_COLLECTIVES_FLAG.split("=")[0]
os.environ["XLA_FLAGS"] += f" {_scheduler}=true"
configure_xla()  # the other flags as the jaxrl command sets them
jax.devices()  # the backend starts now, with these flags
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(f" {_scheduler}=true", "")
configure_xla()  # what the processes tests start inherit: the command's flags
# Also as the jaxrl command does, and before any test: `jaxrl.cli.main` applies it process-wide,
# so without this a worker's programs lowered threefry one way before its first in-process CLI
# test and the other way after, and their cache keys depended on the order xdist ran tests in.
unroll_cpu_threefry()

import pytest  # noqa: E402

from jaxrl.models.config import tiny_config as make_tiny_config  # noqa: E402
from tests import compile_stats, crash_report  # noqa: E402

TIERS = ("process", "learning", "packaging")
compile_stats.listen()
_CACHE_ENTRIES_AT_START = compile_stats.cache_entries(os.environ["JAX_COMPILATION_CACHE_DIR"])
_compile_totals: dict = {}  # over this run's processes (tests/compile_stats.py)
crash_report.folder()  # made here in the controller, before it starts its workers

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")


@pytest.fixture
def tiny_config():
    """Factory fixture: `tiny_config("qwen3", scan_layers=True)`."""
    return make_tiny_config


# The slowest tests of the process and learning tiers (minutes each on a 2-core machine), in
# the order they start, then the fast tier's longest modules: xdist hands tests out in
# collection order (two to each worker, then one more to whichever has fewer than two left),
# so a slow test collected last runs alone at the end while the other worker idles. In the
# learning tier one worker gets LoRA (which trains the quickstart's 300-step base first, ~1
# min, then ~4-8 min of LoRA) and PPO (~1 min), the other staleness 2 (~6 min) and the
# quickstart to its target (~3 min, resuming the base); the tool task goes to whichever is
# free first. In the process tier whole modules move, so a module's tests stay together
# (their module-scoped fixtures are set up once per worker). An entry is a node id or its
# prefix.
SLOW_FIRST = (
    "tests/commands/test_train.py::test_quickstart_learns_with_lora_rank_8",
    "tests/commands/test_train.py::test_quickstart_learns_with_ppo_and_a_critic",
    "tests/run/test_async_run.py::test_staleness_two_learns_the_quickstart_task",
    "tests/commands/test_train.py::test_the_quickstart_learns_to_its_target_reward",
    "tests/run/test_multiturn_run.py::test_tool_task_learns_to_call_the_calculator",
    "tests/launch/test_slurm.py",  # process: a job stopped and requeued three times
    "tests/test_docs.py",
    "tests/config/test_composition_runs.py",
    "tests/distributed/test_multiprocess.py",
    "tests/run/test_golden_metrics.py",
    # fast tier: the modules of the longest tests (tests/time_table.py), so that the last
    # minutes are the many short tests, shared by both workers
    "tests/test_shipped_configs.py",
    "tests/test_longtail_policy.py",
    "tests/step/test_packing.py",
    "tests/rollout/test_continuous.py",
    "tests/run/test_preflight.py",
)


def _slow_rank(item) -> int:
    return next((rank for rank, prefix in enumerate(SLOW_FIRST)
                 if item.nodeid.startswith(prefix)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    """A test belongs to one tier at most: with two it would run in both tiers' CI runs.
    The slowest tests go first (SLOW_FIRST); the rest keep pytest's order."""
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(tiers)}: a test "
                                    f"belongs to one tier at most (one of {', '.join(TIERS)})")
    items.sort(key=_slow_rank)  # stable: within a module, and among the rest, pytest's order


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A `default_compiler` test runs in a pytest of its own whose XLA compiles with its
    default settings (DEFAULT_COMPILER, at the top of this file); this one reports its
    outcome. Its own process neither counts in $JAXRL_TESTS_RAN nor times in $JAXRL_TEST_TIMES."""
    if DEFAULT_COMPILER or pyfuncitem.get_closest_marker("default_compiler") is None:
        return None
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "JAXRL_TESTS_RAN", "JAXRL_TEST_TIMES"))}
    env["JAXRL_TESTS_DEFAULT_COMPILER"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-m", "", pyfuncitem.nodeid], cwd=str(pyfuncitem.config.rootpath), env=env,
        capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        pytest.fail(f"with XLA's default compiler settings (a pytest of its own, exit "
                    f"{result.returncode}):\n{(result.stdout + result.stderr)[-6000:]}",
                    pytrace=False)
    return True


def _compile_s() -> float:
    return compile_stats.counts()["compile_s"]


def _count_compile_s(item):
    """Runs one phase of `item` (a hookwrapper's body); its XLA compile seconds in this process
    ride on the phase's report (user_properties reach xdist's controller): tests/time_table.py
    splits a test's time into compile and run. The `jaxrl` processes a test starts compile out
    of sight: their time counts as run time."""
    before = compile_stats.counts()["compile_s"]
    yield
    item.user_properties.append(("compile_s", compile_stats.counts()["compile_s"] - before))


pytest_runtest_setup = pytest.hookimpl(hookwrapper=True)(_count_compile_s)
pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(_count_compile_s)
_seconds: dict = {}  # nodeid -> seconds of the phases reported so far


def pytest_runtest_logreport(report):
    """Appends each test run to $JAXRL_TESTS_RAN (once, at its teardown; not from xdist's
    workers, whose reports reach the controller too), and its seconds and compile seconds to
    $JAXRL_TEST_TIMES (JSON lines, read by tests/time_table.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.when != "teardown":
        return
    ran, times = os.environ.get("JAXRL_TESTS_RAN"), os.environ.get("JAXRL_TEST_TIMES")
    if ran:
        with open(ran, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")
    if times:
        compile_s = sum(v for k, v in report.user_properties if k == "compile_s")
        with open(times, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": report.nodeid, "s": round(_seconds[report.nodeid], 3),
                                "compile_s": round(compile_s, 3),
                                "tier": _tier(report.keywords)}) + "\n")
    del _seconds[report.nodeid]


def _tier(keywords) -> str:
    return next((tier for tier in TIERS if tier in keywords), "fast")


@pytest.hookimpl(trylast=True)  # after pytest's own fault-handler plugin set stderr
def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: a crash is described in its report
        crash_report.enable(config.workerinput["workerid"])


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A crashed worker's test is reported with its fault-handler dump; after an XLA abort
    it runs once more (tests/crash_report.py says why), and this report is a RERUN."""
    dump = crash_report.describe(report.node.gateway.id)
    report.longrepr = f"{report.longrepr}\n{dump}"
    if crash_report.rerun_once(crashitem, dump):
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # an xdist worker: its counts go to the controller
        session.config.workeroutput["compile_stats"] = compile_stats.counts()
    else:
        compile_stats.add(_compile_totals, compile_stats.counts())


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        crash_report.remove()


@pytest.hookimpl(optionalhook=True)  # xdist's hook; the serving environment has no xdist
def pytest_testnodedown(node, error):
    compile_stats.add(_compile_totals, getattr(node, "workeroutput", {}).get("compile_stats", {}))


def pytest_terminal_summary(terminalreporter, config):
    for report in terminalreporter.stats.get("rerun", []):
        terminalreporter.write_sep("=", f"RERUN after its worker aborted: {report.nodeid}")
        terminalreporter.write_line(str(report.longrepr))
    if not hasattr(config, "workerinput") and _compile_totals:
        terminalreporter.write_line(compile_stats.summary(
            _compile_totals, os.environ["JAX_COMPILATION_CACHE_DIR"], _CACHE_ENTRIES_AT_START))
        for line in compile_stats.top_programs(
                _compile_totals, int(os.environ.get("JAXRL_COMPILE_REPORT", "0"))):
            terminalreporter.write_line(line)
