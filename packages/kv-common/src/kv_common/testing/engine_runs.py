"""Whole runs of a real vLLM engine and their comparison: start, run batches, stop; the
no-connector baseline; exact token equality. Built on :class:`kv_common.testing.engine.EngineProcess`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from kv_common.testing.engine import (
    DEFAULT_KV_CACHE_BYTES,
    EngineProcess,
    EngineResult,
    Prompt,
    max_model_len_for,
)


def run_engine_batches(
    model_dir: str | os.PathLike[str],
    prompts_batches: Sequence[Sequence[Prompt]],
    *,
    kv_transfer_config: dict | None,
    max_tokens: int = 16,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    block_size: int | None = None,
    extra_llm_kwargs: dict | None = None,
    sampling_extra_args_per_batch: Sequence[Sequence[dict | None] | None] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    multiprocess: bool = True,
    cpu_bind: str = "nobind",
    max_model_len: int | None = None,
) -> list[EngineResult]:
    """Start one engine, run each batch in order (turn 1, turn 2, ...), stop it."""
    deadline = time.monotonic() + timeout_s
    extras = list(sampling_extra_args_per_batch or [None] * len(prompts_batches))
    if len(extras) != len(prompts_batches):
        raise ValueError("sampling_extra_args_per_batch needs one entry per batch")
    eng = EngineProcess(
        model_dir,
        kv_transfer_config=kv_transfer_config,
        max_tokens=max_tokens,
        max_model_len=max_model_len or max_model_len_for(prompts_batches, max_tokens, block_size),
        kv_cache_bytes=kv_cache_bytes,
        block_size=block_size,
        extra_llm_kwargs=extra_llm_kwargs,
        env=env,
        multiprocess=multiprocess,
        cpu_bind=cpu_bind,
        start_timeout_s=timeout_s,
    )
    results = []
    t0 = time.perf_counter()
    try:
        eng.start(wait=True)
        for batch, extra in zip(prompts_batches, extras, strict=False):
            remaining = max(1.0, deadline - time.monotonic())
            results.append(eng.generate(batch, extra, timeout_s=remaining))
    finally:
        eng.close()
    total = time.perf_counter() - t0
    tail = eng.stderr_tail()
    for r in results:
        r.stderr_tail = tail
        r.extra["total_s"] = total
    return results


def run_engine(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Prompt],
    *,
    kv_transfer_config: dict | None,
    max_tokens: int = 16,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    block_size: int | None = None,
    extra_llm_kwargs: dict | None = None,
    sampling_extra_args_per_prompt: Sequence[dict | None] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    multiprocess: bool = True,
    cpu_bind: str = "nobind",
    max_model_len: int | None = None,
) -> EngineResult:
    """Start an engine in a child process, generate greedily for ``prompts``, stop it."""
    return run_engine_batches(
        model_dir,
        [prompts],
        kv_transfer_config=kv_transfer_config,
        max_tokens=max_tokens,
        kv_cache_bytes=kv_cache_bytes,
        block_size=block_size,
        extra_llm_kwargs=extra_llm_kwargs,
        sampling_extra_args_per_batch=[sampling_extra_args_per_prompt],
        env=env,
        timeout_s=timeout_s,
        multiprocess=multiprocess,
        cpu_bind=cpu_bind,
        max_model_len=max_model_len,
    )[0]


def baseline(model_dir: str | os.PathLike[str], prompts: Sequence[Prompt], **kwargs: Any) -> EngineResult:
    """``run_engine`` without a KV connector: the reference output."""
    kwargs.pop("kv_transfer_config", None)
    return run_engine(model_dir, prompts, kv_transfer_config=None, **kwargs)


def _tokens(x: EngineResult | Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(t) for t in (x.token_ids if isinstance(x, EngineResult) else x)]


def assert_same_tokens(
    result: EngineResult | Sequence[Sequence[int]], expected: EngineResult | Sequence[Sequence[int]]
) -> None:
    """Exact greedy-token equality per prompt, with a diff that shows where each prompt diverges."""
    got, want = _tokens(result), _tokens(expected)
    problems = []
    if len(got) != len(want):
        problems.append(f"number of outputs differs: got {len(got)}, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g == w:
            continue
        pos = next((k for k, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        lo = max(0, pos - 3)
        problems.append(
            f"prompt {i}: first difference at output token {pos} (got {len(g)} tokens, expected {len(w)})\n"
            f"    got      [{lo}:] {g[lo : pos + 6]}\n"
            f"    expected [{lo}:] {w[lo : pos + 6]}"
        )
    if problems:
        same = sum(1 for g, w in zip(got, want, strict=False) if g == w)
        logged = result.log_warnings if isinstance(result, EngineResult) else []
        raise AssertionError(
            f"generated tokens differ from the baseline ({same}/{len(want)} prompts identical):\n"
            + "\n".join(problems)
            + ("\nengine warnings during the run:\n  " + "\n  ".join(logged) if logged else "")
        )
