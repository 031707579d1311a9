"""Which path a request takes: disaggregated (prefill leg, then decode) or a decode alone.

Conditional disaggregation: a short prompt costs more to ship than to compute, and its prefill leg
adds a round trip and a KV pull to its time to first token. Below ``--decode-only-below`` tokens
the decode computes the prompt itself; so it does when its KV events show it holds most of the
prompt already (``--decode-only-cached``: a follow-up turn on the decode that ran the last one).
Pure decisions, no I/O: the proxy has no tokenizer, so the
count is :func:`~kv_mooncake.proxy.balancer.estimate_prompt_tokens`'s (token-id prompts exactly,
text and chat content at about 4 characters per token, chat templates not counted).
"""

from __future__ import annotations

from typing import Literal

from kv_mooncake.proxy.balancer import estimate_prompt_tokens

Path = Literal["disaggregated", "decode_only_short", "decode_only_cached"]


def choose_path(prompt_tokens: int, decode_only_below: int, decode_cached_tokens: int = 0,
                decode_only_cached: float = 0.0) -> Path:
    """``decode_only_short`` when the prompt is below ``decode_only_below`` tokens;
    ``decode_only_cached`` when a decode holds at least the fraction ``decode_only_cached`` of it
    (``decode_cached_tokens``, from its KV events); else ``disaggregated``. 0 turns a rule off."""
    if decode_only_below > 0 and prompt_tokens < decode_only_below:
        return "decode_only_short"
    if decode_only_cached > 0 and decode_cached_tokens > 0 and decode_cached_tokens >= decode_only_cached * prompt_tokens:
        return "decode_only_cached"
    return "disaggregated"


def request_path(body: dict, decode_only_below: int, decode_cached_tokens: int = 0,
                 decode_only_cached: float = 0.0) -> tuple[Path, int]:
    """The path of a client request and the prompt size it was decided on."""
    tokens = estimate_prompt_tokens(body)
    return choose_path(tokens, decode_only_below, decode_cached_tokens, decode_only_cached), tokens


def token_id_prompt(body: dict) -> list[int] | None:
    """The prompt as token ids when the client sent them (one completions prompt), else None:
    the proxy has no tokenizer, so routing by cached prefix needs them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None
