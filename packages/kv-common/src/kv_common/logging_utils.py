"""Loggers for every kv-* module, under vLLM's ``vllm`` logger.

vLLM configures only its ``vllm`` logger (its handler, format and ``VLLM_LOGGING_LEVEL``; it does
not propagate to the root logger, whose default level is WARNING). A logger named
``vllm.kv_connectors.<module>`` is a child of it: inside ``vllm serve`` our INFO lines are shown and
our warnings are formatted like vLLM's own. Without vLLM (unit tests, tools) records propagate to the
root logger as usual.
"""

from __future__ import annotations

import logging

LOGGER_PREFIX = "vllm.kv_connectors."


def get_logger(name: str) -> logging.Logger:
    """``get_logger(__name__)``: ``kv_mooncake.worker`` -> ``vllm.kv_connectors.kv_mooncake.worker``."""
    return logging.getLogger(LOGGER_PREFIX + name)
