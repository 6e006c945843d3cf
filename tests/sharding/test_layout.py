"""Layout presets load and build meshes; malformed layouts fail with errors that say why."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType

from jaxrl.sharding import available_presets, load_layout, make_mesh, resolve_layout
from jaxrl.sharding.layout import Layout, MeshAxes, preset_dir
from jaxrl.sharding.rules import LOGICAL_AXES, PARAM_AXES, AxisRules

# Preset -> (devices it is built on, expected (data, fsdp, tensor)) on the 8 test devices.
PRESETS = {
    "single": (1, (1, 1, 1)),
    "fsdp": (8, (1, 8, 1)),
    "fsdp_ep": (8, (1, 8, 1)),
    "fsdp_tp": (8, (1, 4, 2)),
    "dp_fsdp_tp": (8, (2, 2, 2)),
}
RULES = AxisRules.from_mapping({"batch": ["data", "fsdp"], "embed": "fsdp"})


def _layout(data=1, fsdp=-1, tensor=1, dcn_data=1) -> Layout:
    return Layout("test", MeshAxes(data, fsdp, tensor), dcn_data, RULES, RULES)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "layout.yaml"
    path.write_text(text)
    return str(path)


def test_shipped_presets_are_the_documented_ones():
    assert set(available_presets()) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_mesh(name):
    num_devices, shape = PRESETS[name]
    devices = jax.devices()[:num_devices]
    mesh = make_mesh(load_layout(name), devices)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    assert all(t == AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_rules_are_explicit_and_rollout_keeps_weights_off_data_axes(name):
    layout = load_layout(name)
    for rules in (layout.train_rules, layout.rollout_rules):
        assert sorted(logical for logical, _ in rules.rules) == sorted(LOGICAL_AXES)
    # Decoding must not all-gather weights per token: rollout weights live on tensor only.
    for axis in PARAM_AXES:
        assert set(layout.rollout_rules.mesh_axes(axis)) <= {"tensor"}
    for rules in (layout.train_rules, layout.rollout_rules):
        assert rules.mesh_axes("batch") == ("data", "fsdp")


def test_preset_by_path_equals_preset_by_name():
    assert load_layout(preset_dir() / "fsdp_tp.yaml") == load_layout("fsdp_tp")


@pytest.mark.parametrize("axes, num_devices, expected", [
    ((1, -1, 2), 8, (1, 4, 2)),
    ((-1, 2, 2), 8, (2, 2, 2)),
    ((1, -1, 1), 4, (1, 4, 1)),
    ((2, 4, -1), 8, (2, 4, 1)),
])
def test_minus_one_takes_the_remaining_devices(axes, num_devices, expected):
    mesh = make_mesh(_layout(*axes), jax.devices()[:num_devices])
    assert tuple(mesh.shape.values()) == expected


@pytest.mark.parametrize("axes", [(3, 1, 1), (3, -1, 1)])
def test_device_count_mismatch_names_both_numbers(axes):
    with pytest.raises(ValueError, match=r"\b3\b.*\b8\b"):
        make_mesh(_layout(*axes))


def test_single_preset_on_more_devices_is_an_error():
    with pytest.raises(ValueError, match=r"needs 1 devices.*8 are available"):
        make_mesh(load_layout("single"))


@pytest.mark.parametrize("axes, message", [
    ((0, -1, 1), "mesh.data must be -1 or >= 1"),
    ((-1, -1, 1), "at most one mesh axis may be -1"),
])
def test_invalid_mesh_sizes(axes, message):
    with pytest.raises(ValueError, match=message):
        _layout(*axes)


def test_unknown_preset_lists_available_presets():
    with pytest.raises(FileNotFoundError) as info:
        load_layout("fsdp_pp")
    assert "'fsdp_pp'" in str(info.value)
    for name in PRESETS:
        assert name in str(info.value)


def test_missing_layout_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_layout(str(tmp_path / "nope.yaml"))


def test_preset_dir_from_environment(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("mesh: {data: 2, fsdp: -1, tensor: 1}\n")
    monkeypatch.setenv("JAXRL_SHARDING_DIR", str(tmp_path))
    assert available_presets() == ["mine"]
    assert tuple(make_mesh(load_layout("mine")).shape.values()) == (2, 4, 1)


@pytest.mark.parametrize("text, names", [
    ("mesh: {data: 1, fsdp: -1, tensor: 1}\nmeshes: {}\n", ["meshes", "mesh"]),
    ("mesh: {data: 1, fsdp: -1, model: 2}\n", ["model"]),
    ("rules:\n  sample: {batch: data}\n", ["sample"]),
    ("mesh: {data: two}\n", ["mesh.data", "two"]),
])
def test_unknown_keys_and_wrong_types_name_the_key(tmp_path, text, names):
    with pytest.raises(ValueError, match="invalid sharding layout") as info:
        load_layout(_write(tmp_path, text))
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("text, names", [
    ("rules:\n  train: {batch: [data, fsd]}\n", ["rules.train", "'fsd'", "fsdp"]),
    ("rules:\n  rollout: {mlp: 2}\n", ["rules.rollout", "2", "tensor"]),
    ("rules:\n  train: {hidden: fsdp}\n", ["rules.train", "'hidden'", "embed"]),
])
def test_bad_rule_names_the_rule_set_and_the_choices(tmp_path, text, names):
    with pytest.raises(ValueError, match="invalid sharding layout") as info:
        load_layout(_write(tmp_path, text))
    for name in names:
        assert name in str(info.value)


def test_dcn_needs_devices_that_report_slices(tmp_path):
    # CPU (and GPU) devices have no `slice_index`: there is one slice, so dcn.data > 1 is
    # a configuration error rather than something to approximate.
    assert not hasattr(jax.devices()[0], "slice_index")
    layout = load_layout(_write(tmp_path, "mesh: {data: 1, fsdp: -1, tensor: 2}\ndcn: {data: 2}\n"))
    assert layout.mesh_shape(8) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="dcn.data=2.*report no slices"):
        make_mesh(layout)


def test_dcn_multiplies_device_count_check():
    with pytest.raises(ValueError, match=r"needs 16 devices.*8 are available"):
        _layout(2, 4, 1, dcn_data=2).mesh_shape(8)


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.packaging
def test_wheel_ships_presets_and_every_module(tmp_path):
    # Build from a copy so no build/ or egg-info lands in the working tree.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("jaxrl", "sharding", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_SHARDING_DIR"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, env=env, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("jaxrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    presets = sorted(p.name for p in (REPO / "sharding").glob("*.yaml"))
    assert presets
    missing = [p for p in presets if f"jaxrl/sharding/presets/{p}" not in names]
    assert not missing, f"presets missing from the wheel: {missing}"
    configs = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    missing = [c for c in configs if f"jaxrl/configs/{c}" not in names]
    assert "quickstart.yaml" in configs and not missing, f"configs missing: {missing}"
    # pyproject.toml lists jaxrl's packages by hand: a new subpackage must be added there.
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "jaxrl").rglob("*.py")
                     if "__pycache__" not in p.parts)
    missing = [m for m in modules if m not in names]
    assert not missing, f"add their packages to pyproject.toml [tool.setuptools] packages: {missing}"

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, env=env, cwd=tmp_path)
    env["PYTHONPATH"] = str(site)
    code = ("import jaxrl; from jaxrl.sharding import available_presets, load_layout; "
            "from jaxrl.config import shipped_config; "
            "load_layout('fsdp'); print(jaxrl.__file__); print(*available_presets()); "
            "print(shipped_config('quickstart.yaml'))")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path,
                         capture_output=True, text=True).stdout.splitlines()
    assert Path(out[0]).is_relative_to(site)  # the installed copy, not the checkout
    assert out[1].split() == [Path(p).stem for p in presets]
    assert Path(out[2]).is_relative_to(site)  # `jaxrl train` without a config finds it


def test_auto_is_single_on_one_device_and_fsdp_on_several():
    assert resolve_layout("auto", 1).name == "single"
    assert resolve_layout("auto", 8).name == "fsdp"
    assert resolve_layout("auto").name == "fsdp"  # the tests' 8 devices
    assert resolve_layout("fsdp_tp", 1).name == "fsdp_tp"  # an explicit preset is kept
    with pytest.raises(FileNotFoundError, match="auto .single on one device"):
        load_layout("autox")
