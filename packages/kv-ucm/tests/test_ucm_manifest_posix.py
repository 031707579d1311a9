"""The namespace manifest over the real UCM Posix store (Python 3.12 with UCM installed).

UCM stores one value size per store, so the manifest is padded to the block value size and read
with ``batch_get_into`` (UcmBackend has no ``batch_get``): an instance of the same layout matches;
one of another layout refuses, naming the settings, rather than failing every hit later. (Posix
reads the first bytes of a longer value into a shorter buffer, so even an instance whose values
have another size reads the manifest and names the difference.)
"""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))

pytest.importorskip("ucm", reason="UCM (uc-manager[cu130]) is Python 3.12 only")

from kv_store import keys  # noqa: E402
from kv_store import manifest as mf  # noqa: E402
from kv_ucm.ucm_backend import UcmBackend  # noqa: E402

SIZE = 16 * 2 * 64 * 4 * 3 + 16  # a small block value (3 layers) + trailer


def posix(root) -> dict:
    return {"ucm_connector_name": "UcmPipelineStore",
            "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(root),
                                     "posix_gc_enable": False}}


def layout(block_size: int, value_size: int) -> mf.Manifest:
    return mf.make_manifest({"model_name": "tiny", "block_size": block_size, "value_size": value_size})


def test_ucm_instances_check_each_others_layout(tmp_path):
    key = keys.manifest_key("shared", "hg0of1.pcp0of1.dcp0of1")
    with UcmBackend(posix(tmp_path)) as a:
        assert mf.publish_and_check(a, key, layout(16, SIZE), SIZE, where="ns", settle_s=0) == "written"
        assert a.value_size == SIZE  # the store opened for block values, not for the manifest
    with UcmBackend(posix(tmp_path)) as b:
        assert mf.publish_and_check(b, key, layout(16, SIZE), SIZE, where="ns", settle_s=0) == "matched"
    with UcmBackend(posix(tmp_path)) as c, pytest.raises(mf.ManifestMismatch,
                                                         match="block_size: stored '16', this engine '8'"):
        mf.publish_and_check(c, key, layout(8, SIZE), SIZE, where="ns", settle_s=0)
    with UcmBackend(posix(tmp_path)) as d:
        other = (SIZE - 16) // 2 + 16
        with pytest.raises(mf.ManifestMismatch, match=f"value_size: stored '{SIZE}', this engine '{other}'"):
            mf.publish_and_check(d, key, layout(8, other), other, where="ns", settle_s=0)
