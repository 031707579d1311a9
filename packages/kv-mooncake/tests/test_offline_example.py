"""The offline example reads vllm-ascend's device lists: ``PROMPT_DEVICE_ID=0,1`` is a TP 2 prefill."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "offline_disaggregated_prefill.py"


@pytest.fixture(scope="module")
def example():
    if not EXAMPLE.exists():
        pytest.skip("examples/ not in this checkout")
    spec = importlib.util.spec_from_file_location("offline_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_list_is_the_engines_tp_size(example, monkeypatch):
    monkeypatch.setenv("PROMPT_DEVICE_ID", "0,1")
    monkeypatch.setenv("DECODE_DEVICE_ID", "2, 3, 4, 5")
    assert example.engine_layout("PROMPT_DEVICE_ID", "0-3", on_cpu=False) == (
        2, {"CUDA_VISIBLE_DEVICES": "0,1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}, "0-3")
    tp, env, bind = example.engine_layout("DECODE_DEVICE_ID", "0-3", on_cpu=True)
    assert (tp, env["ASCEND_RT_VISIBLE_DEVICES"], bind) == (4, "2,3,4,5", "2|3|4|5")  # CPU: one core per rank


def test_unset_list_is_one_rank_and_a_repeated_device_is_refused(example, monkeypatch):
    monkeypatch.delenv("PROMPT_DEVICE_ID", raising=False)
    assert example.engine_layout("PROMPT_DEVICE_ID", "0", on_cpu=True) == (1, {}, "0")
    with pytest.raises(ValueError, match="twice"):
        example.engine_devices("0,0")
