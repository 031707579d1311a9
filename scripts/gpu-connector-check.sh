#!/usr/bin/env bash
# The connectors' data paths on a CUDA GPU for a machine that cannot install vLLM (no network):
# scripts/gpu_connector_check.py with Mooncake's CUDA 13 wheel, carried in as one bundle.
#
#   bash scripts/gpu-connector-check.sh bundle DIR   # here, with PyPI and Debian: DIR/bundle.tar.xz (~23 MB)
#   bash scripts/gpu-connector-check.sh run DIR      # on the GPU machine (python3 with a CUDA 13 torch)
#
# The bundle holds Mooncake's cuda13 wheel without the parts the check does not load (its
# collective-communication and EP libraries, bench binaries), msgspec, isal and pyzmq for Python
# 3.12, and the system libraries the wheel links (libibverbs, libmlx5, libnuma, libcurl and theirs)
# from this Debian machine; `run` puts only those the GPU machine lacks on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"; dir="${2:-.gpu}"
MOONCAKE="mooncake-transfer-engine-cuda13==0.3.13.post1"

if [ "$mode" = bundle ]; then
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$work/whl" "$MOONCAKE" msgspec isal pyzmq
  python3 -m pip install -q --target "$work/site" --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" "$work"/whl/*.whl
  (cd "$work/site/mooncake" && rm -rf libmooncake_pg.so libmooncake_pg_device.so libmooncake_ep_device.so _ep*.so \
    pg_*.so transfer_engine_bench mooncake_client __pycache__)
  rm -f "$work"/site/mooncake_transfer_engine_cuda13.libs/libetcd_wrapper-*.so  # a copy of mooncake/'s; run links it
  rm -rf "$work/site/bin"  # console scripts with this machine's interpreter in their first line
  (cd "$work" && apt-get download ibverbs-providers >/dev/null 2>&1 && dpkg -x ibverbs-providers_*.deb deb)
  mkdir -p "$work/syslib"
  cp -L "$work"/deb/usr/lib/x86_64-linux-gnu/libmlx5.so.1 "$work/syslib/"
  for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
    cp -L "$path" "$work/syslib/"
    ldd "$path" | awk '/=>/ {print $3}' | while read -r dep; do
      case "$(basename "$dep")" in libc.so*|libm.so*|libpthread*|libdl*|librt*|ld-linux*|libgcc_s*|libstdc++*) ;;
        *) cp -L "$dep" "$work/syslib/" ;; esac
    done
  done
  mkdir -p "$dir"
  tar -cJf "$dir/bundle.tar.xz" -C "$work" site syslib
  ls -la "$dir/bundle.tar.xz"
  exit 0
fi

if [ "$mode" != run ]; then
  echo "usage: $0 bundle DIR | run DIR" >&2; exit 2
fi
nvidia-smi -L
tar -xJf "$dir/bundle.tar.xz" -C /tmp
ln -sf /tmp/site/mooncake/libetcd_wrapper.so \
  "$(ls -d /tmp/site/mooncake_transfer_engine_cuda13.libs)/libetcd_wrapper-0b032a94.so"  # mooncake_master's name for it
mkdir -p /tmp/lib
for f in /tmp/syslib/*; do
  n=$(basename "$f"); ldconfig -p | grep -q " $n " || cp "$f" /tmp/lib/
done
cudart=$(python3 -c 'import glob, os, site
hits = [f for d in site.getsitepackages() for f in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.13*"), recursive=True)]
print(os.path.dirname(hits[0]) if hits else "")')
export LD_LIBRARY_PATH="/tmp/lib:${cudart}:${LD_LIBRARY_PATH:-}"
export PYTHONPATH="/tmp/site:$PWD/packages/kv-common/src:$PWD/packages/kv-mooncake/src:$PWD/packages/kv-store/src"
export PATH="/tmp/site/mooncake:$PATH"  # mooncake_master for the store check
PYTHONUNBUFFERED=1 exec timeout 300 python3 scripts/gpu_connector_check.py
