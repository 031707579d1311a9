#!/usr/bin/env bash
# System packages the project needs on a fresh Debian machine (run as root; no-op when present).
set -euo pipefail
if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
  # Mooncake's non-CUDA wheel links libibverbs even for TCP.
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi
