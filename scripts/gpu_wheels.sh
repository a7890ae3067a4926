#!/usr/bin/env bash
# The wheels scripts/gpu_check_device.sh installs on a lent GPU machine (the device tool): its image
# has torch, Triton, transformers, numpy and most of what dspark imports, for CPython 3.12 on
# x86-64, but not the packages below. Each is pinned to the version the tested .venv holds and
# fetched for that interpreter; dspark's own wheel is built from this checkout. Writes .gpuwheels/
# (ignored by git), which `run` carries: about 20 MiB of the 64 MiB a call may take.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.gpuwheels
# What `dspark train/eval/extract` import that the machine's image lacks: speculators imports
# datasets and openai at import time (speculators/train/data.py), zarr brings numcodecs and
# google-crc32c; typing-extensions rides along since pydantic needs a newer one than an image may have.
NEEDS=(speculators hs-connectors loguru datasets dill multiprocess openai jiter distro sniffio
       pydantic pydantic-core annotated-types typing-inspection typing-extensions pydantic-settings python-dotenv
       zarr numcodecs donfig google-crc32c)
rm -rf "$D"
mkdir -p "$D"
mapfile -t pins < <(.venv/bin/python -c 'import sys; from importlib.metadata import version
for n in sys.argv[1:]: print(f"{n}=={version(n)}")' "${NEEDS[@]}")
# pip, less the notes about this machine's absent extra index
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$D" "${pins[@]}" 2> >(grep -v 'is neither a file nor a directory' >&2)
.venv/bin/pip wheel -q --no-deps . -w "$D" 2> >(grep -v 'is neither a file nor a directory' >&2)
echo "$D: $(ls "$D" | wc -l) wheels, $(du -sh "$D" | cut -f1)"
