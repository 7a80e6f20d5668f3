"""Hardware descriptions: presets, JSON and TOML files, flag overrides, and a sentence for
each mistake."""
from __future__ import annotations

import json

import pytest

from pipefill.planner import PRESETS, Overrides, load_hardware_file, parse_tflops_flag

GOOD = {"name": "box", "devices_per_node": 4, "memory_gb": 80, "memory_bandwidth_gb_s": 3000,
        "efficiency": 0.5, "tflops": {"bf16": 900, "fp8": 1800},
        "intra_node": {"bandwidth_gb_s": 400, "latency_us": 2},
        "inter_node": {"bandwidth_gb_s": 25, "latency_us": 8}}


def write_json(tmp_path, data) -> str:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_json_file_in_the_units_people_quote(tmp_path):
    hw = load_hardware_file(write_json(tmp_path, GOOD))
    assert hw.flops == {"bfloat16": 900e12, "fp8": 1800e12}
    assert hw.memory_bytes == 80e9 and hw.memory_bandwidth == 3000e9
    assert hw.intra_node.bandwidth == 400e9 and hw.intra_node.latency == pytest.approx(2e-6)
    assert hw.inter_node.bandwidth == 25e9 and hw.efficiency == 0.5
    assert hw.rate("fp8", "bfloat16") == 900e12  # 1800 at efficiency 0.5
    assert hw.rate("int8", "bfloat16") == 450e12  # no int8 rate: the compute dtype's


def test_a_toml_file_and_one_node_without_a_network(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('devices_per_node = 2\nmemory_gb = 12\nmemory_bandwidth_gb_s = 20\n'
                    'devices_are_cores = true\n[tflops]\nbfloat16 = 0.2\n'
                    '[intra_node]\nbandwidth_gb_s = 10\nlatency_us = 20\n')
    hw = load_hardware_file(str(path))
    assert hw.devices_are_cores and hw.inter_node == hw.intra_node and hw.efficiency == 1.0


@pytest.mark.parametrize("change, words", [
    ({"tflops": {}}, "tflops must be a table"),
    ({"tflops": {"bf17": 3}}, "names dtype 'bf17'"),
    ({"memory_gb": -1}, "memory_gb must be a positive number"),
    ({"memory_gb": "lots"}, "memory_gb must be a positive number"),
    ({"devices_per_node": 2.5}, "devices_per_node must be a whole number"),
    ({"efficiency": 1.5}, "at most 1"),
    ({"intra_node": {"bandwidth_gb_s": 1}}, "intra_node needs latency_us"),
    ({"inter_node": {"bandwidth_gb_s": 1, "latency_us": 1, "mtu": 9000}}, "unknown keys mtu"),
    ({"flops": 3}, "unknown keys flops"),
])
def test_mistakes_in_a_file_are_sentences(tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        load_hardware_file(write_json(tmp_path, {**GOOD, **change}))


def test_missing_keys_unreadable_files_and_no_file(tmp_path):
    data = {k: v for k, v in GOOD.items() if k != "memory_gb"}
    with pytest.raises(ValueError, match="missing memory_gb"):
        load_hardware_file(write_json(tmp_path, data))
    bad = tmp_path / "bad.toml"
    bad.write_text("tflops = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_hardware_file(str(bad))
    with pytest.raises(ValueError, match="no such preset .* or file"):
        load_hardware_file(str(tmp_path / "absent.json"))


def test_flags_override_a_preset():
    hw = Overrides(tflops=parse_tflops_flag("bf16=100"), memory_gb=141, inter_node_gb_s=25,
                   efficiency=0.5).apply(PRESETS["h20"])
    assert hw.flops["bfloat16"] == 100e12 and hw.flops["fp8"] == 296e12
    assert hw.memory_bytes == 141e9 and hw.inter_node.bandwidth == 25e9
    assert hw.intra_node == PRESETS["h20"].intra_node and hw.efficiency == 0.5
    with pytest.raises(ValueError, match="DTYPE=TFLOPS"):
        parse_tflops_flag("bf16:100")
    with pytest.raises(ValueError, match="--efficiency"):
        Overrides(efficiency=2).apply(PRESETS["h20"])
