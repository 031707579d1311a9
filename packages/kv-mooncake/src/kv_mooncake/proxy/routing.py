"""Which path a request takes: disaggregated (prefill leg, then decode) or a decode alone.

Conditional disaggregation: a short prompt costs more to ship than to compute, and its prefill leg
adds a round trip and a KV pull to its time to first token. Below ``--decode-only-below`` tokens
the decode computes the prompt itself. Pure decisions, no I/O: the proxy has no tokenizer, so the
count is :func:`~kv_mooncake.proxy.balancer.estimate_prompt_tokens`'s (token-id prompts exactly,
text and chat content at about 4 characters per token, chat templates not counted).
"""

from __future__ import annotations

from typing import Literal

from kv_mooncake.proxy.balancer import estimate_prompt_tokens

Path = Literal["disaggregated", "decode_only_short"]


def choose_path(prompt_tokens: int, decode_only_below: int) -> Path:
    """``decode_only_short`` when the prompt is below the threshold (0 turns the rule off)."""
    if decode_only_below > 0 and prompt_tokens < decode_only_below:
        return "decode_only_short"
    return "disaggregated"


def request_path(body: dict, decode_only_below: int) -> tuple[Path, int]:
    """The path of a client request and the prompt size it was decided on."""
    tokens = estimate_prompt_tokens(body)
    return choose_path(tokens, decode_only_below), tokens
