"""The namespace manifest on a real mooncake_master: instances of one pool check one another's
layout through the master (the first put of a key wins there, so racing first writers agree)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("mooncake.store")

from conftest import mooncake_options  # noqa: E402
from kv_store import keys  # noqa: E402
from kv_store import manifest as mf  # noqa: E402
from kv_store.mooncake_backend import MooncakeBackend  # noqa: E402

SIZE = 8192
BIG = 1 << 20


def layout(block_size: int) -> mf.Manifest:
    return mf.make_manifest({"model_name": "tiny", "block_size": block_size, "value_size": SIZE})


def test_instances_of_one_pool_check_each_others_layout(mooncake_master):
    clients = [MooncakeBackend(mooncake_options(mooncake_master.address, segment=16 << 20)) for _ in range(3)]
    try:
        key = keys.manifest_key("shared", "hg0of1.pcp0of1.dcp0of1")
        assert mf.publish_and_check(clients[0], key, layout(16), SIZE, where="ns", settle_s=0) == "written"
        assert mf.publish_and_check(clients[1], key, layout(16), SIZE, where="ns", settle_s=0) == "matched"
        with pytest.raises(mf.ManifestMismatch, match="block_size: stored '16', this engine '32'"):
            mf.publish_and_check(clients[2], key, layout(32), SIZE, where="ns", settle_s=0)

        for round_ in range(3):  # first writers racing through the master: one wins
            race = keys.manifest_key(f"race{round_}", "t")
            barrier = threading.Barrier(2)
            results: dict[int, object] = {}

            def start(i, m, race=race, barrier=barrier, results=results):
                barrier.wait()
                try:
                    results[i] = mf.publish_and_check(clients[i], race, m, SIZE, where="ns", settle_s=0.2)
                except mf.ManifestMismatch as exc:
                    results[i] = exc

            threads = [threading.Thread(target=start, args=(i, layout(16 * (i + 1)))) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sum(isinstance(r, mf.ManifestMismatch) for r in results.values()) == 1, results


        # Engines of ONE layout starting together must all start (CI, stop 30, saw one refuse: the key
        # listed, its value not readable yet). This does not reproduce that window every time; the
        # Fake backend of test_store_manifest does.
        big = mf.make_manifest({"model_name": "tiny", "block_size": 16, "value_size": BIG})
        for round_ in range(8):  # values as large as a block's, so a put takes a while
            race = keys.manifest_key(f"same{round_}", "t")
            barrier = threading.Barrier(3)
            results = {}

            def start_same(i, race=race, barrier=barrier, results=results):
                barrier.wait()
                try:
                    results[i] = mf.publish_and_check(clients[i], race, big, BIG, where="ns", settle_s=0)
                except mf.ManifestMismatch as exc:
                    results[i] = exc

            threads = [threading.Thread(target=start_same, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(results) == 3 and set(results.values()) <= {"written", "matched"}, results
    finally:
        for c in clients:
            c.close()
