from pathlib import Path

import pytest

from edgerun.config import (
    DeviceProfile,
    device_profile_from_dict,
    load_device_profile,
    parse_bytes,
    parse_rate,
)
from edgerun.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

UNIFIED = {
    "name": "test",
    "memory_kind": "unified",
    "memory_cap": "8GiB",
    "os_reserve": "1GiB",
    "cuda_context": "512MiB",
    "pinned_limit": "1GiB",
    "memory_bandwidth": "100GB/s",
    "storage_read_bandwidth": "2GB/s",
    "compute_capability": "8.7",
}
DISCRETE = {
    **UNIFIED,
    "memory_kind": "discrete",
    "host_memory_cap": "32GiB",
    "host_reserve": "8GiB",
    "pcie_bandwidth": "25GB/s",
}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GiB", 8 * 2**30),
        ("7.5G", 7_500_000_000),
        ("7.5GB", 7_500_000_000),
        ("512MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("0.1KiB", 102),  # a fraction of a byte rounds down
        ("7.4GiB", 7_945_689_497),
        ("100 B", 100),
        ("2ti", 2 * 2**40),
        (4096, 4096),
        ("4096", 4096),
        (0, 0),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("8GB/s", "must be a size"),
        ("eight", "must be a size such as"),
        ("-1GiB", "must be a size such as"),
        (-5, "must not be negative"),
        (True, "must be a size such as"),
        (float("inf"), "must be a size such as"),
        ("8 parsecs", "must be a size such as"),
    ],
)
def test_parse_bytes_errors_name_the_key(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_bytes(text, "memory_cap", "dev.yaml")
    assert "dev.yaml: key 'memory_cap'" in str(err.value)


def test_parse_rate():
    assert parse_rate("273GB/s") == 273e9
    assert parse_rate("6.5 GiB/s") == 6.5 * 2**30
    assert parse_rate(1e9) == 1e9
    with pytest.raises(ConfigError, match="key 'pcie_bandwidth' must be a rate"):
        parse_rate("8GiB", "pcie_bandwidth")


@pytest.mark.parametrize("name", ["jetson_thor", "orin", "orin_nano", "rtx5070", "cpu"])
def test_shipped_profiles_load(name):
    p = load_device_profile(CONFIGS / f"{name}.yaml")
    assert isinstance(p, DeviceProfile) and p.memory_cap > p.os_reserve + p.cuda_context
    assert p.memory_kind == ("discrete" if name == "rtx5070" else "unified")


def test_shipped_profile_values():
    thor = load_device_profile(CONFIGS / "jetson_thor.yaml")
    orin = load_device_profile(CONFIGS / "orin.yaml")
    rtx = load_device_profile(CONFIGS / "rtx5070.yaml")
    cpu = load_device_profile(CONFIGS / "cpu.yaml")
    assert (thor.memory_bandwidth, thor.compute_capability) == (273e9, "11.0")
    assert (orin.memory_bandwidth, orin.compute_capability) == (204.8e9, "8.7")
    assert (rtx.memory_bandwidth, rtx.compute_capability, rtx.discrete) == (672e9, "12.0", True)
    assert rtx.memory_cap <= 12 * 2**30 and rtx.host_memory_cap > 0 and rtx.pcie_bandwidth > 0
    assert rtx.cpu_expert_bandwidth == 30e9  # an estimate input, optional (0 without it)
    assert device_profile_from_dict({**DISCRETE}).cpu_expert_bandwidth == 0
    assert not cpu.has_cuda and cpu.cuda_context == 0


def test_compute_capability_forms():
    for given in ("8.7", 8.7, "sm_87", "SM87"):
        assert device_profile_from_dict({**UNIFIED, "compute_capability": given}).compute_capability == "8.7"
    assert device_profile_from_dict({**UNIFIED, "compute_capability": "sm_110"}).compute_capability == "11.0"
    with pytest.raises(ConfigError, match="key 'compute_capability' must look like"):
        device_profile_from_dict({**UNIFIED, "compute_capability": "ampere"})


def test_unknown_key_suggests_the_nearest():
    raw = {**UNIFIED, "memory_bandwith": "100GB/s"}
    del raw["memory_bandwidth"]
    with pytest.raises(
        ConfigError, match="unknown key 'memory_bandwith' \\(did you mean 'memory_bandwidth'\\?\\)"
    ):
        device_profile_from_dict(raw, "orin.yaml")
    with pytest.raises(ConfigError, match="unknown key 'zzz' \\(valid keys: name, memory_kind"):
        device_profile_from_dict({**UNIFIED, "zzz": 1})


def test_missing_key():
    raw = dict(UNIFIED)
    del raw["os_reserve"]
    with pytest.raises(ConfigError, match="required key 'os_reserve' is missing"):
        device_profile_from_dict(raw)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"memory_cap": "204.8GB/s"}, "key 'memory_cap' must be a size"),
        ({"memory_bandwidth": "204GiB"}, "key 'memory_bandwidth' must be a rate"),
        ({"memory_kind": "shared"}, "key 'memory_kind' must be one of"),
        ({"os_reserve": "8GiB"}, "leave nothing of memory_cap"),
        ({"memory_bandwidth": 0}, "key 'memory_bandwidth' must be positive"),
        ({"pinned_limit": "9GiB"}, "pinned_limit .* exceeds memory_cap"),
        ({"pcie_bandwidth": "25GB/s"}, "key 'pcie_bandwidth' applies only to memory_kind 'discrete'"),
        (
            {"cpu_expert_bandwidth": "9GB/s"},
            "key 'cpu_expert_bandwidth' applies only to memory_kind 'discrete'",
        ),
        ({"compute_capability": None}, "'cuda_context' must be 0 when compute_capability is null"),
        ({"name": 5}, "key 'name' must be a string"),
    ],
)
def test_impossible_unified_values(change, message):
    with pytest.raises(ConfigError, match=message):
        device_profile_from_dict({**UNIFIED, **change}, "dev.yaml")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"pcie_bandwidth": None}, "key 'pcie_bandwidth' is required"),
        ({"cpu_expert_bandwidth": "30GiB"}, "key 'cpu_expert_bandwidth' must be a rate"),
        ({"cpu_expert_bandwidth": -1}, "key 'cpu_expert_bandwidth' must not be negative"),
        ({"host_reserve": "32GiB"}, "host_reserve .* leaves nothing of host_memory_cap"),
        ({"pinned_limit": "30GiB"}, "pinned_limit .* exceeds host_memory_cap - host_reserve"),
        ({"compute_capability": None, "cuda_context": 0}, "a discrete GPU needs key 'compute_capability'"),
    ],
)
def test_impossible_discrete_values(change, message):
    raw = {k: v for k, v in {**DISCRETE, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        device_profile_from_dict(raw)


def test_yaml_errors(tmp_path):
    with pytest.raises(
        ConfigError, match="device profile not found \\(did you mean .*jetson_thor.yaml\\?\\)"
    ):
        load_device_profile(CONFIGS / "thor.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_device_profile(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_device_profile(bad)


def test_read_model_keys_parse_and_refuse_by_name():
    p = device_profile_from_dict(
        {**UNIFIED, "storage_read_single": "1.3GB/s", "read_depth": 8, "host_read_overhead": 0.0005}
    )
    assert (p.storage_read_single, p.read_depth, p.host_read_overhead) == (1.3e9, 8, 0.0005)
    d = device_profile_from_dict({**UNIFIED})
    assert (d.storage_read_single, d.read_depth, d.host_read_overhead) == (0.0, 4, 3e-4)
    for key, bad in (
        ("read_depth", 2.5),
        ("read_depth", 0),
        ("host_read_overhead", "fast"),
        ("read_depth", True),
    ):
        with pytest.raises(ConfigError, match=rf"key '{key}' must be a positive"):
            device_profile_from_dict({**UNIFIED, key: bad})
