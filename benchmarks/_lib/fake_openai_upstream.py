"""A FakeOpenAIUpstream for the proxy-cost section (``serving/proxy_cost.py``): answers like a prefill or decode OpenAI server at once,
so a proxied request's time over a direct one is the proxy's own cost (no engine noise).

    python -m benchmarks._lib.fake_openai_upstream prefill|decode PORT
"""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "fake",
          "remote_block_ids": [1], "remote_request_id": "fake"}  # no remote_host: no FreeNow is sent


def fake_openai_upstream(role: str) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await request.body()
        body = {"choices": [{"index": 0, "text": "x" * 16, "finish_reason": "length"}]}
        if role == "prefill":
            body["kv_transfer_params"] = PARAMS
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


if __name__ == "__main__":
    uvicorn.run(fake_openai_upstream(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
