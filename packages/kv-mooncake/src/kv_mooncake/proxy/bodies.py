"""What the proxy sends upstream and answers the client: the legs' request bodies, OpenAI errors."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


def prefill_request_body(body: dict) -> dict:
    """The prefill leg: the client's request, one token, one sequence (``n`` 1: the decode runs
    the client's ``n`` samples from the one prompt's KV), not streamed, asking the prefill to keep
    its blocks for a remote decode (extra ``kv_transfer_params`` of the client kept)."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # invalid without streaming / above max_tokens / one prefill serves the decode's n samples
    for key in ("stream_options", "min_tokens", "best_of"):
        out.pop(key, None)
    if "n" in out:
        out["n"] = 1
    client_params = body.get("kv_transfer_params")
    if not isinstance(client_params, dict):
        client_params = {}
    out["kv_transfer_params"] = {
        **client_params,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


def decode_request_body(body: dict, params: dict | None) -> dict:
    out = dict(body)
    if params is not None:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def error_body(status: int, message: str, kind: str) -> dict:
    """OpenAI's error object (what vLLM answers too)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, kind: str, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else None
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def sse_error_event(status: int, message: str, kind: str) -> bytes:
    """A stream that broke after its first byte cannot change its status: tell the client in-band
    (the ``openai`` package raises an APIError on it)."""
    return b"data: " + json.dumps(error_body(status, message, kind)).encode() + b"\n\n"
