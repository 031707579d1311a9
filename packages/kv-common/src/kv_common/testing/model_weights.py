"""Change a model directory's weights the way a deployment does, for the weights-identity tests.

``rewrite_weights_in_place`` gives a model a new checkpoint of the same architecture: every
tensor gets new random values, while the safetensors headers, the file sizes and ``config.json``
stay byte for byte the same (what a fingerprint of names, shapes and sizes cannot tell apart).
No torch: safetensors is a JSON header and raw little-endian data.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path

from kv_common.model_identity import safetensors_tensors


def copy_model(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """A private copy of a model directory (file times kept, as ``cp -p``)."""
    return Path(shutil.copytree(src, dst, copy_function=shutil.copy2))


def _random_data(dtype: str, nbytes: int, rng: random.Random) -> bytes:
    if dtype == "F32":  # finite values, as a trained checkpoint has
        return array("f", (rng.uniform(-0.05, 0.05) for _ in range(nbytes // 4))).tobytes()
    return rng.randbytes(nbytes)


def rewrite_weights_in_place(model_dir: str | os.PathLike[str], seed: int) -> None:
    """New random values for every tensor of every top-level ``*.safetensors`` file, written into
    the same files (same inode, header and size)."""
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        rng = random.Random(f"{seed}:{path.name}")
        with open(path, "r+b") as fh:
            parsed = safetensors_tensors(fh.fileno(), os.fstat(fh.fileno()).st_size)
            assert parsed is not None, f"{path} is not a safetensors file"
            header, spans = parsed
            dtypes = {name: info["dtype"] for name, info in json.loads(header).items() if name != "__metadata__"}
            for name, (begin, end) in sorted(spans.items()):
                fh.seek(8 + len(header) + begin)
                fh.write(_random_data(dtypes[name], end - begin, rng))


def write_safetensors(path: str | os.PathLike[str],
                      tensors: Mapping[str, tuple[str, Sequence[int], bytes]]) -> None:
    """A safetensors file of ``name -> (dtype, shape, raw data)``."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in tensors.values():
            fh.write(data)
