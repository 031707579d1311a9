"""UcmStore over the real UCM Posix pipeline (CPU buffers, a tmp directory as the backend).

Needs Python 3.12 with UCM installed (scripts/make_py312_env.sh); skipped elsewhere.

What UCM 0.8.1's Posix store does, as these tests pin down:
* one file per block, ``<backend>/<first 3 hex of id>/<32 hex of id>``, exactly block_size
  bytes of raw payload: no header, no checksum;
* ``lookup`` only checks that the file exists: truncated or emptied files still look present;
* loading a truncated/empty file fails the task with StoreNotFoundError("-50005"), which the
  adapter reports as that block's ``False``;
* flipped bytes are NOT detected: the load succeeds and returns the damaged bytes;
* dumping an existing id overwrites it (last writer wins).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

# UCM's logger writes to ./log by default; keep it out of the working tree.
os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))

pytest.importorskip("ucm", reason="UCM (uc-manager[cu130]) is Python 3.12 only")
torch = pytest.importorskip(
    "torch", reason="UCM's Python store wrapper imports torch (install torch==2.13.0)"
)

from kv_ucm.block_ids import ucm_block_id  # noqa: E402
from kv_ucm.ucm_store import (  # noqa: E402
    CODE_OS_ERROR,
    UcmError,
    UcmStore,
    load_ucm_yaml,
)

# vLLM CPU layout per layer: [num_blocks, num_kv_heads, block_size, 2*head_size]
NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 8, 2, 16, 32
PER_LAYER_BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD * 4  # float32: 8192


def make_caches(fill: str = "random", seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    if fill == "zeros":
        return [torch.zeros(shape, dtype=torch.float32) for _ in range(NUM_LAYERS)]
    return [torch.randn(shape, generator=gen, dtype=torch.float32) for _ in range(NUM_LAYERS)]


def block_tensors(caches, vllm_block: int) -> list[torch.Tensor]:
    """The tensors of one vLLM block: one contiguous slice per layer."""
    return [layer[vllm_block] for layer in caches]


def ids_for(hashes) -> list[bytes]:
    return [ucm_block_id(h, model="tiny", tp_size=1, dtype="float32", rank=0, use_mla=False) for h in hashes]


def open_store(root, **kwargs) -> UcmStore:
    return UcmStore.from_config(
        {"store_pipeline": "Posix", "storage_backends": str(root)},
        tensor_size=PER_LAYER_BLOCK_BYTES,
        tensors_per_block=NUM_LAYERS,
        **kwargs,
    )


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def block_file(root, block_id: bytes) -> str:
    name = block_id.hex()
    for dirpath, _dirs, files in os.walk(root):
        if name in files:
            return os.path.join(dirpath, name)
    raise AssertionError(f"no file for block {name} under {root}")


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ucm-posix")


@pytest.fixture(scope="module")
def store(store_root):
    # one store for the module: UCM takes ~0.5 s to open a Posix store and ~3 s to close it.
    # Tests sharing it use distinct block ids.
    with open_store(store_root) as s:
        yield s


# -- round trips -------------------------------------------------------------------------------


def test_roundtrip_vllm_cpu_layout(store_root, store):
    src = make_caches()
    ids = ids_for([b"a", b"b", b"c"])
    src_blocks = [1, 4, 6]
    assert store.lookup(ids) == [False, False, False]
    assert store.dump(ids, [block_tensors(src, b) for b in src_blocks]) == [True, True, True]
    assert store.lookup(ids + ids_for([b"zzz"])) == [True, True, True, False]

    dst = make_caches("zeros")
    dst_blocks = [0, 2, 3]
    assert store.load(ids, [block_tensors(dst, b) for b in dst_blocks]) == [True, True, True]
    for layer in range(NUM_LAYERS):
        for s_b, d_b in zip(src_blocks, dst_blocks, strict=True):
            assert as_bytes(dst[layer][d_b]) == as_bytes(src[layer][s_b])
        for untouched in set(range(NUM_BLOCKS)) - set(dst_blocks):
            assert not dst[layer][untouched].any()

    # the files UCM wrote: one per block, raw payload of exactly block_size bytes
    for bid in ids:
        assert os.path.getsize(block_file(store_root, bid)) == NUM_LAYERS * PER_LAYER_BLOCK_BYTES


def test_lookup_on_prefix(store):
    src = make_caches()
    ids = ids_for(range(5))
    assert store.lookup_on_prefix(ids) == 0
    assert store.dump([ids[0], ids[1], ids[3]], [block_tensors(src, b) for b in (0, 1, 3)]) == [True] * 3
    assert store.lookup_on_prefix(ids) == 2  # stops at the first miss (ids[2])
    assert store.lookup_on_prefix(ids[3:]) == 1
    assert store.lookup_on_prefix([]) == 0


def test_plain_buffer_objects(tmp_path):
    size = 4096
    with UcmStore.from_config(
        {"store_pipeline": "Posix", "storage_backends": [str(tmp_path)]}, tensor_size=size
    ) as s:
        payloads = [os.urandom(size) for _ in range(3)]
        ids = ids_for([1, 2, 3])
        # read-only bytes are fine to dump from
        assert s.dump(ids, [memoryview(p) for p in payloads]) == [True] * 3
        outs = [bytearray(size) for _ in range(3)]
        assert s.load(ids, outs) == [True] * 3
        assert [bytes(o) for o in outs] == payloads
        with pytest.raises(ValueError, match="writable"):
            s.load(ids[:1], [memoryview(payloads[0])])


def test_storage_backends_colon_string_and_yaml(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    # UCM 0.8.1 creates the shard directories (000..fff) in the first backend only and fails
    # with -50005 ("Failed to add storage backend") on a second one that lacks them
    with pytest.raises(UcmError, match="shard directories") as info:
        UcmStore.from_config({"store_pipeline": "Posix", "storage_backends": f"{a}:{b}"})
    assert info.value.code == -50005
    for i in range(4096):
        (b / f"{i:03x}").mkdir()
    cfg = tmp_path / "ucm.yaml"
    cfg.write_text(
        textwrap.dedent(
            f"""\
            ucm_connectors:
              - ucm_connector_name: "UcmPipelineStore"
                ucm_connector_config:
                  store_pipeline: "Posix"
                  storage_backends: "{a}:{b}"
                  io_direct: false
            """
        )
    )
    entry = load_ucm_yaml(cfg)["ucm_connectors"][0]
    with UcmStore.from_config(entry, tensor_size=PER_LAYER_BLOCK_BYTES, tensors_per_block=NUM_LAYERS) as s:
        assert s.config["storage_backends"] == [str(a), str(b)]
        src = make_caches()
        ids = ids_for(range(6))
        assert s.dump(ids, [block_tensors(src, i) for i in range(6)]) == [True] * 6
        dst = make_caches("zeros")
        assert s.load(ids, [block_tensors(dst, i) for i in range(6)]) == [True] * 6
        for i in range(6):
            assert digest(block_tensors(dst, i)) == digest(block_tensors(src, i))
    files = [f for d in (a, b) for _, _, fs in os.walk(d) for f in fs if not f.startswith(".")]
    assert len(files) == 6  # each block is stored once, in one of the two backends


# -- across processes ----------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import hashlib, sys, torch
    from kv_ucm.ucm_store import UcmStore
    root, mode, n_layers, tensor_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ids = [bytes.fromhex(h) for h in sys.argv[5:]]
    store = UcmStore.from_config({"store_pipeline": "Posix", "storage_backends": root},
                                 tensor_size=tensor_size, tensors_per_block=n_layers)
    n = tensor_size // 4
    if mode == "load":
        bufs = [[torch.zeros(n, dtype=torch.float32) for _ in range(n_layers)] for _ in ids]
        ok = store.load(ids, bufs)
    else:
        g = torch.Generator().manual_seed(1234)
        bufs = [[torch.randn(n, generator=g) for _ in range(n_layers)] for _ in ids]
        ok = store.dump(ids, bufs)
    print("RESULT ok", ",".join(str(int(x)) for x in ok))
    for row in bufs:
        h = hashlib.sha256()
        for t in row:
            h.update(t.view(torch.uint8).numpy().tobytes())
        print("RESULT digest", h.hexdigest())
    store.close()
    """
)


def run_child(tmp_path, mode, ids):
    env = dict(os.environ)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path / "kv"),
            mode,
            str(NUM_LAYERS),
            str(PER_LAYER_BLOCK_BYTES),
            *(i.hex() for i in ids),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # UCM's logger also prints to stdout: keep only our lines
    lines = [ln.split(" ", 2)[1:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    oks = [v for k, v in lines if k == "ok"]
    assert len(oks) == 1, out.stdout[-3000:]
    return [bool(int(x)) for x in oks[0].split(",")], [v for k, v in lines if k == "digest"]


def digest(tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(as_bytes(t))
    return h.hexdigest()


def test_dump_here_load_in_another_process(tmp_path):
    (tmp_path / "kv").mkdir()
    src = make_caches(seed=7)
    ids = ids_for([b"x", b"y"])
    with open_store(tmp_path / "kv") as s:
        assert s.dump(ids, [block_tensors(src, 2), block_tensors(src, 5)]) == [True, True]
    missing = ids_for([b"never"])
    ok, digests = run_child(tmp_path, "load", ids + missing)
    assert ok == [True, True, False]
    assert digests[:2] == [digest(block_tensors(src, 2)), digest(block_tensors(src, 5))]


def test_dump_in_another_process_load_here(tmp_path):
    (tmp_path / "kv").mkdir()
    ids = ids_for([b"p", b"q", b"r"])
    ok, digests = run_child(tmp_path, "dump", ids)
    assert ok == [True] * 3
    with open_store(tmp_path / "kv") as s:
        assert s.lookup(ids) == [True] * 3
        dst = make_caches("zeros")
        assert s.load(ids, [block_tensors(dst, b) for b in (1, 2, 3)]) == [True] * 3
        assert [digest(block_tensors(dst, b)) for b in (1, 2, 3)] == digests


# -- misses, damage, overwrite -------------------------------------------------------------------


def test_missing_block_fails_cleanly(store):
    src = make_caches()
    present, absent = ids_for([b"here"]), ids_for([b"gone"])
    assert store.dump(present, [block_tensors(src, 0)]) == [True]
    assert store.lookup(absent) == [False]
    dst = make_caches("zeros")
    ok = store.load(
        [present[0], absent[0], present[0]],
        [block_tensors(dst, 1), block_tensors(dst, 2), block_tensors(dst, 3)],
    )
    assert ok == [True, False, True]
    assert all(not layer[2].any() for layer in dst)  # nothing written for the miss
    assert as_bytes(dst[0][1]) == as_bytes(src[0][0])
    assert store.load(absent, [block_tensors(dst, 4)]) == [False]


def test_truncated_or_emptied_file_fails_the_load(store_root, store):
    src = make_caches()
    ids = ids_for([b"t0", b"t1", b"t2", b"t3"])
    assert store.dump(ids, [block_tensors(src, b) for b in range(4)]) == [True] * 4
    os.truncate(block_file(store_root, ids[1]), 1000)
    os.truncate(block_file(store_root, ids[2]), 0)
    # UCM's lookup only checks existence: damaged files still look present
    assert store.lookup(ids) == [True] * 4
    dst = make_caches("zeros")
    # UCM fails the whole batch task with StoreNotFoundError(-50005); the adapter retries block
    # by block and reports only the damaged ones
    assert store.load(ids, [block_tensors(dst, b) for b in range(4)]) == [True, False, False, True]
    for b in (0, 3):
        assert digest(block_tensors(dst, b)) == digest(block_tensors(src, b))


def test_flipped_bytes_are_not_detected(store_root, store):
    """UCM stores raw bytes with no checksum: a bit flip on disk comes back as data."""
    src = make_caches()
    bid = ids_for([b"flip"])
    assert store.dump(bid, [block_tensors(src, 0)]) == [True]
    path = block_file(store_root, bid[0])
    offset = PER_LAYER_BLOCK_BYTES + 100  # inside layer 1's slice
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    assert store.lookup(bid) == [True]
    dst = make_caches("zeros")
    assert store.load(bid, [block_tensors(dst, 0)]) == [True]  # reported as a success ...
    got = [as_bytes(t) for t in block_tensors(dst, 0)]
    want = [as_bytes(t) for t in block_tensors(src, 0)]
    assert got[0] == want[0] and got[2] == want[2]
    diff = [i for i, (x, y) in enumerate(zip(got[1], want[1], strict=True)) if x != y]
    assert diff == [100]  # ... but differs in exactly the flipped byte


def test_dump_overwrites_existing_block(store):
    a, b = make_caches(seed=1), make_caches(seed=2)
    bid = ids_for([b"same"])
    assert store.dump(bid, [block_tensors(a, 0)]) == [True]
    assert store.dump(bid, [block_tensors(b, 0)]) == [True]
    dst = make_caches("zeros")
    assert store.load(bid, [block_tensors(dst, 0)]) == [True]
    assert digest(block_tensors(dst, 0)) == digest(block_tensors(b, 0))


# -- argument checking and errors ---------------------------------------------------------------


def test_block_ids_must_be_16_bytes(store):
    # UCM itself silently mis-parses other lengths (5 bytes -> zero ids): the adapter refuses
    with pytest.raises(ValueError, match="16 bytes"):
        store.lookup([b"short"])
    with pytest.raises(ValueError, match="16 bytes"):
        store.dump([b"x" * 17], [block_tensors(make_caches(), 0)])
    with pytest.raises(ValueError, match="16 bytes"):
        store.lookup(["0" * 16])


def test_buffer_shape_checks(store):
    src = make_caches()
    bid = ids_for([b"s"])
    with pytest.raises(ValueError, match="per block"):
        store.dump(bid, [block_tensors(src, 0)[:2]])
    with pytest.raises(ValueError, match="bytes"):
        store.dump(bid, [[t[:, :8].contiguous() for t in block_tensors(src, 0)]])
    with pytest.raises(ValueError, match="contiguous"):
        store.dump(bid, [[t.transpose(1, 2) for t in block_tensors(src, 0)]])
    with pytest.raises(ValueError, match="buffers"):
        store.dump(bid + bid, [block_tensors(src, 0)])
    assert store.dump([], []) == [] and store.load([], []) == [] and store.lookup([]) == []


def test_lookup_only_store(tmp_path):
    src = make_caches()
    ids = ids_for([b"lo"])
    with open_store(tmp_path) as writer, open_store(tmp_path, lookup_only=True) as reader:
        assert writer.dump(ids, [block_tensors(src, 0)]) == [True]
        assert not reader.can_transfer
        assert reader.lookup(ids) == [True]
        with pytest.raises(UcmError, match="lookup only"):
            reader.load(ids, [block_tensors(make_caches("zeros"), 0)])
        # behind the adapter's guard, UCM itself refuses with -1 "transfer is not enable"
        reader.can_transfer = True
        with pytest.raises(UcmError) as info:
            reader.dump(ids_for([b"lo2"]), [block_tensors(src, 1)])
        assert info.value.operation == "dump"
        assert info.value.code == -1 and "transfer is not enable" in str(info.value)


def test_creation_errors(tmp_path):
    with pytest.raises(UcmError) as info:
        open_store(tmp_path / "does-not-exist")
    assert info.value.operation == "create" and info.value.code == CODE_OS_ERROR
    with pytest.raises(UcmError, match="unknown store pipeline"):
        UcmStore.from_config({"store_pipeline": "NoSuchPipeline", "storage_backends": str(tmp_path)})
    with pytest.raises(ValueError, match="tensor_size"):
        UcmStore.from_config(
            {
                "store_pipeline": "Posix",
                "storage_backends": str(tmp_path),
                "tensor_size": 4096,
                "shard_size": 6000,
                "block_size": 6000,
            }
        )


def test_closed_store(tmp_path):
    s = open_store(tmp_path)
    s.close()
    s.close()  # idempotent
    assert s.closed
    with pytest.raises(UcmError, match="closed"):
        s.lookup(ids_for([b"c"]))
