#!/usr/bin/env bash
# The whole CPU path on the embedded default: toy verifier -> prepare -> extract -> store info.
# Every step is resumable/idempotent: rerunning skips finished work.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
D=${DSPARK_DEMO:-cache}
DATA=$(.venv/bin/python -c "from dspark.toy import demo_chat_path; print(demo_chat_path())")
dspark() { .venv/bin/dspark "$@"; }
set -x
[ -f "$D/models/tiny/model.safetensors" ] || dspark toy-verifier --output "$D/models/tiny"
dspark prepare --model "$D/models/tiny" --data "$DATA" --output "$D/prepared/demo" \
    --seq-length 512 --num-preprocessing-workers 2 --minimum-valid-tokens 16
dspark extract --to zarr --model "$D/models/tiny" --data "$D/prepared/demo" \
    --store "$D/stores/demo" --target-layer-ids 1 3 5
dspark store info "$D/stores/demo"
dspark store verify "$D/stores/demo"
