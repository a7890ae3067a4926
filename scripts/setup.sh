#!/usr/bin/env bash
# Create .venv with a CPU torch and dspark (+ dev tools). Idempotent: a second run is quick.
#
# speculators==0.9.0 pulls torchvision, which would drag torch up to a multi-GB CUDA
# build; we pin a matching torchvision only to satisfy the resolver, then remove it
# (speculators never imports it, and transformers fails on a CPU torch if it is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Mooncake's CPU wheel links against these Debian libraries.
if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 libnuma1 >/dev/null; }
  else
    echo "note: the Mooncake tests need: sudo apt-get install libibverbs1 librdmacm1 libnuma1" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import dspark, speculators, torch, pytest, pytest_timeout, mooncake.store" 2>/dev/null; then
  pip install -q "torch==2.13.0"
  pip install -q -e ".[dev,mooncake]" "torchvision==0.28.*" "torchaudio==2.11.1"
  pip uninstall -q -y torchvision torchaudio
fi
python -c "from importlib.metadata import version as v; print(f\"dspark {v('dspark')} ready: torch {v('torch')}, speculators {v('speculators')}\")"
