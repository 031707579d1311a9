"""Our log records reach the handler vLLM installs on its ``vllm`` logger (what ``vllm serve`` prints)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from kv_common.logging_utils import get_logger


def test_logger_is_under_vllm():
    assert get_logger("kv_mooncake.worker").name == "vllm.kv_connectors.kv_mooncake.worker"


def test_record_from_our_module_reaches_a_handler_on_the_vllm_logger():
    from kv_common import registry

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    vllm_logger = logging.getLogger("vllm")
    handler = Keep(level=logging.INFO)
    old_level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)  # as vLLM's logging config does (VLLM_LOGGING_LEVEL)
    vllm_logger.addHandler(handler)
    try:
        registry.logger.info("hello from kv_common.registry")
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(old_level)
    assert [r.getMessage() for r in records] == ["hello from kv_common.registry"]


def test_vllm_prints_our_info_lines_in_its_format():
    # A fresh process configures vLLM's logging as an engine does; our INFO line comes out of its
    # handler (the root logger, level WARNING and no handler, would drop it).
    pytest.importorskip("vllm")
    code = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"
        "from kv_common import registry\n"
        "registry.logger.info('kv-common says hello')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    line = next((ln for ln in text.splitlines() if "kv-common says hello" in ln), "")
    assert "INFO" in line and "pid=" in line, text[-2000:]  # vLLM's format: "(MainProcess pid=...) INFO ..."
